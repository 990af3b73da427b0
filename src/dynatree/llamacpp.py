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
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import DynaTreeError
from .stats import Clock, PeakMemory, Stats

# llama.cpp's KV cache is allocated for the whole context when the model is created: a run needs
# prompt + new tokens within it; larger contexts take more memory (see `_llama`)
MAX_CONTEXT = 4096


@dataclass
class LlamaCppArConfig:
    """llama.cpp's plain greedy decoding of the target's GGUF file (llama-cpp-python)."""


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


def _llama(gguf: Path, context: int, threads: int):
    key = (str(gguf), context, threads)
    if key not in _LOADED:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise DynaTreeError("llamacpp-ar needs the llama-cpp-python package: pip install llama-cpp-python "
                                "(builds llama.cpp from source, a few minutes)") from None
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            _LOADED[key] = Llama(model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                                 verbose=False)
    return _LOADED[key]


def context_for(target_context: int | None) -> int:
    return min(target_context or MAX_CONTEXT, MAX_CONTEXT)


def check_target(target, prompt_tokens: int, max_new_tokens: int, sampling) -> None:
    """One-line errors for what llamacpp-ar cannot run, before any decoding."""
    if target.gguf is None:
        raise DynaTreeError(f"llamacpp-ar runs llama.cpp on the target's GGUF file; {target.name!r} was not loaded "
                            "from one (use the embedded model or a .gguf path)")
    if target.device.type != "cpu":
        raise DynaTreeError("llamacpp-ar runs llama.cpp on the CPU; load the target with --device cpu")
    if sampling is not None:
        raise DynaTreeError("llamacpp-ar decodes greedily only (its samplers differ from dynatree's); drop --sample")
    context = context_for(target.context_length)
    if prompt_tokens + max_new_tokens > context:
        raise DynaTreeError(f"llamacpp-ar: prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) "
                            f"exceeds the {context} tokens of llama.cpp's context here")


def llamacpp_generate(target, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False,
                      on_tokens=None, sampling=None) -> tuple[list[int], Stats]:
    """Greedy decoding by llama.cpp of the target's GGUF file; new tokens and stats (one pass per token)."""
    check_target(target, len(prompt_ids), max_new_tokens, sampling)
    llm = _llama(target.gguf, context_for(target.context_length), torch.get_num_threads())
    eos = set() if ignore_eos else set(target.eos_ids)
    llm.reset()  # an empty cache: no prefix of an earlier run reused
    memory, clock = PeakMemory(torch.device("cpu")), Clock(torch.device("cpu"))
    new_ids, ttft = [], None
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if ttft is None:
            ttft = clock.elapsed()
        new_ids.append(int(token))
        if on_tokens:
            on_tokens([int(token)])
        if len(new_ids) >= max_new_tokens or token in eos:
            break
    wall = clock.elapsed()
    stats = Stats(new_tokens=len(new_ids), iterations=len(new_ids), drafted_tokens=0, accepted_tokens=0,
                  ttft_s=ttft if ttft is not None else wall, wall_s=wall, peak_mem_mb=memory.peak_mb())
    return new_ids, stats
