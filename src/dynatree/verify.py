"""Greedy verification: the longest root-to-leaf path the target agrees with, plus a bonus token."""

from __future__ import annotations

import torch

from .tree import Tree


def greedy_accept(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Accepted path and bonus token for a verified tree.

    `logits` is [n, vocab]: row i is the target's next-token distribution after node i's
    root-to-node context. A drafted node is accepted when its token is the target's argmax
    after its parent and its parent is accepted (the root always is). Returns the accepted
    nodes (root excluded, root-to-leaf order) and the target's argmax after the last one.
    Siblings carry distinct tokens, so the accepted path is unique.
    """
    pred = logits.argmax(dim=-1).cpu()  # [n] the single device->host transfer of an iteration
    paths = tree.paths  # [n_leaves, max_depth + 1], -1 padded
    child, parent = paths[:, 1:], paths[:, :-1]
    match = (child >= 0) & (tree.tokens[child.clamp(min=0)] == pred[parent.clamp(min=0)])
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [n_leaves] accepted length per path
    best = int(accepted.argmax())
    length = int(accepted[best])
    path = paths[best, 1 : 1 + length].tolist()
    bonus = int(pred[paths[best, length]])
    return path, bonus
