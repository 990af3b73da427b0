"""The feature-head drafter (featurehead.py, drafters/feature.py): exact with every tree policy,
fed the target's own hidden states by the decoder (its cache equals one built from a plain
target pass after every iteration), and refused with one-line errors for another target."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import ARCHS, DEVICE, ON_CPU, VOCAB, fitted_head, hf_greedy, tiny, tiny_head
from dynatree import DynaTreeError, Decoder, generate, make_config
from dynatree import kernels
from dynatree.drafters import FeatureDrafter, HybridDrafter, NgramDrafter
from dynatree.featurehead import FeatureHead, check_head, load_head, output_signature
from dynatree.methods import METHODS
from dynatree.cache import length as kv_length
from dynatree.tree import TreeBuilder
from dynatree.window import KVWindow

TREE_METHODS = {"linear": {"k": 4}, "fixed-tree": {"depth": 4, "branch": 2, "tau": 0.0},
                "dynatree": {"d0": 2, "d_max": 5}, "wetap": {"depth": 3, "budget": 8, "verify": "exact"},
                "specinfer": {"width": 2, "depth": 3}, "specexec": {"budget": 8, "depth": 3},
                "opt-tree": {"budget": 8, "depth": 3}, "dsbd": {"width": 3, "depth": 3},
                "mtad": {"width": 3, "depth": 3}}
PROMPT = [5, 6, 7, 5, 6, 7, 30, 31]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", TREE_METHODS)
def test_greedy_equals_plain_decoding(arch, method):
    """With a random head (its drafts nearly all rejected) and a fitted one (many accepted: whole paths
    committed, the head then fed their features)."""
    target = tiny(arch, eos_ids=[])
    for head in (tiny_head(arch), fitted_head(arch)):
        policy = METHODS[method].policy_cls(make_config(method, **TREE_METHODS[method]))
        run = Decoder(target, policy, FeatureDrafter(head, target)).generate(PROMPT, 40, ignore_eos=True)
        assert run.new_tokens == hf_greedy(target, PROMPT, 40), head.name
        assert run.stats.drafted_tokens > 0
    assert run.stats.accepted_tokens >= 10  # the fitted head's


@torch.no_grad()
def reference_cache(head: FeatureHead, target, tokens: list[int], n_fed: int):
    """The head's cache built from scratch: positions 1..n_fed-1 fed with the target's features of a
    plain (causal, uncached) pass over `tokens` (through `reset`'s prefill, then the root's feed; that
    this equals one feed of the whole prompt is checked on its own below)."""
    hidden = target.model(torch.tensor([tokens], device=target.device), output_hidden_states=True).hidden_states[-1][0]
    drafter = FeatureDrafter(head, target)
    drafter.reset(tokens[:n_fed], hidden[: n_fed - 1])
    drafter._feed_committed()
    return drafter.cache


def test_the_head_is_fed_the_prompt_in_reset_so_the_first_root_expansion_feeds_one_position():
    """The head's prefill happens when the sequence starts, not inside the first tree: a cost-aware
    policy learns a head forward's cost from each tree's drafting time, and a long prompt fed in the
    first tree made the head look many times dearer than it is (it then declined it for most of the run)."""
    target = tiny("llama", eos_ids=[])
    head = fitted_head("llama")
    tokens = PROMPT * 3
    hidden = target.model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    drafter = FeatureDrafter(head, target)
    drafter.reset(tokens, hidden)
    assert kv_length(drafter.cache) == len(tokens) - 2 and drafter.n_fed == len(tokens) - 1
    fed = []
    run = drafter._run
    drafter._run = lambda ids, *args: fed.append(len(ids)) or run(ids, *args)
    first = drafter.propose(TreeBuilder(tokens[-1]), [0], k=3)
    assert fed == [1] and kv_length(drafter.cache) == len(tokens) - 1
    at_once = FeatureDrafter(head, target)  # the whole prompt fed in one forward, as before
    at_once.reset(tokens[:2], hidden[:1])
    at_once.tokens, at_once.features = list(tokens), hidden[at_once.n_fed - 1:]
    want = at_once.propose(TreeBuilder(tokens[-1]), [0], k=3)
    assert torch.equal(first.ids, want.ids) and torch.allclose(first.probs, want.probs, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("window", [None, KVWindow(sink=2, recent=12)])
def test_cache_equals_one_built_from_a_plain_pass_after_every_iteration(arch, window):
    """The hand-off is right: the features the decoder gives (prefill, then root + accepted path of
    each verification) are the target's own, and the tree's entries never stay in the head's cache."""
    target = tiny(arch, eos_ids=[])
    head = fitted_head(arch)  # its paths are often accepted: the hand-off of accepted features is what is checked
    drafter = FeatureDrafter(head, target)
    policy = METHODS["fixed-tree"].policy_cls(make_config("fixed-tree", depth=3, branch=2, tau=0.0))
    decoder = Decoder(target, policy, drafter)
    checked, accepted = 0, 0
    for step in decoder.steps(PROMPT, 30, ignore_eos=True):
        accepted += len(step.path)
        seq = decoder.run.seq
        assert len(drafter.features) == len(seq) - drafter.n_fed  # features of positions n_fed-1 .. len-2
        if drafter.n_fed > 1:
            ref = reference_cache(head, target, seq, drafter.n_fed)
            for mine, want in zip(drafter.cache.layers, ref.layers):
                assert mine.keys.shape == want.keys.shape
                torch.testing.assert_close(mine.keys, want.keys)
                torch.testing.assert_close(mine.values, want.values)
            checked += 1
    assert checked > 3 and accepted >= 5
    if window is not None:  # the windowed run stays exact, and the head keeps every slot its next query may see
        windowed = FeatureDrafter(head, target, window=window)
        decoder = Decoder(target, policy, windowed, window=window)
        for step in decoder.steps(PROMPT * 3, 40, ignore_eos=True):
            fed = torch.arange(1, windowed.n_fed)
            later = torch.arange(windowed.n_fed, len(decoder.run.seq))  # queries of the next root expansion
            seen = window.visible(later, fed).any(0)
            assert set(fed[seen].tolist()) <= set(windowed.slots.slot_pos)
            assert len(windowed.slots.slot_pos) <= window.sink + window.recent
        assert decoder.run.new_tokens == windowed_reference(target, window, PROMPT * 3, 40)


def windowed_reference(target, window, prompt, n):
    run = Decoder(target, METHODS["ar"].policy_cls(make_config("ar")), None, window=window).generate(
        prompt, n, ignore_eos=True)
    return run.new_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_with_a_feature_head_is_exact(arch):
    target = tiny(arch, eos_ids=[])
    drafter = HybridDrafter(NgramDrafter(max_n=3), FeatureDrafter(fitted_head(arch), target))
    assert drafter.uses_target_hidden
    policy = METHODS["dynatree"].policy_cls(make_config("dynatree", d0=2, d_max=5))
    run = Decoder(target, policy, drafter).generate(PROMPT * 2, 40, ignore_eos=True)
    assert run.new_tokens == hf_greedy(target, PROMPT * 2, 40)
    assert drafter.lm.calls > 1  # (the first is reset's prefill of the prompt)


def test_proposals_come_from_the_sub_vocabulary_with_a_full_distribution():
    target = tiny("llama")
    head = tiny_head("llama", draft_vocab=40)
    drafter = FeatureDrafter(head, target)
    hidden = target.model(torch.tensor([PROMPT], device=target.device), output_hidden_states=True).hidden_states[-1][0]
    drafter.reset(PROMPT, hidden[:-1])
    from dynatree.tree import TreeBuilder

    proposal = drafter.propose(TreeBuilder(PROMPT[-1]), [0], k=50, full=True)
    allowed = set(head.vocab_ids.tolist())
    assert proposal.ids.shape[1] == 40 and set(proposal.ids[0].tolist()) == allowed
    assert proposal.dist.shape == (1, VOCAB)
    torch.testing.assert_close(proposal.dist.sum(), torch.tensor(1.0, dtype=proposal.dist.dtype))
    outside = [t for t in range(VOCAB) if t not in allowed]
    assert float(proposal.dist[0, outside].abs().sum()) == 0.0
    assert torch.equal(proposal.dist[0, proposal.ids[0]], proposal.probs[0])


def test_save_and_load_round_trip(tmp_path):
    head = tiny_head("llama")
    head.save(tmp_path / "h", extra={"note": "test"})
    again = load_head(tmp_path / "h", device=DEVICE, dtype=torch.float64)
    assert torch.equal(again.vocab_ids, head.vocab_ids)
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.skipif(not ON_CPU or kernels.packing_available(torch.nn.Linear(2, 2)) is not None,
                    reason="no oneDNN float32 linear here")
def test_a_head_loaded_on_packed_kernels_proposes_what_the_stock_one_does(tmp_path):
    """`load_head(linear="auto")` packs the head's layers and its output rows for oneDNN (drafting
    is then 2-3x cheaper); proposals stay those of the stock kernels up to float rounding."""
    target = tiny("llama", dtype=torch.float32)
    tiny_head("llama").save(tmp_path / "h")
    stock, packed = (load_head(tmp_path / "h", dtype=torch.float32, linear=kernel) for kernel in ("stock", "auto"))
    assert kernels.linear_kernel(stock) == "stock" and kernels.linear_kernel(packed) == "onednn"
    hidden = target.model(torch.tensor([PROMPT], device=target.device), output_hidden_states=True).hidden_states[-1][0].detach()
    from dynatree.tree import TreeBuilder

    answers = []
    for head in (stock, packed):
        drafter = FeatureDrafter(head, target)
        assert isinstance(drafter.out, kernels.PackedLinear) == (head is packed)
        drafter.reset(PROMPT, hidden[:-1])
        tree = TreeBuilder(PROMPT[-1])
        first = drafter.propose(tree, [0], k=3)
        nodes = [tree.add(0, t, p) for t, p in first.candidates(0)]
        answers.append((first, drafter.propose(tree, nodes, k=3)))
    for a, b in zip(*answers):
        assert torch.equal(a.ids, b.ids)
        torch.testing.assert_close(a.probs, b.probs, rtol=1e-4, atol=1e-5)


def test_generate_api_takes_a_head_directory(tmp_path):
    target = tiny("llama", eos_ids=[])
    tiny_head("llama").save(tmp_path / "h")
    record = generate(prompt_ids=PROMPT, method="dynatree", target=target, draft=str(tmp_path / "h"),
                      max_new_tokens=20, ignore_eos=True, dtype="float64")
    assert record.new_token_ids == hf_greedy(target, PROMPT, 20)
    assert record.draft == str(tmp_path / "h")
    assert record.run.draft_linear == "stock"  # float64: oneDNN packs float32/bfloat16/float16 only
    hybrid = generate(prompt_ids=PROMPT, method="dynatree", target=target, draft="ngram+" + str(tmp_path / "h"),
                      max_new_tokens=20, ignore_eos=True, dtype="float64")
    assert hybrid.new_token_ids == record.new_token_ids


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": 64}, "reads features of width 64"),
    ({"vocab_size": 100}, "output layer of 100 rows"),
    ({"tokenizer_sha1": "0" * 40}, "another tokenizer"),
])
def test_a_head_for_another_target_is_a_one_line_error(change, message):
    head = tiny_head("llama")
    other = FeatureHead(dataclasses.replace(head.config, **change), head.vocab_ids, name="other")
    with pytest.raises(DynaTreeError, match=message) as err:
        check_head(other, tiny("llama"))
    assert "\n" not in str(err.value)


def test_a_head_for_another_model_of_the_same_shape_and_tokenizer_is_a_one_line_error(tmp_path):
    """Width, rows and tokenizer alike, weights not: the head's recorded output-layer signature
    tells the models apart; the same model in another dtype passes; a head without a signature
    (saved before it was recorded) is not checked for it."""
    target, other = tiny("llama", seed=0), tiny("llama", seed=1)
    head = tiny_head("llama")
    signed = FeatureHead(dataclasses.replace(head.config, output_signature=output_signature(target.model)),
                         head.vocab_ids, name="signed")
    check_head(signed, target)
    for dtype in (torch.float32, torch.bfloat16):  # the same model in other formats
        check_head(signed, tiny("llama", seed=0, dtype=dtype))
    with pytest.raises(DynaTreeError, match=r"^feature head 'signed' was built for 'tiny-llama-0', a model with other "
                                            r"weights than target 'tiny-llama-1' .*: train one for it with dynatree "
                                            r"distill --kind eagle$"):
        check_head(signed, other)
    check_head(head, other)  # no signature recorded
    check_head(signed, other, same_weights=False)  # a head continued on another model of its shape (--init-head)
    signed.save(tmp_path / "h")  # the signature travels with the saved head
    assert load_head(tmp_path / "h").config.output_signature == signed.config.output_signature


def test_hf_assisted_refuses_a_feature_head(tmp_path):
    tiny_head("llama").save(tmp_path / "h")
    with pytest.raises(DynaTreeError, match="drafts in dynatree's own methods only"):
        generate(prompt_ids=PROMPT, method="hf-assisted", target=tiny("llama"), draft=str(tmp_path / "h"),
                 max_new_tokens=5)


def test_an_unreadable_head_directory_is_a_one_line_error(tmp_path):
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "feature_head.json").write_text("{not json")
    with pytest.raises(DynaTreeError, match="cannot be read"):
        load_head(tmp_path / "h")


def test_a_head_whose_sub_vocabulary_disagrees_with_its_config_is_a_one_line_error(tmp_path):
    head = tiny_head("llama")
    head.save(tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "feature_head.json").read_text())
    (tmp_path / "h" / "feature_head.json").write_text(json.dumps({**raw, "draft_vocab": raw["draft_vocab"] + 16}))
    with pytest.raises(DynaTreeError, match=rf"^feature head .*: its config says {raw['draft_vocab'] + 16} sub-vocabulary "
                                            rf"rows, its vocab_ids hold \({raw['draft_vocab']},\)$"):
        load_head(tmp_path / "h")
    from safetensors.torch import load_file, save_file

    (tmp_path / "h" / "feature_head.json").write_text(json.dumps(raw))  # the right count, in a 2-D table
    state = load_file(str(tmp_path / "h" / "head.safetensors"))
    save_file({**state, "vocab_ids": state["vocab_ids"][None, :].contiguous()}, str(tmp_path / "h" / "head.safetensors"))
    with pytest.raises(DynaTreeError, match=rf"^feature head .*: its config says {raw['draft_vocab']} sub-vocabulary "
                                            rf"rows, its vocab_ids hold \(1, {raw['draft_vocab']}\)$"):
        load_head(tmp_path / "h")


def test_bench_measures_a_feature_head_and_leaves_it_out_of_hf_assisted(tmp_path, prompt_file):
    from dynatree.bench import presets, report, runner

    target = tiny("llama", eos_ids=[])
    head_path = str(tmp_path / "h")
    tiny_head("llama").save(head_path)
    variants = presets.variants("draft", "small", ["ngram", head_path])
    labels = {v.label for v in variants}
    assert f"dynatree[{head_path}]" in labels and "hf-assisted" not in labels and "hf-lookup" in labels
    from dynatree.draftload import load_draft

    head = load_draft(head_path, target).model
    proto = runner.Protocol(dataset=str(prompt_file), n=2, warmup=0, max_new_tokens=[8])
    res = runner.run("draft", variants, proto, target, {head_path: head}, out_dir=tmp_path / "run", progress=False)
    assert all(r["matches_ar"] for r in res["records"])
    quality = res["draft_quality"]
    assert len(quality) == 2 and all(0.0 <= q["agreement"] <= 1.0 and q["cost_ratio"] > 0 for q in quality)
    assert "Draft `" in report.draft_section(res, 8, 800)
    with pytest.raises(DynaTreeError, match="drafts in dynatree's own methods only"):
        presets.method_variants(["hf-assisted"], [head_path])


def test_head_agreement_is_the_share_of_target_picks_it_predicts():
    """By hand: the head fed the target's features of one teacher-forced pass, position by position."""
    from dynatree.bench.draftcheck import head_agreement
    from dynatree.tree import TreeBuilder

    target, head = tiny("llama"), tiny_head("llama")
    prompt, new = PROMPT, hf_greedy(target, PROMPT, 6)
    hits = 0
    for i in range(len(new)):
        seq = prompt + new[:i]
        hidden = target.model(torch.tensor([seq], device=target.device), output_hidden_states=True).hidden_states[-1][0]
        drafter = FeatureDrafter(head, target)
        drafter.reset(seq, hidden[:-1])
        hits += int(drafter.propose(TreeBuilder(seq[-1]), [0], k=1).ids[0, 0]) == new[i]
    assert head_agreement(target, head, prompt, new) == pytest.approx(hits / len(new))
