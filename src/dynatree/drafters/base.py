"""The drafter contract: next-token candidates for a batch of tree nodes.

A drafter sees the committed sequence through `reset`/`commit` and, while a policy grows
a tree, answers `propose(tree, nodes, k)`: for each node, the k most likely next tokens
after that node's own root-to-node context (committed tokens + the path's tokens) and
their probabilities. Each node is answered from its own context; nothing is shared
between branches. Drafters know nothing about tree policies or verification. A drafter
that reads the target's features (`uses_target_hidden`) is handed them by the decoder, from
the prefill and from each verification pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..tree import TreeBuilder


@dataclass
class Proposal:
    ids: torch.Tensor  # [m, k] long, candidate next tokens per node, most probable first; -1 pads
    probs: torch.Tensor  # [m, k] float, their draft probabilities; 0 where ids == -1
    dist: torch.Tensor | None = None  # [m, V] the whole next-token distribution, when asked for (full=True)
    forwards: int = 0  # model forwards this answer cost (0: lookups only, as the n-gram drafter's)
    modelled: torch.Tensor | None = None  # [m] bool, rows a model answered (None: all rows if forwards, else none)

    def by_model(self, row: int) -> bool:
        """Whether a model (not a lookup) proposed row `row`'s candidates: a hybrid answers some rows
        of a call by n-gram lookups and the others by its model."""
        return bool(self.modelled[row]) if self.modelled is not None else self.forwards > 0

    def candidates(self, row: int) -> list[tuple[int, float]]:
        """(token, probability) pairs of node `row`, most probable first, padding dropped."""
        return [(t, p) for t, p in zip(self.ids[row].tolist(), self.probs[row].tolist()) if t >= 0 and p > 0.0]


class Drafter(Protocol):
    name: str
    uses_target_hidden: bool  # True: reset/commit must be given the target's last hidden states

    def reset(self, tokens: list[int], hidden: torch.Tensor | None = None) -> None:
        """Start a new sequence; `tokens` are all committed tokens (prompt + first new token);
        `hidden` the target's last hidden states of the prompt [len(tokens) - 1, hidden size]. A
        drafter with a model runs its prefill here (every committed token but the last), so that the
        first tree's drafting costs what later trees' do: a cost-aware policy learns the cost of a
        draft forward from each tree's drafting time (the decoder counts this time as drafting,
        outside every tree's)."""

    def propose(self, tree: TreeBuilder, nodes: list[int], k: int, full: bool = False) -> Proposal:
        """Top-k next tokens after each of `nodes` (one row per node, in the given order);
        with `full`, also the whole distribution (for drafting by sampling)."""

    def warm_up(self) -> float:
        """Build the compiled graphs of this drafter's model steps (a `--compile` run) before any clock
        starts; the seconds that took when a graph was built, else 0.0 (also for drafters that run
        no model, or run it eagerly)."""

    def without_model(self) -> "Drafter | None":
        """The part of this drafter that runs no model (itself for the n-gram drafter, the n-gram
        part of a hybrid), or None: what a policy that declines to pay for model forwards may
        still draft with. It shares this drafter's state (reset and commit go through this one)."""

    def commit(self, tokens: list[int], path: list[int], hidden: torch.Tensor | None = None) -> None:
        """After verification: `tokens` is the new committed sequence, `path` the accepted
        tree nodes (root excluded) of the tree last grown, `hidden` the target's last hidden
        states of the root and the path's nodes [1 + len(path), hidden size] (same pass)."""
