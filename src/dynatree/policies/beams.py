"""DSBD and MTAD, the two beam-drafting baselines of paper 004 (WETAP, Table 1, Appendix B.3).

Both draft the same shape, a *beam tree*: `depth` layers of `width` nodes each. Layer 1 is
the draft's `width` best (greedy) or sampled (sampling) tokens after the root; every node of
a layer is offered as a parent of the next, and the next layer keeps the `width` (parent,
token) pairs of largest cumulative draft probability f(v) (greedy: beam search) or draws them
without replacement in proportion to f(parent) * q(token | parent) (sampling: beam sampling
with the tempered draft distribution q, which is recorded as the parent's proposal). Every
beam of every layer stays in the tree, so one target pass verifies them all.

  dsbd  Dynamic-width speculative beam decoding (Qin et al., 2025a) in the setting paper 004
        compares it in: one target beam kept per layer ("the expected number of each layer as
        1"). Each layer's candidates that continue the accepted beam are verified in turn by
        speculative sampling against q with the residual max(0, p - q) after a rejection, which
        is dynatree's recursive rejection sampler: LOSSLESS when sampling, greedy-exact. Not built:
        DSBD's tuning of the number of target beams per layer to the context (more than one would
        commit beam-sampling output, another distribution than the target's, and beam search
        instead of greedy decoding).
  mtad  Multi-token assisted decoding (Qin et al., 2025b), multi-candidate form: a beam v of
        layer d passes when P(v) / max_u Q(u) > joint_tau, P the target's and Q the draft's
        product of token probabilities along a beam, the maximum over the beams u of layer d.
        The deepest layer with a passing beam wins (a rejected token does not block the beams
        below it), and of its passing beams the one of largest P is committed, then the bonus
        token is drawn from the target after it. This accepts tokens by their *joint*
        likelihood, so sampled output does NOT keep the target's per-token distribution: LOSSY
        when sampling (the paper's aim is the joint distribution). Greedy, P is 0 or 1 and a beam
        passes exactly when every token on it is the target's argmax: token-for-token greedy.
        The lossless rule on the same tree is `dsbd`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MethodConfig, in_unit, option, positive
from ..sampling import Sampler, draw_without_replacement
from ..tree import TreeBuilder
from ..verify import JointVerifier
from .base import Ask, Growing, TreePolicy, best_pairs, tempered, top_children


def grow_beams(root_token: int, width: int, depth: int, sampler: Sampler | None) -> Growing:
    """The beam tree of the module docstring: `depth` layers of at most `width` nodes, one
    drafter call per layer."""
    tree = TreeBuilder(root_token)
    layer = [0]
    for _ in range(depth):
        proposal = yield Ask(tree, layer, width, full=sampler is not None)
        if sampler is None:
            pairs = best_pairs(tree, layer, top_children(proposal, width, None), width)
        else:
            pairs = _sampled_pairs(tree, layer, tempered(proposal.dist, sampler), width, sampler)
        row = {node: r for r, node in enumerate(layer)}
        layer = [node for parent, token, prob in pairs
                 if (node := tree.add(parent, token, prob, proposal.by_model(row[parent]))) is not None]
        if not layer:
            break
    return tree.build()


def _sampled_pairs(tree: TreeBuilder, layer: list[int], q: torch.Tensor, width: int,
                   sampler: Sampler) -> list[tuple[int, int, float]]:
    """Beam sampling: `width` (parent, token) pairs drawn one after another without replacement
    from f(parent) * q(token | parent), in the order drawn (the order verification tries a
    parent's children in); q(. | parent) is recorded as the proposal of each parent drawn."""
    # [m, V], on the CPU where the sampler's generator draws (drafters hand over CPU distributions)
    weights = torch.tensor([tree.prob(u) for u in layer], dtype=torch.float64)[:, None] * q.cpu()
    pairs = []
    for pick in draw_without_replacement(weights.flatten(), width, sampler.generator):
        row, token = divmod(pick, q.shape[-1])
        tree.proposals[layer[row]] = q[row]
        pairs.append((layer[row], token, float(q[row, token])))
    return pairs


@dataclass
class BeamTreeConfig(MethodConfig):
    """The beam tree's shape, shared by DSBD and MTAD."""

    width: int = option(8, "draft beams per layer (the tree's width)")
    depth: int = option(8, "tree depth (beam decoding steps)")

    def validate(self) -> None:
        positive(self, "width", "depth")


class BeamTreePolicy(TreePolicy):
    """Grows the beam tree of the module docstring; the verifier is the subclass's business."""

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        return (yield from grow_beams(root_token, self.config.width, min(self.config.depth, max_depth), sampler))


@dataclass
class DsbdConfig(BeamTreeConfig):
    """Dynamic-width speculative beam decoding, one target beam per layer (paper 004, B.3). Lossless."""


class DsbdPolicy(BeamTreePolicy):
    """A beam tree verified by the engine's lossless rule (see the module docstring)."""


@dataclass
class MtadConfig(BeamTreeConfig):
    """Multi-token assisted decoding (multi-candidate): joint-likelihood verification. LOSSY when sampling."""

    joint_tau: float = option(0.5, "accept a beam when P(beam) / max Q(beams of its layer) > joint_tau "
                                   "(LOSSY when sampling)")

    def lossy(self) -> str | None:
        """Why sampled output does not follow the target's distribution (always: the joint rule)."""
        return ("MTAD's joint rule is lossy when sampling: it accepts beams by their joint likelihood, so its "
                "output does not follow the target's distribution (dsbd verifies the same trees losslessly)")

    def validate(self) -> None:
        super().validate()
        in_unit(self, "joint_tau")


class MtadPolicy(BeamTreePolicy):
    """A beam tree verified by MTAD's joint-likelihood rule (`verify.JointVerifier`)."""

    def __init__(self, config: MtadConfig):
        super().__init__(config)
        self.verifier = JointVerifier(config.joint_tau)
