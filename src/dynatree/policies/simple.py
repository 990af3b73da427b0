"""Plain decoding, linear speculation and the fixed tree: growth rules with fixed parameters."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import MethodConfig, in_unit, option, positive
from ..sampling import Sampler
from ..tree import TreeBuilder
from .base import Ask, Growing, TreePolicy, grow_levels, tempered


@dataclass
class ArConfig(MethodConfig):
    """Plain greedy decoding with the target: one target forward per token."""


class ArPolicy(TreePolicy):
    needs_drafter = False

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        yield from ()  # asks the drafter nothing
        return TreeBuilder(root_token).build()


@dataclass
class LinearConfig(MethodConfig):
    """A chain of k draft tokens verified in one target pass (classic speculative decoding)."""

    k: int = option(5, "draft chain length K")

    def validate(self) -> None:
        positive(self, "k")


class LinearPolicy(TreePolicy):

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        k = self.config.k
        if sampler is not None:
            return (yield from self._sampled_chain(root_token, min(k, max_depth), sampler))
        grown = yield from grow_levels(root_token, max_depth=min(k, max_depth), n_max=k, max_breadth=1,
                                       expandable=lambda depth, prob: True, breadth=lambda conf: 1)
        return grown.tree.build()

    @staticmethod
    def _sampled_chain(root_token: int, length: int, sampler: Sampler) -> Growing:
        """Each chain token drawn from the draft's distribution (tempered like the target's)."""
        tree = TreeBuilder(root_token)
        node = 0
        for _ in range(length):
            proposal = yield Ask(tree, [node], 1, full=True)
            dist = proposal.dist[0]
            q = tempered(dist[None], sampler)[0]
            if float(q.sum()) <= 0.0:  # the drafter has nothing to say here
                break
            token = sampler.draw(q)
            tree.proposals[node] = q
            node = tree.add(node, token, float(q[token]), proposal.by_model(0))
        return tree.build()


@dataclass
class FixedTreeConfig(MethodConfig):
    """A static tree: top-B children per node down to depth D, pruned below tau, at most n_max nodes."""

    depth: int = option(8, "tree depth D (drafted levels)")
    branch: int = option(3, "children per expanded node B (top-B draft tokens)")
    tau: float = option(0.1, "prune drafted nodes whose cumulative draft probability is below tau")
    n_max: int = option(256, "node budget N_max (drafted nodes per tree)")

    def validate(self) -> None:
        positive(self, "depth", "branch", "n_max")
        in_unit(self, "tau")


class FixedTreePolicy(TreePolicy):

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        c = self.config
        grown = yield from grow_levels(root_token, max_depth=min(c.depth, max_depth), n_max=c.n_max,
                                       max_breadth=c.branch, expandable=lambda depth, prob: True,
                                       breadth=lambda conf: c.branch, tau=c.tau)
        return grown.tree.build()
