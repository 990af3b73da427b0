"""The speculative decoding loop: draft tree -> verify -> accept -> commit cache.

State between iterations: the committed tokens `seq`, and the target cache holding every
committed token but the last one. That last token (the previous bonus) is the root of the
next tree, so it is fed together with the drafted nodes in the next verification pass.
The prefill runs the whole prompt and yields the first new token (like plain decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from . import cache as kv
from .drafters.base import Drafter
from .models import LoadedModel
from .policies.base import TreePolicy
from .stats import Clock, PeakMemory, Stats
from .tree import Tree
from .verify import greedy_accept


@dataclass
class Step:
    """What one iteration did; yielded by `Decoder.steps` after the caches are committed."""

    tree: Tree  # the verified tree (root = previous last token)
    path: list[int]  # accepted drafted nodes, root excluded
    committed: list[int]  # tokens committed this iteration (path tokens + bonus, maybe truncated)


@dataclass
class Run:
    """State of one generation, visible to tests between iterations."""

    seq: list[int]  # prompt + committed new tokens
    prompt_len: int
    cache: object  # target KV cache: entries for seq[:-1]
    stats: Stats = field(default_factory=Stats)

    @property
    def new_tokens(self) -> list[int]:
        return self.seq[self.prompt_len :]


class Decoder:
    """Greedy decoding of one target with one tree policy (and the drafter it needs)."""

    def __init__(self, target: LoadedModel, policy: TreePolicy, drafter: Drafter | None = None):
        if policy.needs_drafter and drafter is None:
            raise ValueError("this policy needs a drafter")
        self.target = target
        self.policy = policy
        self.drafter = drafter

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        ignore_eos: bool = False,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> Run:
        for _ in self.steps(prompt_ids, max_new_tokens, ignore_eos, on_tokens):
            pass
        return self.run

    @torch.no_grad()
    def steps(self, prompt_ids, max_new_tokens, ignore_eos=False, on_tokens=None) -> Iterator[Step]:
        """Generate, yielding after every verification (the prefill is not a `Step`)."""
        device = self.target.device
        memory, clock = PeakMemory(device), Clock(device)
        stop_ids = set() if ignore_eos else set(self.target.eos_ids)
        run = self.run = Run(seq=list(prompt_ids), prompt_len=len(prompt_ids), cache=kv.new_cache(self.target.model))
        stats = run.stats

        # Prefill: the whole prompt in one causal pass gives the first new token.
        logits = self.target.forward(run.cache, prompt_ids, list(range(len(prompt_ids))), mask=None, last_only=True)
        first = int(logits[-1].argmax())
        run.seq.append(first)
        stats.iterations, stats.new_tokens, stats.ttft_s = 1, 1, clock.elapsed()
        if on_tokens:
            on_tokens([first])
        if self.drafter is not None:
            self.drafter.reset(run.seq)

        while stats.new_tokens < max_new_tokens and run.seq[-1] not in stop_ids:
            remaining = max_new_tokens - stats.new_tokens
            prefix = len(run.seq) - 1  # cached tokens; seq[-1] is the root

            tree = self.policy.grow(self.drafter, run.seq[-1], max_depth=remaining - 1)  # 1. draft
            mask = tree.attention_mask(prefix, self.target.dtype, device)  # 2. verify
            logits = self.target.forward(run.cache, tree.tokens.tolist(), tree.position_ids(prefix)[0].tolist(), mask)
            path, bonus = greedy_accept(tree, logits)  # 3. accept
            kv.keep(run.cache, prefix, torch.tensor([0] + path))  # 4. commit caches
            committed = _truncate(tree.tokens[path].tolist() + [bonus], stop_ids, remaining)
            run.seq.extend(committed)
            if self.drafter is not None:
                self.drafter.commit(run.seq, path)
            self.policy.observe(tree, path)

            stats.iterations += 1
            stats.new_tokens += len(committed)
            stats.drafted_tokens += tree.n_drafted
            accepted = min(len(path), len(committed))
            stats.accepted_tokens += accepted
            stats.tree_sizes.append(tree.n_drafted)
            stats.accepted_lens.append(accepted)
            if on_tokens:
                on_tokens(committed)
            yield Step(tree=tree, path=path, committed=committed)

        stats.wall_s = clock.elapsed()
        stats.peak_mem_mb = memory.peak_mb()


def _truncate(tokens: list[int], stop_ids: set[int], limit: int) -> list[int]:
    """Cut after the first stop token and at `limit` tokens."""
    for i, token in enumerate(tokens[:limit]):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens[:limit]
