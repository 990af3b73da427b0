"""How good a draft LM (or feature head) is for its target, measured beside the timed runs
(untimed itself).

  agreement  share of the positions of a continuation where the draft's most likely next
             token equals the target's, both teacher-forced on prompt + continuation (a feature
             head reads the target's features of that same pass: its depth-1 agreement)
  step cost  one cached one-token forward of the draft and of the target at the same
             context, interleaved, median over `steps` steps; `cost_ratio` = draft / target
             (the price of one drafted token in target forwards); a feature head's step is one
             root expansion (its forward, the sub-vocabulary's output rows and the top-k)
"""

from __future__ import annotations

import statistics
import time

import torch

from .. import cache as kv
from ..drafters import FeatureDrafter
from ..featurehead import FeatureHead
from ..runtime import LoadedModel
from ..tree import TreeBuilder


@torch.no_grad()
def head_agreement(target: LoadedModel, head: FeatureHead, prompt_ids: list[int], new_ids: list[int]) -> float:
    """Top-1 agreement of a feature head fed the target's true features, over the positions that
    predicted `new_ids` (one teacher-forced target pass gives the features and the target's picks)."""
    n, seq = len(new_ids), prompt_ids + new_ids[:-1]
    out = target.model(torch.tensor([seq], device=target.device), use_cache=False, output_hidden_states=True)
    picks = out.logits[0, -n:].argmax(-1).cpu()
    drafter = FeatureDrafter(head, target)
    ids = torch.tensor([seq[1:]], device=target.device)  # position p reads token p and the feature of p - 1
    feats = out.hidden_states[-1][:, :-1].to(drafter.dtype)
    pred = head(drafter.embed(ids).to(feats.dtype), feats, torch.arange(1, len(seq), device=target.device)[None])
    mine = head.vocab_ids[drafter.out(pred[0, -n:]).argmax(-1)].cpu()  # the rows' layer drafting runs (int4 for a q4 head)
    return float((mine == picks).float().mean())


@torch.no_grad()
def agreement(target: LoadedModel, draft: LoadedModel | FeatureHead, prompt_ids: list[int], new_ids: list[int],
              target_picks: list[int] | None = None) -> float:
    """Top-1 agreement of draft and target over the positions that predicted `new_ids`;
    `target_picks`: the target's argmax there, when already known (quality.teacher_forced)."""
    if isinstance(draft, FeatureHead):
        return head_agreement(target, draft, prompt_ids, new_ids)
    n = len(new_ids)
    vocab = min(target.vocab_size, draft.vocab_size)
    known = target_picks is not None and draft.vocab_size >= target.vocab_size
    picks = [torch.tensor(target_picks)] if known else []
    for model in (draft,) if known else (target, draft):
        ids = torch.tensor([model.readable(prompt_ids + new_ids[:-1])], device=model.device)
        logits = model.model(ids, use_cache=False, logits_to_keep=n).logits[0, -n:, :vocab]
        picks.append(logits.argmax(-1).cpu())
    return float((picks[0] == picks[1]).float().mean())


@torch.no_grad()
def step_costs(target: LoadedModel, draft: LoadedModel | FeatureHead, ids: list[int], steps: int = 16) -> dict:
    """Median time (ms) of a one-token cached forward of each model on the last `steps` of `ids`."""
    steps = max(1, min(steps, len(ids) - 2))  # a feature head's root needs one earlier position's feature
    start = len(ids) - steps
    cache = kv.new_cache(target.model)
    hidden = target.forward(cache, ids[:start], list(range(start)), None, last_only=True, hidden=True)[1]
    step = {"target": lambda i: target.forward(cache, [ids[i]], [i], None, last_only=True)}
    if isinstance(draft, FeatureHead):
        drafter = FeatureDrafter(draft, target)
        drafter.reset(ids[:start], hidden)
        drafter.propose(TreeBuilder(ids[start - 1]), [0], k=8)  # the prefix, before the timed steps

        def head_step(i):  # one more committed token (its feature: the last one known), then a root expansion
            drafter.commit(ids[: i + 1], [], hidden[-1:])
            drafter.propose(TreeBuilder(ids[i]), [0], k=8)
        step["draft"] = head_step
    else:
        draft_cache = kv.new_cache(draft.model)
        readable = draft.readable(ids)
        draft.forward(draft_cache, readable[:start], list(range(start)), None, last_only=True)
        step["draft"] = lambda i: draft.forward(draft_cache, [readable[i]], [i], None, last_only=True)
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for i in range(start, len(ids)):
        for name in ("target", "draft"):
            t0 = time.perf_counter()
            step[name](i)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            times[name].append(time.perf_counter() - t0)
    target_ms = 1000 * statistics.median(times["target"])
    draft_ms = 1000 * statistics.median(times["draft"])
    return {"target_ms": target_ms, "draft_ms": draft_ms, "cost_ratio": draft_ms / target_ms}


def measure(target: LoadedModel, draft: LoadedModel | FeatureHead, prompt_ids: list[int], new_ids: list[int],
            target_picks: list[int] | None = None) -> dict:
    return {"agreement": agreement(target, draft, prompt_ids, new_ids, target_picks),
            **step_costs(target, draft, prompt_ids + new_ids)}
