"""Sliding-window attention models (Mistral, Starcoder2, Qwen2, Gemma 2/3, Cohere 2), decoded exactly.

Tiny random models with a *small* window (4-16 tokens), so that generations of 64+ tokens cross
it many times: every method's greedy tokens equal transformers' own greedy generate() (which
keeps a rolling sliding-window cache), the caches after every iteration equal plain decoding's,
the load-time probe refuses a model whose masks ignore the window, sampling keeps the target's
distribution, and the KV window (`--kv-window`) combines with the model's own window.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import (DEVICE, EOS, SAMPLING as CONFIG, VOCAB, add_noise, assert_same_cache, chi_square_pvalue, examples, hf_greedy,
                     plain_cache, random_head, tokenizer)
from dynatree import Decoder, api, make_config
from dynatree import cache as kv
from dynatree.attention import use_gqa_attention
from dynatree.drafters import LMDrafter
from dynatree.errors import DynaTreeError
from dynatree.featurehead import FeatureHead
from dynatree.kernels import use_packed_linears
from dynatree.methods import METHODS
from dynatree.probe import check_tree_exact
from dynatree.decode import sliding_eviction
from dynatree.runtime import LoadedModel
from dynatree.sampling import Sampler, target_probs
from dynatree.tree import additive_mask
from dynatree.window import KVWindow

_DIMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, initializer_range=0.3)
# model type -> the config fields that give it sliding-window layers (a window is added per test)
SLIDING = {
    "mistral": _DIMS,  # every layer slides, one mask for all
    "starcoder2": _DIMS,
    "qwen2": dict(_DIMS, use_sliding_window=True, max_window_layers=2),  # layers 2+ slide
    "gemma2": dict(_DIMS, head_dim=8),  # alternating sliding and full layers
    "gemma3_text": dict(_DIMS, head_dim=8, layer_types=["sliding_attention", "sliding_attention",
                                                        "sliding_attention", "full_attention"]),
    "cohere2": _DIMS,  # three sliding layers, then a full one
}
METHODS_TESTED = ("ar", "linear", "fixed-tree", "dynatree", "specinfer", "wetap", "specexec", "opt-tree", "dsbd",
                  "mtad")


@functools.cache
def model(kind: str, window: int, seed: int = 0) -> LoadedModel:
    config = AutoConfig.for_model(kind, vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                                  sliding_window=window, **SLIDING[kind])
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config).to(torch.float64).eval().to(DEVICE)
    use_gqa_attention(m)  # as load_model does
    use_packed_linears(m)
    return LoadedModel(model=m, tokenizer=tokenizer(), name=f"tiny-{kind}-w{window}-{seed}", eos_ids=[])


@functools.cache
def near(kind: str, window: int) -> LoadedModel:
    """model(kind, window) with noise on its weights: a draft that agrees often, but not always."""
    base = model(kind, window)
    m = AutoModelForCausalLM.from_config(base.model.config).to(torch.float64).eval().to(DEVICE)
    m.load_state_dict(base.model.state_dict())
    add_noise(m, 0.08, 11)
    use_gqa_attention(m)
    use_packed_linears(m)
    return LoadedModel(model=m, tokenizer=tokenizer(), name=f"near-{kind}-w{window}", eos_ids=[])


@functools.cache
def head(kind: str, window: int) -> FeatureHead:
    """A random feature head for model(kind, window): an EAGLE-style drafter over its hidden states."""
    return random_head(f"tiny-{kind}", f"head-{kind}", 7)


@functools.cache
def reference(kind: str, window: int, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy(model(kind, window), list(prompt), n)


@pytest.mark.parametrize("kind", sorted(SLIDING))
def test_the_layout_names_the_window_and_the_sliding_layers(kind):
    layout = model(kind, 8).layout
    assert layout.window == 8
    types = getattr(model(kind, 8).model.config, "layer_types", None)
    if kind in ("mistral", "starcoder2"):
        assert layout.layer_types is None  # one mask for every layer
    else:
        assert layout.layer_types == tuple(types) and {"full_attention", "sliding_attention"} <= set(types)


@pytest.mark.parametrize("kind", sorted(SLIDING))
def test_every_method_equals_transformers_greedy_across_many_windows(kind):
    target = model(kind, 8)
    check_tree_exact(target)  # the probe's prompt crosses the window
    draft = model(kind, 8, seed=1)
    prompt = (5, 9, 11, 5, 9, 11, 5, 30, 31, 44)
    for method in METHODS_TESTED:
        for drafter in ([None] if method == "ar" else [draft, "ngram", head(kind, 8)]):
            got = api.generate(method=method, target=target, draft=drafter, prompt_ids=list(prompt), max_new_tokens=64,
                               ignore_eos=True)
            assert got.new_token_ids == reference(kind, 8, prompt, 64), (kind, method, drafter)
    for method in METHODS_TESTED[1:]:  # a draft that agrees often: accepted paths cross the window too
        options = {"tau": 0.0} if method == "fixed-tree" else {}  # (its default prunes this flat draft's nodes)
        got = api.generate(method=method, target=target, draft=near(kind, 8), prompt_ids=list(prompt),
                           max_new_tokens=64, ignore_eos=True, **options)
        assert got.new_token_ids == reference(kind, 8, prompt, 64), (kind, method)
        assert got.stats.accepted_tokens > 0, (kind, method)
    for method in ("hf-ar", "hf-lookup"):  # transformers' own decoding, for the record
        got = api.generate(method=method, target=target, prompt_ids=list(prompt), max_new_tokens=64, ignore_eos=True)
        assert got.new_token_ids == reference(kind, 8, prompt, 64), (kind, method)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(SLIDING))
def test_greedy_exactness_over_prompts_lengths_and_windows(kind):
    @settings(max_examples=examples(40), deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(prompt=st.lists(st.sampled_from([5, 9, 11, 30, 31, 44]), min_size=1, max_size=20),
           n=st.integers(1, 70), window=st.sampled_from([4, 8, 16]), method=st.sampled_from(METHODS_TESTED),
           drafter=st.sampled_from(["lm", "ngram", "hybrid"]))
    def check(prompt, n, window, method, drafter):
        draft = {"lm": model(kind, window, seed=1), "ngram": "ngram",
                 "hybrid": api.Hybrid(model(kind, window, seed=1))}[drafter]
        got = api.generate(method=method, target=model(kind, window), draft=None if method == "ar" else draft,
                           prompt_ids=prompt, max_new_tokens=n, ignore_eos=True)
        assert got.new_token_ids == reference(kind, window, tuple(prompt), n), (kind, window, method, drafter)

    check()


@pytest.mark.parametrize("kind", sorted(SLIDING))
@pytest.mark.parametrize("method, options", [
    ("fixed-tree", {"depth": 4, "branch": 3, "tau": 0.0, "n_max": 30}),
    ("dynatree", {"d0": 2, "d_max": 5, "tau": 0.0, "rho_stop": 0.001, "rho_deep": 0.01}),
])
def test_target_and_draft_caches_match_plain_decoding_after_every_iteration(kind, method, options):
    target, draft = model(kind, 4), near(kind, 4)  # a draft that agrees often: accepted paths are compacted
    drafter = LMDrafter(draft, target.vocab_size)
    decoder = Decoder(target, METHODS[method].policy_cls(make_config(method, **options)), drafter)
    # Gemma's eager attention takes its softmax in float32 whatever the model's dtype, so a tree step
    # and a one-token step (another number of masked keys) round differently there: float32's tolerance
    tol = 1e-5 if kind.startswith("gemma") else 1e-9
    steps, accepted = 0, 0
    for step in decoder.steps([7, 8, 9, 7, 8], max_new_tokens=40, ignore_eos=True):
        accepted += len(step.path)
        run = decoder.run
        plain = plain_cache(target.model, run.seq[:-1])  # all but the new root
        if target.layout.layer_types is None:  # every layer slides: the cache keeps the W - 1 = 3 keys the next query sees
            assert run.slot_pos.tolist() == list(range(len(run.seq) - 4, len(run.seq) - 1))
            assert_entries(run.cache, plain, run.slot_pos, tol)
        else:  # full-attention layers need every entry
            assert_same_cache(run.cache, plain, tol)
        assert_same_cache(drafter.cache, plain_cache(draft.model, run.seq[: drafter.n_cached]), tol)
        steps += 1
    assert steps > 1 and len(decoder.run.seq) - 5 == 40
    assert accepted > 0, "the noisy draft should get some tokens accepted, or the compaction goes untested"


def assert_entries(cache, plain, positions: torch.Tensor, tol: float) -> None:
    """`cache` holds exactly the entries plain decoding has at `positions`."""
    assert kv.length(cache) == len(positions)
    for a, e in zip(cache.layers, plain.layers):
        torch.testing.assert_close(a.keys, e.keys[..., positions, :], rtol=tol, atol=tol)
        torch.testing.assert_close(a.values, e.values[..., positions, :], rtol=tol, atol=tol)


def test_the_probe_refuses_masks_that_ignore_the_window(monkeypatch):
    """A tree step that lets nodes see keys beyond the window (the full mask) is caught at load."""
    target = model("gemma2", 8)
    check_tree_exact(target)
    monkeypatch.setattr(LoadedModel, "masks", lambda self, allowed, q, k: additive_mask(allowed, self.dtype, self.device))
    with pytest.raises(DynaTreeError, match="does not follow the tree mask"):
        check_tree_exact(target)


def test_windows_beyond_the_probe_are_not_probed_past_but_still_masked():
    """A 4096-token window (Mistral's) is not crossed by the probe's short prompt; decoding inside it
    is plain causal attention, which the probe does check."""
    target = model("mistral", 4096)
    check_tree_exact(target)
    prompt = (5, 9, 11, 5, 9, 11)
    got = api.generate(method="dynatree", target=target, draft="ngram", prompt_ids=list(prompt), max_new_tokens=20,
                       ignore_eos=True)
    assert got.new_token_ids == reference("mistral", 4096, prompt, 20)


def windowed_sliding_reference(kind: str, window: int, prompt: tuple[int, ...], n: int, sink: int, recent: int):
    """Greedy decoding with both windows, independent of the engine: every step the whole sequence
    without a cache, each position t seeing [0, sink) and [t - recent, t] (the KV window) and, in the
    sliding layers, only (t - window, t]."""
    m = model(kind, window)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            pos = torch.arange(len(seq), device=m.device)
            kv_window = (pos[None, :] <= pos[:, None]) & ((pos[None, :] < sink) | (pos[None, :] >= pos[:, None] - recent))
            sliding = additive_mask(kv_window & (pos[:, None] - pos[None, :] < window), torch.float64, m.device)
            types = set(getattr(m.model.config, "layer_types", None) or ["sliding_attention"])
            mask = sliding if types == {"sliding_attention"} else {
                "full_attention": additive_mask(kv_window, torch.float64, m.device), "sliding_attention": sliding}
            logits = m.model(torch.tensor([seq], device=m.device), attention_mask=mask, position_ids=pos[None]).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("kind", ["mistral", "cohere2"])
def test_the_kv_window_combines_with_the_model_window(kind):
    """--kv-window SINK,RECENT bounds the cache; the model's own window still hides what it hides:
    a key is seen only where both let it be."""
    prompt = (5, 9, 11, 5, 9, 11, 5, 30)
    want = windowed_sliding_reference(kind, 8, prompt, 40, sink=2, recent=5)
    assert want != reference(kind, 8, prompt, 40)  # the KV window changes the output here: the test has teeth
    for method, draft in [("ar", None), ("dynatree", "ngram"), ("fixed-tree", model(kind, 8, seed=1))]:
        got = api.generate(method=method, target=model(kind, 8), draft=draft, prompt_ids=list(prompt),
                           max_new_tokens=40, ignore_eos=True, kv_window="2,5")
        assert got.new_token_ids == want, (kind, method)


@pytest.mark.slow
def test_compiled_sliding_window_decoding_equals_plain_greedy():
    for kind in ("mistral", "gemma2", "gemma3_text"):
        prompt = [5, 9, 11, 5, 9, 11, 5, 30]
        got = api.generate(method="dynatree", target=model(kind, 8), draft=near(kind, 8), prompt_ids=prompt,
                           max_new_tokens=40, ignore_eos=True, compile=True)
        assert got.new_token_ids == reference(kind, 8, tuple(prompt), 40)
        # trees were verified compiled (paths accepted), and crossing the window built no graph inside the timings
        assert got.stats.graphs_compiled_while_timed == 0 and got.stats.accepted_tokens > 0


@pytest.mark.slow
def test_compiled_decoding_with_both_windows_equals_the_windowed_reference():
    """--compile with --kv-window on a sliding model: the same tokens as the eager engine's reference."""
    prompt = (5, 9, 11, 5, 9, 11, 5, 30)
    want = windowed_sliding_reference("mistral", 8, prompt, 40, sink=2, recent=5)
    got = api.generate(method="dynatree", target=model("mistral", 8), draft="ngram", prompt_ids=list(prompt),
                       max_new_tokens=40, ignore_eos=True, kv_window="2,5", compile=True)
    assert got.new_token_ids == want
    assert got.stats.graphs_compiled_while_timed == 0


V = 6
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # longer than the window: the sliding layers drop its start


@functools.cache
def small(seed: int, noise: float = 0.0, kind: str = "mistral") -> LoadedModel:
    """A 6-token model with a 3-token window; "gemma2": one sliding and one full layer (a mask per layer type)."""
    torch.manual_seed(seed)
    layers = {"mistral": dict(num_hidden_layers=1), "gemma2": dict(num_hidden_layers=2, head_dim=8)}[kind]
    config = AutoConfig.for_model(kind, vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5,
                                  sliding_window=3, bos_token_id=0, eos_token_id=0, pad_token_id=0, **layers)
    m = AutoModelForCausalLM.from_config(config).double().eval().to(DEVICE)
    if noise:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    return LoadedModel(model=m, tokenizer=tokenizer(V), name=f"small-{kind}-{seed}-{noise}", eos_ids=[])


@pytest.mark.slow
@pytest.mark.parametrize("kind, method, options", [
    ("mistral", "dynatree", {"d0": 1, "d_max": 2, "tau": 0.0, "rho_stop": 0.01, "rho_deep": 0.02}),
    ("mistral", "specinfer", {"width": 2, "depth": 2}),
    ("gemma2", "dynatree", {"d0": 1, "d_max": 2, "tau": 0.0, "rho_stop": 0.01, "rho_deep": 0.02}),
    ("gemma2", "dsbd", {"width": 3, "depth": 2}),
])
def test_sampling_keeps_the_sliding_target_distribution(kind, method, options):
    target, runs = small(0, kind=kind), 2000
    assert (target.layout.layer_types is not None) is (kind == "gemma2")  # gemma2: one mask per layer type
    with torch.no_grad():
        expected = {}
        for ys in itertools.product(range(V), repeat=3):
            prob = 1.0
            for i in range(3):
                logits = target.model(torch.tensor([PROMPT + list(ys[:i])], device=target.device)).logits[0, -1:]
                prob *= float(target_probs(logits, CONFIG)[0, ys[i]])
            expected[ys] = prob
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        policy = METHODS[method].policy_cls(make_config(method, **options))
        run = Decoder(target, policy, LMDrafter(small(0, 0.3, kind), vocab_limit=V),
                      sampler=Sampler(CONFIG, seed)).generate(PROMPT, 3, ignore_eos=True)
        counts[tuple(run.new_tokens)] = counts.get(tuple(run.new_tokens), 0) + 1
    assert chi_square_pvalue(counts, expected, runs) > 1e-3, method


def test_a_model_whose_layers_all_slide_but_name_their_types_gets_one_mask_and_evicts():
    """Gemma 3 with only sliding layers: one mask for every layer (no dict), and the cache is evicted
    to the W - 1 keys the next query sees, as for Mistral; the tokens stay transformers'."""
    config = AutoConfig.for_model("gemma3_text", vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0,
                                  sliding_window=4, **dict(_DIMS, head_dim=8, layer_types=["sliding_attention"] * 4))
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config).to(torch.float64).eval().to(DEVICE)
    target = LoadedModel(model=m, tokenizer=tokenizer(), name="tiny-gemma3-all-sliding", eos_ids=[])
    assert target.layout.window == 4 and target.layout.layer_types is None
    assert sliding_eviction(target) == KVWindow(0, 3)
    check_tree_exact(target)
    prompt = [5, 9, 11, 5, 9, 11, 5, 30]
    want = hf_greedy(target, prompt, 40)
    decoder = Decoder(target, METHODS["dynatree"].policy_cls(make_config("dynatree")), LMDrafter(model("gemma2", 4, 1), VOCAB))
    assert decoder.generate(prompt, 40, ignore_eos=True).new_tokens == want
    assert kv.length(decoder.run.cache) <= 3  # the evicted cache: what the next query can see
    for method, draft in [("ar", None), ("dynatree", "ngram"), ("linear", target)]:
        got = api.generate(method=method, target=target, draft=draft, prompt_ids=prompt, max_new_tokens=40,
                           ignore_eos=True)
        assert got.new_token_ids == want, method


def test_a_window_only_in_the_cache_layers_is_read_from_transformers_own_cache():
    """What slides is what transformers' DynamicCache for the config says (kv.attention_layout)."""
    layout = kv.attention_layout(model("qwen2", 8).model)
    assert layout.window == 8 and layout.layer_types[:2] == ("full_attention", "full_attention")
    plain = AutoConfig.for_model("qwen2", **dict(_DIMS, use_sliding_window=False, sliding_window=8), vocab_size=VOCAB)
    assert kv.attention_layout(AutoModelForCausalLM.from_config(plain)).window is None  # the window is not used
