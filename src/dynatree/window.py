"""Attention-sink KV window (StreamingLLM-style cache compression), exact under speculation.

Policy `--kv-window SINK,RECENT`: a token at position t attends to the first SINK tokens
(the "attention sinks") and to the tokens at positions t-RECENT .. t. The KV cache then only
ever needs those entries, so it holds at most SINK + RECENT tokens and memory stays flat.

Positions. Every token keeps its true position in the text: a cached key keeps the rotation
(or learned position) it was computed with, and new tokens and tree nodes continue from the
true length (root position + depth), so queries and kept keys are always consistent. This
differs from StreamingLLM's re-numbering inside the cache, deliberately: with re-numbered
positions a tree node at depth d would need the kept keys shifted by d relative to the
sinks, which one verification pass cannot give every depth at once, so speculative output
could not equal AR output under the same policy. The price: generation stays within the
model's context length (the window bounds memory and attention cost, not length).

Exactness under speculation follows from the mask: a tree node at position t sees exactly
the keys AR would have kept when decoding position t (sinks, then positions >= t - RECENT),
which for deeper nodes excludes the oldest cached entries that AR would already have evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cache as kv
from .errors import DynaTreeError


@dataclass(frozen=True)
class KVWindow:
    sink: int  # first tokens of the sequence, always kept
    recent: int  # most recent tokens kept before each query

    @staticmethod
    def parse(text: str | None) -> "KVWindow | None":
        """'SINK,RECENT' -> KVWindow; None or '' -> no window."""
        if not text:
            return None
        parts = str(text).split(",")
        try:
            sink, recent = (int(p) for p in parts)
        except ValueError:
            raise DynaTreeError(f"--kv-window takes SINK,RECENT (two integers), got {text!r}") from None
        return KVWindow(sink, recent).validated()

    def validated(self) -> "KVWindow":
        if self.sink < 0 or self.recent < 1:
            raise DynaTreeError(f"--kv-window needs SINK >= 0 and RECENT >= 1, got {self.sink},{self.recent}")
        if self.sink >= self.recent:
            raise DynaTreeError(
                f"--kv-window sink ({self.sink}) must be smaller than the recent window ({self.recent})"
            )
        return self

    def check_context(self, context_length: int | None, name: str) -> None:
        if context_length is not None and self.sink + self.recent > context_length:
            raise DynaTreeError(
                f"--kv-window {self.sink},{self.recent} keeps {self.sink + self.recent} tokens, more than the "
                f"context length {context_length} of {name!r}"
            )

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """[q, k] bool: which keys each query may see under the window (causality not included)."""
        return (key_pos[None, :] < self.sink) | (key_pos[None, :] >= query_pos[:, None] - self.recent)

    def needed(self, slot_pos: torch.Tensor, next_pos: int) -> torch.Tensor:
        """Cache slots any query at position >= next_pos can still see."""
        return (slot_pos < self.sink) | (slot_pos >= next_pos - self.recent)

    def evict(self, cache, slot_pos: torch.Tensor, next_pos: int) -> torch.Tensor:
        """Drop from `cache` the slots no query at position >= next_pos can see; the kept slots'
        positions (`slot_pos`: the position of each cache slot, in order)."""
        needed = self.needed(slot_pos, next_pos)
        if bool(needed.all()):
            return slot_pos
        idx = needed.nonzero().squeeze(1)
        kv.keep(cache, 0, idx)
        return slot_pos[idx]

    def __str__(self) -> str:
        return f"{self.sink},{self.recent}"
