"""After every iteration the caches hold exactly what plain decoding of the committed tokens gives."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from helpers import ARCHS, assert_same_cache, noisy_copy, plain_cache, tiny
from dynatree import Decoder, make_config
from dynatree import cache as kv
from dynatree.drafters import LMDrafter
from dynatree.errors import DynaTreeError
from dynatree.methods import METHODS
from dynatree.runtime import cache_kwarg


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method, options", [
    ("fixed-tree", {"depth": 4, "branch": 3, "tau": 0.0, "n_max": 30}),
    ("dynatree", {"d0": 2, "d_max": 5, "tau": 0.0, "rho_stop": 0.001, "rho_deep": 0.01}),
    ("linear", {"k": 4}),
    ("dsbd", {"width": 3, "depth": 4}),  # beam layers interleave parents
    ("mtad", {"width": 3, "depth": 4}),  # its joint rule may commit a beam through a token greedy would reject
])
def test_target_and_draft_caches_match_plain_decoding(arch, method, options):
    target, draft = tiny(arch, eos_ids=[]), noisy_copy(arch, 0, 0.08)
    drafter = LMDrafter(draft, target.vocab_size)
    decoder = Decoder(target, METHODS[method].policy_cls(make_config(method, **options)), drafter)
    accepted_any = False
    for step in decoder.steps([7, 8, 9, 7, 8], max_new_tokens=40, ignore_eos=True):
        run = decoder.run
        assert_same_cache(run.cache, plain_cache(target.model, run.seq[:-1]))  # all but the new root
        assert drafter.n_cached <= len(run.seq) - 1  # the bonus token is never in the draft cache
        assert_same_cache(drafter.cache, plain_cache(draft.model, run.seq[: drafter.n_cached]))
        accepted_any |= len(step.path) > 0
    assert accepted_any, "the noisy draft should get some tokens accepted, or this test checks little"


def test_keep_moves_path_entries_into_place():
    target = tiny("llama")
    cache = plain_cache(target.model, list(range(3, 13)))  # 10 entries
    before = [layer.keys.clone() for layer in cache.layers]
    kv.keep(cache, 4, torch.tensor([0, 2, 5]))
    assert kv.length(cache) == 7
    for layer, old in zip(cache.layers, before):
        assert torch.equal(layer.keys[..., :4, :], old[..., :4, :])
        assert torch.equal(layer.keys[..., 4:, :], old[..., [4, 6, 9], :])
    kv.crop(cache, 2)
    assert kv.length(cache) == 2


class CountingDrafter(LMDrafter):
    """Counts the committed tokens the drafter re-reads: each should be fed at most once."""

    fed_committed = 0  # committed tokens run through the draft model
    reused = 0  # cache entries kept from accepted tree nodes instead

    def _feed_committed(self, end=None):
        self.fed_committed += (len(self.tokens) if end is None else end) - self.n_cached
        return super()._feed_committed(end)

    def commit(self, tokens, path, hidden=None):
        before = self.n_cached
        super().commit(tokens, path, hidden)
        self.reused += self.n_cached - before


def test_draft_cache_survives_iterations():
    target, draft = tiny("gpt_neox", eos_ids=[]), noisy_copy("gpt_neox", 0, 0.08)
    drafter = CountingDrafter(draft, target.vocab_size)
    decoder = Decoder(target, METHODS["dynatree"].policy_cls(make_config("dynatree")), drafter)
    run = decoder.generate([5, 6, 7, 8, 9, 10], max_new_tokens=60, ignore_eos=True)
    assert 0 < drafter.reused <= sum(run.stats.accepted_lens)
    assert drafter.fed_committed + drafter.reused == drafter.n_cached <= len(run.seq) - 1  # nothing fed twice


def test_slot_cache_grows_and_otherwise_writes_in_place(monkeypatch):
    """Entries are written by index into buffers that double when full; the values equal
    what transformers' own DynamicCache holds for the same forwards."""
    monkeypatch.setattr(kv, "MIN_CAPACITY", 4)
    target = tiny("llama")
    tokens = list(range(3, 23))
    ours = plain_cache(target.model, tokens)  # 20 one-token forwards: capacity 4 -> 8 -> 16 -> 32
    theirs = DynamicCache(config=target.model.config)
    for pos, token in enumerate(tokens):
        target.model(input_ids=torch.tensor([[token]], device=target.device),
                     position_ids=torch.tensor([[pos]], device=target.device),
                     **{cache_kwarg(target.model): theirs}, use_cache=True)
    assert all(type(layer) is kv.SlotLayer and layer.key_buf.shape[-2] == 32 for layer in ours.layers)
    assert_same_cache(ours, theirs)
    buffers = [layer.key_buf.data_ptr() for layer in ours.layers]
    target.forward(ours, [5, 6], [20, 21], None)  # room left: written into the same buffers
    assert [layer.key_buf.data_ptr() for layer in ours.layers] == buffers
    assert kv.length(ours) == 22
    kv.crop(ours, 10)
    assert_same_cache(ours, plain_cache(target.model, tokens[:10]))


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_share_one_length_through_forwards_keep_and_crop(arch):
    """Every layer of a cache holds the same entries count (`cache.Filled`, one object): after a
    prefill, a tree step, `keep` and `crop` each layer's keys and values are views of exactly that
    many slots, and the entries equal plain decoding's."""
    target = tiny(arch)
    cache = kv.new_cache(target.model)
    assert len({id(layer.filled) for layer in cache.layers}) == 1
    assert [layer.last for layer in cache.layers] == [False] * (len(cache.layers) - 1) + [True]
    target.forward(cache, [3, 4, 5, 6], [0, 1, 2, 3], None)
    allowed = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    target.forward(cache, [7, 8, 9], [4, 5, 5], target.masks(allowed, torch.tensor([4, 5, 5]), torch.tensor([0, 1, 2, 3, 4, 5, 5])))
    for count in (7, 6, 2):
        if count == 6:
            kv.keep(cache, 4, torch.tensor([0, 2]))  # the path 7 -> 9
        elif count == 2:
            kv.crop(cache, 2)
        assert kv.length(cache) == count
        assert all(layer.length == count and layer.keys.shape[-2] == count == layer.values.shape[-2]
                   for layer in cache.layers)
    kv.keep(cache, 2, torch.empty(0, dtype=torch.long))
    target.forward(cache, [5, 6, 7, 9], [2, 3, 4, 5], None)
    assert_same_cache(cache, plain_cache(target.model, [3, 4, 5, 6, 7, 9]))
    cache.crop(-2)  # transformers' own crop calls every layer's: the shared count drops by 2, once
    assert kv.length(cache) == 4
    assert_same_cache(cache, plain_cache(target.model, [3, 4, 5, 6]))
    with pytest.raises(AttributeError, match="view of its buffer"):
        cache.layers[0].keys = torch.zeros(1)


def test_a_forward_that_does_not_advance_the_shared_length_is_an_error():
    """The last layer's update advances the shared count; a model whose last cache layer is not
    updated so (here: no layer marked last) is a one-line error after its forward, not a cache that
    silently attends to the wrong entries."""
    target = tiny("llama")
    cache = kv.new_cache(target.model)
    cache.layers[-1].last = False
    with pytest.raises(DynaTreeError, match=r"left the cache at 0 entries, not 3: its last cache layer"):
        target.forward(cache, [3, 4, 5], [0, 1, 2], None)


def test_recurrent_and_chunked_attention_caches_are_refused():
    """Sliding windows are masked (test_sliding.py); state that cannot be compacted by index is refused."""
    linear = AutoConfig.for_model("qwen3_next", num_hidden_layers=4, hidden_size=16, vocab_size=64)
    with pytest.raises(DynaTreeError, match="qwen3_next is refused: it has linear_attention layers"):
        kv.attention_layout(SimpleNamespace(config=linear))
    chunked = AutoConfig.for_model("llama4_text", num_hidden_layers=4)
    with pytest.raises(DynaTreeError, match="llama4_text is refused: it has chunked_attention layers"):
        kv.attention_layout(SimpleNamespace(config=chunked))


def test_layers_sliding_over_different_windows_are_refused(monkeypatch):
    """One window per model is masked; a model whose sliding layers differ in window is refused,
    naming the windows (transformers builds no such cache today, so its layer types are faked)."""
    mistral = AutoConfig.for_model("mistral", num_hidden_layers=3, sliding_window=8)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    kwargs = [{"sliding_window": 8}, {}, {"sliding_window": 16}]
    monkeypatch.setattr(kv, "get_layer_types_and_kwargs", lambda config: (types, kwargs))
    with pytest.raises(DynaTreeError, match=r"^mistral is refused: its layers slide over different windows \(\[8, 16\]\)"):
        kv.attention_layout(SimpleNamespace(config=mistral))


def test_draft_slots_on_a_hand_drawn_tree():
    """The draft LM's and the feature head's shared bookkeeping (drafters/slots.py): what each fed query
    sees, which entries a commit keeps, and what a window evicts."""
    from dynatree.drafters.slots import DraftSlots
    from dynatree.tree import TreeBuilder
    from dynatree.window import KVWindow

    slots = DraftSlots(None)
    allowed, key_pos = slots.committed([0, 1, 2])  # three committed positions, fed causally
    assert key_pos == [0, 1, 2] and allowed.tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    slots.fed_committed([0, 1, 2])
    tree = TreeBuilder(7)  # the root (position 2, already fed) -> a, b; a -> c
    a, b = tree.add(0, 8, 0.6), tree.add(0, 9, 0.3)
    c = tree.add(a, 10, 0.9)
    allowed, positions, key_pos = slots.level(tree, [a, b], root_pos=2, base=3)
    assert positions == [3, 3] and key_pos == [0, 1, 2, 3, 3]
    assert allowed.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]  # each node: the committed ones and itself
    slots.fed_level([a, b], 3, positions)
    allowed, positions, key_pos = slots.level(tree, [c], root_pos=2, base=5)
    assert positions == [4] and key_pos == [0, 1, 2, 3, 3, 4]
    assert allowed.tolist() == [[1, 1, 1, 1, 0, 1]]  # c sees a (slot 3), not its sibling b (slot 4)
    slots.fed_level([c], 5, positions)

    cache = _entries(6)  # one entry per slot, valued by its slot
    assert slots.keep_path(cache, [a, c]) == 2  # a and c move after the committed entries; b is dropped
    assert slots.slot_pos == [0, 1, 2, 3, 4] and slots.nodes == {}
    assert cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 5]
    unfed = DraftSlots(None)
    unfed.fed_committed([0, 1])
    unfed.fed_level([a], 2, [2])
    assert unfed.keep_path(_entries(3), [a, c]) == 1  # c was never fed: the kept path stops at a

    dropped = DraftSlots(None)
    dropped.fed_committed([0, 1, 2])
    dropped.fed_level([a, b], 3, [3, 3])
    cache = _entries(5)
    dropped.drop_tree(cache)
    assert kv.length(cache) == 3 and dropped.nodes == {}

    windowed = DraftSlots(KVWindow(sink=1, recent=2))
    allowed, key_pos = windowed.committed([0, 1, 2, 3, 4])
    assert allowed[4].tolist() == [True, False, True, True, True]  # position 4: the sink, its 2 recent and itself
    windowed.fed_committed([0, 1, 2, 3, 4])
    cache = _entries(5)
    windowed.evict(cache, next_query=5)  # position 5 will see 0 (sink), 3 and 4
    assert windowed.slot_pos == [0, 3, 4] and cache.layers[0].keys[0, 0, :, 0].tolist() == [0, 3, 4]


def _entries(n: int):
    """A one-layer slot cache (cache.py) of n entries whose keys and values hold their slot number."""
    cache = kv.Cache(layers=[kv.SlotLayer()])
    values = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    cache.update(values.clone(), values.clone(), 0)
    return cache
