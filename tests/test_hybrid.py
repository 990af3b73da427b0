"""The hybrid drafter (`--draft ngram+MODEL`): n-gram candidates where the context repeats a
seen n-gram, the draft LM's elsewhere; exact decoding; the API, CLI and bench plumbing."""

from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, noisy_copy, tiny
from dynatree import DynaTreeError, Decoder, api, draftspec, make_config
from dynatree import cache as kv
from dynatree.bench import presets, report, runner
from dynatree.cli import main
from dynatree.drafters import HybridDrafter, LMDrafter, NgramDrafter
from dynatree.draftload import load_draft, load_draft_model
from dynatree.methods import METHODS
from dynatree.tree import TreeBuilder


class CountingLM(LMDrafter):
    """An LM drafter that records the nodes it is asked about."""

    def propose(self, tree, nodes, k, full=False):
        self.asked.append(list(nodes))
        return super().propose(tree, nodes, k, full)


def _hybrid(min_match=2):
    target = tiny("llama", eos_ids=[])
    lm = CountingLM(noisy_copy("llama", 0, 0.08), vocab_limit=target.vocab_size)
    lm.asked = []
    return target, lm, HybridDrafter(NgramDrafter(max_n=3), lm, min_match=min_match)


def test_a_repeated_context_is_drafted_by_ngram_alone():
    _, lm, hybrid = _hybrid()
    hybrid.reset([5, 6, 7, 8, 5, 6])  # the root's context ends in "5 6", seen before and followed by 7
    tree = TreeBuilder(6)
    proposal = hybrid.propose(tree, [0], k=2)
    assert proposal.candidates(0)[0][0] == 7
    assert lm.asked == [] and hybrid.lm_calls == 0
    child = tree.add(0, 7, proposal.probs[0, 0].item())  # "5 6 7" continues with 8: still a match
    assert hybrid.propose(tree, [child], k=2).candidates(0)[0][0] == 8
    assert lm.asked == []


def test_an_unseen_context_asks_the_lm_and_gets_its_answer():
    _, lm, hybrid = _hybrid()
    hybrid.reset([5, 6, 7, 8, 40])  # "40" never continued before: no n-gram match at the root
    tree = TreeBuilder(40)
    proposal = hybrid.propose(tree, [0], k=3)
    assert lm.asked == [[0]] and hybrid.lm_calls == 1

    alone = LMDrafter(noisy_copy("llama", 0, 0.08), vocab_limit=lm.vocab_limit)
    alone.reset([5, 6, 7, 8, 40])
    expected = alone.propose(TreeBuilder(40), [0], k=3)
    assert torch.equal(proposal.ids, expected.ids) and torch.allclose(proposal.probs, expected.probs)

    # next level: a node continuing a seen n-gram goes to the n-gram, the other to the LM
    seen = tree.add(0, 5, 0.5)   # "40 5": order-1 match only ("5" -> 6) < min_match 2 -> LM
    other = tree.add(0, 41, 0.3)  # "40 41": no match -> LM
    hybrid.propose(tree, [seen, other], k=2)
    assert lm.asked[-1] == [seen, other]


def test_the_hybrid_marks_which_rows_its_model_answered():
    _, lm, hybrid = _hybrid()
    hybrid.reset([5, 6, 7, 8, 40, 5, 6])  # "5 6" seen before (-> 7): the root is copied
    tree = TreeBuilder(6)
    copied = hybrid.propose(tree, [0], k=2)
    assert copied.forwards == 0 and not copied.by_model(0)
    hybrid.reset([5, 6, 7, 8, 40])  # "40" unseen: the LM answers the root
    tree = TreeBuilder(40)
    asked = hybrid.propose(tree, [0], k=2)
    assert asked.forwards == 1 and asked.by_model(0)
    seen = tree.add(0, 7, 0.5, asked.by_model(0))  # "40 7": unseen (LM); "7 8" below it would be copied
    nxt = tree.add(0, 6, 0.4, asked.by_model(0))  # "40 6": unseen -> LM
    level = hybrid.propose(tree, [seen, nxt], k=2)
    assert [level.by_model(0), level.by_model(1)] == [True, True]
    below = tree.add(seen, 8, 0.5, level.by_model(0))  # "7 8" seen, "40 7 8": order 2 "7 8" -> 40: copied
    mixed = tree.add(nxt, 99, 0.5, level.by_model(1))  # "6 99": unseen -> LM
    last = hybrid.propose(tree, [below, mixed], k=2)
    assert [last.by_model(0), last.by_model(1)] == [False, True] and last.forwards == 1
    assert tree.modelled == [False, True, True, True, True]  # the root is no one's proposal


def test_a_node_below_an_ngram_drafted_node_never_reaches_the_lm():
    _, lm, hybrid = _hybrid(min_match=1)
    hybrid.reset([5, 6, 7, 9, 9, 5])  # root context "... 9 5": order-2 "9 5" unseen, order 1 "5" -> 6: n-gram
    tree = TreeBuilder(5)
    hybrid.propose(tree, [0], k=2)
    assert lm.asked == []
    child = tree.add(0, 77, 0.1)  # "5 77": no match at all, but the LM never saw the root this iteration
    proposal = hybrid.propose(tree, [child], k=2)
    assert lm.asked == [] and proposal.candidates(0) == []


def test_the_draft_lm_is_fed_the_prompt_in_reset_so_the_first_root_expansion_feeds_one_token():
    """The draft's prefill happens when the sequence starts (a cost-aware policy learns a draft forward's
    cost from each tree's drafting time: the prompt fed inside the first tree made it look dear)."""
    target = tiny("llama", eos_ids=[])
    lm = LMDrafter(noisy_copy("llama", 0, 0.08), vocab_limit=target.vocab_size)
    tokens = [5, 6, 7, 8, 9, 10, 11, 40]
    lm.reset(tokens)
    assert kv.length(lm.cache) == len(tokens) - 1 and lm.n_cached == len(tokens) - 1
    fed = []
    forward = lm.draft.forward
    lm.draft.forward = lambda cache, ids, *args, **kw: fed.append(len(ids)) or forward(cache, ids, *args, **kw)
    lm.propose(TreeBuilder(40), [0], k=2)
    assert fed == [1] and kv.length(lm.cache) == len(tokens)


def test_the_lm_catches_up_on_tokens_committed_while_the_ngram_drafted():
    _, lm, hybrid = _hybrid()
    tokens = [5, 6, 7, 8, 40]
    hybrid.reset(tokens)
    tree = TreeBuilder(40)
    hybrid.propose(tree, [0], k=2)  # no match: the LM is fed the prompt
    child = tree.add(0, 5, 0.5)
    hybrid.propose(tree, [child], k=2)
    tokens = tokens + [5, 6]  # the LM-drafted node accepted, then the target's token
    hybrid.commit(tokens, [child])
    hybrid.propose(TreeBuilder(6), [0], k=2)  # "5 6" seen: n-gram only, the LM is not fed
    tokens = tokens + [7, 8, 41]
    hybrid.commit(tokens, [])
    assert len(lm.asked) == 2
    caught_up = hybrid.propose(TreeBuilder(41), [0], k=4)  # "41" unseen: the LM, fed 7 8 41 at once
    alone = LMDrafter(noisy_copy("llama", 0, 0.08), vocab_limit=lm.vocab_limit)
    alone.reset(tokens)
    expected = alone.propose(TreeBuilder(41), [0], k=4)
    assert len(lm.asked) == 3 and torch.equal(caught_up.ids, expected.ids)
    assert torch.allclose(caught_up.probs, expected.probs, atol=1e-9)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("method, options", [
    ("dynatree", {"d0": 2, "d_max": 5}), ("linear", {"k": 4}), ("fixed-tree", {"depth": 3, "branch": 2}),
    ("dynatree", {"d0": 2, "d_max": 5, "cost_aware": True}),  # the cut and the model's idle spells
])
@pytest.mark.parametrize("min_match", [1, 2, 3])
def test_greedy_decoding_with_the_hybrid_equals_plain_decoding(arch, method, options, min_match):
    target = tiny(arch, eos_ids=[])
    lm = CountingLM(noisy_copy(arch, 0, 0.08), vocab_limit=target.vocab_size)
    lm.asked = []
    hybrid = HybridDrafter(NgramDrafter(max_n=3), lm, min_match=min_match)
    policy = METHODS[method].policy_cls(make_config(method, **options))
    decoder = Decoder(target, policy, hybrid)
    lm_levels = 0
    for prompt in ([5, 6, 7, 5, 6, 7, 5], [40, 41, 90, 3], [9] * 6):
        lm.asked = []
        run = decoder.generate(prompt, 30, ignore_eos=True)
        assert run.new_tokens == hf_greedy(target, prompt, 30), (prompt, min_match)
        assert hybrid.lm_calls == len(lm.asked)
        lm_levels += len(lm.asked)
    assert lm_levels > 0  # the LM drafted some levels, the n-gram others (with caches caught up in between)


def test_min_match_must_be_an_order_the_ngram_drafter_has():
    _, lm, _ = _hybrid()
    with pytest.raises(ValueError, match="min_match"):
        HybridDrafter(NgramDrafter(max_n=3), lm, min_match=4)


def test_api_and_cli_take_ngram_plus_a_model(saved_tiny, capsys):
    target = api.load_model(str(saved_tiny))
    prompt = [5, 6, 7, 5, 6, 7, 5, 30]
    for draft in (f"ngram+{saved_tiny}", api.Hybrid(target), load_draft(f"ngram+{saved_tiny}", target)):
        rec = api.generate(method="dynatree", target=target, draft=draft, prompt_ids=prompt, max_new_tokens=12,
                           ignore_eos=True)
        assert rec.draft.startswith("ngram+") and rec.new_token_ids == hf_greedy(target, prompt, 12)
        assert rec.run.ngram_max == 4
    with pytest.raises(DynaTreeError, match="needs a draft model after"):
        api.generate(method="dynatree", target=target, draft="ngram+", prompt_ids=prompt, max_new_tokens=2)
    with pytest.raises(DynaTreeError, match="needs a draft model after"):
        load_draft("ngram+ngram", target)
    with pytest.raises(DynaTreeError, match="draft language model alone"):
        api.generate(method="hf-assisted", target=target, draft=api.Hybrid(target), prompt_ids=prompt, max_new_tokens=2)

    argv = ["generate", "w5 w6 w7 w5 w6", "--target", str(saved_tiny), "--draft", f"ngram+{saved_tiny}",
            "--max-new-tokens", "6", "--ignore-eos", "--json"]
    assert main(argv) == 0
    assert '"draft": "ngram+' in capsys.readouterr().out


def test_bench_runs_the_hybrid_beside_its_lm_and_reports_it_with_that_draft(tmp_path, prompt_file):
    target = tiny("llama", eos_ids=[])
    drafts = ["ngram", "tiny-draft", "ngram+tiny-draft"]
    variants = presets.variants("draft", "small", drafts)
    assert {v.label for v in variants} == {
        "ar", "linear[ngram]", "linear[tiny-draft]", "linear[ngram+tiny-draft]", "dynatree[ngram]",
        "dynatree[tiny-draft]", "dynatree[ngram+tiny-draft]", "hf-lookup", "hf-assisted",
        *(f"dynatree[{d}] +cost-aware" for d in drafts)}
    assert next(v for v in variants if v.method == "hf-assisted").draft == "tiny-draft"
    with pytest.raises(DynaTreeError, match="alone"):
        runner.check_variants([runner.Variant("ar", "ar"), runner.Variant("a", "hf-assisted", {}, "ngram+tiny-draft")])

    lms = {"tiny-draft": target, "ngram+tiny-draft": api.Hybrid(target)}
    assert runner.draft_lms({spec: load_draft(d, target) for spec, d in lms.items()}) == {"tiny-draft": target}
    proto = runner.Protocol(dataset=str(prompt_file), n=2, warmup=1, max_new_tokens=[8])
    res = runner.run("draft", variants, proto, target, lms, out_dir=tmp_path, progress=False)
    assert all(r["matches_ar"] for r in res["records"])
    assert [q["draft"] for q in res["draft_quality"]] == ["tiny-draft", "tiny-draft"]  # measured once per prompt
    section = report.draft_section(res, 8, 800)
    assert "| dynatree[ngram+tiny-draft] |" in section and "| dynatree[tiny-draft] |" in section
    assert "| dynatree[ngram+tiny-draft] +cost-aware |" in section
    # one measured prompt: a sample deviation of one value is undefined, so none is shown (issue 37)
    md = report.render(res)
    assert "(1 prompt)" in md and not [line for line in md.splitlines() if "± " in line and "values: mean ±" not in line], md


@pytest.mark.parametrize("spec, ngram, model", [
    (None, True, None), ("auto", True, None), ("ngram", True, None), ("ngram+d", True, "d"), ("d", False, "d"),
])
def test_one_parser_reads_every_draft_spec(spec, ngram, model):
    parsed = draftspec.parse(spec)
    assert (parsed.ngram, parsed.model, parsed.model_alone) == (ngram, model, model is not None and not ngram)


@pytest.mark.parametrize("spec, message", [("", "is empty"), ("  ", "is empty"), ("ngram+", "needs a draft model"),
                                           ("ngram+ngram", "needs a draft model"), ("ngram+ngram+d", "takes one draft model"),
                                           (3, "draft must be a spec string")])
def test_bad_draft_specs_are_named(spec, message):
    with pytest.raises(DynaTreeError, match=message):
        draftspec.parse(spec)


def test_cost_aware_hybrid_declines_a_dear_model_but_keeps_copying():
    """A draft model that costs 25 target steps per call never pays: cost-aware DynaTree stops
    asking it (idle spells, a probe now and then) but goes on drafting from the n-gram part, and
    the output stays plain greedy decoding."""
    import time

    from dynatree.costmeasure import _CURVES
    from dynatree.costmodel import CostCurve

    class DearLM(CountingLM):
        def propose(self, tree, nodes, k, full=False):
            time.sleep(0.05)
            return super().propose(tree, nodes, k, full)

    target = tiny("llama", eos_ids=[])
    lm = DearLM(noisy_copy("llama", 0, 0.08), vocab_limit=target.vocab_size)
    lm.asked = []
    hybrid = HybridDrafter(NgramDrafter(max_n=3), lm)
    policy = METHODS["dynatree"].policy_cls(make_config("dynatree", cost_aware=True, history=False))
    prompt = [5, 6, 7, 8, 9, 10] * 3 + [40]
    _CURVES[target.model] = {(False, False): CostCurve((1, 2, 9), (0.002, 0.0021, 0.003))}
    try:
        run = Decoder(target, policy, hybrid).generate(prompt, 60, ignore_eos=True)
    finally:
        del _CURVES[target.model]
    assert run.new_tokens == hf_greedy(target, prompt, 60)
    state = policy.state()
    assert state["idle_iterations"] > run.stats.iterations / 2 and state["draft_forward_ms"] > 40
    assert len(lm.asked) < run.stats.iterations / 4  # probes only
    assert run.stats.accepted_tokens > 0 and hybrid.ngram  # the copying went on


def test_a_draft_is_loaded_once_checked_against_its_target_and_named_as_its_spec(saved_tiny):
    """draftload.load_draft is the one path from a --draft value to a checked Draft: a Draft built
    once is reused as it is for its target, and checked again for another target."""
    target = api.load_model(str(saved_tiny))
    assert load_draft(None, target).name == load_draft("auto", target).name == "ngram"
    hybrid = load_draft(f"ngram+{saved_tiny}", target)
    assert hybrid.ngram and hybrid.name == f"ngram+{target.name}" and not hybrid.model_alone
    alone = load_draft(target, target)
    assert alone.model is target and alone.model_alone and load_draft(alone, target) is alone
    prompt = [5, 6, 7, 5, 6, 7, 5, 30]
    for draft in (hybrid, alone):
        rec = api.generate(method="linear", target=target, draft=draft, prompt_ids=prompt, max_new_tokens=8,
                           ignore_eos=True)
        assert rec.draft == draft.name and rec.new_token_ids == hf_greedy(target, prompt, 8)
    with pytest.raises(DynaTreeError, match="draft language model alone"):
        api.generate(method="hf-assisted", target=target, draft=hybrid, prompt_ids=prompt, max_new_tokens=2)
    other = tiny("llama", vocab=40)  # another tokenizer: the Draft is checked again for it
    with pytest.raises(DynaTreeError, match="different vocabularies"):
        load_draft(alone, other)
    with pytest.raises(DynaTreeError, match="draft model spec"):
        load_draft_model("ngram", target)


def test_the_bench_refuses_a_draft_that_is_not_what_its_spec_says(prompt_file):
    """runner.run's `drafts` map a --draft spec to its Draft or loaded model; a value that contradicts
    its spec is a one-line error, never relabelled (a model under 'ngram' would run as a hybrid)."""
    target = tiny("llama", eos_ids=[])
    variants = presets.method_variants(["ar", "linear"], ["ngram"])
    proto = runner.Protocol(dataset=str(prompt_file), n=1, warmup=0, max_new_tokens=[4])
    for drafts, message in [({"ngram": target}, "must be a Draft or the draft model"),
                            ({"tiny-draft": "tiny-draft"}, "must be a Draft or the draft model"),
                            ({"tiny-draft": api.Hybrid(target)}, "must be a Draft or the draft model"),
                            ({"tiny-draft": load_draft(api.Hybrid(target), target)}, "drafts as 'ngram\\+"),
                            ({"ngram": load_draft(target, target)}, "not as that spec says")]:
        with pytest.raises(DynaTreeError, match=message):
            runner.run("custom", variants, proto, target, drafts, progress=False)
