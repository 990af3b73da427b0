"""Cost-aware tree size: the target's verification time as a function of the
number of tokens it verifies, and the tree size that maximises expected tokens per second.

On a CPU a verification pass is far from free (64 tokens cost a few times one token), so
drafting as many nodes as the tree rules allow can lose time.
With p(u) the chance that node u's path is accepted (estimated from the draft's probabilities,
see `Calibration`), the k drafted nodes of largest p (always ancestor-closed, since a child's p never
exceeds its parent's) commit about 1 + p_1 + ... + p_k tokens per pass, so the best k maximises

    (1 + p_1 + ... + p_k) / (t_draft + t_verify(k + 1))     (k + 1: the root is verified too)

t_draft being the time already spent drafting the tree (a draft model's forwards are not free).

This module is pure (no clock, no model): the curve is measured by `costmeasure.curve_for`,
once per target model, and handed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostCurve:
    sizes: tuple[int, ...]  # tokens verified per forward that were timed, increasing
    seconds: tuple[float, ...]  # time of one such forward, non-decreasing

    def at(self, n: int) -> float:
        """Forward time for n tokens: linear between measured sizes, last slope beyond."""
        s, t = self.sizes, self.seconds
        if n <= s[0]:
            return t[0]
        for i in range(1, len(s)):
            if n <= s[i] or i == len(s) - 1:
                slope = (t[i] - t[i - 1]) / (s[i] - s[i - 1])
                return t[i - 1] + slope * (n - s[i - 1])
        return t[-1]


def best_rate(probs: list[float], curve: CostCurve | IterationCosts, draft_s: float = 0.0) -> tuple[int, float]:
    """How many of the drafted nodes (path probabilities, any order) to verify: the k that
    maximises expected committed tokens per second of the iteration, `draft_s` seconds of
    drafting included (`curve.at(n)`: seconds of verifying n tokens); and that rate."""
    ranked = sorted(probs, reverse=True)
    best_k, best, expected = 0, 1.0 / max(draft_s + curve.at(1), 1e-9), 1.0
    for k, p in enumerate(ranked, start=1):
        expected += p
        rate = expected / max(draft_s + curve.at(k + 1), 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k, best


class IterationCosts:
    """What one iteration costs, as the cost-aware policy predicts it: the target's measured curve
    plus what the decoder's timings (`learn`) showed besides it, learnt as running averages
    (weight `rate` for the newest):
      * drafting: seconds per drafter call that ran a model (`forward_s`) and per lookup-only
        call (`lookup_s`, the n-gram drafter's), so a tree's drafting time is known before its
        drafter is called again and a policy needs no clock;
      * verification: how far a measured iteration (target pass, acceptance, cache commits) runs
        above the curve's forward, for one token and for trees apart (the curve is timed on the
        prompt, decoding runs on a longer context and does more than the forward).
    Unknown costs start at 0 (the first tree of a run is drafted as if drafting were free)."""

    def __init__(self, curve: CostCurve, rate: float = 0.2):
        self.curve, self.rate = curve, rate
        self.forward_s = self.lookup_s = 0.0
        self.extra_s = [0.0, 0.0]  # measured minus curve: [one token, trees]
        self.seen = [False, False, False, False]  # forward_s, lookup_s, extra one token, extra trees learnt yet

    def drafting(self, levels: int, forwards: int) -> float:
        """Predicted seconds of `levels` drafter calls, `forwards` of them running a model."""
        return forwards * self.forward_s + (levels - forwards) * self.lookup_s

    def at(self, n: int) -> float:
        """Predicted seconds of verifying n tokens (the root included), commits included; never
        below half the curve's forward (one offset learnt on some tree sizes, or measured in a fast
        spell of the machine, must not make other trees look free)."""
        return max(self.curve.at(n) + self.extra_s[n > 1], 0.5 * self.curve.at(n))

    def learn(self, levels: int, forwards: int, verified: int, draft_s: float, verify_s: float,
              catch_up: bool = False) -> None:
        """One iteration as measured: `levels` drafter calls (`forwards` with a model) took
        `draft_s`, verifying `verified` tokens took `verify_s`. With `catch_up`, its first model call
        also fed tokens committed while the model idled, so its drafting time bounds a usual forward's
        from above: it is learnt only when below the estimate (which a slow spell of the machine may
        have raised while the model idled and nothing else could lower it)."""
        if forwards:
            forward_s = max(draft_s - (levels - forwards) * self.lookup_s, 0.0) / forwards
            if not catch_up or not self.seen[0] or forward_s < self.forward_s:
                self.forward_s = self._mix(0, self.forward_s, forward_s)
        elif levels:
            self.lookup_s = self._mix(1, self.lookup_s, draft_s / levels)
        kind = int(verified > 1)
        self.extra_s[kind] = self._mix(2 + kind, self.extra_s[kind], verify_s - self.curve.at(verified))

    def _mix(self, which: int, old: float, new: float) -> float:
        first, self.seen[which] = not self.seen[which], True
        return new if first else (1 - self.rate) * old + self.rate * new


def step_prob(parents, logp, u: int) -> float:
    """q: the draft's probability of node u's token given its parent (logp: cumulative log-probabilities)."""
    return math.exp(logp[u] - logp[parents[u]])


class Calibration:
    """How often a drafted node is accepted, given its parent was, as a function of the draft's
    conditional probability q of its token: per bin of q, hits / trials, starting from `prior`
    pseudo-trials at the bin's centre (so an unseen bin trusts the draft), old trials fading
    (`decay`) so that a draft whose acceptance changes with the text is learnt again. Learnt from every
    verification, for the drafter actually in use, whose probabilities may be under- or
    overconfident (an n-gram drafter gives at most 1/2 to a continuation it has seen once).

    Nodes a model proposed and nodes a lookup proposed (`modelled`, per node: a hybrid drafter mixes
    both in one tree) are learnt in two tables: the same q means a different chance of acceptance
    from a draft model's softmax and from an n-gram's counts, and one table would judge each by the
    other's record."""

    def __init__(self, bins: int = 10, prior: float = 4.0, decay: float = 0.98):
        self.bins = bins
        self.decay = decay  # each new trial of a bin scales its old counts by this: ~1/(1-decay) trials remembered
        centres = [(b + 0.5) / bins for b in range(bins)]
        self.trials = {source: [prior] * bins for source in (False, True)}  # per source: lookup, model
        self.hits = {source: [prior * c for c in centres] for source in (False, True)}

    def _bin(self, q: float) -> int:
        return min(int(q * self.bins), self.bins - 1)

    def __call__(self, q: float, modelled: bool = False) -> float:
        """Estimated acceptance of a node whose parent is accepted and whose draft probability is q,
        proposed by a model (`modelled`) or by a lookup."""
        b = self._bin(q)
        return self.hits[modelled][b] / self.trials[modelled][b]

    def _count(self, q: float, hit: bool, modelled: bool) -> None:
        b, trials, hits = self._bin(q), self.trials[modelled], self.hits[modelled]
        trials[b] = self.decay * trials[b] + 1
        hits[b] = self.decay * hits[b] + hit

    def table(self, modelled: bool) -> list[float]:
        """Estimated acceptance per bin of q for one source (for a run's record)."""
        return [h / t for h, t in zip(self.hits[modelled], self.trials[modelled])]

    def observe(self, parents: list[int], logp: list[float], accepted: set[int],
                modelled: list[bool] | None = None) -> None:
        """One verified tree: every drafted node whose parent was accepted (or is the root) is a trial
        (`modelled`: per node, whether a model proposed it; None: none did)."""
        for u in range(1, len(parents)):
            if parents[u] in accepted:
                self._count(step_prob(parents, logp, u), u in accepted, bool(modelled and modelled[u]))

    def observe_choices(self, parents: list[int], logp: list[float], tokens: list[int], choices: dict[int, int],
                        modelled: list[bool] | None = None) -> None:
        """Greedy decoding, where the target's next token at each accepted node is known (`choices`:
        node -> token; at the last accepted node it is the committed bonus token): every drafted
        child of such a node is a trial, verified or cut from the tree before verification - a
        hit iff its token is the target's choice. Trials from cut nodes are what lets a policy
        that cuts everything (verification looks dear, the draft looks unsure) still learn that
        its draft is better than it looks. `modelled` as in `observe`."""
        for u in range(1, len(parents)):
            choice = choices.get(parents[u])
            if choice is not None:
                self._count(step_prob(parents, logp, u), tokens[u] == choice, bool(modelled and modelled[u]))
