"""The draft tree: a small value built once per iteration, then turned into tensors.

Node 0 is the *root*: the last committed token, which is not yet in the target's
KV cache (it is the previous iteration's bonus token). Nodes 1..n-1 are drafted
tokens. Nodes are stored in breadth-first order, so `parents[i] < i` and depths
never decrease; siblings always carry distinct tokens.

For a prefix of `P` cached tokens, node `i` sits at position `P + depths[i]` and
may attend to the whole prefix plus its own ancestors (itself included). That is
exactly the context sequential decoding would give it along its root-to-node path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch


def causal_allowed(cached: int, n: int) -> torch.Tensor:
    """[n, cached + n] bool: n tokens fed after `cached` cache entries, each seeing every cached entry
    and the fed tokens up to itself (plain causal attention)."""
    return torch.ones(n, cached + n, dtype=torch.bool).tril(cached)


@dataclass(frozen=True, eq=False)
class Tree:
    tokens: torch.Tensor  # [n] long, token of each node; tokens[0] is the root
    parents: torch.Tensor  # [n] long, parent index; parents[0] = -1, parents[i] < i
    depths: torch.Tensor  # [n] long, distance from the root; depths[0] = 0
    logp: torch.Tensor  # [n] float64, cumulative draft log-probability of the path; logp[0] = 0
    proposals: dict = field(default_factory=dict)  # node -> [V] distribution its children were *sampled* from
    source: list[int] | None = None  # node -> its index in the builder the drafter saw (None: the same)

    @property
    def size(self) -> int:
        """Number of nodes, root included."""
        return int(self.tokens.shape[0])

    @property
    def n_drafted(self) -> int:
        """Number of drafted nodes (root excluded)."""
        return self.size - 1

    @cached_property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.size else 0

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[n, n] bool: ancestors[i, j] is True when j is i or an ancestor of i."""
        n = self.size
        anc = torch.eye(n, dtype=torch.bool)
        for depth in range(1, self.max_depth + 1):  # one vector op per level
            level = (self.depths == depth).nonzero().squeeze(1)
            anc[level] |= anc[self.parents[level]]
        return anc

    def position_ids(self, root_pos: int) -> torch.Tensor:
        """[1, n] positions of the nodes when the root sits at `root_pos` (prefix length)."""
        return (root_pos + self.depths).unsqueeze(0)

    def allowed(self, prefix_len: int) -> torch.Tensor:
        """[n, prefix_len + n] bool: every node sees the cached prefix and its own ancestors."""
        return torch.cat([torch.ones(self.size, prefix_len, dtype=torch.bool), self.ancestors], dim=1)

    def attention_mask(self, prefix_len: int, dtype: torch.dtype, device=None) -> torch.Tensor:
        """[1, 1, n, prefix_len + n] additive mask: 0 where attention is allowed, dtype-min elsewhere."""
        return additive_mask(self.allowed(prefix_len), dtype, device)

    @cached_property
    def paths(self) -> torch.Tensor:
        """[n_leaves, max_depth + 1] long: node indices of each root-to-leaf path, padded with -1."""
        is_parent = torch.zeros(self.size, dtype=torch.bool)
        is_parent[self.parents[1:]] = True
        leaves = (~is_parent).nonzero().squeeze(1)
        paths = torch.full((len(leaves), self.max_depth + 1), -1, dtype=torch.long)
        row, node = self.ancestors[leaves].nonzero(as_tuple=True)  # every (leaf, ancestor) pair
        paths[row, self.depths[node]] = node  # an ancestor's depth is its place on the path
        return paths

    def drafted_nodes(self, nodes: list[int]) -> list[int]:
        """`nodes` as the drafter knows them (builder indices; they differ after pruning)."""
        return nodes if self.source is None else [self.source[u] for u in nodes]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to `node` (root excluded)."""
        path = []
        parents = self.parents.tolist()
        while node > 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Turn a [q, k] bool matrix into the [1, 1, q, k] additive mask transformers expects."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask[None, None]


class TreeBuilder:
    """A tree under construction; policies add children level by level, then call `build()`."""

    def __init__(self, root_token: int):
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.depths: list[int] = [0]
        self.logp: list[float] = [0.0]
        self.modelled: list[bool] = [False]  # per node: a draft model proposed it (else a lookup, or the root)
        self._child_tokens: list[set[int]] = [set()]
        self.proposals: dict[int, torch.Tensor] = {}  # node -> distribution its children were sampled from

    def __len__(self) -> int:
        return len(self.tokens)

    def prob(self, node: int) -> float:
        """Cumulative draft probability of the root-to-node path."""
        return math.exp(self.logp[node])

    def level_allowed(self, nodes: list[int], slot: dict[int, int], committed: int, base: int) -> torch.Tensor:
        """[m, base + m] bool: what each of `nodes` (one level, fed as m rows after `base` entries of a
        draft's cache) sees: the first `committed` entries (the committed tokens), the entries of its fed
        ancestors (`slot`: node -> cache entry) and its own row."""
        m = len(nodes)
        allowed = torch.zeros(m, base + m, dtype=torch.bool)
        allowed[:, :committed] = True
        for row, node in enumerate(nodes):
            allowed[row, base + row] = True
            parent = self.parents[node]
            while parent > 0:
                allowed[row, slot[parent]] = True
                parent = self.parents[parent]
        return allowed

    def path_tokens(self, node: int) -> list[int]:
        """Tokens from the root's first child down to `node` (root excluded)."""
        out = []
        while node > 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def add(self, parent: int, token: int, prob: float, modelled: bool = False) -> int | None:
        """Add a child of `parent` (`modelled`: a draft model proposed it, `Proposal.by_model`); returns
        its index, or None if a sibling already has that token."""
        if token in self._child_tokens[parent] or prob <= 0.0:
            return None
        self._child_tokens[parent].add(token)
        self._child_tokens.append(set())
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.logp.append(self.logp[parent] + math.log(prob))
        self.modelled.append(modelled)
        return len(self.tokens) - 1

    def build(self, keep: list[int] | None = None) -> Tree:
        """The finished tree; with `keep`, only those nodes (the root and every kept node's
        parent must be kept too), re-ordered breadth-first, remembering their builder indices."""
        if keep is None:
            if any(b < a for a, b in zip(self.depths, self.depths[1:])):
                raise ValueError("tree nodes must be added in breadth-first order")
            order, source = list(range(len(self))), None
        else:
            kept = set(keep)
            if 0 not in kept or any(self.parents[u] not in kept for u in kept if u):
                raise ValueError("a kept tree must contain the root and the parent of every kept node")
            order = sorted(kept, key=lambda u: (self.depths[u], u))
            source = order
        index = {u: i for i, u in enumerate(order)}
        return Tree(
            tokens=torch.tensor([self.tokens[u] for u in order], dtype=torch.long),
            parents=torch.tensor([index[self.parents[u]] if u else -1 for u in order], dtype=torch.long),
            depths=torch.tensor([self.depths[u] for u in order], dtype=torch.long),
            logp=torch.tensor([self.logp[u] for u in order], dtype=torch.float64),
            proposals={index[u]: q for u, q in self.proposals.items() if u in index},
            source=source,
        )
