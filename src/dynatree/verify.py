"""Acceptance rules: which drafted path of a verified tree is committed, and the bonus token.

One contract (`Verifier.accept(tree, logits, sampler) -> Accepted`) with three rules: greedy
(the longest root-to-leaf path the target agrees with), recursive rejection sampling (lossless
sampling, `sampling.sample_accept`) and WETAP's beam rule (lossy when sampling). The decoder
resolves the rule once per run: the policy's own (`TreePolicy.verifier`) or `default_verifier`.
"""

from __future__ import annotations

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
    """An acceptance rule. `lossless`: sampled output keeps the target's distribution."""

    lossless: bool = True

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
    if tree.size == 1:  # nothing drafted (plain decoding)
        return [], int(logits[0].argmax())
    pred = logits.argmax(dim=-1).cpu()  # [n] the single device->host transfer of an iteration
    paths = tree.paths  # [n_leaves, max_depth + 1], -1 padded
    child, parent = paths[:, 1:], paths[:, :-1]
    match = (child >= 0) & (tree.tokens[child.clamp(min=0)] == pred[parent.clamp(min=0)])
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [n_leaves] accepted length per path
    best = int(accepted.argmax())
    length = int(accepted[best])
    path = paths[best, 1 : 1 + length].tolist()
    bonus = int(pred[paths[best, length]])
    return path, bonus


class BeamVerifier(Verifier):
    """WETAP's deep-to-shallow beam verification (paper 004, eq. 9 and Algorithm 1). LOSSY.

    A drafted node v is accepted on its own when its whole root-to-v beam passes
        min(1, P(beam) / Q(beam)) > tau,
    P and Q being the products of the target's and the draft's probabilities of the beam's
    tokens: a rejected token no longer blocks its descendants. Levels are scanned from the
    deepest up; the first level with an accepted node wins, and among its accepted nodes the
    one with the largest P. Its beam is committed and the bonus token is drawn from the
    target after it (argmax when greedy). With nothing accepted, only the bonus is committed.

    With sampling this does NOT keep the target's distribution (a beam the target finds
    unlikely token by token can pass on its product), which is why `dynatree` labels it lossy
    and measures its perplexity. Greedy, P is 0/1 (the target's argmax), so a beam passes
    exactly when every token on it is the target's argmax: the rule then equals
    `greedy_accept` and the output is token-for-token that of greedy decoding.
    """

    lossless = False  # when sampling

    def __init__(self, tau: float):
        self.tau = tau

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
        passed = ((beam_logp - tree.logp).clamp(max=0.0).exp() > self.tau) & ~impossible  # min(1, P/Q) > tau
        passed[0] = False
        if not bool(passed.any()):
            return Accepted([], bonus(0))
        depth = int(tree.depths[passed].max())  # the deepest level with an accepted beam
        candidates = (passed & (tree.depths == depth)).nonzero().squeeze(1)
        node = int(candidates[beam_logp[candidates].argmax()])
        return Accepted(tree.path_to(node), bonus(node))
