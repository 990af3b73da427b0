"""A draft language model with its own KV cache, expanding a whole tree level per forward.

Cache layout while a tree grows: [committed tokens | tree nodes fed so far, level by level].
Each fed node attends to the committed tokens and to its own ancestors only (4-D mask,
position = committed length - 1 + depth), so every branch is drafted from its own context.
After verification `commit` keeps the accepted path's entries (moved into place) and drops
the rest: the cache survives across iterations and only new tokens are ever fed again.
"""

from __future__ import annotations

import torch

from .. import cache as kv
from ..models import LoadedModel
from ..tree import TreeBuilder, additive_mask
from .base import Proposal


class LMDrafter:
    def __init__(self, draft: LoadedModel, vocab_limit: int):
        self.draft = draft
        self.model = draft.model
        self.name = draft.name
        self.vocab_limit = vocab_limit  # only ids the target can score are proposed

    def reset(self, tokens: list[int]) -> None:
        self.cache = kv.new_cache(self.model)
        self.tokens = list(tokens)
        self.n_cached = 0  # committed tokens whose entries are in the cache
        self.slots: dict[int, int] = {}  # tree node -> cache slot, for nodes fed this iteration

    @torch.no_grad()
    def propose(self, tree: TreeBuilder, nodes: list[int], k: int) -> Proposal:
        if nodes == [0]:
            logits = self._feed_committed()
        elif 0 in nodes:
            raise ValueError("the root is expanded on its own, before any other node")
        else:
            logits = self._feed_nodes(tree, nodes)
        probs = torch.softmax(logits[:, : self.vocab_limit].float(), dim=-1)
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        return Proposal(ids=top.indices.cpu(), probs=top.values.cpu())

    def commit(self, tokens: list[int], path: list[int]) -> None:
        fed = []
        for node in path:  # fed nodes on a path form a prefix of it: a node is fed only if its parent was
            if node not in self.slots:
                break
            fed.append(self.slots[node] - self.n_cached)
        kv.keep(self.cache, self.n_cached, torch.tensor(fed, dtype=torch.long))
        self.n_cached += len(fed)
        self.tokens = list(tokens)
        self.slots = {}

    def _feed_committed(self) -> torch.Tensor:
        """Feed the committed tokens not yet cached (the root is always among them)."""
        start, end = self.n_cached, len(self.tokens)
        n = end - start
        allowed = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)  # causal over cache + new
        logits = self.draft.forward(self.cache, self.tokens[start:end], list(range(start, end)), self._mask(allowed))
        self.n_cached = end
        return logits[-1:]

    def _feed_nodes(self, tree: TreeBuilder, nodes: list[int]) -> torch.Tensor:
        """Feed one tree level: each node sees the committed tokens and its own ancestors."""
        base = kv.length(self.cache)
        m = len(nodes)
        allowed = torch.zeros(m, base + m, dtype=torch.bool)
        allowed[:, : self.n_cached] = True
        for row, node in enumerate(nodes):
            allowed[row, base + row] = True
            parent = tree.parents[node]
            while parent > 0:
                allowed[row, self.slots[parent]] = True
                parent = tree.parents[parent]
        root_pos = len(self.tokens) - 1
        positions = [root_pos + tree.depths[node] for node in nodes]
        logits = self.draft.forward(self.cache, [tree.tokens[node] for node in nodes], positions, self._mask(allowed))
        for row, node in enumerate(nodes):
            self.slots[node] = base + row
        return logits

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        return additive_mask(allowed, self.model.dtype, self.model.device)
