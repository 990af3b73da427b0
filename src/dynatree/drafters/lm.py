"""A draft language model with its own KV cache, expanding a whole tree level per forward.

Cache layout while a tree grows (slots.py): [committed tokens | tree nodes fed so far, level by
level]. Each fed node attends to the committed tokens and to its own ancestors only (4-D mask,
position = root position + depth), so every branch is drafted from its own context.
With `compile` (a `--compile` run; by default the draft's own `compile` setting) every draft forward
after the first of a sequence (the prompt's, eager as the target's prefill is) on a cache of 2+
entries (`runtime.compiles_on`) runs the draft's compiled steps (`LoadedModel.compiled`: one graph for
one masked token, one for several), built by `warm_up` before any clock starts.
After verification `commit` keeps the accepted path's entries (moved into place) and drops
the rest: the cache survives across iterations and only new tokens are ever fed again.
With a KV window the draft follows the same policy as the target: each query sees only
what the window lets it see, and committed entries no longer needed are evicted, so the
draft's memory stays bounded and a draft identical to the target proposes exactly the
target's windowed predictions.
"""

from __future__ import annotations

import torch

from .. import cache as kv
from ..runtime import LoadedModel, compiles_on
from ..tree import TreeBuilder
from ..window import KVWindow
from .base import Proposal
from .slots import DraftSlots


class LMDrafter:
    uses_target_hidden = False

    def __init__(self, draft: LoadedModel, vocab_limit: int, window: KVWindow | None = None,
                 compile: bool | None = None):
        self.draft = draft
        # draft forwards after the first of a sequence through torch.compile (None: the draft's own setting)
        self.compile = draft.compile if compile is None else compile
        self.model = draft.model
        self.name = draft.name
        self.vocab_limit = vocab_limit  # only ids the target can score are proposed
        self.window = window

    @torch.no_grad()
    def reset(self, tokens: list[int], hidden=None) -> None:
        self.cache = kv.new_cache(self.model)
        self.tokens = list(tokens)
        self.n_cached = 0  # committed tokens already run through the draft (cached, or evicted by the window)
        self.slots = DraftSlots(self.window)  # which position each cache slot holds (slots.py)
        if len(tokens) > 1:  # the draft's prefill: every committed token but the root (fed when it is expanded)
            self._feed_committed(len(tokens) - 1)

    @torch.no_grad()
    def propose(self, tree: TreeBuilder, nodes: list[int], k: int, full: bool = False) -> Proposal:
        if nodes == [0]:
            logits = self._feed_committed()
        elif 0 in nodes:
            raise ValueError("the root is expanded on its own, before any other node")
        else:
            logits = self._feed_nodes(tree, nodes)
        probs = torch.softmax(logits[:, : self.vocab_limit].float(), dim=-1)
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        dist = None
        if full:  # over the target's ids: a draft with a smaller output layer gives its missing ids 0
            dist = probs.new_zeros(len(probs), self.vocab_limit)
            dist[:, : probs.shape[1]] = probs
            dist = dist.cpu()
        return Proposal(ids=top.indices.cpu(), probs=top.values.cpu(), dist=dist, forwards=1)

    def without_model(self) -> None:
        return None  # every proposal is a draft forward

    def warm_up(self) -> float:
        """With `compile`: the draft's compiled steps built now (`LoadedModel.warm_up`; every draft
        forward passes a mask), else 0.0."""
        return self.draft.warm_up(("masked-token", "tree")) if self.compile else 0.0

    def commit(self, tokens: list[int], path: list[int], hidden=None) -> None:
        self.n_cached += self.slots.keep_path(self.cache, path)  # the path's entries are what the draft would compute
        self.tokens = list(tokens)
        self.slots.evict(self.cache, self.n_cached)

    def _feed_committed(self, end: int | None = None) -> torch.Tensor:
        """Feed the committed tokens not yet run through the draft, up to `end` (default: all of them,
        the root among them); the last one's logits."""
        start, end = self.n_cached, len(self.tokens) if end is None else end
        positions = list(range(start, end))
        allowed, key_pos = self.slots.committed(positions)
        prefill = end < len(self.tokens)  # `reset`'s feed of the prompt: only its cache entries are used
        logits = self.draft.forward(self.cache, self.draft.readable(self.tokens[start:end]), positions,
                                    self._mask(allowed, positions, key_pos), last_only=prefill,
                                    compiled=self._compiled())
        self.slots.fed_committed(positions)
        self.n_cached = end
        return logits[-1:]

    def _feed_nodes(self, tree: TreeBuilder, nodes: list[int]) -> torch.Tensor:
        """Feed one tree level: each node sees the committed tokens and its own ancestors."""
        base = kv.length(self.cache)
        allowed, positions, key_pos = self.slots.level(tree, nodes, len(self.tokens) - 1, base)
        logits = self.draft.forward(self.cache, self.draft.readable([tree.tokens[node] for node in nodes]), positions,
                                    self._mask(allowed, positions, key_pos), compiled=self._compiled())
        self.slots.fed_level(nodes, base, positions)
        return logits

    def _compiled(self) -> bool:
        """Whether the next forward is compiled (never the sequence's first: an empty cache)."""
        return self.compile and compiles_on(self.cache)

    def _mask(self, allowed: torch.Tensor, query_pos: list[int], key_pos: list[int]) -> torch.Tensor:
        return self.draft.masks(allowed, torch.tensor(query_pos), torch.tensor(key_pos))
