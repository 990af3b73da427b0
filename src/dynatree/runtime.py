"""A loaded causal LM at run time: one forward over explicit positions on a KV cache, and its
torch.compile wrapper.

`LoadedModel` is what the engine decodes with; models.py builds it (from an alias, a directory,
a .gguf file or a hub id) and this module runs it: `forward` (ids at explicit positions with a
4-D mask on top of a cache), `compiled` (decode steps through torch.compile, one graph per kind
of step) and `warm_up` (those graphs built before any clock starts).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cache as kv
from .attention import alibi_correction, alibi_slopes, tree_mask
from .kernels import linear_kernel
from .tree import additive_mask, causal_allowed


# Graphs torch.compile may build per function before it falls back to eager (see `LoadedModel.compiled`).
RECOMPILE_LIMIT = 64
# What dynamo makes symbolic from the first compile (torch.compiler.config.dynamic_sources): the
# cache's entry count (one object shared by its layers, `cache.Filled`, read through each layer: one
# symbol, not one per layer) and a step's token count. Left to dynamo, each kind of step compiled twice:
# once with static sizes, then again at the next step with these sizes symbolic.
# Entries are regular expressions (an optional ":dim" suffix names one dimension). The setting is
# process-wide: it adds these names to whatever the user set. Any compiled function's argument of the
# same name would match (torch matches from the start of the source's name), hence the feature head's
# inputs travel in one dict under a name only it uses (featurehead.head_step).
DYNAMIC_SOURCES = (
    r"L\['kwargs'\]\['(cache|past_key_values)'\]\.layers\[\d+\]\.filled\.count",
    *(re.escape(f"L['kwargs']['{name}']") + f":{dim}"
      for name, dim in (("input_ids", 1), ("position_ids", 1), ("attention_mask", 2), ("attention_mask", 3))),
    # per-layer-type masks of sliding-window models (see `LoadedModel.masks`)
    *(re.escape(f"L['kwargs']['attention_mask']['{kind}']") + f":{dim}"
      for kind in ("full_attention", "sliding_attention") for dim in (2, 3)),
    # a feature head's compiled step (featurehead.head_step): the tokens it feeds, its cache's entries
    *(re.escape(f"L['feature_head_step']['{name}']") + f":{dim}"
      for name, dim in (("embeds", 1), ("features", 1), ("positions", 1), ("mask", 2), ("mask", 3))),
    r"L\['feature_head_step'\]\['cache'\]\.layers\[\d+\]\.filled\.count",
)
# The kinds of decode step a compiled target builds one graph each for (see `LoadedModel.warm_up`):
# one token without a mask (plain steps), a masked tree of 2+ tokens (sizes are symbolic, but
# dynamo specialises a size of 1), and one token with a mask (steps under a KV window).
STEP_KINDS = ("token", "tree", "masked-token")

# Inductor's checks inside the generated code of every call: sizes and strides of the graph's inputs
# (the weights included) and of each extern kernel's output (the packed linears' custom op included),
# alignment, scalars; about a thousand calls per step of a 30-layer model, a few percent of a compiled
# one-token step on a CPU (measured: docs/results/compile-asserts). They compute nothing:
# when every check holds the graph computes the same values, and a failing one means a shape or layout
# the graph was not built for (a fake kernel disagreeing with its real one, a weight relaid in place),
# which would then compute on silently. The test suite compiles with them (tests/conftest.py), so such
# a mismatch fails there, and the compiled exactness tests compare tokens with plain decoding. Passed
# as torch.compile options, so only dynatree's graphs leave them out; options this torch lacks are
# not passed.
RUNTIME_ASSERTS = ("size_asserts", "alignment_asserts", "scalar_asserts")


def no_runtime_asserts() -> dict:
    """torch.compile options that turn RUNTIME_ASSERTS off (those this torch has)."""
    import torch._inductor.config as inductor_config

    return {k: False for k in RUNTIME_ASSERTS if hasattr(inductor_config, k)}


# How inductor's graphs are called on a CPU: by a C++ wrapper (the per-graph code that allocates buffers
# and calls the kernels in turn), not by generated Python. A 30-layer step makes about 450 calls (the
# fused kernels, the int4 or packed products, attention); from Python each costs microseconds of
# interpreter time. Same kernels, same values (logits bit for bit); a compiled q4 step is faster, a
# float32 one unchanged (measured: docs/results/cpp-wrapper). `cpp_wrapper_build_separate` compiles
# the wrapper's entry apart from the kernels, which halves the time to build a graph with the C++
# wrapper. Both options or neither: a torch without `cpp_wrapper_build_separate` (older than those
# tested) keeps the Python wrapper. Not used on CUDA, where it has not been measured.
CPU_WRAPPER = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}


def wrapper_options(device: torch.device) -> dict:
    """torch.compile options for how the graphs' kernels are called on `device`: CPU_WRAPPER on a CPU
    whose torch has both options, else none (the Python wrapper)."""
    import torch._inductor.config as inductor_config

    if device.type != "cpu" or not all(hasattr(inductor_config, k) for k in CPU_WRAPPER):
        return {}
    return dict(CPU_WRAPPER)


# Guards dynamo need not check on the model's modules before every compiled call (see `module_guards`).
SKIPPED_MODULE_GUARDS = frozenset({"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "DICT_NOT_CONTAINS"})
# nn.Module's own bookkeeping dicts, whose type dynamo checks on every module of the model before every
# call (TYPE_MATCH: "is still a dict"). nn.Module makes them dicts; torch's containers may swap `_modules`
# for an OrderedDict (deleting an item), which the traced code reads the same way; what they hold (keys,
# each submodule's type) stays guarded.
MODULE_DICTS = ("._modules", "._parameters", "._buffers")


# Set once the process has a model whose repeated layers differ (`note_layers`): from then on
# `module_guards` keeps the shape check of every layer's tensors, not only the first of each role's.
_every_layer_check = False


def keep_every_layer_check(on: bool = True) -> None:
    """Switch `module_guards` to keep (or, `on=False`, to drop again) the shape checks of later layers'
    tensors equal to the first layer's. Graphs built under the other setting are discarded
    (torch._dynamo.reset): compiled wrappers rebuild theirs on their next call, with these guards."""
    global _every_layer_check
    if on != _every_layer_check:
        _every_layer_check = on
        torch._dynamo.reset()


def _tensor_meta(t: torch.Tensor) -> tuple:
    strides = t.stride() if t.layout == torch.strided else None  # (oneDNN's opaque packed weights have none)
    return tuple(t.shape), strides, t.dtype, t.device


def layers_differ(module: torch.nn.Module) -> bool:
    """Whether two tensors of `module` in the same role differ in shape, strides, dtype or device, a role
    being what `weight_role` makes of dynamo's names for them: numeric module names (the layers of a
    ModuleList, the children of an nn.Sequential), parameter and buffer names (a ParameterList's) and
    dict keys taken out, list and tuple positions kept, and kept apart by where the module holds the
    tensor (parameter, buffer, plain attribute, item of a list, tuple or dict attribute), as dynamo's
    sources are. True for a model whose later layers have another MLP width, say, and, conservatively,
    for a Sequential whose children differ."""
    first: dict[tuple, tuple] = {}

    def differs(key: tuple, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        meta = _tensor_meta(t)
        return first.setdefault(key, meta) != meta

    def index(key) -> str:
        return re.sub(r"^\d+$", "*", str(key))

    for name, sub in module.named_modules():
        role = re.sub(r"(?:^|(?<=\.))\d+(?=\.|$)", "*", name)
        for kind, held in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            if any(differs((role, kind, index(attr)), t) for attr, t in held.items()):
                return True
        for attr, value in vars(sub).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            if isinstance(value, dict):  # dynamo: attr['key'], merged by weight_role where the key is a number
                items = [((role, "attribute", attr, index(k)), t) for k, t in value.items()]
            elif isinstance(value, (list, tuple)):  # dynamo: attr[i], which weight_role keeps apart
                items = [((role, "attribute", attr, i), t) for i, t in enumerate(value)]
            else:
                items = [((role, "attribute", attr), value)]
            if any(differs(key, t) for key, t in items):
                return True
    return False


def note_layers(module: torch.nn.Module) -> None:
    """Called for every model when it is wrapped (`LoadedModel`, at load, before any run warms its
    graphs): where `module`'s layers differ (`layers_differ`), keep every layer's shape checks in this
    process from now on (`keep_every_layer_check`, which drops the graphs built so far: a compiled
    run in another thread at that moment rebuilds its graphs). Without them such a model would pass
    the guards of a graph built for a uniform model of its class whose layers have its first layer's
    shapes, and run that graph on its own weights (tests catch that by inductor's size asserts, which
    shipped graphs leave out). Feature heads have one layer: nothing to note."""
    if not _every_layer_check and layers_differ(module):
        keep_every_layer_check(True)


def module_guards(entries) -> list[bool]:
    """torch.compile's `guard_filter_fn`: which guards to keep (see `LoadedModel.compiled`).

    Drops, on sources inside the model's modules only, the checks that no hooks were added,
    that no instance attribute shadows a class one, that each module's `_modules`/`_parameters`/
    `_buffers` is still a dict (what they hold stays guarded), and the shape checks of repeated layers'
    weights whose shape, strides, dtype and device equal those of the first of their role
    (`weight_role`). Kept: the first shape check of each role and every one that differs from it
    (every model of one class runs the same code, so the weights' shapes are what tells apart the
    graphs of a target and a draft LM, or of two feature heads, that differ only in widths: without
    them one model ran the other's graph; checking every layer's copy cost 0.28 ms a step; all kept
    in a process that has a model whose layers differ: `note_layers`),
    attribute values (PackedLinear.enabled, the config's attention implementation, training, each
    layer list's length), each module's type (a submodule replaced by another kind recompiles), and
    every guard on the inputs (ids, positions, mask, KV cache), so switching kernels or attention still
    recompiles. On SmolLM2's compiled q4 one-token step 2661 of 7423 guards stay.
    """
    first_of_role: dict[str, tuple] = {}  # role -> (shape, strides, dtype, device) of its first weight
    keep = []
    for e in entries:
        if not e.orig_guard.source.is_unspecialized_nn_module():
            keep.append(True)
        elif e.guard_type == "TENSOR_MATCH":
            if not (e.has_value and isinstance(e.value, torch.Tensor)):
                keep.append(True)
                continue
            meta = _tensor_meta(e.value)
            first = first_of_role.setdefault(weight_role(e.name), meta)
            # its role's first check, or a copy of another shape, or every check (`note_layers`)
            keep.append(first is meta or first != meta or _every_layer_check)
        else:
            keep.append(not (e.guard_type in SKIPPED_MODULE_GUARDS
                             or (e.guard_type == "TYPE_MATCH" and e.name.endswith(MODULE_DICTS))))
    return keep


def weight_role(name: str) -> str:
    """A weight's source name with the indexes of repeated layers taken out: the same role in every
    layer ("...['layers']._modules['3']._modules['mlp']..." -> "...['layers']._modules[*]._modules['mlp']...").
    (Also merges the children of an nn.Sequential: a copy whose shape differs is kept.) A model
    whose later layers differ from its first ones would match the graph of a uniform model of its
    class with its first layer's shapes: `note_layers` then keeps every check in the process."""
    return re.sub(r"\['\d+'\]", "[*]", name)


@dataclass(eq=False)
class LoadedModel:
    """A causal LM ready for decoding, with what the engine needs to know about it."""

    # (neither in the repr: printed whole, the module tree and every added token ran to ~60 lines)
    model: torch.nn.Module = field(repr=False)  # a transformers *ForCausalLM in eval mode
    tokenizer: object = field(repr=False)  # its tokenizer (PreTrainedTokenizerBase)
    name: str  # the spec the user gave (alias, path or hub id)
    eos_ids: list[int] = field(default_factory=list)  # tokens that end generation
    compile: bool = False  # run decode steps (not prefills) through torch.compile; may be switched per run
    linear_note: str | None = None  # why the linears were left on stock kernels although not asked to (recorded)
    weights: str = "dense"  # the linear layers' weight format: dense, q4 or int8 (weights.py)
    weights_note: str | None = None  # what the low-bit format converted and what it left dense (recorded)
    gguf: Path | None = None  # the GGUF file the model was converted from (q4 weights, llamacpp-ar), if any
    row_dependent: list[str] = field(default_factory=list)  # low-bit: dense layers not row-wise (weights.py)
    _compiled: object = field(default=None, repr=False)  # the torch.compile wrapper, built on first use
    # held by a decode (api.run) from start to end, as its target or its draft LM: decodes on one model run
    # one after the other, since they share its kernels' switches, compiled graphs and measured costs
    # (reentrant: a callback's own decode on the same thread is not a deadlock)
    busy: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def __post_init__(self):
        note_layers(self.model)  # (at load, before any run warms its graphs: see `note_layers`)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def linear(self) -> str:
        """What the linear layers run now: "onednn" (packed weights, kernels.py) or "stock"."""
        return linear_kernel(self.model)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def context_length(self) -> int | None:
        """Longest sequence the model supports, when its config says; None where it names no limit
        (BLOOM's ALiBi positions have none: memory is its only bound, and no length is refused)."""
        cfg = self.model.config
        for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length",
                    "max_seq_len"):  # (max_seq_len: MPT's)
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @functools.cached_property
    def layout(self) -> kv.AttentionLayout:
        """Which layers attend through a sliding window (cache.attention_layout)."""
        return kv.attention_layout(self.model)

    @functools.cached_property
    def alibi_slopes(self) -> torch.Tensor | None:
        """Per-head ALiBi slopes of a BLOOM model switched to tree-aware masks (attention.use_slot_alibi),
        else None."""
        return alibi_slopes(self.model)

    def masks(self, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
        """The attention mask(s) of a step: `allowed` [queries, keys] says what each query may see
        (its prefix, its tree ancestors, what a KV window keeps); `query_pos`/`key_pos` are the true
        positions of the queries and of the keys (cache slots, then this step's tokens).

        Returns the [1, 1, queries, keys] additive mask ([1, heads, queries, keys] for BLOOM: each
        visible key also carries the correction of its ALiBi bias from slot to position,
        attention.use_slot_alibi); for a model with sliding-window layers
        those layers also hide the keys at or beyond the window from each query's true position:
        one mask when every layer slides (every model takes one 4-D mask for all its layers), else
        one per layer type keyed by the layer types' names (Gemma 2/3, Qwen2, Cohere 2 take such a
        dict through their public `attention_mask` argument; the probe refuses a model that does not).
        """
        full = additive_mask(allowed, self.dtype, self.device)
        slopes = self.alibi_slopes
        if slopes is not None:  # (BLOOM has no sliding window)
            correction = alibi_correction(slopes, key_pos.cpu(), self.dtype).to(self.device)
            return full + torch.where(allowed.to(self.device)[None], correction[:, None, :], 0)[None]
        window = self.layout.window
        if window is None:
            return full
        near = (query_pos.reshape(-1, 1) - key_pos.reshape(1, -1)) < window
        sliding = additive_mask(allowed & near, self.dtype, self.device)
        if self.layout.layer_types is None:
            return sliding
        return {"full_attention": full, "sliding_attention": sliding}

    @property
    def embedding_rows(self) -> int:
        """Rows of the input embedding: the token ids the model can read."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    def readable(self, ids: list[int]) -> list[int]:
        """`ids` with those the model has no embedding row for read as id 0. Only a draft meets such
        ids (padding rows of a larger target output layer, beyond every tokenizer string; check_embedding
        guarantees the tokenizer is covered), and only to shape its proposals, never what is committed."""
        rows = self.embedding_rows
        return [t if t < rows else 0 for t in ids]

    @property
    def prompt_id_bound(self) -> int:
        """Prompt tokens must be ids below this: rows of both the input embedding and the output layer."""
        return min(self.vocab_size, self.embedding_rows)

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (may exceed the tokenizer's size because of padding)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def forward(self, cache, ids: list[int], positions: list[int], mask: torch.Tensor | None,
                last_only: bool = False, hidden: bool = False, compiled: bool | None = None):
        """Run `ids` at explicit `positions` on top of `cache` (which grows by len(ids)).

        `mask` is what `masks` returns (a [1, 1, len(ids), cached + len(ids)] additive mask, or one
        per layer type), or None for plain causal attention by cache slot (sliding windows included:
        the model builds that mask itself). Returns logits [len(ids), vocab] ([1, vocab] with `last_only`);
        with `hidden`, (logits, last hidden states [len(ids), hidden size]): the features the
        output layer reads, of every row even with `last_only` (for feature drafters).
        `compiled` (default: the model's `compile` setting): every call but the prefill
        (`last_only`) goes through torch.compile, compiled on first use and cached on disk: see
        `compiled`. The decoder passes its run's setting, so one loaded model serves compiled
        and eager runs side by side.
        """
        device = self.device
        model = self.model
        if (self.compile if compiled is None else compiled) and not last_only:
            model = self.compiled()
        # BLOOM takes a tree's mask through its mask builder, not as an argument (attention.use_slot_alibi)
        aside = self.alibi_slopes is not None and mask is not None
        with kv.advancing(cache, len(ids), self.name), (tree_mask(mask) if aside else contextlib.nullcontext()):
            out = model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                attention_mask=None if aside else mask,
                **{cache_kwarg(self.model): cache},
                use_cache=True,
                **({"logits_to_keep": 1} if last_only else {}),
                **({"output_hidden_states": True} if hidden else {}),
            )
        return (out.logits[0], out.hidden_states[-1][0]) if hidden else out.logits[0]

    def compiled(self):
        """The model wrapped in torch.compile for decode steps, built on first use.

        The weights stay inputs of the graph, read on every call (inductor's `freezing` is read from
        its global config when a graph is built; given in torch.compile's `options` it freezes
        nothing, so it is not passed). Packed linears (kernels.py) emit their own operations when
        compiled (a multiply-sum on the weight for one row, the oneDNN copy for several), so a
        weight changed in place needs `repack_linears` as it does eagerly.
        Sizes that vary from step to step (cache length, tree size: `DYNAMIC_SOURCES`) are symbolic
        from the first compile, so each kind of step (`STEP_KINDS`) builds one graph: at most 2 for
        a run (1 for `ar`), which `warm_up` builds before any timing (left to dynamo, each kind
        compiled twice, first with static sizes). The recompile limit is raised to
        RECOMPILE_LIMIT anyway, so switching kernels or attention never silently falls back to
        eager. Before every call dynamo checks its guards; `module_guards` leaves out those on the
        modules' hooks, instance dicts, the types of their own dicts and the shape checks of later
        layers' weights equal to the first layer's, unless the process has a model whose layers
        differ (`note_layers`) (docs/benchmarks.md has the measurements).
        """
        if self._compiled is None:
            self._compiled = compile_steps(self.model, self.dtype, self.device)
        return self._compiled

    @torch.no_grad()
    def warm_up(self, kinds, hidden: bool = False) -> float:  # (always compiled: called for compiled runs)
        """Run every kind of decode step in `kinds` (STEP_KINDS) once, compiled, on a scratch cache,
        so that graphs not built yet are built now; returns the seconds that took when a graph was
        compiled, else 0.0. The decoder calls it before its clock starts, so compiling (minutes on a
        CPU) never counts as decoding: it is reported apart, as `compile_s`. Once built, the steps
        cost milliseconds; they are run every time rather than remembered, because dynamo may drop
        or invalidate graphs (a reset, a kernel switch) without telling. `hidden`: the steps
        return hidden states too (a run with a feature drafter), which is another graph."""
        start, graphs = time.perf_counter(), compiled_graphs()
        cache = kv.new_cache(self.model)
        self.forward(cache, [0] * 4, list(range(4)), None, last_only=True, hidden=hidden)  # eager prefill (with `hidden`,
        # transformers installs its hooks that capture hidden states here, not inside the first compiled step)
        self._warm_steps(cache, 4, kinds, hidden, tree_size=2)
        # Where that built graphs, a second round at another cache length and tree size. Where torch
        # reads DYNAMIC_SOURCES per dimension (2.13 does; 2.11 ignores the ":N" entries) it reuses
        # them; elsewhere dynamo built static graphs first and builds symbolic ones when sizes change,
        # and this round is where that happens, not in the timed steps (seen on an H200 with torch
        # 2.11). Runs whose graphs exist already skip it (a request pays one round).
        if compiled_graphs() != graphs:
            self.forward(cache, [0], [4], None, last_only=True)  # one more cached token, eagerly
            self._warm_steps(cache, 5, kinds, hidden, tree_size=3)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start if compiled_graphs() != graphs else 0.0

    def _warm_steps(self, cache, context: int, kinds, hidden: bool, tree_size: int) -> None:
        """One compiled step of each kind in `kinds` on top of `cache`'s `context` tokens (cropped back after each)."""
        for kind in (k for k in STEP_KINDS if k in kinds):
            n = tree_size if kind == "tree" else 1
            allowed = causal_allowed(context, n)
            mask = None if kind == "token" else self.masks(allowed, torch.arange(context, context + n),
                                                           torch.arange(context + n))
            self.forward(cache, [0] * n, list(range(context, context + n)), mask, hidden=hidden, compiled=True)
            kv.crop(cache, context)


def compiles_on(cache) -> bool:
    """Whether a drafter's step on `cache` may run compiled: on 2+ entries, the lengths its warm-up builds
    graphs for (dynamo specialises an entry count of 1: another graph, built inside the timings)."""
    return kv.length(cache) >= 2


def compile_steps(fn, dtype: torch.dtype, device: torch.device):
    """`fn` (a module or a function) wrapped in torch.compile as dynatree compiles decode steps (see
    `LoadedModel.compiled`): DYNAMIC_SOURCES symbolic from the first graph, RECOMPILE_LIMIT,
    `module_guards`, no runtime asserts, the C++ wrapper on a CPU; `dtype`/`device` those of the weights.
    Used for targets and draft LMs (`LoadedModel.compiled`) and feature heads (featurehead.head_step)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    given = [s for s in torch.compiler.config.dynamic_sources.split(",") if s]
    torch.compiler.config.dynamic_sources = ",".join(dict.fromkeys(given + list(DYNAMIC_SOURCES)))
    # 16-bit models: inductor rounds every intermediate to the dtype where eager code does, as it
    # would not by default: otherwise the one-token and tree graphs, fused differently, round some
    # values differently and greedy tokens differ from ar's
    options = {"guard_filter_fn": module_guards, "emulate_precision_casts": dtype in (torch.bfloat16, torch.float16),
               **no_runtime_asserts(), **wrapper_options(device)}
    return torch.compile(fn, options=options)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (to tell whether a timed span compiled)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@functools.cache
def _forward_takes_cache(cls: type) -> bool:
    return "cache" in inspect.signature(cls.forward).parameters


def cache_kwarg(module: torch.nn.Module) -> str:
    """The name the module's forward takes the KV cache by: `cache` since transformers renamed
    `past_key_values` (which still works there, with a deprecation notice on every call)."""
    return "cache" if _forward_takes_cache(type(module)) else "past_key_values"
