"""Tree baselines of the WETAP paper (004, section 4.1, Appendix B.3), as tree policies.

All three are verified by dynatree's lossless verifiers (greedy: longest agreed path;
sampling: recursive rejection sampling), so they keep the target's distribution.

  specinfer  A fork: `width` children of the root, each continued by a single chain to
             `depth` (every token has one and only one child). Sampling draws the root's
             children without replacement and each chain token from the tempered draft
             distribution (SpecInfer's multi-step speculative sampling); greedy takes the
             top-`width` tokens, then top-1 chains.
  specexec   Budgeted best-first search: each round expands (top `branch` children) the
             `expand` most probable not-yet-expanded nodes among the `budget` most probable
             nodes found so far, in one drafter call, until all of them are expanded or at
             `depth`; the tree is those `budget` nodes.
  opt-tree   Layer by layer: the nodes of the newest layer get their top children, and the
             tree becomes the `budget` nodes of largest cumulative draft probability seen so
             far, which maximises the expected accepted length sum_v f(v) under the draft
             model for the nodes found; growth stops at `depth`, when no new node makes the
             cut, or when a layer would add less than `delta` to that expectation
             (that layer is then left out).
DSBD and MTAD, the paper's beam-drafting baselines, are in `beams.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodConfig, option, positive, require
from ..sampling import Sampler, draw_without_replacement
from ..tree import TreeBuilder
from .base import Ask, Growing, TreePolicy, tempered, top_children


@dataclass
class SpecInferConfig(MethodConfig):
    """SpecInfer's fork-shaped tree: `width` chains from the root."""

    width: int = option(8, "children of the root, each the start of one chain")
    depth: int = option(8, "tree depth (chain length)")

    def validate(self) -> None:
        positive(self, "width", "depth")


class SpecInferPolicy(TreePolicy):

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        c = self.config
        tree = TreeBuilder(root_token)
        ends = [0]
        for level in range(min(c.depth, max_depth)):
            k = c.width if level == 0 else 1
            proposal = yield Ask(tree, ends, k, full=sampler is not None)
            if sampler is None:
                offers = top_children(proposal, k, None)
            else:
                offers = [self._draw(tree, node, q, k, sampler) for node, q in zip(ends, tempered(proposal.dist, sampler))]
            ends = [child for row, (node, children) in enumerate(zip(ends, offers)) for token, prob in children
                    if (child := tree.add(node, token, prob, proposal.by_model(row))) is not None]
            if not ends:
                break
        return tree.build()

    @staticmethod
    def _draw(tree: TreeBuilder, node: int, q: torch.Tensor, k: int, sampler: Sampler) -> list[tuple[int, float]]:
        """k distinct tokens drawn from q without replacement; q is recorded as the node's proposal."""
        if float(q.sum()) <= 0.0:
            return []
        tree.proposals[node] = q
        return [(token, float(q[token])) for token in draw_without_replacement(q, k, sampler.generator)]


@dataclass
class SpecExecConfig(MethodConfig):
    """SpecExec-style budgeted best-first expansion of the most probable continuations."""

    budget: int = option(64, "node budget: drafted nodes in the tree")
    depth: int = option(8, "maximum tree depth")
    expand: int = option(8, "nodes expanded per drafter call")
    branch: int = option(8, "children proposed per expanded node")

    def validate(self) -> None:
        positive(self, "budget", "depth", "expand", "branch")


class SpecExecPolicy(TreePolicy):

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        c = self.config
        depth = min(c.depth, max_depth)
        tree = TreeBuilder(root_token)
        expanded: set[int] = set()
        while True:
            open_nodes = [u for u in [0] + _most_probable(tree, c.budget) if u not in expanded and tree.depths[u] < depth]
            todo = sorted(open_nodes, key=lambda u: -tree.logp[u])[: c.expand]
            if not todo:
                break
            if 0 in todo:
                todo = [0]  # the root is drafted on its own
            expanded.update(todo)
            proposal = yield Ask(tree, todo, c.branch, full=sampler is not None)
            for row, (node, children) in enumerate(zip(todo, top_children(proposal, c.branch, sampler))):
                for token, prob in children:
                    tree.add(node, token, prob, proposal.by_model(row))
        return tree.build(keep=[0] + _most_probable(tree, c.budget))


@dataclass
class OptTreeConfig(MethodConfig):
    """OPT-Tree-style tree maximising the expected accepted length under a node budget."""

    budget: int = option(64, "node budget: drafted nodes in the tree")
    depth: int = option(8, "maximum tree depth")
    delta: float = option(0.0, "stop when a new layer adds less than delta to the expected accepted length")

    def validate(self) -> None:
        positive(self, "budget", "depth")
        require(self.delta >= 0, f"--delta must be >= 0, got {self.delta}")


class OptTreePolicy(TreePolicy):

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        c = self.config
        tree = TreeBuilder(root_token)
        kept: list[int] = []
        layer, expected = [0], 0.0
        for level in range(1, min(c.depth, max_depth) + 1):
            proposal = yield Ask(tree, layer, c.budget, full=sampler is not None)
            for row, (node, children) in enumerate(zip(layer, top_children(proposal, c.budget, sampler))):
                for token, prob in children:
                    tree.add(node, token, prob, proposal.by_model(row))
            best = _most_probable(tree, c.budget)
            gain = sum(tree.prob(u) for u in best) - expected
            if gain < c.delta:  # this layer is not worth its cost: the tree stays as it was
                break
            kept, expected = best, expected + gain
            layer = [u for u in kept if tree.depths[u] == level]
            if not layer:
                break
        return tree.build(keep=[0] + kept)


def _most_probable(tree: TreeBuilder, n: int) -> list[int]:
    """The n drafted nodes of largest cumulative probability; parents sort before their
    children on ties (a child is never more probable), so the set is a valid tree."""
    nodes = sorted(range(1, len(tree)), key=lambda u: (-tree.logp[u], tree.depths[u], u))
    return sorted(nodes[:n])

