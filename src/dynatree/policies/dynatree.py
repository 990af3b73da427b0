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

With `cost_aware` (ours), each grown tree is cut to the nodes of largest p worth their
verification time, the drafting time of the iteration included, with acceptance estimated from
the draft's probabilities through a calibration learnt from past verifications (costmodel.py;
greedy, nodes cut before verification are learnt from too, the target's choice after every
accepted node being known); growth stops after a level unless a deeper chain could raise the
expected tokens per second (`_stop`). Times are predicted, never read from a clock: the
target's cost curve (measured by the decoder, handed over in `prepare`) corrected, like the
drafting time per drafter call, by the timings the decoder reports after every iteration
(`IterationCosts`); acceptance is calibrated apart for nodes a model proposed and nodes a lookup
proposed (a hybrid's trees mix both). The policy may also decline to pay for draft-model forwards: when a tree
that ran one has a best expected rate more than `idle_slack` under the rate of plain one-token
steps (the model costs more than its calibrated acceptance brings back), the next iterations
(an idle spell, `gate.py`) draft with the drafter's model-free part only (`Drafter.without_model`: a hybrid's
n-gram copying, so the hybrid does not fall below its free part) or verify the root alone. The
iteration after a spell is a probe that asks the model again and verifies at least its
likeliest node, so acceptance is learnt back (calibration forgets old trials,
`Calibration.decay`). The probe's drafting time, which includes feeding the model the tokens of the
spell, is learnt as a draft forward's cost only when below the estimate: an upper bound, which can undo
a cost that a slow spell of the machine raised while the model idled (its lookups and verification are
learnt as any iteration's). Once the probe's outcome (and,
greedy, the target's choices at its cut nodes) is learnt, its tree is judged again: if it would now pay in expectation drafting
resumes; else a probe that beat plain steps in measured tokens per second halves the next
spell (acceptance is coming back faster than the calibration shows) and one that did not
doubles it (up to `backoff_max`). Judging probes on their single outcome alone would stop a
draft that is right less than half the time yet pays on average (most single probes fail), and resuming
on any accepted node would keep a right but dear draft running half the time. Trees whose
drafting ran no model (n-gram lookups) cost next to nothing and never start a spell.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..config import MethodConfig, in_open_unit, in_unit, option, positive, require
from ..costmodel import Calibration, CostCurve, IterationCosts, best_rate, step_prob
from ..sampling import Sampler
from ..tree import Tree, TreeBuilder
from .base import Growing, Growth, Timing, TreePolicy, grow_levels
from .gate import IDLE, PROBE, DraftGate


@dataclass
class DynaTreeConfig(MethodConfig):
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
    cost_aware: bool = option(False, "grow and cut each tree to the size that maximises expected tokens per second "
                                     "under the target's measured verification cost and the time spent drafting "
                                     "(costmodel.py)")
    idle_slack: float = option(0.05, "with --cost-aware: a tree drafted by a model pays while its expected rate is "
                                     "at most this fraction below plain one-token steps'; else the model idles")
    backoff_max: int = option(16, "with --cost-aware: longest spell of iterations without the draft model between "
                                  "two probes of it")

    def validate(self) -> None:
        positive(self, "d0", "d_max", "b_min", "b_mid", "b_max", "n_max", "history_window", "backoff_max")
        in_unit(self, "idle_slack")
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


class DynaTreePolicy(TreePolicy):
    def __init__(self, config: DynaTreeConfig):
        super().__init__(config)
        self.uses_cost_curve = config.cost_aware
        self.d0 = float(config.d0)  # adapted state; starts at the configured values
        self.tau_h = config.tau_h
        self.window: deque[float] = deque(maxlen=config.history_window)
        self.costs: IterationCosts | None = None  # predicted drafting and verification times, when cost_aware
        self.calibration = Calibration()  # acceptance vs draft probability, learnt when cost_aware
        self._grown: TreeBuilder | None = None  # the last tree as drafted, before the cut (cost_aware, greedy)
        self._growth = Growth()  # the drafter calls the last tree cost (cost_aware)
        self._drafted: TreeBuilder | None = None  # the last tree as drafted (cost_aware), to judge a probe by
        self.gate = DraftGate(config.backoff_max)  # idle spells and probes of the draft model (cost_aware)
        self.model_free = False  # whether the drafter has a part that runs no model (`prepare`)
        self._probe = False  # whether the last grown tree was a probe after an idle spell

    def prepare(self, curve: CostCurve | None, model_free: bool) -> None:
        self.model_free = model_free
        self.gate.start_run()
        self.costs = IterationCosts(curve) if curve is not None else None

    def _accept_estimates(self, tree: TreeBuilder) -> list[float]:
        """Per node, the calibrated chance that its whole root-to-node path is accepted."""
        est = [1.0]
        for u in range(1, len(tree)):
            parent = tree.parents[u]
            est.append(est[parent] * self.calibration(step_prob(tree.parents, tree.logp, u), tree.modelled[u]))
        return est

    def _worth(self, tree: TreeBuilder, drafting: float) -> tuple[list[int], float, list[float]]:
        """The drafted nodes worth verifying after `drafting` seconds spent on this tree (which make
        bigger trees pay sooner), most likely first (parents before children), the expected tokens
        per second of verifying them, and the acceptance estimates."""
        est = self._accept_estimates(tree)
        ranked = sorted(range(1, len(tree)), key=lambda u: (-est[u], u))
        k, rate = best_rate([est[u] for u in ranked], self.costs, drafting)
        return ranked[:k], rate, est

    def _plain_rate(self) -> float:
        """The rate drafting must reach to pay: plain one-token steps', less `idle_slack`."""
        return (1.0 - self.config.idle_slack) / self.costs.at(1)

    def _cut(self, tree: TreeBuilder, growth: Growth) -> tuple[list[int] | None, bool]:
        """The root and the drafted nodes worth verifying (drafting them took `growth`), or None for
        all; and whether verifying them pays (their expected rate reaches plain steps')."""
        kept, rate, est = self._worth(tree, self.costs.drafting(growth.levels, growth.forwards))
        if self._probe and not kept and len(tree) > 1:  # a probe verifies its likeliest node: acceptance is learnt
            kept = [max(range(1, len(tree)), key=lambda u: (est[u], -u))]
        return (None if len(kept) == len(tree) - 1 else [0, *kept]), rate >= self._plain_rate()

    def _stop(self, tree: TreeBuilder, growth: Growth, depth_limit: int) -> bool:
        """Stop growing unless a deeper chain below the likeliest node u of the level just drafted
        (depth `growth.levels`, drafted by `growth`'s calls) would raise the expected rate:
        j more levels (up to `depth_limit`), each costing what the average level did so far, each
        node as likely given its parent as u was given its own. Every j is tried, not just the
        next level, because the cost curve is not convex (CPU GEMM kernels change with the number
        of rows)."""
        if self.costs is None:
            return False
        levels, drafting = growth.levels, self.costs.drafting(growth.levels, growth.forwards)
        _, rate, est = self._worth(tree, drafting)
        level = [v for v in range(1, len(tree)) if tree.depths[v] == levels]
        if not level:
            return True
        u = max(level, key=lambda v: est[v])
        ratio = est[u] / est[tree.parents[u]]
        probs, chain = [est[v] for v in range(1, len(tree))], est[u]
        for more in range(1, depth_limit - levels + 1):
            chain *= ratio
            probs.append(chain)
            if best_rate(probs, self.costs, drafting * (levels + more) / levels)[1] > rate:
                return False
        return True

    def grow(self, root_token: int, max_depth: int, sampler: Sampler | None = None) -> Growing:
        c = self.config
        d0, tau_h = round(self.d0), self.tau_h

        def expandable(depth: int, prob: float) -> bool:
            return prob >= c.rho_stop and (depth < d0 or prob > c.rho_deep)

        def breadth(confidence: float) -> int:
            if confidence >= tau_h:
                return c.b_min
            return c.b_mid if confidence >= c.tau_l else c.b_max

        self._growth, self._grown, self._drafted = Growth(), None, None
        mode = self.gate.begin() if self.costs is not None else None
        idle, self._probe = mode == IDLE, mode == PROBE  # idle: the draft model did not pay lately
        if idle and not self.model_free:  # its model-free part only, or the root alone
            return TreeBuilder(root_token).build()
        depth_limit = min(c.d_max, max_depth)
        grown = yield from grow_levels(
            root_token, max_depth=depth_limit, n_max=c.n_max, max_breadth=c.b_max,
            expandable=expandable, breadth=breadth, tau=c.tau,
            stop=lambda tree, growth: self._stop(tree, growth, depth_limit), model_free=idle,
        )
        if self.costs is None:
            return grown.tree.build()
        self._growth, self._drafted = grown.growth, grown.tree  # what observe learns from and judges a probe by
        self._grown = grown.tree if sampler is None else None  # greedy: learn from the nodes cut too (`_learn`)
        keep, paid = self._cut(grown.tree, grown.growth)
        if grown.growth.forwards and not self._probe:  # a model ran: did it pay? (a probe is judged in observe)
            self.gate.drafted(paid)
        return grown.tree.build(keep=keep)

    def observe(self, tree: Tree, path: list[int], bonus: int, timing: Timing) -> None:
        c = self.config
        if self.costs is not None:
            g = self._growth
            # a probe's first call catches up on the tokens of the idle spell: an upper bound of a usual forward
            self.costs.learn(g.levels, g.forwards, len(tree.tokens), timing.draft_s, timing.verify_s, catch_up=self._probe)
            last = self._learn(tree, path)
            if self._probe and g.forwards:  # judged with what it taught, then on what it achieved
                plain = self._plain_rate()
                expected = self._worth(self._drafted, self.costs.drafting(g.levels, g.forwards))[1]
                achieved = (1 + len(path)) / max(timing.draft_s + timing.verify_s, 1e-9)
                self.gate.probed(pays_now=expected >= plain, beat_plain=achieved >= plain)
            if last is not None:  # the bonus: the target's choice at the last accepted node, learnt after a
                grown, node = last  # probe is judged on what the verified nodes taught (as the policy was tuned)
                self.calibration.observe_choices(grown.parents, grown.logp, grown.tokens, {node: bonus}, grown.modelled)
        if not c.history or tree.n_drafted == 0:
            return
        self.window.append(len(path) / tree.n_drafted)
        error = sum(self.window) / len(self.window) - c.target_accept
        self.d0 = min(max(self.d0 + c.eta_depth * error, 1.0), c.d_max - 1.0)
        self.tau_h = min(max(self.tau_h - c.eta_tau * error, c.tau_l), 1.0)

    def _learn(self, tree: Tree, path: list[int]) -> tuple[TreeBuilder, int] | None:
        """Calibrate acceptance on a verified tree. Greedy, from the tree as drafted: the target's
        choice at each accepted node is the next accepted token, so nodes cut before verification
        count too; returns (that tree, its last accepted node), whose choice is the bonus token
        (learnt by `observe`), or None (sampling: the bonus is a draw; or nothing drafted)."""
        grown, self._grown = self._grown, None
        if grown is None and tree.n_drafted == 0:  # nothing drafted (an idle iteration): nothing to learn
            return None
        if grown is None:  # sampling: the verified nodes only (`_drafted`: the tree as drafted, its sources)
            modelled = [self._drafted.modelled[u] for u in tree.drafted_nodes(list(range(tree.size)))]
            self.calibration.observe(tree.parents.tolist(), tree.logp.tolist(), {0, *path}, modelled)
            return None
        chain = [0, *tree.drafted_nodes(path)]  # the accepted nodes as drafted
        choices = {a: grown.tokens[b] for a, b in zip(chain, chain[1:])}
        self.calibration.observe_choices(grown.parents, grown.logp, grown.tokens, choices, grown.modelled)
        return grown, chain[-1]

    def state(self) -> dict:
        """The adapted parameters as they are now, and the cost curve the tree sizes were chosen on."""
        state = {"d0": round(self.d0), "d0_continuous": self.d0, "tau_h": self.tau_h}
        if self.config.cost_aware:
            state["idle_iterations"] = self.gate.idle_iterations  # declined the draft model: it did not pay
        if self.costs is not None:  # so a run's tree sizes can be checked against what it measured and learnt
            curve = self.costs.curve
            state["cost_curve_ms"] = {n: round(s * 1e3, 3) for n, s in zip(curve.sizes, curve.seconds)}
            state["draft_forward_ms"] = round(self.costs.forward_s * 1e3, 3)  # per drafter call that ran a model
            state["draft_lookup_ms"] = round(self.costs.lookup_s * 1e3, 3)  # per lookup-only drafter call
            # acceptance learnt per bin of the draft's probability, by proposer (costmodel.Calibration)
            state["calibration"] = {"model": [round(a, 3) for a in self.calibration.table(True)],
                                    "lookup": [round(a, 3) for a in self.calibration.table(False)]}
            state["verify_extra_ms"] = {"token": round(self.costs.extra_s[0] * 1e3, 3),  # measured minus the curve
                                        "tree": round(self.costs.extra_s[1] * 1e3, 3)}
        return state
