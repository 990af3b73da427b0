"""KV-cache operations the engine needs; the only module that touches transformers' cache API.

The engine's caches hold one `SlotLayer` per model layer: keys and values live in buffers
allocated ahead ([batch, heads, capacity, head_dim]); a forward writes its new entries
by index after the held ones, and the model attends to the view of the first `length`
slots. (transformers' `DynamicLayer` instead concatenates, copying the whole cache on
every forward.) After a tree verification the cache holds `prefix + tree` entries;
`keep` moves the entries of the accepted path into place right after the prefix and
drops the rest, so no second target pass is needed to rebuild the cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from .attention import EXACT_SDPA
from .errors import DynaTreeError

MIN_CAPACITY = 256  # slots a layer allocates at first; it doubles when a forward needs more


class Filled:
    """How many slots of a cache's layers hold entries: one count shared by every layer of a cache.

    Every forward writes the same number of entries into each layer, so one count serves them all;
    kept in one object, it is one symbolic size of a compiled step instead of one per layer (each an
    argument and a returned value of the graph on every call)."""

    def __init__(self):
        self.count = 0


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values in preallocated buffers, written by index.

    `keys`/`values` are views of the first `length` slots of the buffers, shaped like a
    `DynamicLayer`'s, so the model and the tests read them the same way. The layers of one cache
    share their `length` (`Filled`): a forward writes its entries after the held ones in every
    layer, and the `last` layer's update, the forward's final one, advances the shared count. So
    `keys`/`values`/`length` describe the cache between forwards; inside one, a layer attends to
    what its `update` returns (the held entries and this forward's).
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, dtype: torch.dtype | None = None, filled: Filled | None = None, last: bool = True):
        super().__init__()
        self.store_dtype = dtype  # the buffers' dtype; None: the model's key/value dtype
        self.filled = Filled() if filled is None else filled  # slots in use, shared by the cache's layers
        self.last = last  # whether this layer is updated last in a forward (it advances `filled`)
        self.key_buf: torch.Tensor | None = None  # [batch, heads, capacity, head_dim]
        self.value_buf: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.filled.count

    # views computed when read, never stored: a compiled step then returns no views of the buffers
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.key_buf is None else self.key_buf[..., : self.filled.count, :]

    @keys.setter
    def keys(self, value) -> None:  # CacheLayerMixin.__init__ sets None
        if value is not None:
            raise AttributeError("SlotLayer.keys is a view of its buffer; write entries with update")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.value_buf is None else self.value_buf[..., : self.filled.count, :]

    @values.setter
    def values(self, value) -> None:
        if value is not None:
            raise AttributeError("SlotLayer.values is a view of its buffer; write entries with update")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.store_dtype or key_states.dtype, key_states.device
        self.key_buf, self.value_buf = key_states[..., :0, :].to(self.dtype), value_states[..., :0, :].to(self.dtype)
        self.is_initialized = True

    def reserve(self, n: int) -> None:
        """Make room for `n` more entries (eager; never inside a compiled forward if reserved ahead)."""
        # One slot always stays free: a view of the whole buffer would differ in contiguity from
        # the usual partial view, and torch.compile would build another graph for that case.
        need = self.length + n
        if need < self.key_buf.shape[-2]:
            return
        capacity = max(MIN_CAPACITY, self.key_buf.shape[-2])
        while capacity <= need:
            capacity *= 2
        self.key_buf, self.value_buf = (_grown(buf, capacity, self.length) for buf in (self.key_buf, self.value_buf))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.reserve(n)
        start = self.filled.count
        self.key_buf[..., start : start + n, :] = key_states
        self.value_buf[..., start : start + n, :] = value_states
        if self.last:
            self.filled.count = start + n
        return self.key_buf[..., : start + n, :], self.value_buf[..., : start + n, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0  # (kv length, kv offset) after this forward's entries

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # no maximum: the buffers grow

    def reset(self) -> None:
        self.filled.count = 0

    def crop(self, tokens_to_remove: int) -> None:  # transformers' convention: a negative count
        # transformers' Cache.crop calls every layer's: the shared count is cut once, by the last layer
        if self.last:
            self.truncate(max(0, self.length - abs(tokens_to_remove)))

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries (of every layer of the cache: the count is shared)."""
        self.filled.count = length


def _grown(buf: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
    new = buf.new_empty(*buf.shape[:-2], capacity, buf.shape[-1])
    new[..., :length, :] = buf[..., :length, :]
    # One compiled graph for every capacity instead of a new graph when the buffers grow.
    torch._dynamo.maybe_mark_dynamic(new, 2)
    return new


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention a model's layers do, as transformers' own cache for the model says.

    A sliding-window layer lets a query at position q see the keys at positions k with
    q - window < k <= q (transformers' rule). The engine keeps every entry in a `SlotLayer`
    for those layers too, and restricts what they see with their own mask (runtime.masks),
    so a tree node sees exactly what its own sequential step would: the prefix inside the
    window of its *true* position, and its ancestors.
    """

    window: int | None  # the sliding layers' window; None: every layer attends to everything before it
    layer_types: tuple[str, ...] | None  # per layer, when full and sliding layers mix (one mask per type,
    # keyed by these names, as the models' `attention_mask` dict is); None: one mask serves every layer


def attention_layout(model) -> AttentionLayout:
    """The model's `AttentionLayout`, from the layer types transformers itself builds caches for
    (`get_layer_types_and_kwargs`); a layer of any other kind (recurrent, chunked, shared) is refused."""
    types, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    if isinstance(kwargs, dict):  # transformers 5.17 (the GPU image docs/results/eagle-gpu runs on): one dict for every layer
        kwargs = [kwargs] * len(types)
    kinds = {"full_attention", "sliding_attention"}
    other = sorted(set(types) - kinds)
    if other:
        raise DynaTreeError(f"{model.config.model_type} is refused: it has {', '.join(other)} layers, whose cache "
                            "state tree verification cannot compact by index or mask by position")
    windows = {kw["sliding_window"] for t, kw in zip(types, kwargs) if t == "sliding_attention"}
    if len(windows) > 1:
        raise DynaTreeError(f"{model.config.model_type} is refused: its layers slide over different windows "
                            f"({sorted(windows)}), which dynatree does not mask")
    window = windows.pop() if windows else None
    mixed = window is not None and len(set(types)) > 1  # full and sliding layers: one mask per type
    return AttentionLayout(window=window, layer_types=tuple(types) if mixed else None)


def new_cache(model) -> Cache:
    layers = DynamicCache(config=model.config).layers
    attention_layout(model)  # refuses layers whose state cannot be compacted by index
    # a model attending in float64 (attention.use_exact_attention) keeps its keys and values there:
    # converted once when written, instead of the whole cache at every step
    dtype = torch.float64 if model.config._attn_implementation == EXACT_SDPA else None
    filled = Filled()
    return Cache(layers=[SlotLayer(dtype, filled, last=i == len(layers) - 1) for i in range(len(layers))])


def reserve(cache: Cache, n: int) -> None:
    """Make room for `n` more entries in every layer before a forward (a no-op for other caches)."""
    for layer in cache.layers:
        if isinstance(layer, SlotLayer) and layer.is_initialized:
            layer.reserve(n)


@contextlib.contextmanager
def advancing(cache: Cache, n: int, model: str):
    """Around one forward of `n` tokens on `cache`: room for its entries first (`reserve`, so a
    compiled forward never reallocates), and once it has run, `check_advanced` (the cache must hold
    `n` entries more). `model` names the model in the error."""
    reserve(cache, n)
    held = length(cache)
    yield
    check_advanced(cache, held, n, model)


def check_advanced(cache: Cache, held: int, n: int, model: str) -> None:
    """After a forward of `n` tokens on a cache that held `held`: the shared count must have moved by
    `n`, which it does when the last layer (`SlotLayer.last`) was updated once with the forward's `n`
    entries. A model whose last cache layer is not updated so is an error here, not a cache that reads
    wrong entries. (Other orders, a layer skipped or updated twice, are not seen here; the probe's
    eager check against plain decoding refuses such a model at load.)"""
    if isinstance(cache.layers[-1], SlotLayer) and length(cache) != held + n:
        raise DynaTreeError(f"{model}: a forward of {n} tokens left the cache at {length(cache)} entries, not "
                            f"{held + n}: its last cache layer was not updated once with the forward's entries")


def length(cache: Cache) -> int:
    """Number of token positions held in the cache."""
    return cache.get_seq_length()


def keep(cache: Cache, start: int, keep_idx: torch.Tensor) -> None:
    """Keep entries [0, start) plus entries `start + keep_idx` (in that order); drop everything else.

    `keep_idx` must be increasing, which holds for a root-to-node path in BFS order, so
    each kept entry moves to a slot at or before its old one.
    """
    m = int(keep_idx.numel())
    in_place = m == 0 or int(keep_idx[-1]) == m - 1  # increasing and ending at m - 1: already 0..m-1
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if not in_place:
            src = start + keep_idx.to(layer.keys.device)
            for buf in (layer.key_buf, layer.value_buf):
                buf[..., start : start + m, :] = buf[..., src, :]  # the gather copies before the write
        layer.truncate(start + m)


def crop(cache: Cache, new_length: int) -> None:
    """Drop every entry from position `new_length` on."""
    keep(cache, new_length, torch.empty(0, dtype=torch.long))
