"""DynaTree (paper 000, sections 3.3 and Algorithm 1): confidence-aware breadth and depth,
probability pruning under a node budget, and history adaptation every iteration.

Growth rules, for a node u at depth d(u) with cumulative draft probability p(u) and
drafter confidence c(u) (its top-1 probability):
  * expand u iff d(u) < d_max and p(u) >= rho_stop and (d(u) < D0 or p(u) > rho_deep);
  * give it B(u) = b_min if c(u) >= tau_h, b_max if c(u) < tau_l, else b_mid children;
  * prune any drafted node with p(u) < tau (it is neither verified nor expanded);
  * stop at n_max drafted nodes, keeping the most probable ones of the last level.
The root is the last committed token (p = 1), so the first drafted level already branches.

History adaptation (when `history` is on), after every verification: a_r = accepted draft
tokens / drafted tokens of that iteration (skipped when nothing was drafted); with
a_bar = mean of the last `history_window` values and error e = a_bar - target_accept:
    D0    <- clip(D0 + eta_depth * e, 1, d_max - 1)       (used rounded to an integer)
    tau_h <- clip(tau_h - eta_tau * e, tau_l, 1)
High acceptance makes drafting more aggressive (deeper, narrower), low acceptance more
conservative. Only D0 and tau_h adapt; every other parameter stays as configured.

With `cost_aware` (ours, issue 5), each grown tree is cut to the nodes of largest p worth
their verification time under the target's measured cost curve (costmodel.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..config import in_open_unit, in_unit, option, positive, require
from ..costmodel import CostCurve, best_size, curve_for
from ..drafters.base import Drafter
from ..models import LoadedModel
from ..sampling import Sampler
from ..tree import Tree, TreeBuilder
from .base import grow_levels


@dataclass
class DynaTreeConfig:
    """Confidence-aware adaptive tree (DynaTree)."""

    d0: int = option(5, "base depth D0: every sufficiently likely node above it is expanded")
    d_max: int = option(8, "hard maximum depth D_max")
    b_min: int = option(1, "children of a confident node (c >= tau_h)")
    b_mid: int = option(2, "children of a node with tau_l <= c < tau_h")
    b_max: int = option(3, "children of an uncertain node (c < tau_l)")
    tau_h: float = option(0.9, "high-confidence threshold on the draft's top-1 probability")
    tau_l: float = option(0.4, "low-confidence threshold on the draft's top-1 probability")
    rho_stop: float = option(0.05, "early stop: do not expand nodes whose path probability is below this")
    rho_deep: float = option(0.5, "deep expansion: beyond D0, expand only nodes whose path probability exceeds this")
    tau: float = option(0.01, "prune drafted nodes whose path probability is below tau")
    n_max: int = option(256, "node budget N_max (drafted nodes per tree)")
    history: bool = option(True, "adapt D0 and tau_h from recent acceptance (history adaptation)")
    history_window: int = option(8, "iterations W in the sliding acceptance window")
    target_accept: float = option(0.35, "target per-iteration acceptance a* of the proportional controller")
    eta_depth: float = option(4.0, "step size for D0 per unit of acceptance error")
    eta_tau: float = option(0.2, "step size for tau_h per unit of acceptance error")
    cost_aware: bool = option(False, "cut each tree to the size that maximises expected tokens per second under "
                                     "the target's measured verification cost (issue 5; costmodel.py)")

    def validate(self) -> None:
        positive(self, "d0", "d_max", "b_min", "b_mid", "b_max", "n_max", "history_window")
        require(self.d0 < self.d_max, f"--d0 must be smaller than --d-max, got {self.d0} >= {self.d_max}")
        require(
            self.b_min <= self.b_mid <= self.b_max,
            f"need --b-min <= --b-mid <= --b-max, got {self.b_min}, {self.b_mid}, {self.b_max}",
        )
        in_open_unit(self, "tau_h", "tau_l", "rho_stop", "rho_deep", "target_accept")
        in_unit(self, "tau")
        require(self.tau_l < self.tau_h, f"--tau-l must be below --tau-h, got {self.tau_l} >= {self.tau_h}")
        require(
            self.rho_stop < self.rho_deep,
            f"--rho-stop must be below --rho-deep, got {self.rho_stop} >= {self.rho_deep}",
        )
        require(self.eta_depth >= 0 and self.eta_tau >= 0, "--eta-depth and --eta-tau must be >= 0")


class DynaTreePolicy:
    needs_drafter = True

    def __init__(self, config: DynaTreeConfig):
        self.config = config
        self.d0 = float(config.d0)  # adapted state; starts at the configured values
        self.tau_h = config.tau_h
        self.window: deque[float] = deque(maxlen=config.history_window)
        self.curve: CostCurve | None = None  # the target's verification cost, when cost_aware

    def calibrate(self, target: LoadedModel, context: list[int]) -> None:
        """Called by the decoder after the prefill: fetch the target's cost curve if needed."""
        if self.config.cost_aware:
            self.curve = curve_for(target, context)

    def _cut(self, tree: TreeBuilder) -> list[int] | None:
        """The root and the drafted nodes worth verifying (most probable first), or None for all."""
        if self.curve is None:
            return None
        ranked = sorted(range(1, len(tree)), key=lambda u: (-tree.logp[u], u))  # parents before children
        k = best_size([tree.prob(u) for u in ranked], self.curve)
        return None if k == len(ranked) else [0, *ranked[:k]]

    def grow(self, drafter: Drafter, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Tree:
        c = self.config
        d0, tau_h = round(self.d0), self.tau_h

        def expandable(depth: int, prob: float) -> bool:
            return prob >= c.rho_stop and (depth < d0 or prob > c.rho_deep)

        def breadth(confidence: float) -> int:
            if confidence >= tau_h:
                return c.b_min
            return c.b_mid if confidence >= c.tau_l else c.b_max

        return grow_levels(
            drafter, root_token, max_depth=min(c.d_max, max_depth), n_max=c.n_max, max_breadth=c.b_max,
            expandable=expandable, breadth=breadth, tau=c.tau, cut=self._cut,
        )

    def observe(self, tree: Tree, path: list[int]) -> None:
        c = self.config
        if not c.history or tree.n_drafted == 0:
            return
        self.window.append(len(path) / tree.n_drafted)
        error = sum(self.window) / len(self.window) - c.target_accept
        self.d0 = min(max(self.d0 + c.eta_depth * error, 1.0), c.d_max - 1.0)
        self.tau_h = min(max(self.tau_h - c.eta_tau * error, c.tau_l), 1.0)

    def state(self) -> dict:
        """The adapted parameters as they are now."""
        return {"d0": round(self.d0), "d0_continuous": self.d0, "tau_h": self.tau_h}
