"""Drafting with a feature head (featurehead.py) from the target's own hidden states.

The head's cache holds committed positions only, each computed from the target's *true*
feature of the position before (what the head was trained on). The engine hands those
features over: the prompt's after the prefill (`reset`, which feeds them to the head at once: the
head's own prefill, so the first tree's drafting costs what later trees' do), the verified root's
and accepted path's after each verification (`commit`; the same forward pass, no second target
pass). Expanding the root feeds the committed tokens the head has not seen yet (the previous
iteration's accepted path and bonus) with their true features; deeper levels feed each node
with its parent's *predicted* feature, one level per forward, each node seeing the committed
positions and its own ancestors (4-D mask, position = root position + depth). After
verification the tree's entries are dropped: the accepted tokens are fed again next time with
the target's features, as in training. Under a KV window the head sees what the window lets
the target see and evicts the same way.

With `compile` (a `--compile` run) every head forward after the first of a sequence (`reset`'s feed
of the prompt, eager as the target's prefill is) on a cache of 2+ entries
(`runtime.compiles_on`) goes through the head's torch.compile wrapper (`FeatureHead.compiled`): one
graph for one fed token and one for several, built by `warm_up` before any clock starts. Proposals never decide what is committed, so compiled and eager
heads round differently without touching exactness.
"""

from __future__ import annotations

import time
import weakref

import torch

from .. import cache as kv
from ..featurehead import FeatureHead, check_head
from ..kernels import PackedLinear, linear_kernel
from ..runtime import compiled_graphs, compiles_on
from ..tree import TreeBuilder, additive_mask, causal_allowed
from ..weights import int4_linear
from ..window import KVWindow
from .base import Proposal
from .slots import DraftSlots


class FeatureDrafter:
    uses_target_hidden = True

    def __init__(self, head: FeatureHead, target, window: KVWindow | None = None, compile: bool = False):
        check_head(head, target)
        self.head = head
        self.compile = compile  # head steps after the first of a sequence through torch.compile
        self.name = head.name
        self.embed = target.model.get_input_embeddings()
        self.dtype, self.device = head.fc.weight.dtype, head.fc.weight.device  # the head's: its inputs are cast there
        # the sub-vocabulary's rows of the target's output layer [draft_vocab, hidden], as a linear layer
        self.out = _output_layer(head, target)
        self.vocab_size = target.vocab_size
        self.window = window
        self.calls = 0  # head forwards (for stats and tests)

    @torch.no_grad()
    def reset(self, tokens: list[int], hidden: torch.Tensor | None = None) -> None:
        if hidden is None or len(hidden) < len(tokens) - 1:
            raise ValueError("a feature drafter needs the target's hidden states of the prompt")
        self.cache = kv.new_cache(self.head.body)
        self.tokens = list(tokens)
        self.n_fed = 1  # next committed position to feed (position 0 has no feature before it)
        self.features = hidden[: len(tokens) - 1]  # true features of positions n_fed - 1 .. len(tokens) - 2
        self.slots = DraftSlots(self.window)  # which position each cache slot holds (slots.py)
        self.node_feat: dict[int, torch.Tensor] = {}  # tree node -> the head's predicted feature at it
        if len(tokens) > 2:  # the head's prefill: every prompt position but the root's (fed when it is expanded)
            self._feed_committed(len(tokens) - 1)

    @torch.no_grad()
    def propose(self, tree: TreeBuilder, nodes: list[int], k: int, full: bool = False) -> Proposal:
        if nodes == [0]:
            out = self._feed_committed()
        elif 0 in nodes:
            raise ValueError("the root is expanded on its own, before any other node")
        else:
            out = self._feed_nodes(tree, nodes)
        probs = torch.softmax(self.out(out).float(), dim=-1)
        top = probs.topk(min(k, probs.shape[-1]), dim=-1)
        dist = None
        if full:
            dist = probs.new_zeros(len(nodes), self.vocab_size)
            dist[:, self.head.vocab_ids] = probs
            dist = dist.cpu()
        return Proposal(ids=self.head.vocab_ids[top.indices].cpu(), probs=top.values.cpu(), dist=dist, forwards=1)

    def without_model(self) -> None:
        return None  # every proposal is a head forward

    @torch.no_grad()
    def warm_up(self) -> float:
        """With `compile`: run the head's compiled steps (one fed token, several) on a scratch cache, so
        that graphs not built yet are built now; the seconds that took when a graph was built, else 0.0.
        As `LoadedModel.warm_up`: a second round at another cache length and count where the first built
        graphs (a torch that builds static graphs first builds the symbolic ones there)."""
        if not self.compile:
            return 0.0
        start, graphs = time.perf_counter(), compiled_graphs()
        cache = kv.new_cache(self.head.body)
        self._scratch_forward(cache, 4, compiled=False)  # the eager first forward of a sequence
        self._warm_steps(cache, 4, sizes=(1, 2))
        if compiled_graphs() != graphs:  # a second round at another cache length and count
            self._scratch_forward(cache, 1, compiled=False)
            self._warm_steps(cache, 5, sizes=(1, 3))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start if compiled_graphs() != graphs else 0.0

    def _warm_steps(self, cache, context: int, sizes) -> None:
        """A compiled head step of each of `sizes` fed tokens on top of `cache`'s `context` entries
        (cropped back after each)."""
        for n in sizes:
            self._scratch_forward(cache, n, compiled=True)
            kv.crop(cache, context)

    def _scratch_forward(self, cache, n: int, compiled: bool) -> None:
        """`n` zero tokens fed causally on top of `cache` (for `warm_up`)."""
        held, hidden = kv.length(cache), self.head.config.hidden_size
        dtype, device = self.dtype, self.device
        allowed = causal_allowed(held, n)
        self._head_forward(cache, torch.zeros(1, n, hidden, dtype=dtype, device=device),
                           torch.zeros(n, hidden, dtype=dtype, device=device), list(range(held, held + n)),
                           additive_mask(allowed, dtype, device), compiled=compiled)

    def commit(self, tokens: list[int], path: list[int], hidden: torch.Tensor | None = None) -> None:
        """`hidden`: the target's features of the verified root and accepted path, in order."""
        if hidden is None:
            raise ValueError("a feature drafter needs the target's hidden states of the accepted path")
        new = len(tokens) - len(self.tokens)  # committed tokens; their features are those of the positions before
        self.features = torch.cat([self.features, hidden[:new]])
        self.slots.drop_tree(self.cache)  # the tree's entries were computed from predicted features
        self.tokens = list(tokens)
        self.node_feat = {}
        self.slots.evict(self.cache, self.n_fed)

    def _feed_committed(self, end: int | None = None) -> torch.Tensor:
        """Feed committed positions n_fed .. end - 1 (default: through the root) with their true
        features; the last one's prediction."""
        start, end = self.n_fed, len(self.tokens) if end is None else end
        positions = list(range(start, end))
        allowed, _ = self.slots.committed(positions)
        prefill = end < len(self.tokens)  # `reset`'s feed of the prompt (eager: the sequence's first forward)
        out = self._run(self.tokens[start:end], self.features[: end - start] if prefill else self.features, positions,
                        allowed)
        self.slots.fed_committed(positions)
        # what is left is never a view of the prompt's features: a compiled head step is guarded on whether
        # its inputs are views, and the warm-up builds its graphs for fresh tensors
        self.n_fed, self.features = end, self.features[end - start:].clone() if prefill else self.features[end - start:]
        if end == len(self.tokens):  # the root was fed: its prediction expands it
            self.node_feat[0] = out[-1]
        return out[-1:]

    def _feed_nodes(self, tree: TreeBuilder, nodes: list[int]) -> torch.Tensor:
        """Feed one tree level: each node from its parent's predicted feature, seeing the committed
        positions and its own ancestors."""
        base = kv.length(self.cache)
        allowed, positions, _ = self.slots.level(tree, nodes, len(self.tokens) - 1, base)
        features = torch.stack([self.node_feat[tree.parents[node]] for node in nodes])
        out = self._run([tree.tokens[node] for node in nodes], features, positions, allowed)
        self.slots.fed_level(nodes, base, positions)
        for row, node in enumerate(nodes):
            self.node_feat[node] = out[row]
        return out

    def _run(self, ids: list[int], features: torch.Tensor, positions: list[int], allowed: torch.Tensor) -> torch.Tensor:
        device = self.device
        embeds = self.embed(torch.tensor([ids], device=device)).to(self.dtype)
        mask = additive_mask(allowed, self.dtype, device)
        self.calls += 1
        compiled = self.compile and compiles_on(self.cache)  # (never the sequence's first forward: an empty cache)
        return self._head_forward(self.cache, embeds, features, positions, mask, compiled=compiled)[0]

    def _head_forward(self, cache, embeds: torch.Tensor, features: torch.Tensor, positions: list[int],
                      mask: torch.Tensor, compiled: bool) -> torch.Tensor:
        """One head forward on `cache` (compiled or eager), its inputs built alike for both callers
        (`_run`, `warm_up`): a graph is guarded on how each input is made (a view or not), so the
        warm-up's must be made as the run's are."""
        head = self.head.compiled() if compiled else self.head
        with kv.advancing(cache, len(positions), self.head.name):
            return head(embeds=embeds, features=features.to(self.dtype)[None],
                        positions=torch.tensor([positions], device=embeds.device), mask=mask, cache=cache)


# per head, its output layer for the target whose output weights it was gathered from (built once:
# a drafter is made for every run, and gathering + packing 8192 rows costs milliseconds)
_OUTPUTS: "weakref.WeakKeyDictionary[FeatureHead, tuple]" = weakref.WeakKeyDictionary()


def _dense_rows(rows: torch.Tensor, packed: bool) -> torch.nn.Module:
    """`rows` as a linear layer (bias-free), packed for oneDNN when `packed`."""
    layer = torch.nn.utils.skip_init(torch.nn.Linear, rows.shape[1], rows.shape[0], bias=False,
                                     device=rows.device, dtype=rows.dtype)
    layer.weight = torch.nn.Parameter(rows, requires_grad=False)
    return PackedLinear(layer) if packed else layer


def _output_layer(head: FeatureHead, target) -> torch.nn.Module:
    """The head's output layer: the target's output rows of its sub-vocabulary as a linear layer, on
    the head's kernels (packed for oneDNN when its own layers are, which makes a few-row product
    several times faster than MKL's; in int4 for a q4 head, `FeatureHead.to_q4`, quantized from the
    target's rows as they are, not after a cast, and keeping no dense copy)."""
    weight = target.model.get_output_embeddings().weight
    packed = linear_kernel(head) == "onednn"
    key = (weight.data_ptr(), weight.dtype, packed, head.fc.weight.dtype, head.weights)
    cached = _OUTPUTS.get(head)
    if cached is None or cached[0] != key or cached[2]() is not weight:  # another target, or a new weight
        rows = weight.detach()[head.vocab_ids]
        layer = int4_linear(rows) if head.weights == "q4" else _dense_rows(rows.to(head.fc.weight.dtype), packed)
        cached = _OUTPUTS[head] = (key, layer, weakref.ref(weight))
    return cached[1]
