"""The tree-policy contract and the level-by-level growth loop the policies share.

A policy turns a drafter's proposals into a `Tree` (`grow`) and may learn from each
verification's outcome and what the decoder measured of it (`observe`). Policies are pure:
no clocks, no model calls. `grow` is a generator that yields an `Ask` for each drafter call it
wants and is sent the drafter's `Proposal` back; the decoder makes the call (`decode.draft`),
so a policy never holds a drafter and tests can answer its asks with scripted proposals. A
policy that sizes trees by cost declares `uses_cost_curve` and is handed the target's measured
verification cost curve (`prepare`), and per-iteration timings arrive through `observe`. A policy with its own acceptance rule sets `verifier` (WETAP's beam
rule); otherwise the engine's greedy or rejection-sampling verifier decides. Growth happens one
depth level at a time so that a whole level costs a single drafter call (one draft forward).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Generator

import torch

from ..costmodel import CostCurve
from ..drafters.base import Proposal
from ..sampling import Sampler
from ..tree import Tree, TreeBuilder
from ..verify import Verifier


@dataclass(frozen=True)
class Timing:
    """What the decoder measured of one iteration, for `TreePolicy.observe`."""

    draft_s: float  # growing the tree: the policy's own work and every drafter call
    verify_s: float  # the target's pass over the tree, acceptance and the cache commits


@dataclass(frozen=True)
class Ask:
    """One drafter call a policy asks for while growing a tree (`Drafter.propose`'s arguments)."""

    tree: TreeBuilder  # the tree grown so far
    nodes: list[int]  # the nodes to propose children for, one proposal row each, in this order
    k: int  # candidates per node
    full: bool = False  # also each node's whole next-token distribution (drafting by sampling)
    model_free: bool = False  # only the drafter's part that runs no model (`Drafter.without_model`)


# What `TreePolicy.grow` returns: yields asks, is sent their proposals, returns the tree.
Growing = Generator[Ask, Proposal, Tree]


@dataclass(frozen=True)
class Growth:
    """What growing a tree has cost so far, in drafter calls."""

    levels: int = 0  # drafter calls (one per tree level)
    forwards: int = 0  # of those, calls that ran a model (the rest were n-gram lookups)


@dataclass(frozen=True)
class Grown:
    """What `grow_levels` returns: the tree as drafted (not built yet: a policy may cut it) and its cost."""

    tree: TreeBuilder
    growth: Growth


class TreePolicy:
    """The contract between the decoder and a tree policy. The decoder calls `prepare` once per
    run, then `grow` and `observe` once per iteration; subclasses implement `grow`."""

    needs_drafter: bool = True  # False only for plain decoding
    uses_cost_curve: bool = False  # True: `prepare` is handed the target's verification cost curve
    verifier: Verifier | None = None  # the policy's own acceptance rule (WETAP's, MTAD's), or None: the engine's

    def __init__(self, config):
        self.config = config  # the method's validated config dataclass (methods.make_config)

    def prepare(self, curve: CostCurve | None, model_free: bool) -> None:
        """Before a run's prefill (outside its timings): a new sequence starts; `curve` is the
        target's measured cost curve when `uses_cost_curve`, else None; `model_free` says whether
        the drafter has a part that runs no model (what an `Ask` with `model_free` is answered by)."""

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        """Draft a tree below `root_token`, no deeper than `max_depth` levels: yield an `Ask` per
        drafter call, receive its `Proposal`, return the tree. In sampling mode (`sampler` given)
        a policy may draw children from the draft distribution, recording it in
        `TreeBuilder.proposals`; children it picks deterministically need nothing more."""
        raise NotImplementedError

    def observe(self, tree: Tree, path: list[int], bonus: int, timing: Timing) -> None:
        """After every verification: the accepted path (root excluded), the bonus token the target
        chose after its last node (greedy: the target's argmax there; sampling: a draw) and the
        iteration's timings."""

    def state(self) -> dict | None:
        """What the policy adapted during the run, for the run's record (None: nothing)."""
        return None


def tempered(dist: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """[m, V] draft distributions -> the same temperature/top-k/top-p the target samples with
    (tokens the drafter gives no mass stay at zero; all-zero rows stay all zero)."""
    k = sampler.config.top_k
    if k and k < dist.shape[-1]:  # only the k most probable tokens can survive: warp those alone
        top = dist.topk(k, dim=-1)
        q = torch.zeros(dist.shape, dtype=torch.float64, device=dist.device).scatter_(-1, top.indices, _warp(top.values, sampler))
    else:
        q = _warp(dist, sampler)
    return q


def _warp(probs: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    q = sampler.probs(probs.clamp_min(1e-30).log()).masked_fill(probs <= 0, 0.0)
    total = q.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, q / total.clamp_min(1e-300), q)


def best_pairs(tree: TreeBuilder, layer: list[int], offers: list[list[tuple[int, float]]],
               width: int) -> list[tuple[int, int, float]]:
    """A beam step across parents: of every (parent in `layer`, offered (token, prob)) pair, the
    `width` of largest cumulative draft probability f(v), most probable first, as (parent, token, prob)."""
    candidates = [(tree.logp[parent] + math.log(prob), parent, token, prob)
                  for parent, children in zip(layer, offers) for token, prob in children]
    return [(parent, token, prob) for _, parent, token, prob in heapq.nlargest(width, candidates, key=lambda c: c[0])]


def top_children(proposal: Proposal, k: int, sampler: Sampler | None) -> list[list[tuple[int, float]]]:
    """Per proposal row, its k most probable (token, probability) children: from the drafter's
    own probabilities when greedy, from its tempered distribution when sampling (the
    proposal must then carry `dist`)."""
    if sampler is None:
        return [proposal.candidates(row)[:k] for row in range(proposal.ids.shape[0])]
    top = tempered(proposal.dist, sampler).topk(min(k, proposal.dist.shape[-1]), dim=-1)
    return [[(t, p) for t, p in zip(ids, ps) if p > 0.0] for ids, ps in zip(top.indices.tolist(), top.values.tolist())]


def grow_levels(
    root_token: int,
    *,
    max_depth: int,
    n_max: int,
    max_breadth: int,
    expandable: Callable[[int, float], bool],
    breadth: Callable[[float], int],
    tau: float = 0.0,
    stop: Callable[[TreeBuilder, Growth], bool] | None = None,
    model_free: bool = False,
) -> Generator[Ask, Proposal, Grown]:
    """Grow a tree breadth-first, one drafter call per level.

    A node at depth d with cumulative draft probability p is expanded when d < max_depth
    and `expandable(d, p)`; it gets `breadth(c)` children, c being the drafter's top-1
    probability at that node. Children whose cumulative probability is below `tau` are
    pruned. At most `n_max` drafted nodes: when a level's children exceed the remaining
    budget, the most probable (by cumulative probability) are kept. `stop(tree, growth)`, when
    given, is asked after each drafter call (`growth`: the calls so far) whether to stop growing.
    With `model_free`, only the drafter's model-free part is asked. Returns the tree as drafted and
    what drafting it cost (the caller builds it, cut or whole).
    """
    tree = TreeBuilder(root_token)
    frontier = [0]
    log_tau = math.log(tau) if tau > 0 else -math.inf
    growth = Growth()
    while frontier and len(tree) - 1 < n_max:
        nodes = [u for u in frontier if tree.depths[u] < max_depth and expandable(tree.depths[u], tree.prob(u))]
        if not nodes:
            break
        proposal = yield Ask(tree, nodes, max_breadth, model_free=model_free)
        growth = Growth(growth.levels + 1, growth.forwards + proposal.forwards)
        children = []  # (cumulative logp, parent, token, prob, proposed by a model)
        for row, parent in enumerate(nodes):
            candidates = proposal.candidates(row)
            if not candidates:
                continue
            for token, prob in candidates[: breadth(candidates[0][1])]:
                logp = tree.logp[parent] + math.log(prob)
                if logp >= log_tau:
                    children.append((logp, parent, token, prob, proposal.by_model(row)))
        budget = n_max - (len(tree) - 1)
        if len(children) > budget:
            best = sorted(range(len(children)), key=lambda i: -children[i][0])[:budget]
            children = [children[i] for i in sorted(best)]  # keep BFS order by parent
        frontier = [node for _, parent, token, prob, modelled in children
                    if (node := tree.add(parent, token, prob, modelled)) is not None]
        if stop is not None and stop(tree, growth):
            break
    return Grown(tree, growth)
