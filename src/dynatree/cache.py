"""KV-cache operations the engine needs; the only module that touches transformers' cache API.

The engine uses a `transformers.DynamicCache` (transformers 5.x: `cache.layers[i].keys`
and `.values`, shaped [batch, heads, seq, head_dim]). After a tree verification the
cache holds `prefix + tree` entries; `keep` moves the entries of the accepted path
into place right after the prefix and drops the rest, so no second target pass is
needed to rebuild the cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .errors import DynaTreeError


def new_cache(model) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        # Sliding-window and linear-attention layers keep a rolling state that cannot be
        # compacted by index; reject them instead of silently decoding wrong tokens.
        if type(layer) is not DynamicLayer:
            raise DynaTreeError(
                f"{model.config.model_type} uses {type(layer).__name__} cache layers "
                "(sliding window or recurrent state), which dynatree does not support yet"
            )
    return cache


def length(cache: DynamicCache) -> int:
    """Number of token positions held in the cache."""
    return cache.get_seq_length()


def keep(cache: DynamicCache, start: int, keep_idx: torch.Tensor) -> None:
    """Keep entries [0, start) plus entries `start + keep_idx` (in that order); drop everything else.

    `keep_idx` must be increasing, which holds for a root-to-node path in BFS order, so
    each kept entry moves to a slot at or before its old one and the copy is safe.
    """
    m = int(keep_idx.numel())
    in_place = m == 0 or int(keep_idx[-1]) == m - 1  # increasing and ending at m - 1: already 0..m-1
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if not in_place:
            src = start + keep_idx.to(layer.keys.device)
            layer.keys[..., start : start + m, :] = layer.keys[..., src, :]
            layer.values[..., start : start + m, :] = layer.values[..., src, :]
        layer.keys = layer.keys[..., : start + m, :]
        layer.values = layer.values[..., : start + m, :]


def crop(cache: DynamicCache, new_length: int) -> None:
    """Drop every entry from position `new_length` on."""
    keep(cache, new_length, torch.empty(0, dtype=torch.long))
