"""transformers' own methods, wrapped: same tokens as ours, statistics that add up."""

from __future__ import annotations

import pytest

from helpers import ARCHS, hf_greedy, noisy_copy, tiny
from dynatree import DynaTreeError, generate
from dynatree.bench import draftcheck, report, results, runner
from dynatree.draftspec import Hybrid
from dynatree.runtime import LoadedModel


@pytest.mark.parametrize("arch", ARCHS)
def test_peers_match_ar_and_report_stats(arch):
    target = tiny(arch, eos_ids=[])
    prompt = [5, 6, 7, 5, 6, 7, 5]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)
    draft = noisy_copy(arch, 0, 0.08)  # a copy made before the hook below, so it does not carry it
    passes = []  # tokens each target pass received, seen from outside
    target.model.register_forward_pre_hook(
        lambda module, args, kwargs: passes.append((kwargs.get("input_ids") if kwargs.get("input_ids") is not None
                                                    else args[0]).shape[1]), with_kwargs=True)
    for method, draft in [("hf-ar", None), ("hf-lookup", None), ("hf-assisted", draft)]:
        passes.clear()
        rec = generate(method=method, target=target, draft=draft, prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)
        assert rec.new_token_ids == ar.new_token_ids, method
        s = rec.stats
        # M as ours: tokens per verification pass, a first pass that verified drafts counting as one
        verified = passes[0] > len(prompt)
        assert s.mean_generated_len == pytest.approx(30 / s.iterations if verified else 29 / (s.iterations - 1))
        assert s.new_tokens == 30
        assert 1 <= s.iterations <= 30
        assert s.new_tokens == s.iterations + s.accepted_tokens
        assert s.acceptance_rate is None or 0 <= s.acceptance_rate <= 1
        assert 0 < s.ttft_s <= s.wall_s
        if method == "hf-ar":
            assert s.iterations == 30 and s.drafted_tokens == 0
        if method == "hf-assisted":
            assert s.accepted_tokens > 0 and s.iterations < 30


def test_peer_stops_at_eos_like_ours():
    target = tiny("llama", eos_ids=[])
    prompt = [9, 10, 11, 9, 10]
    full = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=30, ignore_eos=True).new_token_ids
    eos = full[7]
    stopped = tiny("llama", eos_ids=[eos])
    for method in ("ar", "hf-ar", "hf-lookup", "dynatree"):
        rec = generate(method=method, target=stopped, prompt_ids=prompt, max_new_tokens=30)
        assert rec.new_token_ids == full[: full.index(eos) + 1], method


def _lm(vocab: int, seed: int = 1) -> LoadedModel:
    """A tiny Llama draft with the shared 96-token tokenizer but an embedding of `vocab` rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers import DEVICE, config, tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config("llama", vocab=vocab)).to(torch.float64).eval().to(DEVICE)
    return LoadedModel(model=model, tokenizer=tokenizer(), name=f"draft-{vocab}-rows", eos_ids=[2])


def _resized(target: LoadedModel, vocab: int) -> LoadedModel:
    """The target's own weights with its embedding and output layer cut or padded to `vocab` rows (new
    rows initialized by transformers): a draft of another width that agrees with the target wherever
    the target's pick is among the rows they share."""
    import copy

    import torch

    model = copy.deepcopy(target.model)
    with torch.random.fork_rng():  # the new rows' initial values, without moving the global generator
        torch.manual_seed(3)
        model.resize_token_embeddings(vocab)
    return LoadedModel(model=model, tokenizer=target.tokenizer, name=f"resized-{vocab}-rows", eos_ids=[2])


def test_a_draft_with_a_padded_output_layer_runs_everywhere():
    """Model families pad their output layers differently (49280 vs 49152 rows with one tokenizer):
    dynatree's methods draft with it, and hf-assisted runs transformers' universal assisted decoding
    (greedy) instead of raising its 'different tokenizers' ValueError."""
    target, padded = tiny("llama", eos_ids=[]), _lm(128)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=20, ignore_eos=True)
    for method in ("hf-assisted", "dynatree", "linear", "fixed-tree"):
        rec = generate(method=method, target=target, draft=padded, prompt_ids=prompt, max_new_tokens=20, ignore_eos=True)
        assert rec.new_token_ids == ar.new_token_ids, method
        assert rec.run.hf_universal_assisted is (method == "hf-assisted")
    for method in ("dynatree", "specinfer"):  # sampled, the draft's extra rows are never proposed
        rec = generate(method=method, target=target, draft=padded, prompt_ids=prompt, max_new_tokens=20, sample=True, seed=3)
        assert all(0 <= t < 96 for t in rec.new_token_ids)
    with pytest.raises(DynaTreeError, match=r"hf-assisted cannot sample with draft 'draft-128-rows': its vocabulary size \(128\) differs from the target's \(96\)"):
        generate(method="hf-assisted", target=target, draft=padded, prompt_ids=prompt, max_new_tokens=4, sample=True)


def test_the_bench_checks_and_notes_hf_assisted_with_a_padded_draft(tmp_path, prompt_file, capfd):
    """Sampled, it fails before any run (not in the middle of one); greedy, the report says transformers
    ran universal assisted decoding; transformers' own notices about its internal calls stay quiet."""
    target, padded = tiny("llama", eos_ids=[]), _lm(128)
    variants = [runner.Variant("ar", "ar"), runner.Variant("hf-assisted", "hf-assisted", {}, "padded")]
    sampled = runner.Protocol(dataset=str(prompt_file), n=2, warmup=0, max_new_tokens=[6], sample=True)
    with pytest.raises(DynaTreeError, match="hf-assisted cannot sample with draft 'draft-128-rows'.*\\(128\\).*\\(96\\)"):
        runner.run("custom", variants, sampled, target, {"padded": padded}, out_dir=tmp_path / "s", progress=False)
    assert not (tmp_path / "s" / "results.json").exists() or not results.load(tmp_path / "s")["records"]
    greedy = runner.Protocol(dataset=str(prompt_file), n=2, warmup=0, max_new_tokens=[6])
    res = runner.run("custom", variants, greedy, target, {"padded": padded}, out_dir=tmp_path / "g", progress=False)
    assert all(r["matches_ar"] for r in res["records"])
    assert "hf-assisted: the draft's vocabulary size differs from the target's, so transformers ran universal" \
        in report.render(res)
    assert "generation_config" not in capfd.readouterr().err


def test_transformers_notice_about_its_own_assistant_call_is_not_shown(capfd):
    """transformers logs (once per process) a deprecation notice about how its generate() calls the
    assistant; the caller cannot act on it, so hf_generate holds it back (and only it)."""
    import logging

    logging.Logger.warning_once.cache_clear()  # so the notice is due in this test whatever ran before
    generate(method="hf-assisted", target=tiny("llama", eos_ids=[]), draft=_lm(128), prompt_ids=[5, 6, 7],
             max_new_tokens=8, ignore_eos=True)
    assert "generation_config" not in capfd.readouterr().err


def test_draft_checks_read_padding_ids_like_the_drafter():
    """bench's agreement and step-cost checks feed a draft LM the target's ids as LMDrafter does."""
    padded = _lm(160, seed=0)
    target = LoadedModel(model=padded.model, tokenizer=padded.tokenizer, name="padded-target", eos_ids=[])
    draft = _lm(96)
    ids = [5, 6, 7, 120, 130, 8, 9, 150, 10, 11]
    m = draftcheck.measure(target, draft, ids[:4], ids[4:])
    assert 0 <= m["agreement"] <= 1 and m["draft_ms"] > 0


@pytest.mark.parametrize("target_rows, draft_rows", [(160, 96), (96, 128)])
def test_a_draft_with_fewer_or_more_output_rows_runs_every_method(target_rows, draft_rows):
    """Issue 29: a draft LM with fewer output rows than the target (as Qwen2.5-0.5B for -7B) crashed every
    method with --sample (the residual and the hybrid's distribution had the draft's width); one with
    more rows (padding) is cut to the target's width. Both: every method's greedy tokens are ar's, and
    sampling runs (its distribution: tests/test_sampling.py, drafters 'narrow' and 'wide')."""
    padded = _lm(target_rows, seed=0)
    target = LoadedModel(model=padded.model, tokenizer=padded.tokenizer, name="padded-target", eos_ids=[])
    draft, near = _lm(draft_rows), _resized(target, draft_rows)  # a random draft, and one that agrees often
    prompt = [5, 6, 7, 5, 6, 7]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=24, ignore_eos=True).new_token_ids
    assert ar == hf_greedy(target, prompt, 24)
    for method in ("linear", "dynatree", "fixed-tree", "specinfer", "specexec", "opt-tree", "wetap", "dsbd", "mtad"):
        rec = generate(prompt_ids=prompt, method=method, target=target, draft=near, max_new_tokens=24, ignore_eos=True)
        assert rec.new_token_ids == ar and rec.stats.accepted_tokens > 0, (method, rec.stats.accepted_tokens)
        for d in (draft, Hybrid(draft)):
            rec = generate(prompt_ids=prompt, method=method, target=target, draft=d, max_new_tokens=24,
                           ignore_eos=True)
            assert rec.new_token_ids == ar, (method, d)
            if draft_rows > target_rows and method not in ("dynatree", "specinfer"):
                continue  # (sampling with more draft rows: those two here, the chi-square test's 'wide' cases)
            rec = generate(prompt_ids=prompt, method=method, target=target, draft=d, max_new_tokens=24,
                           sample=True, seed=1, ignore_eos=True)
            assert len(rec.new_token_ids) == 24 and all(0 <= t < target_rows for t in rec.new_token_ids), (method, d)


def test_a_draft_lm_reads_target_ids_beyond_its_embedding_as_proposals_only():
    """A target padded beyond the tokenizer may (with random weights) commit a padding id the draft
    has no row for: the draft reads it as id 0 and output stays exact."""
    padded = _lm(160, seed=0)
    target = LoadedModel(model=padded.model, tokenizer=padded.tokenizer, name="padded-target", eos_ids=[])
    draft = _lm(96)
    prompt = [5, 6, 7, 5, 6, 7, 5]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=40, ignore_eos=True).new_token_ids
    assert any(t >= 96 for t in ar), "the test needs the target to commit a padding id"
    for method in ("dynatree", "linear"):
        rec = generate(method=method, target=target, draft=draft, prompt_ids=prompt, max_new_tokens=40, ignore_eos=True)
        assert rec.new_token_ids == ar, method


def test_a_draft_whose_embedding_does_not_cover_its_tokenizer_is_refused():
    small = _lm(40)
    for method in ("dynatree", "hf-assisted"):
        with pytest.raises(DynaTreeError, match="draft 'draft-40-rows' has 40 embedding rows but its tokenizer has 96"):
            generate(method=method, target=tiny("llama"), draft=small, prompt_ids=[5, 6, 70], max_new_tokens=4)
