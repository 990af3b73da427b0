"""The datastore (`--draft ngram+STORE`): look-ups equal a brute-force count, the n-gram drafter
takes its continuations only where the text offers no long match, decoding with it stays exact,
`dynatree distill --kind store` builds one from the target's own answers, the bench loads it, and
every bad input (a store for another tokenizer, a broken or tampered directory, a store named
without the n-gram drafter, in the model's place or as a target) is a one-line error."""

from __future__ import annotations

import collections
import json
import re
import random

import numpy as np
import pytest

from helpers import VOCAB, hf_greedy, noisy_copy, tiny
from dynatree import DynaTreeError, api, draftspec
from dynatree.cli import main
from dynatree.distill.chat import chat_ids
from dynatree.datastore import Datastore, StoreInfo, from_answers, load_datastore, save_datastore
from dynatree.draftload import Draft, load_draft
from dynatree.drafters import HybridDrafter, LMDrafter, NgramDrafter
from dynatree.tree import TreeBuilder


def brute(segments: list[list[int]], context: list[int], order: int, min_order: int):
    """(n, counts) of the longest suffix of context (min_order..order tokens) followed by a token in a segment."""
    for n in range(min(order, len(context)), min_order - 1, -1):
        counts = collections.Counter()
        for seg in segments:
            for i in range(len(seg) - n):
                if seg[i: i + n] == context[-n:]:
                    counts[seg[i + n]] += 1
        if counts:
            return n, counts
    return 0, collections.Counter()


@pytest.mark.parametrize("seed", range(6))
def test_lookups_equal_a_brute_force_count(seed):
    rng = random.Random(seed)
    vocab = [7, 96, 300, 49152, 65535, 70000][seed]  # 3, 7, 9, 16, 16 and 17 bits per token: orders 4, 4, 4, 4, 4, 3
    alphabet = sorted({0, vocab - 1, vocab // 2, vocab // 3, vocab - 2, 1})  # high bits of the keys set too
    segments = [[rng.choice(alphabet) for _ in range(rng.randrange(0, 30))] for _ in range(8)]
    flat = [t for s in segments for t in s + [(1 << vocab.bit_length()) - 1]]
    order = min(4, 64 // vocab.bit_length())
    info = StoreInfo(target="t", vocab_size=vocab, tokenizer_sha1="x", order=order, tokens=len(flat), segments=8)
    store = Datastore(np.array(flat), info, "s")
    for _ in range(200):
        context = [rng.choice(alphabet) for _ in range(rng.randrange(0, 7))]
        n, counts = brute(segments, context, order, 2)
        got_n, got = store.continuations(context, min_order=2)
        assert got_n == n and dict(got) == dict(counts), context
        assert [c for _, c in got] == sorted((c for _, c in got), reverse=True)  # most frequent first


def test_no_ngram_spans_two_answers_and_answers_keep_their_prompts_tail():
    target = tiny("llama")
    store = from_answers(target, [([1, 2, 3, 4, 5, 6, 7], 5), ([8, 9, 10], 1)], order=4)
    assert store.continuations([4, 5, 6], min_order=2) == (3, [(7, 1)])  # answer 1 kept its prompt's last 4 tokens
    assert store.continuations([2, 3], min_order=2) == (2, [(4, 1)])
    assert store.continuations([1, 2], min_order=2) == (0, [])  # beyond the 4 tokens before the answer: left out
    assert store.continuations([6, 7], min_order=2) == (0, [])  # 7 ends answer 1: nothing follows it, not 8
    assert store.continuations([7, 8], min_order=2) == (0, [])
    assert store.continuations([8, 9], min_order=2) == (2, [(10, 1)])


def _drafter(store, max_n=3):
    d = NgramDrafter(max_n=max_n, vocab_size=VOCAB, store=store)
    return d


def test_the_store_answers_only_where_the_text_has_no_long_match():
    target = tiny("llama")
    store = from_answers(target, [([20, 21, 22, 23, 24, 25], 0), ([20, 21, 22, 30], 0)], order=4)
    d = _drafter(store)
    d.reset([9, 20, 21, 22])  # no match in the text; the store saw "20 21 22" followed by 23 and 30
    top = d.propose(TreeBuilder(22), [0], k=3).candidates(0)
    assert [t for t, _ in top[:2]] == [23, 30] and top[0][1] == pytest.approx(1 / 3)  # PPM weights: count / (2 + 1)
    assert d.match_order(d.context(TreeBuilder(22), 0)) == 0  # routing (the hybrid's) stays the text's own
    d.reset([20, 21, 22, 40, 20, 21, 22])  # the text continued "20 21 22" (with 40): 3 tokens, the store's 3 are not longer
    assert d.propose(TreeBuilder(22), [0], k=1).candidates(0)[0][0] == 40
    d.reset([21, 22, 23, 50, 20, 21, 22, 23])  # the text matches "21 22 23" (3 tokens = store_below), the store 4
    assert d.propose(TreeBuilder(23), [0], k=1).candidates(0)[0][0] == 50 and d.store_answers == 0
    d.reset([22, 23, 50, 20, 21, 22, 23])  # the text matches 2 tokens only: the store's 4 lead
    assert d.propose(TreeBuilder(23), [0], k=1).candidates(0)[0][0] == 24 and d.store_answers == 1
    plain = NgramDrafter(max_n=3, vocab_size=VOCAB)
    plain.reset([9, 20, 21, 22])
    assert d.name == "ngram+datastore" and plain.name == "ngram"
    tree = TreeBuilder(22)
    child = tree.add(0, 23, 0.5)  # deeper nodes read their own path: "21 22 23" -> 24 from the store
    d.reset([9, 20, 21, 22])
    assert d.propose(tree, [child], k=1).candidates(0)[0][0] == 24


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["linear", "fixed-tree", "dynatree", "wetap"])
def test_greedy_with_a_store_equals_plain_decoding(arch, method):
    target = tiny(arch, eos_ids=[])
    store = from_answers(target, [([5, 6, 7] + hf_greedy(target, [5, 6, 7], 30), 3)], name="own-text")
    for prompt in ([5, 6, 7], [40, 5, 6, 7], [11, 12]):
        for draft in (Draft(ngram=True, model=None, target=target, store=store),
                      Draft(ngram=True, model=noisy_copy(arch, 0, 0.08), target=target, store=store)):
            run = api.generate(prompt_ids=prompt, method=method, target=target, draft=draft, max_new_tokens=24,
                               ignore_eos=True)
            assert run.new_token_ids == hf_greedy(target, prompt, 24), (prompt, draft.name)
    run = api.generate(prompt_ids=[5, 6, 7], method="linear", target=target,
                       draft=Draft(ngram=True, model=None, target=target, store=store), max_new_tokens=24,
                       ignore_eos=True, k=6)
    assert run.stats.accepted_tokens >= 12  # the store held this very text: most drafts are accepted


def test_the_hybrid_names_its_parts_and_keeps_its_routing():
    target = tiny("llama", eos_ids=[])
    store = from_answers(target, [([40, 41, 42, 43], 0)], name="st")
    hybrid = HybridDrafter(NgramDrafter(max_n=3, store=store), LMDrafter(noisy_copy("llama", 0, 0.08), VOCAB))
    assert hybrid.name == "ngram+st+" + noisy_copy("llama", 0, 0.08).name
    hybrid.reset([9, 40, 41])  # the store matches, the text does not: the LM is asked (routing by the text)
    hybrid.propose(TreeBuilder(41), [0], k=2)
    assert hybrid.lm_calls == 1


def test_specs_name_a_store_and_loading_checks_it(tmp_path):
    target = tiny("llama", eos_ids=[])
    store_dir = tmp_path / "st"
    save_datastore(from_answers(target, [([5, 6, 7, 8], 0)]), store_dir, record={"by": "test"})
    spec = draftspec.parse(f"ngram+{store_dir}")
    assert (spec.ngram, spec.model, spec.store) == (True, None, str(store_dir))
    spec = draftspec.parse(f"ngram+{store_dir}+some/model")
    assert (spec.model, spec.store, spec.text) == ("some/model", str(store_dir), f"ngram+{store_dir}+some/model")
    draft = load_draft(f"ngram+{store_dir}", target)
    assert draft.store.continuations([5, 6], 2) == (2, [(7, 1)]) and draft.name == f"ngram+{store_dir}"
    run = api.generate(prompt_ids=[5, 6, 7], method="dynatree", target=target, draft=f"ngram+{store_dir}",
                       max_new_tokens=10, ignore_eos=True)
    assert run.new_token_ids == hf_greedy(target, [5, 6, 7], 10)
    model = noisy_copy("llama", 0, 0.08)
    run = api.generate(prompt_ids=[5, 6, 7], method="dynatree", target=target, max_new_tokens=10, ignore_eos=True,
                       draft=api.Hybrid(model, store=str(store_dir)))
    assert run.new_token_ids == hf_greedy(target, [5, 6, 7], 10) and run.draft == f"ngram+{store_dir}+{model.name}"
    run = api.generate(prompt_ids=[5, 6, 7], method="dynatree", target=target, max_new_tokens=10, ignore_eos=True,
                       draft=api.Hybrid(None, store=str(store_dir)))  # the store alone, as 'ngram+STORE'
    assert run.new_token_ids == hf_greedy(target, [5, 6, 7], 10) and run.draft == f"ngram+{store_dir}"
    from dynatree.bench.runner import _draft_for

    assert _draft_for(f"ngram+{store_dir}", api.Hybrid(None, store=str(store_dir)), target).name == f"ngram+{store_dir}"
    with pytest.raises(DynaTreeError, match="drafts as 'ngram\\+.*', not as that spec says"):  # a bench's drafts, checked
        _draft_for(f"ngram+{store_dir}+{model.name}", api.Hybrid(None, store=str(store_dir)), target)
    with pytest.raises(DynaTreeError, match="Hybrid\\(store=...\\) names no datastore: 'nope'"):
        api.generate(prompt_ids=[5], method="dynatree", target=target, draft=api.Hybrid(model, store="nope"))
    plus_dir = tmp_path / "my+store"  # a directory name may hold '+'
    save_datastore(from_answers(target, [([5, 6, 7, 8], 0)]), plus_dir)
    assert draftspec.parse(f"ngram+{plus_dir}").store == str(plus_dir)
    assert (draftspec.parse(f"ngram+{plus_dir}+a+b").store, draftspec.parse(f"ngram+{plus_dir}+a+b").model) == (
        str(plus_dir), "a+b")
    for bad, message in [(str(store_dir), "is a datastore, which the n-gram drafter reads: pass ngram+"),
                         (f"ngram+{store_dir}+", "needs a draft model after"),
                         (f"ngram+{store_dir}+ngram", "needs a draft model after"),
                         (f"ngram+{store_dir}+{store_dir}", "a datastore comes right after 'ngram\\+', before the model"),
                         (f"ngram+some/model+{store_dir}", "a datastore comes right after 'ngram\\+', before the model")]:
        with pytest.raises(DynaTreeError, match=message):
            draftspec.parse(bad)
    with pytest.raises(DynaTreeError, match="Hybrid\\(lm\\) takes a draft model, got .*Hybrid\\(lm, store=STORE\\)"):
        api.generate(prompt_ids=[5], method="dynatree", target=target, draft=api.Hybrid(str(store_dir)))
    from dynatree.models import load_model
    for spec in (str(store_dir), "smollm2-135m-store"):
        with pytest.raises(DynaTreeError, match="is a datastore: the n-gram drafter reads it"):
            load_model(spec)

    foreign = tmp_path / "foreign"
    save_datastore(from_answers(tiny("llama", vocab=120), [([5, 6, 7], 0)]), foreign)
    with pytest.raises(DynaTreeError, match="holds token ids of a 120-token vocabulary, target 'tiny-llama-0' has 96"):
        load_draft(f"ngram+{foreign}", target)
    config = json.loads((store_dir / "datastore.json").read_text())
    (store_dir / "datastore.json").write_text(json.dumps({**config, "tokenizer_sha1": "0" * 40}))
    with pytest.raises(DynaTreeError, match="was built with another tokenizer"):
        load_draft(f"ngram+{store_dir}", target)
    mismatch = "tokens.npy does not match datastore.json (length, answers or token ids: unsigned ids below {}, {} separators)"
    for bad, message in [({"tokens": 3}, mismatch.format(96, config["segments"])),
                         ({"segments": 2}, mismatch.format(96, 2)),
                         ({"vocab_size": 8}, mismatch.format(8, config["segments"])),
                         ({"order": 1}, "order 1 is not in 2..4 for a 96-token vocabulary")]:
        (store_dir / "datastore.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(DynaTreeError, match=re.escape(message)):
            load_datastore(str(store_dir))
    (store_dir / "datastore.json").write_text(json.dumps(config))
    np.save(store_dir / "tokens.npy", np.array([5, -6, 7, 8, 127], dtype=np.int16))  # signed ids: refused
    with pytest.raises(DynaTreeError, match="does not match datastore.json"):
        load_datastore(str(store_dir))
    (store_dir / "tokens.npy").write_bytes(b"not numpy")
    with pytest.raises(DynaTreeError, match="is not a readable datastore"):
        load_datastore(str(store_dir))


def test_cli_kind_store_builds_from_the_targets_answers_and_bad_input(tmp_path, capsys):
    from test_distill_eagle import chat_target

    target = chat_target()
    saved = tmp_path / "target"
    target.model.save_pretrained(saved)
    target.tokenizer.save_pretrained(saved)
    prompts = tmp_path / "prompts.jsonl"
    rows = [" ".join(f"w{5 + (i * 7 + j * 3) % 80}" for j in range(4 + i % 5)) for i in range(6)]
    prompts.write_text("\n".join(json.dumps({"prompt": r}) for r in rows))
    argv = ["distill", "--kind", "store", "--target", str(saved), "--out", str(tmp_path / "s"), "--quiet",
            "--prompts", str(prompts), "--self-prompts", "0", "--max-new-tokens", "8", "--data-dir", str(tmp_path / "d")]
    assert main(argv) == 0
    assert "datastore written to" in capsys.readouterr().out
    record = json.loads((tmp_path / "s" / "distill.json").read_text())
    assert record["kind"] == "store" and record["data"]["sequences"] == 6
    store = load_datastore(str(tmp_path / "s"))
    first = prompts.read_text().splitlines()[0]
    asked = chat_ids(target.tokenizer, [json.loads(first)["prompt"]], [])
    answer = hf_greedy(target, asked, 8, eos=2)
    assert store.continuations(asked[-2:] + answer[:1], 2)[1][0][0] == answer[1]  # its own answer, looked up
    assert main([*argv[:6], str(tmp_path / "again"), *argv[7:]]) == 0  # a second build reuses the saved answers
    chunks = json.loads((tmp_path / "again" / "distill.json").read_text())["data"]["chunks"]
    assert chunks["answers_reused"] == chunks["total"] == 1
    for bad, message in [(["--order", "5"], "--order must be in 2..4"),
                         (["--order", "1"], "--order must be in 2..4"),
                         (["--resume"], "--resume does not apply to --kind store"),
                         (["--steps", "3"], "--steps does not apply to --kind store")]:
        assert main([*argv[:6], str(tmp_path / "x"), *argv[7:], *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (bad, err)


def test_bench_loads_the_store_once_and_reports_it_in_the_draft_name(tmp_path, saved_tiny, prompt_file):
    from dynatree.models import load_model

    target = load_model(str(saved_tiny), dtype="float32")
    store_dir = tmp_path / "st"
    save_datastore(from_answers(target, [([5, 6, 7] + hf_greedy(target, [5, 6, 7], 20), 3)]), store_dir)
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(saved_tiny), "--methods", "ar,dynatree", "--draft",
                 f"ngram,ngram+{store_dir}", "--dataset", str(prompt_file), "--n", "2", "--warmup", "0",
                 "--max-new-tokens", "8", "--no-ppl", "--no-progress", "--out", str(out)]) == 0
    records = json.loads((out / "results.json").read_text())["records"]
    assert {r["draft"] for r in records if r["method"] == "dynatree"} == {"ngram", f"ngram+{store_dir}"}
    assert all(r["matches_ar"] for r in records)
    target = tiny("llama", eos_ids=[])
    store = from_answers(target, [([5, 6, 7], 0)], name="st")
    from dynatree.bench import presets, runner

    variants = presets.method_variants(["ar", "linear"], ["ngram"])
    proto = runner.Protocol(dataset=str(prompt_file), n=1, warmup=0, max_new_tokens=[4])
    with pytest.raises(DynaTreeError, match="not as that spec says"):  # a store under plain 'ngram': refused
        runner.run("custom", variants, proto, target, {"ngram": Draft(ngram=True, model=None, target=target,
                                                                      store=store)}, progress=False)
    variants = presets.method_variants(["ar", "linear"], [f"ngram+{store_dir}"])
    with pytest.raises(DynaTreeError, match="not as that spec says"):  # another store under this one's name: refused
        runner.run("custom", variants, proto, target, {f"ngram+{store_dir}": Draft(ngram=True, model=None,
                                                                                  target=target, store=store)},
                   progress=False)
