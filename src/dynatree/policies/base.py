"""The tree-policy contract and the level-by-level growth loop the policies share.

A policy turns a drafter's proposals into a `Tree` (`grow`) and may learn from the
verification outcome (`observe`). The engine calls nothing else, except that a policy with
its own acceptance rule exposes it as `verifier` (`.accept(tree, logits, sampler)`, WETAP's
beam rule); without one the engine's greedy or rejection-sampling verifier decides. Growth happens one depth
level at a time so that a whole level costs a single drafter call (one draft forward).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol

import torch

from ..drafters.base import Drafter, Proposal
from ..sampling import Sampler
from ..tree import Tree, TreeBuilder


class TreePolicy(Protocol):
    needs_drafter: bool  # False only for plain decoding

    def grow(self, drafter: Drafter | None, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Tree:
        """Draft a tree below `root_token`, no deeper than `max_depth` levels. In sampling mode
        (`sampler` given) a policy may draw children from the draft distribution, recording it
        in `TreeBuilder.proposals`; children it picks deterministically need nothing more."""

    def observe(self, tree: Tree, path: list[int]) -> None:
        """Called after every verification with the accepted path (root excluded)."""

    # Optional, besides `verifier` (above): `calibrate(target, context)`, called once per run
    # before the prefill and outside the run's timings, lets a policy measure the target
    # (DynaTree's verification cost curve, measured once per model).


class Stateless:
    """Mixin for policies that do not learn from verification outcomes."""

    def observe(self, tree: Tree, path: list[int]) -> None:
        return None


def tempered(dist: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """[m, V] draft distributions -> the same temperature/top-k/top-p the target samples with
    (tokens the drafter gives no mass stay at zero; all-zero rows stay all zero)."""
    k = sampler.config.top_k
    if k and k < dist.shape[-1]:  # only the k most probable tokens can survive: warp those alone
        top = dist.topk(k, dim=-1)
        q = torch.zeros(dist.shape, dtype=torch.float64).scatter_(-1, top.indices, _warp(top.values, sampler))
    else:
        q = _warp(dist, sampler)
    return q


def _warp(probs: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    q = sampler.probs(probs.clamp_min(1e-30).log()).masked_fill(probs <= 0, 0.0)
    total = q.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp_min(1e-300), q)


def top_children(proposal: Proposal, k: int, sampler: Sampler | None) -> list[list[tuple[int, float]]]:
    """Per proposal row, its k most probable (token, probability) children: from the drafter's
    own probabilities when greedy, from its tempered distribution when sampling (the
    proposal must then carry `dist`)."""
    if sampler is None:
        return [proposal.candidates(row)[:k] for row in range(proposal.ids.shape[0])]
    top = tempered(proposal.dist, sampler).topk(min(k, proposal.dist.shape[-1]), dim=-1)
    return [[(t, p) for t, p in zip(ids, ps) if p > 0.0] for ids, ps in zip(top.indices.tolist(), top.values.tolist())]


def grow_levels(
    drafter: Drafter,
    root_token: int,
    *,
    max_depth: int,
    n_max: int,
    max_breadth: int,
    expandable: Callable[[int, float], bool],
    breadth: Callable[[float], int],
    tau: float = 0.0,
    cut: Callable[[TreeBuilder], list[int] | None] | None = None,
    stop: Callable[[TreeBuilder, int], bool] | None = None,
) -> Tree:
    """Grow a tree breadth-first, one drafter call per level.

    A node at depth d with cumulative draft probability p is expanded when d < max_depth
    and `expandable(d, p)`; it gets `breadth(c)` children, c being the drafter's top-1
    probability at that node. Children whose cumulative probability is below `tau` are
    pruned. At most `n_max` drafted nodes: when a level's children exceed the remaining
    budget, the most probable (by cumulative probability) are kept. `stop(tree, levels)`, when
    given, is asked after each drafter call (`levels` calls so far) whether to stop growing;
    `cut`, when given, picks the nodes to keep from the grown tree (None: all).
    """
    tree = TreeBuilder(root_token)
    frontier = [0]
    log_tau = math.log(tau) if tau > 0 else -math.inf
    levels = 0
    while frontier and len(tree) - 1 < n_max:
        nodes = [u for u in frontier if tree.depths[u] < max_depth and expandable(tree.depths[u], tree.prob(u))]
        if not nodes:
            break
        proposal = drafter.propose(tree, nodes, max_breadth)
        levels += 1
        children = []  # (cumulative logp, parent, token, prob)
        for row, parent in enumerate(nodes):
            candidates = proposal.candidates(row)
            if not candidates:
                continue
            for token, prob in candidates[: breadth(candidates[0][1])]:
                logp = tree.logp[parent] + math.log(prob)
                if logp >= log_tau:
                    children.append((logp, parent, token, prob))
        budget = n_max - (len(tree) - 1)
        if len(children) > budget:
            best = sorted(range(len(children)), key=lambda i: -children[i][0])[:budget]
            children = [children[i] for i in sorted(best)]  # keep BFS order by parent
        frontier = [node for _, parent, token, prob in children if (node := tree.add(parent, token, prob)) is not None]
        if stop is not None and stop(tree, levels):
            break
    return tree.build(keep=cut(tree) if cut is not None else None)
