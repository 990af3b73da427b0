"""A model-free drafter: continuations of the longest matching suffix in the text so far.

The index maps every n-gram (n = 1..max_n) of the committed sequence (prompt + generated
tokens) to the counts of the tokens that followed it. A node's context is the committed
sequence plus its own path in the tree; its candidates come from the longest suffix of
that context seen before, backing off to shorter suffixes PPM-style: order n gives token t
probability escape * count(t) / (total + 1) and passes escape / (total + 1) on to order
n - 1, so longer matches dominate and the probabilities of one node sum to at most 1.
Updating the index costs O(max_n) per committed token; a lookup O(max_n) per node.

With a datastore (datastore.py: text the target wrote itself, e.g. its answers to many chat
prompts), a context whose longest match in the text so far is shorter than `store_below` tokens
and that the datastore matches longer takes the datastore's continuations first (the same
escape-weighted counts), the text's own back-off after them: REST-style retrieval where the text
cannot be copied. `match_order` stays the text's own (what the hybrid routes by).
"""

from __future__ import annotations

import heapq

import torch

from ..datastore import Datastore
from ..tree import TreeBuilder
from .base import Proposal


NGRAM_MAX = 4  # the default longest n-gram matched (Request.ngram_max, --ngram-max)


class NgramDrafter:
    uses_target_hidden = False

    name = "ngram"

    def __init__(self, max_n: int = NGRAM_MAX, vocab_size: int | None = None, store: Datastore | None = None,
                 store_below: int = 3):
        if max_n < 1 or store_below < 1:
            raise ValueError("max_n and store_below must be at least 1")
        self.max_n = max_n
        self.vocab_size = vocab_size  # needed only for whole distributions (full=True)
        self.store = store  # consulted where the text's own match is shorter than store_below tokens
        self.store_below = store_below
        self.span = max(max_n, store.order if store is not None else 0)  # context tokens a lookup reads
        if store is not None:
            self.name = f"ngram+{store.name}"

    def reset(self, tokens: list[int], hidden=None) -> None:
        self.tokens: list[int] = []
        self.found: dict[tuple[int, ...], tuple[int, list[tuple[int, int]]]] = {}  # datastore answers of this run
        self.store_answers = 0  # node proposals whose candidates the datastore led (for stats and tests)
        self.index: list[dict[tuple[int, ...], dict[int, int]]] = [{} for _ in range(self.max_n + 1)]
        self._extend(tokens)

    def without_model(self) -> NgramDrafter:
        return self  # lookups only

    def warm_up(self) -> float:
        return 0.0  # no model, nothing to compile

    def commit(self, tokens: list[int], path: list[int], hidden=None) -> None:
        self._extend(tokens[len(self.tokens) :])

    def propose(self, tree: TreeBuilder, nodes: list[int], k: int, full: bool = False) -> Proposal:
        """With `full`, `dist` is the back-off distribution renormalized over every candidate
        (all zeros where nothing matched)."""
        ids = torch.full((len(nodes), k), -1, dtype=torch.long)
        probs = torch.zeros(len(nodes), k)
        dist = torch.zeros(len(nodes), self.vocab_size) if full else None
        for row, node in enumerate(nodes):
            candidates = self.distribution(self.context(tree, node), None if full else k)
            for col, (token, p) in enumerate(candidates[:k]):
                ids[row, col], probs[row, col] = token, p
            if full and candidates:
                tokens, mass = zip(*candidates)
                dist[row, list(tokens)] = torch.tensor(mass) / sum(mass)
        return Proposal(ids=ids, probs=probs, dist=dist)

    def context(self, tree: TreeBuilder, node: int) -> list[int]:
        """The last tokens (max_n, or the datastore's order if longer) of a node's context: committed
        tokens + its path in the tree."""
        return (self.tokens[-self.span :] + tree.path_tokens(node))[-self.span :]

    def match_order(self, context: list[int]) -> int:
        """Length of the longest suffix of `context` (at most max_n) the text has continued before; 0 if none."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            if tuple(context[-n:]) in self.index[n]:
                return n
        return 0

    def distribution(self, context: list[int], k: int | None) -> list[tuple[int, float]]:
        """Up to k (all when None) (token, probability) pairs after `context`, most probable first."""
        probs: dict[int, float] = {}
        escape = 1.0
        orders = range(min(self.max_n, len(context)), 0, -1)
        tables = (self.index[n].get(tuple(context[-n:])) for n in orders)  # looked up as the loop needs them
        if self.store is not None:
            tables = list(tables)
            own = next((n for n, counts in zip(orders, tables) if counts), 0)  # match_order, from the same look-ups
            if own < self.store_below:
                n, found = self._stored(context)
                if n > own:
                    tables.insert(0, dict(found))
                    self.store_answers += 1
        for counts in tables:
            if not counts:
                continue
            total = sum(counts.values())
            for token, count in counts.items():
                if token not in probs:
                    probs[token] = escape * count / (total + 1)
            escape /= total + 1
            if k is not None and len(probs) >= k:  # lower orders cannot beat what we have: each is below `escape`
                break
        ranked = lambda item: (item[1], -item[0])  # noqa: E731 - most probable first, then smaller id
        return heapq.nlargest(k, probs.items(), key=ranked) if k is not None else sorted(probs.items(), key=ranked, reverse=True)

    def _stored(self, context: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """The datastore's longest match for `context` (order, counts), remembered for this run."""
        key = tuple(context[-self.store.order:])
        if key not in self.found:
            self.found[key] = self.store.continuations(list(key))
        return self.found[key]

    def _extend(self, new_tokens: list[int]) -> None:
        for token in new_tokens:
            end = len(self.tokens)
            for n in range(1, min(self.max_n, end) + 1):
                followers = self.index[n].setdefault(tuple(self.tokens[end - n : end]), {})
                followers[token] = followers.get(token, 0) + 1
            self.tokens.append(token)
