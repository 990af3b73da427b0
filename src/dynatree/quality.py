"""Quality of a generated continuation: its perplexity under the target (paper 004, eq. 11).

    PPL(x_1..x_n) = exp(-1/n * sum_i log P_target(x_i | prompt, x_<i))

P_target is the target's own next-token distribution (softmax of its logits, temperature 1,
no top-k/top-p), scored with full causal attention in one teacher-forced pass, whatever
method, sampling settings or KV window produced the tokens. Lossless methods produce
continuations distributed as the target samples them, so their PPL matches plain sampling
up to noise; a lossy verifier (WETAP's beam rule, MTAD's joint rule) shows up as a shift.
"""

from __future__ import annotations

import math

import torch

from .runtime import LoadedModel


@torch.no_grad()
def teacher_forced(target: LoadedModel, prompt_ids: list[int], new_ids: list[int]) -> tuple[float | None, list[int]]:
    """From one teacher-forced pass: the PPL of `new_ids` after `prompt_ids` (None when nothing was
    generated) and the target's most likely token at each of their positions (what a draft's
    top-1 agreement is scored against, bench/draftcheck.py)."""
    if not new_ids:
        return None, []
    ids = torch.tensor([prompt_ids + new_ids], device=target.device)
    logits = target.model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1]  # rows predicting new_ids
    logp = torch.log_softmax(logits.double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(new_ids, device=target.device)[:, None]).mean()
    return math.exp(float(nll)), logits[:, : target.vocab_size].argmax(-1).tolist()


def perplexity(target: LoadedModel, prompt_ids: list[int], new_ids: list[int]) -> float | None:
    """PPL of `new_ids` after `prompt_ids`; None when nothing was generated."""
    return teacher_forced(target, prompt_ids, new_ids)[0]
