"""The cache bookkeeping of a drafter that runs a model with its own KV cache (the draft LM, the
feature head): which position each committed cache slot holds, which slot each tree node fed this
iteration holds, what each fed query may see, and what a KV window evicts after a commit.

Cache layout while a tree grows: [committed positions | tree nodes fed so far, level by level].
A committed position sees the committed ones before it (causal); a tree node sees the committed
positions and its own ancestors only, at position = root position + depth; under a KV window each
query sees only what the window lets the target see. After verification a drafter either keeps the
accepted path's entries (`keep_path`: the draft LM's are what it would compute again) or drops
every tree entry (`drop_tree`: the feature head's were computed from predicted features).
"""

from __future__ import annotations

import torch

from .. import cache as kv
from ..tree import TreeBuilder, causal_allowed
from ..window import KVWindow


class DraftSlots:
    """Slot and position bookkeeping for one drafter's cache (reset per sequence)."""

    def __init__(self, window: KVWindow | None):
        self.window = window  # the target's KV window, followed by the draft's cache too (or None)
        self.reset()

    def reset(self) -> None:
        self.slot_pos: list[int] = []  # position of each committed cache slot (they come first in the cache)
        self.nodes: dict[int, tuple[int, int]] = {}  # tree node -> (cache slot, position), nodes fed this iteration

    def committed(self, positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Feeding committed `positions` causally after the cached ones: what each may see
        [len(positions), keys] and every key's position. Call `fed_committed` after the forward."""
        key_pos = self.slot_pos + positions
        return self._windowed(causal_allowed(len(self.slot_pos), len(positions)), positions, key_pos), key_pos

    def fed_committed(self, positions: list[int]) -> None:
        self.slot_pos.extend(positions)

    def level(self, tree: TreeBuilder, nodes: list[int], root_pos: int, base: int
              ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Feeding one tree level at cache slot `base` (the cache's length): what each node may see (the
        committed positions and its own ancestors), the nodes' positions and every key's position.
        Call `fed_level` after the forward."""
        slots = {node: slot for node, (slot, _) in self.nodes.items()}
        allowed = tree.level_allowed(nodes, slots, len(self.slot_pos), base)
        positions = [root_pos + tree.depths[node] for node in nodes]
        key_pos = self.slot_pos + [pos for _, pos in sorted(self.nodes.values())] + positions
        return self._windowed(allowed, positions, key_pos), positions, key_pos

    def fed_level(self, nodes: list[int], base: int, positions: list[int]) -> None:
        for row, (node, pos) in enumerate(zip(nodes, positions)):
            self.nodes[node] = (base + row, pos)

    def keep_path(self, cache, path: list[int]) -> int:
        """Keep the cache entries of the accepted path's fed nodes (moved after the committed ones) and
        drop the rest of the tree's; how many were kept (a prefix of the path: a node is fed only if its
        parent was)."""
        committed = len(self.slot_pos)
        kept = []
        for node in path:
            if node not in self.nodes:
                break
            slot, pos = self.nodes[node]
            kept.append(slot - committed)
            self.slot_pos.append(pos)
        kv.keep(cache, committed, torch.tensor(kept, dtype=torch.long))
        self.nodes = {}
        return len(kept)

    def drop_tree(self, cache) -> None:
        """Drop every tree entry (the committed ones stay)."""
        kv.crop(cache, len(self.slot_pos))
        self.nodes = {}

    def evict(self, cache, next_query: int) -> None:
        """Under a KV window, evict the committed entries no query from position `next_query` on may
        see (the first committed position not fed yet: the root, or earlier when the draft lags)."""
        if self.window is not None:
            self.slot_pos = self.window.evict(cache, torch.tensor(self.slot_pos, dtype=torch.long), next_query).tolist()

    def _windowed(self, allowed: torch.Tensor, query_pos: list[int], key_pos: list[int]) -> torch.Tensor:
        if self.window is None:
            return allowed
        return allowed & self.window.visible(torch.tensor(query_pos), torch.tensor(key_pos))
