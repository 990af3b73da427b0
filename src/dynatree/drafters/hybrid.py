"""n-gram copying where the text repeats itself, a draft LM (or feature head) everywhere else.

A node whose context (committed tokens + its path) ends in an n-gram of order >= `min_match`
that the text has seen before takes the n-gram drafter's candidates, which cost nothing; the
other nodes of the level are fed to the draft LM in one forward. The LM can only expand a
node whose every ancestor it has seen, so it answers the root only when the root needs it,
and a node below an n-gram-drafted ancestor stays with the n-gram drafter (whose lower
orders may still have candidates). The LM's cache catches up on skipped committed tokens
the next time the root needs it (`LMDrafter` feeds every committed token it has not seen).
"""

from __future__ import annotations

import torch

from ..tree import TreeBuilder
from .base import Proposal
from .feature import FeatureDrafter
from .lm import LMDrafter
from .ngram import NgramDrafter


class HybridDrafter:
    def __init__(self, ngram: NgramDrafter, lm: LMDrafter | FeatureDrafter, min_match: int = 2):
        if not 1 <= min_match <= ngram.max_n:
            raise ValueError(f"min_match must be in 1..{ngram.max_n}, got {min_match}")
        self.ngram, self.lm, self.min_match = ngram, lm, min_match
        self.name = f"{ngram.name}+{lm.name}"  # ngram+MODEL, or ngram+STORE+MODEL with a datastore
        self.uses_target_hidden = lm.uses_target_hidden

    def reset(self, tokens: list[int], hidden=None) -> None:
        self.ngram.reset(tokens)
        self.lm.reset(tokens, hidden)
        self.lm_nodes: set[int] = set()  # nodes of the growing tree the LM has been fed
        self.lm_calls = 0  # draft LM forwards (for stats and tests)

    def propose(self, tree: TreeBuilder, nodes: list[int], k: int, full: bool = False) -> Proposal:
        copied = [self.ngram.match_order(self.ngram.context(tree, node)) >= self.min_match for node in nodes]
        ask_lm = [not c and self._lm_can_expand(tree, node) for node, c in zip(nodes, copied)]
        result = self.ngram.propose(tree, nodes, k, full)
        lm_rows = [row for row, ask in enumerate(ask_lm) if ask]
        if lm_rows:
            lm_nodes = [nodes[row] for row in lm_rows]
            answer = self.lm.propose(tree, lm_nodes, k, full)
            self.lm_calls += 1
            self.lm_nodes.update(lm_nodes)
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
        self.ngram.commit(tokens, path)
        self.lm.commit(tokens, path, hidden)
        self.lm_nodes = set()

    def _lm_can_expand(self, tree: TreeBuilder, node: int) -> bool:
        """The root always; another node when the LM was fed its parent (and so all its ancestors)."""
        return node == 0 or tree.parents[node] in self.lm_nodes
