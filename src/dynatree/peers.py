"""transformers' own decoding, wrapped to report the same statistics as dynatree's methods.

  hf-ar        target.generate(do_sample=False)                  (plain greedy; sampled under --sample)
  hf-assisted  target.generate(assistant_model=draft, ...)       (HF speculative decoding)
  hf-lookup    target.generate(prompt_lookup_num_tokens=k, ...)  (HF prompt-lookup decoding)

Nothing inside transformers is changed. The statistics are observed from outside with
public hooks: a streamer timestamps every batch of committed tokens (TTFT), and a forward
pre-hook on the target counts its passes and the tokens each one receives. After the first
pass, a pass receives the last committed token plus the candidates to verify, so drafted
tokens = received tokens - prompt length - (passes - 1), and committed drafted tokens =
new tokens - passes (every pass commits its accepted candidates plus one target token).
`ignore_eos` is applied the same way as in dynatree: EOS is an ordinary token and
generation runs to max_new_tokens (`eos_token_id=None`), never by suppressing EOS.

`hf-ar` with compile is transformers at its best: `generate()` with a static cache sized for
the prompt and the new tokens, and transformers' own compiled forward for its decode steps
(inductor with its default options, as dynatree compiles; on the CPU without CUDA graphs, which
need a GPU). An untimed 4-token generate() first builds the graph, so compiling is
reported apart (`compile_s`) as for dynatree's methods, and graphs built inside the timed run
are counted. `hf-assisted` compiles the same way (the target's forward; its drafts vary in length,
so a graph may still be built in the timed run: counted). Prompt lookup with a static cache fails
inside the compiled graph, so `hf-lookup` runs uncompiled only (methods.py says why).
"""

from __future__ import annotations

from typing import Callable

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from .attention import stock_attention
from .errors import DynaTreeError
from .config import MethodConfig, in_open_unit, option, positive, require
from .kernels import stock_linears
from .runtime import LoadedModel, compiled_graphs
from .stats import Clock, PeakMemory, Stats


@dataclass
class HfArConfig(MethodConfig):
    """transformers' plain generate(): greedy, or sampled under --sample."""

    def generate_kwargs(self, draft, target) -> dict:
        return {}


@dataclass
class HfAssistedConfig(MethodConfig):
    """transformers' assisted generation with a draft LM (generate(assistant_model=...))."""

    num_assistant_tokens: int = option(20, "draft tokens per iteration (transformers' num_assistant_tokens)")
    assistant_schedule: str = option("constant", "constant | heuristic | heuristic_transient (num_assistant_tokens_schedule)")
    assistant_confidence: float = option(0.4, "stop drafting below this draft confidence (assistant_confidence_threshold)")

    def validate(self) -> None:
        positive(self, "num_assistant_tokens")
        require(
            self.assistant_schedule in ("constant", "heuristic", "heuristic_transient"),
            f"--assistant-schedule must be constant, heuristic or heuristic_transient, got {self.assistant_schedule!r}",
        )
        in_open_unit(self, "assistant_confidence")

    def generate_kwargs(self, draft: LoadedModel, target: LoadedModel) -> dict:
        kwargs = {}
        if universal_assisted(target, draft):
            kwargs.update(tokenizer=target.tokenizer, assistant_tokenizer=draft.tokenizer)
        return kwargs | {
            "assistant_model": draft.model,
            "num_assistant_tokens": self.num_assistant_tokens,
            "num_assistant_tokens_schedule": self.assistant_schedule,
            "assistant_confidence_threshold": self.assistant_confidence,
        }


@dataclass
class HfLookupConfig(MethodConfig):
    """transformers' prompt-lookup decoding (generate(prompt_lookup_num_tokens=...))."""

    prompt_lookup_num_tokens: int = option(10, "candidate tokens copied from the matched n-gram's continuation")
    max_matching_ngram_size: int = option(2, "longest n-gram transformers tries to match")

    def validate(self) -> None:
        positive(self, "prompt_lookup_num_tokens", "max_matching_ngram_size")

    def generate_kwargs(self, draft, target) -> dict:
        return {
            "prompt_lookup_num_tokens": self.prompt_lookup_num_tokens,
            "max_matching_ngram_size": self.max_matching_ngram_size,
        }


def _config_vocab(model: LoadedModel) -> int:
    return model.model.config.get_text_config().vocab_size


def universal_assisted(target: LoadedModel, draft: LoadedModel) -> bool:
    """Whether transformers runs hf-assisted as universal assisted decoding: it takes configs with
    different vocabulary sizes (model families pad output layers differently, e.g. 49280 vs 49152
    rows) for different tokenizers and then re-tokenizes the draft's text for the target each
    iteration, even when the tokenizers are the same (dynatree's check_compatible requires that).
    Slower than plain assisted decoding; noted wherever it runs."""
    return _config_vocab(target) != _config_vocab(draft)


def universal_note(target: LoadedModel, draft: LoadedModel) -> str:
    return (f"hf-assisted: the draft's vocabulary size ({_config_vocab(draft)}) differs from the target's "
            f"({_config_vocab(target)}), so transformers runs universal assisted decoding (it re-tokenizes the "
            "draft's text each iteration; slower than plain assisted decoding)")


def check_assisted(target: LoadedModel, draft, sampling) -> None:
    """hf-assisted cannot sample with such a draft: transformers' universal speculative decoding fails then."""
    if sampling is not None and isinstance(draft, LoadedModel) and universal_assisted(target, draft):
        raise DynaTreeError(
            f"hf-assisted cannot sample with draft {draft.name!r}: its vocabulary size ({_config_vocab(draft)}) "
            f"differs from the target's ({_config_vocab(target)}), for which transformers runs universal "
            "speculative decoding, which fails when sampling; use greedy decoding, or dynatree's methods "
            "(they sample with this draft)")


class _Stamps(BaseStreamer):
    """Records when each batch of new tokens leaves generate()."""

    def __init__(self, clock: Clock, on_tokens):
        self.clock, self.on_tokens = clock, on_tokens
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value):
        if not self.seen_prompt:  # generate() streams the prompt first
            self.seen_prompt = True
            return
        self.times.append(self.clock.elapsed())
        if self.on_tokens:
            self.on_tokens(value.reshape(-1).tolist())

    def end(self):
        pass


class _Asked(StoppingCriteria):
    """Ends generate() when the caller's `stopped()` says so. Plain decoding (hf-ar) asks its
    criteria before it streams a step's token, so it stops one step after the one that completed a
    stop string; assisted decoding (hf-assisted, hf-lookup) streams first and stops in the same
    step. `Prepared.result` cuts the ids at the stop either way."""

    def __init__(self, stopped):
        self.stopped = stopped

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), bool(self.stopped()), dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def _notices_off():
    """transformers' generate() calls itself for the assistant with a generation_config and
    arguments together, then logs a deprecation notice about that call, which its caller cannot
    act on. Only that module's notices are held back, and only here; errors still show."""
    import logging

    log = logging.getLogger("transformers.generation.utils")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@torch.no_grad()
def hf_generate(
    target: LoadedModel,
    config,
    prompt_ids: list[int],
    max_new_tokens: int,
    ignore_eos: bool = False,
    draft: LoadedModel | None = None,
    on_tokens=None,
    sampling=None,
    compile: bool = False,
    stopped: Callable[[], bool] | None = None,
) -> tuple[list[int], Stats]:
    """Run transformers' generate() for one of the hf-* configs; return new tokens and stats.
    `compile` (hf-ar and hf-assisted): a static cache and transformers' compiled forward (see above).
    `stopped()` (a stop string in the text streamed to `on_tokens`) ends generate() when true (hf-ar
    one step late: see `_Asked`)."""
    device = target.device
    received: list[int] = []

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        received.append(int(ids.shape[1]))

    check_assisted(target, draft, sampling)
    extra = config.generate_kwargs(draft, target)
    if sampling is None:
        extra["do_sample"] = False
    else:  # the same temperature -> top-k -> top-p chain as dynatree's; seeded by the caller
        extra.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    if compile:
        extra.update(_static_compiled(device, len(prompt_ids) + max_new_tokens))
    eos = None if ignore_eos else (target.eos_ids or None)
    ids = torch.tensor([prompt_ids], device=device)
    common = dict(attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                  pad_token_id=target.eos_ids[0] if target.eos_ids else 0, **extra)
    # the baselines run the attention and the linear kernels transformers gets by default
    # (see attention.stock_attention, kernels.stock_linears)
    models = (target.model, draft.model if draft is not None else None)
    with stock_attention(*models), stock_linears(*models), _notices_off():
        compile_s = None
        if compile:  # build the decode step's graph before the clock (prefill + compiled steps; on CUDA
            # the CUDA graphs are recorded after a few calls), leaving the random numbers to the timed run
            start, graphs = time.perf_counter(), compiled_graphs()
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                target.model.generate(ids, max_new_tokens=4, eos_token_id=None, **common)
            compile_s = time.perf_counter() - start if compiled_graphs() != graphs else 0.0
        hook = target.model.register_forward_pre_hook(count, with_kwargs=True)
        try:
            graphs = compiled_graphs()
            memory, clock = PeakMemory(device), Clock(device)
            stamps = _Stamps(clock, on_tokens)
            criteria = StoppingCriteriaList([_Asked(stopped)] if stopped is not None else [])
            out = target.model.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos, streamer=stamps,
                                        stopping_criteria=criteria, **common)
            wall = clock.elapsed()
        finally:
            hook.remove()
    new_ids = out[0, len(prompt_ids) :].tolist()
    passes = len(received)
    stats = Stats(
        new_tokens=len(new_ids),
        iterations=passes,
        drafted_tokens=sum(received) - len(prompt_ids) - (passes - 1),
        accepted_tokens=len(new_ids) - passes,
        ttft_s=stamps.times[0] if stamps.times else wall,
        wall_s=wall,
        peak_mem_mb=memory.peak_mb(),
        compile_s=compile_s,
        graphs_compiled_while_timed=compiled_graphs() - graphs if compile else None,
        prefill_verified=bool(received) and received[0] > len(prompt_ids),  # the prompt came with drafts
    )
    return new_ids, stats


def _static_compiled(device: torch.device, length: int) -> dict:
    """generate() options for a static cache of `length` slots and transformers' compiled forward."""
    from transformers import CompileConfig

    if device.type == "cuda":
        config = CompileConfig()  # transformers' default: CUDA graphs ("reduce-overhead")
    else:
        config = CompileConfig(mode=None)  # inductor's default mode (CUDA graphs need a GPU)
        config._compile_all_devices = True  # transformers' own switch to compile off the GPU
    return {"cache_implementation": "static", "max_cache_len": length, "compile_config": config}
