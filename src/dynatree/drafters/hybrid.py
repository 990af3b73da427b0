"""n-gram copying where the text repeats itself, a draft LM (or feature head) everywhere else.

A node whose context (committed tokens + its path) ends in an n-gram the text has seen before may
take the n-gram drafter's candidates, which cost nothing; the other nodes of the level are fed to
the draft LM in one forward. Which match orders the n-gram drafter keeps is either fixed
(`min_match`: orders >= it) or learnt during the run (`min_match=None`, `MatchRouter`: an order goes
to the n-gram drafter while its top candidate is the target's token at least as often as the
model's). The LM can only expand a node whose every ancestor it has seen, so it answers the root
only when the root needs it, and a node below an n-gram-drafted ancestor stays with the n-gram
drafter (whose lower orders may still have candidates). The LM's cache catches up on skipped
committed tokens the next time the root needs it (`LMDrafter` feeds every committed token it has
not seen).
"""

from __future__ import annotations

import torch

from ..tree import TreeBuilder
from .base import Proposal
from .feature import FeatureDrafter
from .lm import LMDrafter
from .ngram import NgramDrafter


class MatchRouter:
    """Per text match order, whether the n-gram drafter or the model answers a node: learnt from the
    tokens this run commits.

    Every committed token tests the n-gram drafter at the position it was committed in: its top
    candidate there is recomputed from the index as it stood when the tree was grown (lookups are
    free), so its rate per match order is measured at every committed position, whoever drafted it.
    The model's rate is measured where it answered the node at that position. A node whose text
    match has order o >= 1 goes to the n-gram drafter while its rate at o is at least the model's at
    o (a tie too: copying costs nothing); a node without any match goes to the model.

    Rates are hit counts with a prior of `weight` observations: the n-gram drafter's prior is the
    fixed rule's (`min_match` orders and up: `copy_prior`, below: `guess_prior`, so that a run starts
    as the fixed rule would), the model's rate at one order is pulled towards its rate over all
    orders (measured mostly where nothing matched), which starts at `model_prior`. Pure: counts in,
    decisions out; the hybrid feeds it.
    """

    def __init__(self, max_n: int, min_match: int = 2, weight: float = 4.0, copy_prior: float = 0.7,
                 guess_prior: float = 0.3, model_prior: float = 0.5):
        self.max_n, self.min_match, self.weight = max_n, min_match, weight
        self.priors = [guess_prior if n < min_match else copy_prior for n in range(max_n + 1)]
        self.model_prior = model_prior
        self.ngram = [[0, 0] for _ in range(max_n + 1)]  # per match order: [top candidate was the token, tested]
        self.model = [[0, 0] for _ in range(max_n + 1)]

    def observe_ngram(self, order: int, hit: bool) -> None:
        self.ngram[order][0] += hit
        self.ngram[order][1] += 1

    def observe_model(self, order: int, hit: bool) -> None:
        self.model[order][0] += hit
        self.model[order][1] += 1

    def ngram_rate(self, order: int) -> float:
        hits, seen = self.ngram[order]
        return (hits + self.weight * self.priors[order]) / (seen + self.weight)

    def model_rate(self, order: int) -> float:
        hits = sum(h for h, _ in self.model)
        seen = sum(s for _, s in self.model)
        pooled = (hits + self.weight * self.model_prior) / (seen + self.weight)
        hits, seen = self.model[order]
        return (hits + self.weight * pooled) / (seen + self.weight)

    def copies(self, order: int) -> bool:
        """Whether a node whose text match has this order takes the n-gram drafter's candidates."""
        return order >= 1 and self.ngram_rate(order) >= self.model_rate(order)

    def state(self) -> dict:
        """What the run learnt (for the run record): orders copied, and both rates per order."""
        orders = range(1, self.max_n + 1)
        return {"copied_orders": [n for n in orders if self.copies(n)],
                "ngram_rate": [round(self.ngram_rate(n), 3) for n in orders],
                "model_rate": [round(self.model_rate(n), 3) for n in orders],
                "tested": {"ngram": [self.ngram[n][1] for n in orders], "model": [self.model[n][1] for n in orders]}}


class HybridDrafter:
    def __init__(self, ngram: NgramDrafter, lm: LMDrafter | FeatureDrafter, min_match: int | None = 2):
        if min_match is not None and not 1 <= min_match <= ngram.max_n:
            raise ValueError(f"min_match must be in 1..{ngram.max_n} (or None: learnt per run), got {min_match}")
        self.ngram, self.lm, self.min_match = ngram, lm, min_match
        self.name = f"{ngram.name}+{lm.name}"  # ngram+MODEL, or ngram+STORE+MODEL with a datastore
        self.uses_target_hidden = lm.uses_target_hidden

    def reset(self, tokens: list[int], hidden=None) -> None:
        self.ngram.reset(tokens)
        self.lm.reset(tokens, hidden)
        self.lm_nodes: set[int] = set()  # nodes of the growing tree the LM has been fed
        self.lm_top: dict[int, tuple[int, int]] = {}  # node -> (its text match order, the LM's top candidate)
        self.lm_calls = 0  # draft LM forwards (for stats and tests)
        self.router = MatchRouter(self.ngram.max_n) if self.min_match is None else None

    def propose(self, tree: TreeBuilder, nodes: list[int], k: int, full: bool = False) -> Proposal:
        orders = [self.ngram.match_order(self.ngram.context(tree, node)) for node in nodes]
        ask_lm = [not self._copies(order) and self._lm_can_expand(tree, node) for node, order in zip(nodes, orders)]
        result = self.ngram.propose(tree, nodes, k, full)
        lm_rows = [row for row, ask in enumerate(ask_lm) if ask]
        if lm_rows:
            lm_nodes = [nodes[row] for row in lm_rows]
            answer = self.lm.propose(tree, lm_nodes, k, full)
            self.lm_calls += 1
            self.lm_nodes.update(lm_nodes)
            self.lm_top.update((node, (orders[row], int(answer.ids[i, 0]))) for i, (node, row) in
                               enumerate(zip(lm_nodes, lm_rows)))
            rows = torch.tensor(lm_rows)
            width = answer.ids.shape[1]  # the LM may offer fewer than k (tiny vocabularies)
            result.ids[rows], result.probs[rows] = -1, 0.0
            result.ids[rows, :width], result.probs[rows, :width] = answer.ids, answer.probs
            if full:
                result.dist[rows] = answer.dist[:, : result.dist.shape[1]]
            result.forwards = answer.forwards
            result.modelled = torch.tensor(ask_lm)
        return result

    def warm_up(self) -> float:
        return self.lm.warm_up()

    def without_model(self) -> NgramDrafter:
        return self.ngram  # declining the model still leaves the free copying

    def commit(self, tokens: list[int], path: list[int], hidden=None) -> None:
        if self.router is not None:
            self._learn(tokens, path)
        self.ngram.commit(tokens, path)
        self.lm.commit(tokens, path, hidden)
        self.lm_nodes, self.lm_top = set(), {}

    def routing_state(self) -> dict | None:
        """The learnt routing of this run (None with a fixed `min_match`)."""
        return self.router.state() if self.router is not None else None

    def _copies(self, order: int) -> bool:
        return self.router.copies(order) if self.router is not None else order >= self.min_match

    def _learn(self, tokens: list[int], path: list[int]) -> None:
        """Test both drafters at each newly committed position (the root, then the accepted path's
        nodes), before the n-gram index learns the new tokens (as it stood while the tree grew)."""
        before = self.ngram.tokens
        new = tokens[len(before):]
        nodes = [0] + list(path)
        for i, token in enumerate(new[: len(nodes)]):
            context = (before[-self.ngram.span:] + new[:i])[-self.ngram.span:]
            order = self.ngram.match_order(context)
            if order:
                counted = self.ngram.store_answers  # a test, not a proposal: leave the stat alone
                top = self.ngram.distribution(context, 1)
                self.ngram.store_answers = counted
                self.router.observe_ngram(order, bool(top) and top[0][0] == token)
            if nodes[i] in self.lm_top:
                lm_order, lm_token = self.lm_top[nodes[i]]
                self.router.observe_model(lm_order, lm_token == token)

    def _lm_can_expand(self, tree: TreeBuilder, node: int) -> bool:
        """The root always; another node when the LM was fed its parent (and so all its ancestors)."""
        return node == 0 or tree.parents[node] in self.lm_nodes
