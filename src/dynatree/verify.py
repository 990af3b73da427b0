"""Acceptance rules: which drafted path of a verified tree is committed, and the bonus token.

One contract (`Verifier.accept(tree, logits, sampler) -> Accepted`) with four rules: greedy
(the longest root-to-leaf path the target agrees with), recursive rejection sampling (lossless
sampling, `sampling.sample_accept`), WETAP's beam rule and MTAD's joint rule (both lossy when
sampling). The decoder resolves the rule once per run: the policy's own (`TreePolicy.verifier`)
or `default_verifier`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sampling import Sampler, sample_accept
from .tree import Tree


@dataclass(frozen=True)
class Accepted:
    """What verification commits: the accepted drafted nodes and the target's token after them."""

    path: list[int]  # accepted tree nodes, root excluded, root-to-leaf order
    bonus: int  # the target's token after the path's last node (after the root when the path is empty)


class Verifier:
    """An acceptance rule (whether it keeps the target's distribution when sampling is the method
    config's to say: `MethodConfig.lossy`)."""

    def accept(self, tree: Tree, logits: torch.Tensor, sampler: Sampler | None) -> Accepted:
        """`logits` [n, vocab]: the target's row after each node of `tree`; `sampler` None when greedy."""
        raise NotImplementedError


class GreedyVerifier(Verifier):
    """Greedy decoding: `greedy_accept`."""

    def accept(self, tree: Tree, logits: torch.Tensor, sampler: Sampler | None) -> Accepted:
        return Accepted(*greedy_accept(tree, logits))


class RejectionVerifier(Verifier):
    """Sampling: recursive rejection sampling over each accepted node's children (`sample_accept`)."""

    def accept(self, tree: Tree, logits: torch.Tensor, sampler: Sampler | None) -> Accepted:
        return Accepted(*sample_accept(tree, sampler.probs(logits), sampler.generator))


def default_verifier(sampler: Sampler | None) -> Verifier:
    """The engine's lossless rule: greedy, or rejection sampling when there is a sampler."""
    return GreedyVerifier() if sampler is None else RejectionVerifier()


def greedy_accept(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Accepted path and bonus token for a verified tree.

    `logits` is [n, vocab]: row i is the target's next-token distribution after node i's
    root-to-node context. A drafted node is accepted when its token is the target's argmax
    after its parent and its parent is accepted (the root always is). Returns the accepted
    nodes (root excluded, root-to-leaf order) and the target's argmax after the last one.
    Siblings carry distinct tokens, so the accepted path is unique.
    """
    # `max(dim).indices` is argmax, the first maximal index on ties as argmax's (both documented so),
    # and faster than `argmax` over a bfloat16 row of logits on the CPU
    if tree.size == 1:  # nothing drafted (plain decoding)
        return [], int(logits[0].max(dim=-1).indices)
    pred = logits.max(dim=-1).indices.cpu()  # [n] the single device->host transfer of an iteration
    paths = tree.paths  # [n_leaves, max_depth + 1], -1 padded
    child, parent = paths[:, 1:], paths[:, :-1]
    match = (child >= 0) & (tree.tokens[child.clamp(min=0)] == pred[parent.clamp(min=0)])
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [n_leaves] accepted length per path
    best = int(accepted.argmax())
    length = int(accepted[best])
    path = paths[best, 1 : 1 + length].tolist()
    bonus = int(pred[paths[best, length]])
    return path, bonus


class _DeepestBeamVerifier(Verifier):
    """Beam rules that judge each drafted node by its whole root-to-node beam (WETAP, MTAD).

    P(v) is the product of the target's probabilities of the tokens on v's beam (0 or 1 when
    greedy: the target's argmax), Q(v) the draft's (`Tree.logp`). A node passes on its own when
    `passes(tree, log P)` says so, so a rejected token no longer blocks its descendants. The
    deepest level with a passing node wins, and of its passing nodes the one of largest P;
    its beam is committed and the bonus token is drawn from the target after it (argmax when
    greedy). With nothing passing, only the bonus is committed. A beam holding a token the
    target gives probability 0 never passes. LOSSY when sampling: a beam the target finds
    unlikely token by token can pass on its product. Greedy, a beam passes exactly when every
    token on it is the target's argmax (P = 1 > tau >= ratio threshold for any Q <= 1), so the
    rule equals `greedy_accept` and the output is token-for-token that of greedy decoding.
    """

    def __init__(self, tau: float):
        self.tau = tau  # the rule's pass threshold, in [0, 1)

    def passes(self, tree: Tree, beam_logp: torch.Tensor) -> torch.Tensor:
        """[n] bool: which nodes pass, from the [n] log P of their beams."""
        raise NotImplementedError

    def accept(self, tree: Tree, logits: torch.Tensor, sampler: Sampler | None) -> Accepted:
        probs = None if sampler is None else sampler.probs(logits).cpu()  # [n, V] float64 when sampling

        def bonus(node: int) -> int:
            return int(logits[node].argmax()) if probs is None else sampler.draw(probs[node])

        if tree.n_drafted == 0:
            return Accepted([], bonus(0))
        parents, tokens = tree.parents[1:], tree.tokens[1:]
        if probs is None:
            node_p = (logits.argmax(dim=-1).cpu()[parents] == tokens).double()  # [n-1] target's 0/1 probability
        else:
            node_p = probs[parents, tokens]
        ancestors = tree.ancestors.double()
        zero = torch.zeros(1, dtype=torch.float64)
        beam_logp = ancestors @ torch.cat([zero, node_p.clamp_min(1e-300).log()])  # [n] log P of each beam
        impossible = (ancestors @ torch.cat([zero, (node_p <= 0).double()])) > 0  # a token with P = 0 on the beam
        passed = self.passes(tree, beam_logp) & ~impossible
        passed[0] = False
        if not bool(passed.any()):
            return Accepted([], bonus(0))
        depth = int(tree.depths[passed].max())  # the deepest level with an accepted beam
        candidates = (passed & (tree.depths == depth)).nonzero().squeeze(1)
        node = int(candidates[beam_logp[candidates].argmax()])
        return Accepted(tree.path_to(node), bonus(node))


class BeamVerifier(_DeepestBeamVerifier):
    """WETAP's deep-to-shallow beam verification (paper 004, eq. 9 and Algorithm 1). LOSSY.

    A drafted node v passes when its beam has min(1, P(v) / Q(v)) > tau (see
    `_DeepestBeamVerifier` for P, Q, the choice among passing nodes and greedy exactness).
    """

    def passes(self, tree: Tree, beam_logp: torch.Tensor) -> torch.Tensor:
        return (beam_logp - tree.logp).clamp(max=0.0).exp() > self.tau


class JointVerifier(_DeepestBeamVerifier):
    """MTAD's joint-likelihood verification, multi-candidate form (Qin et al., 2025b). LOSSY.

    A drafted node v at depth d passes when P(v) / max_u Q(u) > tau, the maximum over the
    nodes u of depth d (see `_DeepestBeamVerifier` for the rest and greedy exactness).
    """

    def passes(self, tree: Tree, beam_logp: torch.Tensor) -> torch.Tensor:
        level_max = torch.full((tree.max_depth + 1,), -math.inf, dtype=torch.float64)
        level_max = level_max.scatter_reduce(0, tree.depths, tree.logp, reduce="amax")
        ratio = beam_logp - level_max[tree.depths]  # log P(v) - log max Q of v's level
        return ratio > (math.log(self.tau) if self.tau > 0 else -math.inf)
