"""How good a draft LM is for its target, measured beside the timed runs (untimed itself).

  agreement  share of the positions of a continuation where the draft's most likely next
             token equals the target's, both teacher-forced on prompt + continuation
  step cost  one cached one-token forward of the draft and of the target at the same
             context, interleaved, median over `steps` steps; `cost_ratio` = draft / target
             (the price of one drafted token in target forwards)
"""

from __future__ import annotations

import statistics
import time

import torch

from .. import cache as kv
from ..models import LoadedModel


@torch.no_grad()
def agreement(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], new_ids: list[int],
              target_picks: list[int] | None = None) -> float:
    """Top-1 agreement of draft and target over the positions that predicted `new_ids`;
    `target_picks`: the target's argmax there, when already known (quality.teacher_forced)."""
    n = len(new_ids)
    vocab = min(target.vocab_size, draft.vocab_size)
    known = target_picks is not None and draft.vocab_size >= target.vocab_size
    picks = [torch.tensor(target_picks)] if known else []
    for model in (draft,) if known else (target, draft):
        ids = torch.tensor([prompt_ids + new_ids[:-1]], device=model.device)
        logits = model.model(ids, use_cache=False, logits_to_keep=n).logits[0, -n:, :vocab]
        picks.append(logits.argmax(-1).cpu())
    return float((picks[0] == picks[1]).float().mean())


@torch.no_grad()
def step_costs(target: LoadedModel, draft: LoadedModel, ids: list[int], steps: int = 16) -> dict:
    """Median time (ms) of a one-token cached forward of each model on the last `steps` of `ids`."""
    steps = max(1, min(steps, len(ids) - 1))
    start = len(ids) - steps
    caches = {}
    for name, model in (("target", target), ("draft", draft)):
        caches[name] = kv.new_cache(model.model)
        model.forward(caches[name], ids[:start], list(range(start)), None, last_only=True)
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for i in range(start, len(ids)):
        for name, model in (("target", target), ("draft", draft)):
            t0 = time.perf_counter()
            model.forward(caches[name], [ids[i]], [i], None, last_only=True)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            times[name].append(time.perf_counter() - t0)
    target_ms = 1000 * statistics.median(times["target"])
    draft_ms = 1000 * statistics.median(times["draft"])
    return {"target_ms": target_ms, "draft_ms": draft_ms, "cost_ratio": draft_ms / target_ms}


def measure(target: LoadedModel, draft: LoadedModel, prompt_ids: list[int], new_ids: list[int],
            target_picks: list[int] | None = None) -> dict:
    return {"agreement": agreement(target, draft, prompt_ids, new_ids, target_picks),
            **step_costs(target, draft, prompt_ids + new_ids)}
