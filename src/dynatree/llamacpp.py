"""llama.cpp on the same GGUF file: the baseline a CPU user would otherwise run (`llamacpp-ar`).

The target must come from a GGUF file (the embedded model, or a `.gguf` path): llama.cpp then
decodes the file as stored (SmolLM2: Q4_1 layers, a Q8_0 output layer; it computes the 4-bit
dot products on 8-bit-quantized activations), through the `llama-cpp-python` binding (an
optional extra: `pip install llama-cpp-python`, built from source in a few minutes). It gets the
same prompt token ids and the same number of threads as torch (`torch.get_num_threads()`), and
decodes greedily one token per pass (`temp=0`), EOS respected unless `ignore_eos`. Every run
starts from an empty KV cache (`reset()`: the binding would otherwise reuse the previous run's
prompt prefix, which dynatree's runs never do). Its tokens may differ from dynatree's `ar`:
another implementation, with other rounding.

Before the binding decodes in this process, a child process decodes a short prompt with the same
file, context and threads (`ready`): some llama.cpp builds crash there (a natively built binding on
Intel Xeons with AMX: llama.cpp's AMX kernels, ggml-org/llama.cpp#20824, seen on this project's
machines), and a crash in-process would take a whole benchmark down with it, so it is refused
up front with a one-line error saying how to rebuild the binding.
"""

from __future__ import annotations

from typing import Callable

import atexit
import contextlib
import dataclasses
import functools
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import MethodConfig, option, positive
from .cpu import cpu_flags
from .errors import DynaTreeError
from .stats import Clock, PeakMemory, Stats
from .wording import counted

# llama.cpp's KV cache is allocated for the whole context when the model is created: a run needs
# prompt + new tokens within it; larger contexts take more memory (see `_llama`)
MAX_CONTEXT = 4096


@dataclass
class LlamaCppArConfig(MethodConfig):
    """llama.cpp's plain greedy decoding of the target's GGUF file (llama-cpp-python)."""


@dataclass
class LlamaCppLookupConfig(MethodConfig):
    """llama.cpp's own speculative mode in the binding: prompt-lookup decoding (llama-cpp-python's
    `LlamaPromptLookupDecoding` drafts the continuation of the last matching n-gram; one llama.cpp
    pass verifies it), greedy. Same options as transformers' prompt lookup (hf-lookup)."""

    prompt_lookup_num_tokens: int = option(10, "candidate tokens copied from the matched n-gram's continuation")
    max_matching_ngram_size: int = option(2, "longest n-gram llama.cpp's lookup tries to match")

    def validate(self) -> None:
        positive(self, "prompt_lookup_num_tokens", "max_matching_ngram_size")


_LOADED: dict[tuple, object] = {}  # (file, context, threads) -> llama_cpp.Llama, loaded once per process


@atexit.register
def _close_all() -> None:
    """Free llama.cpp's models before the interpreter tears its modules down (the binding's own
    finalizer fails then, printing a traceback at exit)."""
    for llm in _LOADED.values():
        llm.close()
    _LOADED.clear()


@functools.lru_cache(maxsize=8)
def gguf_format(gguf: Path) -> str:
    """What llama.cpp reads from a GGUF file, for labels: the storage types of its weight matrices,
    most common first, the rarer ones with the tensors they hold (the embedded SmolLM2:
    "GGUF Q4_1 x210, Q8_0 (token_embd.weight)")."""
    from gguf import GGUFReader

    kinds: dict[str, list[str]] = {}
    for tensor in GGUFReader(str(gguf)).tensors:
        if len(tensor.shape) >= 2:  # matrices: what decoding reads (norms and biases are tiny)
            kinds.setdefault(tensor.tensor_type.name, []).append(tensor.name)
    parts = [f"{kind} x{len(names)}" if len(names) > 2 else f"{kind} ({', '.join(sorted(names))})"
             for kind, names in sorted(kinds.items(), key=lambda kv: -len(kv[1]))]
    return "GGUF " + ", ".join(parts)


# the child process of `ready`: load the file as `_llama` does, decode a prompt of several tokens
# (the batched path, where the AMX crash happens), then two single-token passes
PROBE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=int(sys.argv[3]),
            n_threads_batch=int(sys.argv[3]), verbose=False)
tokens = llm.tokenize(b"The quick brown fox jumps over the lazy dog; then it runs into the woods and hides.")
llm.eval(tokens)
llm.eval(tokens[:1])
llm.eval(tokens[1:2])
llm.close()
"""
# verified on an AMX Xeon: a native build (-march=native) turns the AMX kernels on whatever the AMX
# options say, so the build names the AVX-512 features instead
REBUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON '
           '-DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" '
           "pip install --force-reinstall --no-cache-dir llama-cpp-python")
PROBE_TIMEOUT_S = 600  # a child that has not decoded the short prompt by then is reported as stuck
# (file, context, threads) -> None (decoded in a child process) or why it failed: probed once
_READY: dict[tuple, str | None] = {}


def _import_binding():
    try:
        import llama_cpp
    except ImportError:
        raise DynaTreeError("llamacpp-ar and llamacpp-lookup need the llama-cpp-python package: pip install "
                            "llama-cpp-python (builds llama.cpp from source, a few minutes)") from None
    return llama_cpp


def ready(gguf: Path, context: int, threads: int) -> None:
    """The binding is installed and decodes `gguf` in a child process without crashing (module
    docstring), or a one-line error; probed once per process and setting (a failure is kept and
    raised again, so a server does not start a new probe per request)."""
    key = (str(gguf), context, threads)
    if key not in _READY:
        _import_binding()
        _READY[key] = _probe(gguf, context, threads)
    if _READY[key] is not None:
        raise DynaTreeError(_READY[key])


def _probe(gguf: Path, context: int, threads: int) -> str | None:
    """Run PROBE in a child process; what went wrong, in one line, or None."""
    try:
        child = subprocess.run([sys.executable, "-c", PROBE, str(gguf), str(context), str(threads)],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                               timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return (f"llama.cpp did not decode a short prompt of {gguf.name} within {PROBE_TIMEOUT_S} s "
                "in a child process")
    said = (child.stderr.strip().splitlines() or [""])[-1]
    if child.returncode < 0:
        try:
            how = signal.Signals(-child.returncode).name
        except ValueError:
            how = f"signal {-child.returncode}"
        hint = (f"; on Intel CPUs with AMX this is a known crash of llama.cpp's AMX kernels "
                f"(ggml-org/llama.cpp#20824): rebuild the binding without them: {REBUILD}"
                if how == "SIGSEGV" and "amx_int8" in cpu_flags() else "")
        return (f"llama.cpp crashed ({how}) decoding a short prompt of {gguf.name} in a child process, "
                f"so llamacpp-ar/llamacpp-lookup cannot run in this one" + (f" ({said})" if said else "")
                + hint)
    if child.returncode != 0:
        return (f"llama.cpp could not decode a short prompt of {gguf.name} in a child process: "
                f"{said or f'exit status {child.returncode}'}")
    return None


def _llama(gguf: Path, context: int, threads: int, lookup: LlamaCppLookupConfig | None = None):
    """The binding's model for a file, context and thread count (with `lookup`, its prompt-lookup
    draft model, wrapped to count the passes), loaded once per process after `ready`."""
    key = (str(gguf), context, threads, None if lookup is None else dataclasses.astuple(lookup))
    if key not in _LOADED:
        ready(gguf, context, threads)  # imports the binding, too
        from llama_cpp import Llama
        draft = None if lookup is None else _counting_lookup(lookup)
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            _LOADED[key] = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                 draft_model=draft, verbose=False)
    return _LOADED[key]


def _counting_lookup(config: LlamaCppLookupConfig):
    """The binding's prompt-lookup draft model, counting its calls and drafted tokens: it is asked
    once after every llama.cpp pass that sampled a token (the prefill's and each verification's),
    so its calls are the passes of a run."""
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    class Counting(LlamaPromptLookupDecoding):
        calls = drafted = 0

        def __call__(self, input_ids, *args, **kwargs):
            out = super().__call__(input_ids, *args, **kwargs)
            self.calls += 1
            self.drafted += len(out)
            return out

    return Counting(max_ngram_size=config.max_matching_ngram_size, num_pred_tokens=config.prompt_lookup_num_tokens)


def context_for(target_context: int | None) -> int:
    return min(target_context or MAX_CONTEXT, MAX_CONTEXT)


def ready_for(target) -> None:
    """`ready` for the target's GGUF file at the context and threads `llamacpp_generate` uses (a
    target without a file, or not on the CPU, is refused by `check_target`)."""
    if target.gguf is not None and target.device.type == "cpu":
        ready(target.gguf, context_for(target.context_length), torch.get_num_threads())


def check_target(target, prompt_tokens: int, max_new_tokens: int, sampling, method: str = "llamacpp-ar") -> None:
    """One-line errors for what llama.cpp (llamacpp-ar, llamacpp-lookup) cannot run, before any decoding."""
    if target.gguf is None:
        raise DynaTreeError(f"{method} runs llama.cpp on the target's GGUF file; {target.name!r} was not loaded "
                            "from one (use the embedded model or a .gguf path)")
    if target.device.type != "cpu":
        raise DynaTreeError(f"{method} runs llama.cpp on the CPU; load the target with --device cpu")
    if sampling is not None:
        raise DynaTreeError(f"{method} decodes greedily only (its samplers differ from dynatree's); drop --sample")
    context = context_for(target.context_length)
    if prompt_tokens + max_new_tokens > context:
        raise DynaTreeError(f"{method}: prompt ({counted(prompt_tokens, 'token')}) + max_new_tokens ({max_new_tokens}) "
                            f"exceeds the {context} tokens of llama.cpp's context here")


def llamacpp_generate(target, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False,
                      on_tokens=None, sampling=None, lookup: LlamaCppLookupConfig | None = None,
                      stopped: Callable[[], bool] | None = None) -> tuple[list[int], Stats]:
    """Greedy decoding by llama.cpp of the target's GGUF file, one pass per token, or with `lookup`
    its prompt-lookup speculative mode; new tokens and stats. `stopped()`, asked after each token
    reached `on_tokens`, ends the run when true (a stop string in the text)."""
    check_target(target, len(prompt_ids), max_new_tokens, sampling, "llamacpp-ar" if lookup is None else "llamacpp-lookup")
    llm = _llama(target.gguf, context_for(target.context_length), torch.get_num_threads(), lookup)
    eos = set() if ignore_eos else set(target.eos_ids)
    llm.reset()  # an empty cache: no prefix of an earlier run reused
    if lookup is not None:
        llm.draft_model.calls = llm.draft_model.drafted = 0
    memory, clock = PeakMemory(torch.device("cpu")), Clock(torch.device("cpu"))
    new_ids, ttft = [], None
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if ttft is None:
            ttft = clock.elapsed()
        new_ids.append(int(token))
        if on_tokens:
            on_tokens([int(token)])
        if len(new_ids) >= max_new_tokens or token in eos or (stopped is not None and stopped()):
            break
    wall = clock.elapsed()
    passes, drafted = len(new_ids), 0
    if lookup is not None:  # the last pass's own drafts were never verified when the run stopped there
        passes, drafted = max(llm.draft_model.calls, 1), llm.draft_model.drafted
    stats = Stats(new_tokens=len(new_ids), iterations=passes, drafted_tokens=drafted,
                  accepted_tokens=max(len(new_ids) - passes, 0),
                  ttft_s=ttft if ttft is not None else wall, wall_s=wall, peak_mem_mb=memory.peak_mb())
    return new_ids, stats
