"""WETAP (paper 004): entropy-controlled layer width, probability+length pruning, and
deep-to-shallow beam verification.

Growth (section 3.2.1, Algorithm 1 lines 3-16), for tree length L:
  * layer 1 has W_min nodes: the draft's top W_min tokens after the root;
  * layer t+1 has W_{t+1} = round(W_min + (W_max - W_min) * Hn_t ** gamma) nodes: the
    W_{t+1} children of layer t with the largest cumulative draft probability f(v) (each
    layer-t node offers its own top W_{t+1} tokens), drafted in one drafter call;
  * Hn_t = clip(H_t / log W_t, 0, 1), H_t the entropy of layer t's f(v) normalised to sum
    to 1 (eqs. 3-6); a layer of one node has Hn = 0.
  With `dynamic_width` off (the paper's ablation) every layer, the first too, has W_max nodes.
Pruning to the budget B (section 3.2.2, Appendix D), see `prune`.
Verification: `verify="beam"` is the paper's rule (`verify.BeamVerifier`), lossy when
sampling; `verify="exact"` verifies the same tree with dynatree's lossless verifier
(greedy: longest agreed path; sampling: recursive rejection sampling).

Choices the paper leaves open (ours): f(v) (not the token's own probability) is what layer
selection, entropy and the pruning score use; widths round to the nearest integer; the
verification threshold `beam_tau` defaults to 0.5 (the paper gives no value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import MethodConfig, option, positive, require
from ..sampling import Sampler
from ..tree import TreeBuilder
from ..verify import BeamVerifier
from .base import Ask, Growing, TreePolicy, best_pairs, top_children

VERIFIERS = ("beam", "exact")


@dataclass
class WetapConfig(MethodConfig):
    """Width-entropy tree with probability+length pruning (WETAP)."""

    depth: int = option(8, "tree length L (drafted levels)")
    budget: int = option(64, "node budget B: drafted nodes left after pruning")
    w_min: int = option(16, "minimum layer width W_min (the first layer's width)")
    w_max: int = option(128, "maximum layer width W_max")
    gamma: float = option(1.2, "exponent gamma of the entropy-to-width map (> 0)")
    alpha: float = option(0.6, "pruning score weight: alpha * probability + (1 - alpha) * depth/L")
    dynamic_width: bool = option(True, "width from the previous layer's entropy (off: every layer W_max)")
    verify: str = option("beam", "beam: the paper's deep-to-shallow beam rule, LOSSY when sampling; exact: lossless")
    beam_tau: float = option(0.5, "beam rule threshold: accept a beam when min(1, P/Q) > beam_tau")

    def lossy(self) -> str | None:
        """Why sampled output does not follow the target's distribution, or None when it does."""
        if self.verify != "beam":
            return None
        return ("WETAP's beam rule (--verify beam) is lossy when sampling: its output does not follow the "
                "target's distribution (--verify exact is lossless)")

    def validate(self) -> None:
        positive(self, "depth", "budget", "w_min", "w_max")
        require(self.w_min <= self.w_max, f"--w-min must not exceed --w-max, got {self.w_min} > {self.w_max}")
        require(self.gamma > 0, f"--gamma must be > 0, got {self.gamma}")
        require(0.0 <= self.alpha <= 1.0, f"--alpha must be in [0, 1], got {self.alpha}")
        require(self.verify in VERIFIERS, f"--verify must be one of {', '.join(VERIFIERS)}, got {self.verify!r}")
        require(0.0 <= self.beam_tau < 1.0, f"--beam-tau must be in [0, 1), got {self.beam_tau}")


def next_width(layer_probs: list[float], w_min: int, w_max: int, gamma: float) -> int:
    """Eqs. 3-6: the width of the next layer from the cumulative probabilities of this one."""
    if len(layer_probs) < 2:
        return w_min
    total = sum(layer_probs)
    entropy = -sum(p / total * math.log(p / total) for p in layer_probs if p > 0)
    h_norm = min(1.0, max(0.0, entropy / math.log(len(layer_probs))))
    return round(w_min + (w_max - w_min) * h_norm**gamma)


def prune(parents: list[int], depths: list[int], probs: list[float], length: int, budget: int,
          alpha: float, eps: float = 1e-6) -> list[int]:
    """The drafted nodes (indices >= 1; node 0 is the root) WETAP keeps under `budget`.

    1. score(v) = alpha * (f(v) - f_min) / (f_max - f_min + eps) + (1 - alpha) * depth(v) / L
       (eqs. 7-8); keep the `budget` best (ties: smaller index first);
    2. add back every missing ancestor of a kept node (the tree may now exceed the budget);
    3. one pass over the leaves of that tree, shallowest first (then least probable), removing
       them until the budget holds;
    4. while still over budget, remove the least probable leaf.
    Steps 3-4 are our reading of section 3.2.2 ("prune the leaf tokens from shallow to deep
    layers ... if the number still exceeds the budget, prune tokens with lowest probabilities").
    """
    drafted = range(1, len(parents))
    if len(drafted) <= budget:
        return list(drafted)
    p_min, p_max = min(probs[1:]), max(probs[1:])

    def score(v: int) -> float:
        return alpha * (probs[v] - p_min) / (p_max - p_min + eps) + (1 - alpha) * depths[v] / length

    kept = set(sorted(drafted, key=lambda v: (-score(v), v))[:budget])  # 1.
    for v in list(kept):  # 2.
        while parents[v] > 0 and parents[v] not in kept:
            v = parents[v]
            kept.add(v)

    def leaves() -> list[int]:
        inner = {parents[v] for v in kept}
        return [v for v in kept if v not in inner]

    for v in sorted(leaves(), key=lambda v: (depths[v], probs[v], v)):  # 3.
        if len(kept) <= budget:
            break
        kept.remove(v)
    while len(kept) > budget:  # 4.
        kept.remove(min(leaves(), key=lambda v: (probs[v], -v)))
    return sorted(kept)


class WetapPolicy(TreePolicy):

    def __init__(self, config: WetapConfig):
        super().__init__(config)
        self.verifier = BeamVerifier(config.beam_tau) if config.verify == "beam" else None

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        c = self.config
        tree = TreeBuilder(root_token)
        layer, width = [0], c.w_min if c.dynamic_width else c.w_max
        for _ in range(min(c.depth, max_depth)):
            proposal = yield Ask(tree, layer, width, full=sampler is not None)
            chosen = best_pairs(tree, layer, top_children(proposal, width, sampler), width)  # top f(v)
            row = {node: r for r, node in enumerate(layer)}
            layer = [node for parent, token, prob in chosen
                     if (node := tree.add(parent, token, prob, proposal.by_model(row[parent]))) is not None]
            if not layer:
                break
            layer_probs = [tree.prob(u) for u in layer]
            width = next_width(layer_probs, c.w_min, c.w_max, c.gamma) if c.dynamic_width else c.w_max
        if len(tree) - 1 <= c.budget:
            return tree.build()
        probs = [tree.prob(u) for u in range(len(tree))]
        keep = prune(tree.parents, tree.depths, probs, c.depth, c.budget, c.alpha)
        return tree.build(keep=[0] + keep)
