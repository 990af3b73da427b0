"""`dynatree distill --kind eagle` on a tiny chat-templated target: on-policy data (the target's
greedy answers; features and labels from one teacher-forced pass), Spec-Bench's benchmark
questions held out, the unrolled training mask by hand, a head that trains, loads and drafts
exactly, and every bad input's one-line error."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch

from helpers import ON_CPU, hf_greedy, tiny, tokenizer
from dynatree import DynaTreeError
from dynatree.api import generate
from dynatree.prompts import encode_prompt, load_texts
from dynatree.cli import main
from dynatree.distill.chat import instruction_prompts
from dynatree.distill.eagle_data import EagleConfig, build_data, label, labelling_params
from dynatree.distill.eagle_train import distill_eagle, make_batch, noisy_features, segment_masks
from dynatree.featurehead import check_head, load_head, output_signature
from dynatree.runtime import LoadedModel

TEMPLATE = "{% for m in messages %}{{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4 {% endif %}"
SMALL = dict(prompts="", self_prompts=0, max_new_tokens=12, gen_batch=3, label_batch=2, draft_vocab=60, unroll=2,
             seq_len=64, steps=40, batch_size=4, lr=3e-3, warmup=3, checkpoint_every=20, eval_fraction=0.25)


def chat_target() -> LoadedModel:
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = TEMPLATE
    return LoadedModel(model=tiny("llama", seed=4, dtype=torch.float32).model, tokenizer=tok, name="tiny-chat",
                       eos_ids=[2])


@pytest.fixture()
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [" ".join(f"w{5 + (i * 7 + j * 3) % 80}" for j in range(4 + i % 5)) for i in range(16)]
    path.write_text("\n".join(json.dumps({"prompt": r}) for r in rows))
    return path


def test_data_is_the_targets_greedy_answers_labelled_by_one_pass(prompts):
    target = chat_target()
    data = build_data(target, EagleConfig(**{**SMALL, "prompts": str(prompts)}), progress=False)
    assert data["info"]["sequences"] == 16
    for tokens, feats, labels, start in list(zip(data["tokens"], data["features"], data["labels"],
                                                  data["answer_from"]))[:4]:
        tokens = tokens.tolist()
        prompt_len = tokens.index(4) + 1  # the template's generation prompt ends the prompt
        answer = hf_greedy(target, tokens[:prompt_len], 12, eos=2)
        assert tokens[prompt_len:] == answer
        assert start == prompt_len  # where the answer starts is kept: answer rows are known
        out = target.model(torch.tensor([tokens], device=target.device), output_hidden_states=True)
        torch.testing.assert_close(feats.float(), out.hidden_states[-1][0].to(torch.bfloat16).float().cpu())
        assert torch.equal(labels.long(), out.logits[0].argmax(-1).cpu())


def test_a_stopped_build_resumes_from_its_parts_and_a_larger_one_reuses_them(tmp_path, prompts, monkeypatch):
    """Data is built and saved `chunk` conversations at a time: a build stopped in its third chunk
    keeps two; the next run builds only the rest; asking for more self-written questions later
    reuses every part and question block that does not change (the data equals a fresh build's)."""
    import dynatree.distill.eagle_data as de

    target, parts = chat_target(), tmp_path / "parts"
    cfg = EagleConfig(**{**SMALL, "prompts": str(prompts), "chunk": 4, "self_prompts": 3})
    real_label, calls = de.label, []

    def failing_label(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the session ends in the third chunk
        return real_label(*args, **kwargs)
    monkeypatch.setattr(de, "label", failing_label)
    with pytest.raises(KeyboardInterrupt):
        build_data(target, cfg, progress=False, parts=parts)
    monkeypatch.setattr(de, "label", real_label)
    assert len(list(parts.glob("part-*.pt"))) == 2 and len(list(parts.glob("questions-*.json"))) == 1
    data = build_data(target, cfg, progress=False, parts=parts)
    # 16 file prompts + 3 questions, 4 per chunk; the third chunk's answers were saved before it stopped
    assert data["info"]["chunks"] == {"total": 5, "reused": 2, "answers_reused": 1}
    fresh = build_data(target, cfg, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(data["tokens"], fresh["tokens"]))
    assert all(torch.equal(a, b) for a, b in zip(data["labels"], fresh["labels"]))
    more = build_data(target, EagleConfig(**{**SMALL, "prompts": str(prompts), "chunk": 4, "self_prompts": 6}),
                      progress=False, parts=parts)
    assert more["info"]["chunks"]["reused"] == 4  # the file prompts' chunks; the questions' chunk changed
    assert len(list(parts.glob("questions-*.json"))) == 2  # block 1 written, block 0 reused
    assert all(torch.equal(a, b) for a, b in zip(more["tokens"][:16], data["tokens"][:16]))  # the file prompts'


def test_committed_answers_rebuild_the_data_without_generating(tmp_path, prompts, monkeypatch):
    """A chunk's answers (token ids, gzip JSON) are kept apart from its features and labels: with
    only the answers files (as committed), a build generates nothing, recomputes the rest in one
    pass and gives the same data; a part built before answers were kept apart gets its answers
    file; a broken or another target's answers file is a one-line error."""
    import gzip

    import dynatree.distill.eagle_data as de

    target, parts = chat_target(), tmp_path / "parts"
    cfg = EagleConfig(**{**SMALL, "prompts": str(prompts), "chunk": 8})
    first = build_data(target, cfg, progress=False, parts=parts)
    answers = sorted(parts.glob("answers-*.json.gz"))
    assert len(answers) == 2
    record = json.loads(gzip.decompress(answers[0].read_bytes()))
    assert record["target"] == "tiny-chat" and record["dtype"] == "float32" and record["device"] == str(target.device)
    assert record["weights"] == "dense"
    for path in parts.glob("part-*.pt"):
        path.unlink()

    def no_generation(*args, **kwargs):
        raise AssertionError("generated again")
    monkeypatch.setattr(de, "answer_conversations", no_generation)
    again = build_data(target, cfg, progress=False, parts=parts)
    assert again["info"]["chunks"] == {"total": 2, "reused": 0, "answers_reused": 2}
    for name in ("tokens", "labels"):
        assert all(torch.equal(a, b) for a, b in zip(first[name], again[name]))
    assert again["answer_from"] == first["answer_from"]

    answers[0].unlink()  # as a part built before this change: its answers file is written from it
    build_data(target, cfg, progress=False, parts=parts)
    assert json.loads(gzip.decompress(answers[0].read_bytes()))["sequences"] == record["sequences"]

    for part in parts.glob("part-*.pt"):
        part.unlink()
    good = answers[0].read_bytes()
    broken = {"another target": (gzip.compress(json.dumps({**record, "target": "another"}).encode()),
                                 "holds answers of 'another', not of 'tiny-chat'"),
              "another format": (gzip.compress(json.dumps({**record, "weights": "q4"}).encode()),
                                 "holds answers of tiny-chat in weights q4, not dense as loaded"),
              "another dtype, saved before the format was": (
                  gzip.compress(json.dumps({k: v for k, v in {**record, "dtype": "bfloat16"}.items() if k != "weights"}).encode()),
                  "holds answers of tiny-chat in dtype bfloat16, not float32 as loaded"),
              "not gzip": (b"not gzip", "is not a saved chunk of answers"),
              "truncated": (good[: len(good) // 2], "is not a saved chunk of answers"),
              "starts missing": (gzip.compress(json.dumps({**record, "answer_from": record["answer_from"][1:]}).encode()),
                                 "sequences and answer starts do not match")}
    for name, (blob, message) in broken.items():
        answers[0].write_bytes(blob)
        with pytest.raises(DynaTreeError, match=message) as err:
            build_data(target, cfg, progress=False, parts=parts)
        assert "\n" not in str(err.value), name


def with_bfloat16_parameters(target: LoadedModel) -> LoadedModel:
    """The target's modules with every parameter converted to bfloat16 (buffers as they are)."""
    model = copy.deepcopy(target.model)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return LoadedModel(model=model, tokenizer=target.tokenizer, name=target.name + "-bf16", eos_ids=target.eos_ids)


def test_a_bfloat16_labelling_pass_labels_with_bfloat16_weights_and_keeps_its_parts_apart(tmp_path, prompts):
    """--label-dtype bfloat16: features and labels come from the target's modules on bfloat16 copies of its
    weights (what a model whose parameters are bfloat16 computes, batch for batch), the answers stay the
    float32 target's (the same answers files, nothing generated again), and its parts are saved beside the
    target's own, never mixed with them (a part under the other's name is a one-line error); a second
    bfloat16 build reuses its own."""
    target, parts = chat_target(), tmp_path / "parts"
    cfg = EagleConfig(**{**SMALL, "prompts": str(prompts), "chunk": 8})
    own = build_data(target, cfg, progress=False, parts=parts)
    b16_cfg = dataclasses.replace(cfg, label_dtype="bfloat16")
    b16 = build_data(target, b16_cfg, progress=False, parts=parts)
    assert b16["info"]["chunks"] == {"total": 2, "reused": 0, "answers_reused": 2}
    assert len(list(parts.glob("part-*.pt"))) == 4 and len(list(parts.glob("answers-*.json.gz"))) == 2
    assert b16["key"] == {**own["key"], "label_dtype": "bfloat16"} and "label_dtype" not in own["key"]
    assert build_data(target, b16_cfg, progress=False, parts=parts)["info"]["chunks"]["reused"] == 2
    assert build_data(target, cfg, progress=False, parts=parts)["info"]["chunks"]["reused"] == 2

    assert all(torch.equal(a, b) for a, b in zip(b16["tokens"], own["tokens"]))  # the float32 target's answers
    reference = with_bfloat16_parameters(target)
    for chunk in (slice(0, 8), slice(8, 16)):  # labelled a chunk at a time, as the build does
        feats, labels = label(reference, [t.tolist() for t in b16["tokens"][chunk]], cfg.label_batch)
        assert all(torch.equal(a, b) for a, b in zip(feats, b16["features"][chunk]))
        assert all(torch.equal(a, b) for a, b in zip(labels, b16["labels"][chunk]))
    assert any(not torch.equal(a, b) for a, b in zip(b16["features"], own["features"]))  # not a float32 pass

    loaded = {p: torch.load(p, weights_only=True) for p in parts.glob("part-*.pt")}
    b16_part = next(p for p, d in loaded.items() if d["label_dtype"] == "bfloat16")
    own_part = next(p for p, d in loaded.items() if d["label_dtype"] == "target"
                    and torch.equal(d["tokens"][0], loaded[b16_part]["tokens"][0]))
    shutil.copy(b16_part, own_part)  # a bfloat16 part under the target's own name
    with pytest.raises(DynaTreeError, match=r"holds features and labels of a 'bfloat16' pass, not 'target' as asked") as err:
        build_data(target, cfg, progress=False, parts=parts)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_the_bfloat16_pass_keeps_tied_and_untied_output_layers(arch):
    """The copies are taken per parameter: a model whose output layer is its embedding (gpt2) computes with
    the one bfloat16 copy in both places, as a bfloat16 model does."""
    target = tiny(arch, dtype=torch.float32)
    sequences = [[5, 9, 14, 5, 9, 22, 31], [7, 8, 9], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    params = labelling_params(target, EagleConfig(label_dtype="bfloat16"))
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    got = label(target, sequences, 2, params=params)
    want = label(with_bfloat16_parameters(target), sequences, 2)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)


def test_a_bfloat16_pass_of_a_target_not_dense_float32_is_refused():
    for target, form in ((with_bfloat16_parameters(tiny("llama", dtype=torch.float32)), "bfloat16"),
                         (dataclasses.replace(tiny("llama", dtype=torch.float32), weights="q4"), "q4")):
        with pytest.raises(DynaTreeError, match=f"copies a dense float32 target's weights; .* is loaded as {form} "
                                                r"\(leave --label-dtype out") as err:
            build_data(target, EagleConfig(**{**SMALL, "label_dtype": "bfloat16"}), progress=False)
        assert "\n" not in str(err.value)
    with pytest.raises(DynaTreeError, match="--label-dtype must be target or bfloat16, got 'float16'"):
        build_data(tiny("llama", dtype=torch.float32), EagleConfig(**{**SMALL, "label_dtype": "float16"}), progress=False)


def test_a_turn_asked_by_two_sources_is_kept_once(prompts):
    target = chat_target()
    once = build_data(target, EagleConfig(**{**SMALL, "prompts": str(prompts)}), progress=False)
    twice = build_data(target, EagleConfig(**{**SMALL, "prompts": f"{prompts},{prompts}"}), progress=False)
    assert twice["info"]["duplicates_dropped"] == 16 and twice["info"]["sequences"] == 16
    assert all(torch.equal(a, b) for a, b in zip(once["tokens"], twice["tokens"]))


def test_self_written_documents_come_back_in_requests_to_summarize_or_quote(tmp_path, monkeypatch):
    """`--self-documents N`: the target writes N documents (sampled) from (topic, kind, use) seeds in
    blocks; each kept document comes back inside its seed's conversation (chat.DOCUMENT_KINDS), whose
    answers are then labelled like any other source's; a document outside DOCUMENT_CHARS is left out
    without shifting the others; a larger build reuses the blocks whose seeds did not change."""
    import dynatree.distill.eagle_data as de
    from dynatree.distill.chat import DOCUMENT_KINDS

    target, parts = chat_target(), tmp_path / "parts"
    real, written = de.generate_batched, []

    def writer(target, prompts, max_new, batch, bar=None, sample=False, seed=0):
        if not sample:  # the answers: the target's own greedy decoding
            return real(target, prompts, max_new, batch, bar, sample, seed)
        written.append(seed)  # a document per prompt ("w10 w11 ..."); the first block's second: one word
        b = len(written) - 1
        return [[5] if (b == 0 and i == 1) else [10 + (7 * b + i + j) % 60 for j in range(20)]
                for i in range(len(prompts))]
    monkeypatch.setattr(de, "generate_batched", writer)
    cfg = EagleConfig(**{**SMALL, "self_documents": 5})
    blocks = de.document_blocks(5, cfg)
    assert [len(b) for b in blocks] == [3, 2] and de.document_blocks(9, cfg)[0] == blocks[0]
    assert {(k, u) for block in de.document_blocks(400, cfg) for _, k, u in block} == {
        (k, u) for k, (_, uses) in enumerate(DOCUMENT_KINDS) for u in range(len(uses))}  # every use is asked

    parts.mkdir()
    convs = de.self_documents(target, 5, cfg, parts=parts)
    seeds = [seed for block in blocks for seed in block]
    kept = [seed for i, seed in enumerate(seeds) if i != 1]
    assert len(convs) == 4 and len(written) == 2
    for (_, k, u), conv, (b, i) in zip(kept, convs, [(0, 0), (0, 2), (1, 0), (1, 1)]):
        doc = target.tokenizer.decode([10 + (7 * b + i + j) % 60 for j in range(20)], skip_special_tokens=True).strip()
        assert conv == [turn.replace("{doc}", doc) for turn in DOCUMENT_KINDS[k][1][u]]
        assert doc in conv[0]
    saved = [json.loads(p.read_text()) for p in sorted(parts.glob("documents-*.json"))]
    assert sorted(len(t) for t in saved) == [2, 3] and any(t[1] is None for t in saved if len(t) == 3)

    data = build_data(target, cfg, progress=False, parts=parts)  # the blocks are read back, not written
    assert len(written) == 2 and data["info"]["documents"] == {"conversations": 4, "asked_for": 5}
    assert data["info"]["sequences"] == sum(len(c) for c in convs)  # one sequence per turn
    assert data["key"]["self_documents"] == 5 and "self_documents" not in EagleConfig(**SMALL).data_key()
    more = de.self_documents(target, 7, cfg, parts=parts)  # block 0 reused; block 1 (now 3 seeds) and 2 written
    assert len(written) == 4 and more[:2] == convs[:2]
    with pytest.raises(DynaTreeError, match="--self-documents"):
        EagleConfig(**{**SMALL, "self_documents": -1}).validate()


def _gpu_builder():
    """docs/results/eagle-gpu/build.py, the script a lent GPU builds the embedded target's data with."""
    import importlib.util
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "docs" / "results" / "eagle-gpu"
    sys.path.insert(0, str(folder))  # (it imports weights_sums from beside it)
    try:
        spec = importlib.util.spec_from_file_location("eagle_gpu_build", folder / "build.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


def test_the_gpu_builder_writes_what_the_distiller_reads(tmp_path, monkeypatch):
    """build.py answers many chunks' conversations in one batched generation per turn: each chunk's
    sequences and answer starts equal the distiller's own (eagle_data.answer_conversations, one
    chunk at a time), later turns and a prompt over l_max included; the document blocks it writes
    are the files the distiller then reads instead of writing them."""
    import time

    import dynatree.distill.eagle_data as de

    build = _gpu_builder()
    target = chat_target()
    cfg = EagleConfig(**{**SMALL, "self_documents": 7, "l_max": 40})
    chunks = [[["w5 w6 w7", "w8 w9"], ["w10 w11"]], [["w12 " * 45 + "w13", "w14"], ["w15 w16", "w17", "w18 w19"]]]
    assert len(chat_ids_of(target, chunks[1][0][0])) > cfg.l_max  # left out, with its later turn
    assert build.answer_chunks(target, chunks, cfg) == [de.answer_conversations(target, chunk, cfg) for chunk in chunks]

    parts = tmp_path / "parts"
    parts.mkdir()
    written, complete = build.write_documents(target, cfg, parts, 6, time.perf_counter() + 600)
    assert (written, complete) == (3, True) and len(list(parts.glob("documents-*.json"))) == 3
    monkeypatch.setattr(de, "generate_batched", lambda *a, **k: pytest.fail("a saved block was written again"))
    convs = de.self_documents(target, 7, cfg, parts=parts)
    assert 0 < len(convs) <= 7


def chat_ids_of(target, text):
    from dynatree.distill.chat import chat_ids

    return chat_ids(target.tokenizer, [text], [])


def test_long_prompts_are_answered_by_exact_speculation(prompts, monkeypatch):
    """On a CPU, greedy answers to long prompts are decoded one at a time by the library's own
    speculation (one decode per long prompt): the same tokens as the target's greedy decoding,
    in the prompts' order, EOS included where reached."""
    import dynatree.api as api
    import dynatree.distill.chat as chat

    target = chat_target()
    rows = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
    asked = [chat.chat_ids(target.tokenizer, [row], []) for row in rows]
    free = [hf_greedy(target, prompt, 12) for prompt in asked]
    eos = max(set(t for a in free for t in a[2:]), key=lambda t: sum(t in a[2:] for a in free))  # stops many answers
    target.eos_ids = [eos]
    monkeypatch.setattr(chat, "SPECULATE_FROM", 9)  # the longest of the test prompts
    long = sum(len(p) >= 9 for p in asked)
    assert 0 < long < len(asked)
    calls, real = [], api.generate
    monkeypatch.setattr(api, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    answers = chat.generate_batched(target, asked, 12, 3)
    assert len(calls) == (long if ON_CPU else 0)  # a GPU answers every prompt in batches
    expected = [hf_greedy(target, prompt, 12, eos=eos) for prompt in asked]
    assert answers == expected
    assert any(a[-1] == eos and len(a) < 12 for a, p in zip(answers, asked) if len(p) >= 9)
    assert len({tuple(a) for a in answers}) > 1


def test_other_asks_use_training_material_only():
    """`specbench-asks` asks other things about the training questions' articles, passages,
    sentences and problems; nothing of a held-out question appears in any of them, and no
    conversation starts with a question `specbench` asks itself."""
    from dynatree.distill.chat import other_asks

    convs, info = instruction_prompts("specbench-asks", holdout=10)
    assert info["specbench-asks"]["conversations"] == len(convs) == 67 * 7
    text = "\n".join(t for c in convs for t in c)
    for p in load_texts("specbench", 10):
        core = p.text.split(": ", 1)[-1].rsplit("\n", 1)[0]  # the article, passages, sentence or problem
        assert core[:200] not in text
    asked, _ = instruction_prompts("specbench", holdout=10)
    assert not {c[0] for c in convs} & {c[0] for c in asked}
    assert len({c[0] for c in convs}) == len(convs) and any(len(c) == 2 for c in convs)
    assert other_asks("summarization", ["Summarize: An article."])[0] == [
        "Summarize the following article in two sentences.\n\nAn article.", "Now write a headline for the article."]
    assert other_asks("mt_bench", ["Write a poem."]) == []


@pytest.mark.parametrize("part", ["specbench", "specbench-asks"])
def test_a_holdout_that_leaves_no_question_names_it(part):
    with pytest.raises(DynaTreeError) as err:
        instruction_prompts(part, holdout=77)
    assert str(err.value) == (f"--holdout 77 leaves no question of --prompts {part} for training "
                              "(its tasks have 76 to 77 questions each)")
    assert instruction_prompts(part, holdout=76)[0]  # one question left in five tasks


def test_spec_bench_benchmark_questions_are_held_out():
    convs, info = instruction_prompts("specbench", holdout=10)
    asked = {c[0] for c in convs}
    benchmark = load_texts("specbench", 10)
    assert benchmark and not any(p.text in asked for p in benchmark)
    assert info["specbench"]["conversations"] == len(convs) == 461 - 6 * 10  # the shipped file: 461 questions, 6 tasks
    assert max(len(c) for c in convs) == 2  # MT-Bench's second turns are kept


def test_answer_rows_are_the_targets_answers_and_the_loss_can_keep_to_them():
    """A row is an answer row when its label is the target's choice of an answer token; with
    --loss-rows answers the loss is the cross-entropy over those rows only; held-out agreement is
    reported over all rows and over answer rows."""
    from transformers import DynamicCache

    from helpers import tiny_head
    from dynatree.distill.eagle_train import evaluate, make_batch, unrolled_loss

    target, head = tiny("llama", dtype=torch.float32), tiny_head("llama", dtype=torch.float32)
    vocab = head.vocab_ids.cpu()  # batches are built on the CPU (as distill_eagle builds them)
    gen = torch.Generator().manual_seed(0)
    n, start = 12, 7  # tokens 0..6 the prompt, 7..11 the answer
    data = {"tokens": [torch.randint(5, 90, (n,), generator=gen)], "features": [torch.randn(n, 32, generator=gen)],
            "labels": [vocab[torch.randint(0, 80, (n,), generator=gen)]], "answer_from": [start]}
    sub_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    sub_index[vocab] = torch.arange(len(vocab))
    batch = make_batch(data, [0], 64, sub_index, vocab, multiple=1)  # (no padding: the reference below has none)
    # row r: input token r + 1, label the choice of token r + 2: answer rows r = 5..10
    assert batch["answer"][0].tolist() == [False] * 5 + [True] * 6
    assert make_batch({**data, "answer_from": [None]}, [0], 64, sub_index, vocab, multiple=1)["answer"].all()

    embed, out_rows = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight[head.vocab_ids]
    cfg = EagleConfig(unroll=1, feature_loss=0.0, loss_rows="answers")
    loss, stats = unrolled_loss(head, embed, out_rows, batch, cfg)
    L = batch["tokens"].shape[1]
    on = {k: v.to(target.device) for k, v in batch.items()}  # the reference pass, where the models are
    out = head(embed(on["tokens"]).float(), on["features"], on["positions"], _pass_mask(L, 1).to(target.device),
               DynamicCache())
    per_row = torch.nn.functional.cross_entropy(out[0] @ out_rows.T, on["sub_labels"][0], reduction="none")
    torch.testing.assert_close(loss, per_row[5:].mean())
    everything, _ = unrolled_loss(head, embed, out_rows, batch, dataclasses.replace(cfg, loss_rows="all"))
    torch.testing.assert_close(everything, per_row.mean())
    hits = (head.vocab_ids[(out[0] @ out_rows.T).argmax(-1)] == on["labels"][0])
    assert stats == [(int(hits.sum()), 11, int(hits[5:].sum()), 6)]
    result = evaluate(head, embed, out_rows, data, [0], cfg, sub_index, vocab)
    assert result["answer_agreement_by_depth"] == [int(hits[5:].sum()) / 6]
    assert result["agreement_by_depth"] == [int(hits.sum()) / 11]
    with pytest.raises(DynaTreeError, match="--loss-rows must be all or answers"):
        EagleConfig(loss_rows="prompt").validate()


def _pass_mask(rows: int, depth: int, window: int = 0) -> torch.Tensor:
    """The reference mask of one sequence (eagle_train.segment_masks packs several): additive, [1, 1, rows,
    depth * rows], of pass `depth` (1-based) over the keys of passes 1..depth: row r sees pass-1 keys
    r' <= r - (depth - 1) (and r' >= r - window with a window) and pass-i key r - (depth - i)."""
    allowed = torch.zeros(rows, depth * rows, dtype=torch.bool)
    r = torch.arange(rows)
    allowed[:, :rows] = torch.ones(rows, rows, dtype=torch.bool).tril(-(depth - 1))
    if window:
        allowed[:, :rows] &= torch.ones(rows, rows, dtype=torch.bool).triu(-window)
    for i in range(2, depth + 1):
        col = r - (depth - i)
        ok = col >= 0
        allowed[r[ok], (i - 1) * rows + col[ok]] = True
    mask = torch.zeros(rows, depth * rows)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def test_pass_mask_by_hand():
    # depth 2 over 3 rows: row r sees pass-1 keys r' <= r - 1 and its own pass-2 key
    allowed = _pass_mask(3, 2)[0, 0] == 0
    assert allowed.tolist() == [[False, False, False, True, False, False],
                                [True, False, False, False, True, False],
                                [True, True, False, False, False, True]]
    # depth 3: pass-1 keys up to r - 2, pass-2 key r - 1, pass-3 key r
    allowed = _pass_mask(3, 3)[0, 0] == 0
    assert allowed[2].tolist() == [True, False, False, False, True, False, False, False, True]
    # the packed masks of one sequence are these
    masks = segment_masks(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], 3)
    assert torch.equal(masks[1][0, 0], _pass_mask(3, 2)[0, 0] == 0) and torch.equal(masks[2][0, 0], allowed)


def test_a_window_limits_how_far_back_the_first_pass_keys_reach():
    # window 1 over 4 rows, depth 1: row r sees rows r - 1 and r, as a drafter under KVWindow(0, 1)
    assert (_pass_mask(4, 1, window=1)[0, 0] == 0).tolist() == [[True, False, False, False],
                                                                 [True, True, False, False],
                                                                 [False, True, True, False],
                                                                 [False, False, True, True]]
    # depth 2, window 2: pass-1 keys r - 2 .. r - 1, and the own pass-2 key
    assert (_pass_mask(4, 2, window=2)[0, 0] == 0)[3].tolist() == [False, True, True, False,
                                                                   False, False, False, True]
    masks = segment_masks(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], 2, window=2)
    assert torch.equal(masks[1][0, 0], _pass_mask(4, 2, window=2)[0, 0] == 0)
    # a window as long as the sequence changes nothing
    assert all(torch.equal(a, b) for a, b in zip(
        segment_masks(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], 3, window=4),
        segment_masks(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], 3)))


@pytest.mark.parametrize("window", [0, 2])
def test_the_mask_of_packed_sequences_is_each_sequences_own_mask_on_the_diagonal(window):
    """Sequences of 3, 5 and 1 rows packed into one batch row, then 2 rows of padding: each sequence's
    block of every pass is `_pass_mask` of its length (and window), nothing across sequences, padding rows
    see only themselves."""
    lengths = [3, 5, 1]
    segment = torch.tensor([[0] * 3 + [1] * 5 + [2] + [-1] * 2])
    local = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 0]])
    L = segment.shape[1]
    masks = segment_masks(segment, local, 4, window)
    for depth in (1, 2, 3, 4):
        allowed = masks[depth - 1][0, 0]
        assert masks[depth - 1].dtype == torch.bool and masks[depth - 1].shape == (1, 1, L, depth * L)
        want = torch.zeros(L, depth * L, dtype=torch.bool)
        start = 0
        for m in lengths:
            own = _pass_mask(m, depth, window)[0, 0] == 0
            for i in range(depth):
                want[start:start + m, i * L + start: i * L + start + m] = own[:, i * m: (i + 1) * m]
            start += m
        for r in range(start, L):  # padding: its own key of the last pass (and, at depth 1, the padding)
            want[r, (depth - 1) * L + r] = True
            if depth == 1:
                want[r, start:L] = True
        assert torch.equal(allowed, want), depth


def test_packing_fills_rows_first_fit_longest_first():
    gen = torch.Generator().manual_seed(0)
    lengths = [41, 12, 30, 9, 20, 50]  # rows 40, 11, 29, 8, 19, 49: a batch row holds at most 49
    data = {"tokens": [torch.randint(5, 90, (n,), generator=gen) for n in lengths],
            "features": [torch.randn(n, 4, generator=gen) for n in lengths],
            "labels": [torch.randint(5, 90, (n,), generator=gen) for n in lengths], "answer_from": [None] * 6}
    sub_index = torch.arange(100)
    packed = make_batch(data, list(range(6)), 64, sub_index, torch.arange(100), multiple=1)
    plain = make_batch(data, list(range(6)), 64, sub_index, torch.arange(100), pack=False, multiple=1)
    # first fit, longest first, into rows of the longest: [49] [40, 8] [29, 19] [11]
    assert packed["tokens"].shape == (4, 49) and plain["tokens"].shape == (6, 49)
    # as training builds them: the rows' length rounded up to a multiple of 64 (few shapes for the
    # kernels' per-shape caches), the same rows plus padding that belongs to no sequence
    rounded = make_batch(data, list(range(6)), 64, sub_index, torch.arange(100))
    assert rounded["tokens"].shape == (4, 64) and make_batch(data, [0], 64, sub_index, torch.arange(100),
                                                             multiple=16)["tokens"].shape == (1, 48)
    for key in packed:
        if key != "head_vocab":
            assert torch.equal(rounded[key][:, :49], packed[key]), key
    assert not rounded["valid"][:, 49:].any() and (rounded["segment"][:, 49:] == -1).all()
    with pytest.raises(ValueError, match="multiple must be at least 1"):
        make_batch(data, [0], 64, sub_index, torch.arange(100), multiple=0)
    assert [sorted(set(row.tolist()) - {-1}) for row in packed["segment"]] == [[5], [0, 3], [2, 4], [1]]
    assert int(packed["valid"].sum()) == int(plain["valid"].sum()) == sum(lengths) - 6
    for k in range(6):  # every sequence's rows, in order, whole
        here = packed["segment"] == k
        assert int(here.sum()) == lengths[k] - 1
        assert torch.equal(packed["local"][here], torch.arange(lengths[k] - 1))
        for key in ("tokens", "labels", "positions", "features", "answer"):
            assert torch.equal(packed[key][here], plain[key][k][plain["valid"][k]]), key


def test_training_fits_the_data_and_the_head_drafts_exactly(tmp_path, prompts):
    target = chat_target()
    out = tmp_path / "head"
    summary = distill_eagle(target, out, EagleConfig(**{**SMALL, "prompts": str(prompts)}), progress=False)
    first, last = summary["history"][0]["train_agreement_moving_avg"][0], summary["history"][-1]["train_agreement_moving_avg"][0]
    # a random 2-layer target on 12 conversations: the head fits them (held-out agreement is measured
    # on the real target, docs/results); both depths are trained
    assert last > first + 0.08 and summary["history"][-1]["train_agreement_moving_avg"][1] > 0.2
    head = load_head(out, dtype=torch.float32)
    assert head.config.draft_vocab == 60
    assert head.config.output_signature == output_signature(target.model)  # what check_head compares
    # on a conversation it learnt (chat template, first question), its paths are accepted too
    prompt = encode_prompt(target.tokenizer, json.loads(prompts.read_text().splitlines()[0])["prompt"], chat=True)
    record = generate(prompt_ids=prompt, method="dynatree", target=target, draft=str(out), max_new_tokens=20,
                      ignore_eos=True)
    assert record.new_token_ids == hf_greedy(target, prompt, 20)
    assert record.stats.accepted_tokens > 0
    with pytest.raises(DynaTreeError, match="pass --resume"):
        distill_eagle(target, out, EagleConfig(**{**SMALL, "prompts": str(prompts)}), progress=False)
    # --init-head continues it (sub-vocabulary and weights kept; a near-zero rate leaves them as they were)
    again = tmp_path / "again"
    distill_eagle(target, again, EagleConfig(**{**SMALL, "prompts": str(prompts), "init_head": str(out), "steps": 2,
                                                "lr": 1e-12, "warmup": 1}), progress=False)
    cont = load_head(again, dtype=torch.float32)
    assert torch.equal(cont.vocab_ids, head.vocab_ids)
    for (name, a), (_, b) in zip(head.state_dict().items(), cont.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    # ... also a head of another model of the target's shape (its signature differs), signed anew
    foreign = tmp_path / "foreign"
    shutil.copytree(out, foreign)
    config = json.loads((foreign / "feature_head.json").read_text())
    config["output_signature"] = [2 * v for v in config["output_signature"]]
    (foreign / "feature_head.json").write_text(json.dumps(config))
    with pytest.raises(DynaTreeError, match="a model with other weights"):
        check_head(load_head(foreign), target)
    distill_eagle(target, tmp_path / "from-foreign", EagleConfig(**{**SMALL, "prompts": str(prompts), "steps": 1,
                                                                   "init_head": str(foreign)}), progress=False)
    assert load_head(tmp_path / "from-foreign").config.output_signature == output_signature(target.model)
    with pytest.raises(DynaTreeError, match="not a feature-head directory"):
        EagleConfig(init_head=str(tmp_path)).validate()


def test_bfloat16_autocast_training_fits_and_keeps_float32_weights(tmp_path, prompts):
    target = chat_target()
    out = tmp_path / "head"
    summary = distill_eagle(target, out, EagleConfig(**{**SMALL, "prompts": str(prompts), "train_dtype": "bfloat16"}),
                            progress=False)
    first, last = summary["history"][0]["train_agreement_moving_avg"][0], summary["history"][-1]["train_agreement_moving_avg"][0]
    assert last > first + 0.08
    assert summary["config"]["train_dtype"] == "bfloat16"
    head = load_head(out, dtype=torch.float32)
    state = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    prompt = target.tokenizer("w9 w10 w11 w4", add_special_tokens=False).input_ids
    record = generate(prompt_ids=prompt, method="dynatree", target=target, draft=head, max_new_tokens=20, ignore_eos=True)
    assert record.new_token_ids == hf_greedy(target, prompt, 20)


def test_bfloat16_training_warns_where_the_cpu_would_emulate_it(monkeypatch, capsys):
    """--train-dtype bfloat16 on a CPU without oneDNN bfloat16 (AVX2 only) warns once, naming the reason and
    the way out; float32, a capable CPU or a GPU device stay silent. (The probe is replaced: the warning must
    be checked on AVX-512 and AVX2 machines alike.)"""
    from dynatree.distill import eagle_train

    monkeypatch.setattr(eagle_train, "onednn_linear_problem", lambda dtype: "bf16 path needs avx512bw")
    line = eagle_train.warn_emulated_bfloat16(EagleConfig(train_dtype="bfloat16"), torch.device("cpu"))
    assert "emulated on this CPU (bf16 path needs avx512bw)" in line and "--train-dtype float32" in line
    assert capsys.readouterr().err.strip() == line
    assert eagle_train.warn_emulated_bfloat16(EagleConfig(train_dtype="float32"), torch.device("cpu")) is None
    assert eagle_train.warn_emulated_bfloat16(EagleConfig(train_dtype="bfloat16"), torch.device("cuda")) is None
    monkeypatch.setattr(eagle_train, "onednn_linear_problem", lambda dtype: None)
    assert eagle_train.warn_emulated_bfloat16(EagleConfig(train_dtype="bfloat16"), torch.device("cpu")) is None
    assert capsys.readouterr().err == ""


def test_soft_label_training_fits_the_targets_distribution_and_the_head_drafts_exactly(tmp_path, prompts):
    """--label-loss soft: each row learns the target's distribution over the sub-vocabulary (recorded in
    distill.json); the head still learns the target's choices and drafts exactly."""
    target = chat_target()
    out = tmp_path / "head"
    summary = distill_eagle(target, out, EagleConfig(**{**SMALL, "prompts": str(prompts), "label_loss": "soft"}),
                            progress=False)
    steps = [h for h in summary["history"] if "train_step_loss" in h]
    first, last = steps[0], steps[-1]
    # a random target's distributions are flat, so its argmax is learnt more slowly than from hard labels
    # (test above: +0.08), but learnt
    assert last["train_agreement_moving_avg"][0] > first["train_agreement_moving_avg"][0] + 0.05
    assert last["train_step_loss"] < first["train_step_loss"]
    assert summary["config"]["label_loss"] == "soft"
    prompt = target.tokenizer("w9 w10 w11 w4", add_special_tokens=False).input_ids
    record = generate(prompt_ids=prompt, method="dynatree", target=target, draft=str(out), max_new_tokens=20,
                      ignore_eos=True)
    assert record.new_token_ids == hf_greedy(target, prompt, 20)
    with pytest.raises(DynaTreeError, match="label_loss differ"):  # a checkpoint resumes with its own loss only
        distill_eagle(target, out, EagleConfig(**{**SMALL, "prompts": str(prompts)}), resume=True, progress=False)


@pytest.mark.parametrize("arch,why", [("granite", r"logits changed after the output layer \(logits_scaling = 4.0\)"),
                                      ("gemma2", r"logits changed after the output layer \(final_logit_softcapping = 30.0\)"),
                                      ("cohere", r"logits changed after the output layer \(logit_scale = 0.0625\)"),
                                      ("phi", "an output-layer bias")])
def test_soft_labels_are_refused_for_a_target_whose_logits_are_not_its_feature_times_its_output_layer(
        tmp_path, prompts, arch, why):
    """A soft-cap, a logit scale or divisor, or an output-layer bias makes the target's distribution other
    than softmax(feature @ output rows): soft labels would then not be the target's own, so they are refused
    by name. (Hard labels are the argmax of its real logits.)"""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"granite": {"logits_scaling": 4.0}, "gemma2": {"head_dim": 8}, "cohere": {}, "phi": {}}[arch]
    config = AutoConfig.for_model(arch, vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, **extra)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    target = LoadedModel(model=model, tokenizer=chat_target().tokenizer, name=f"tiny-{arch}", eos_ids=[2])
    cfg = EagleConfig(**{**SMALL, "prompts": str(prompts), "label_loss": "soft"})
    with pytest.raises(DynaTreeError, match=rf"^--label-loss soft needs logits that are the last feature times the "
                                            rf"output layer; tiny-{arch} \({arch}\) has {why}: use --label-loss hard$"):
        distill_eagle(target, tmp_path / "head", cfg, progress=False)
    assert not (tmp_path / "head").exists()  # refused before any work


@pytest.fixture()
def saved_chat(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    target = chat_target()
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def test_cli_kind_eagle_end_to_end_and_bad_input(tmp_path, prompts, saved_chat, capsys):
    argv = ["distill", "--kind", "eagle", "--target", str(saved_chat), "--out", str(tmp_path / "h"), "--quiet",
            "--prompts", str(prompts), "--self-prompts", "0", "--max-new-tokens", "8", "--draft-vocab", "50",
            "--unroll", "2", "--steps", "3", "--checkpoint-every", "2", "--seq-len", "32"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "feature head written to" in out
    assert "--warmup 30 is longer than --steps 3: warming up over all 3 steps" in err  # the default warm-up, cut
    record = json.loads((tmp_path / "h" / "distill.json").read_text())
    assert record["kind"] == "eagle" and {"step": 0, "warmup_cut": {"from": 30, "to": 3}} in record["history"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 20)
    first = json.dumps({"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]})
    broken = tmp_path / "broken.jsonl"  # a question file whose later lines are not questions
    broken.write_text(first + "\n{not json\n")
    uncategorised = tmp_path / "uncategorised.jsonl"
    uncategorised.write_text(first + "\n" + json.dumps({"question_id": 2, "turns": ["Hi?"]}) + "\n")
    for bad, message in [(["--prompts", str(broken)], "broken.jsonl:2: expected a Spec-Bench question"),
                         (["--prompts", str(uncategorised)], "uncategorised.jsonl:2: expected a Spec-Bench question"),
                         (["--layers", "2"], "--layers does not apply to --kind eagle"),
                         (["--unroll", "0"], "--unroll must be at least 1"),
                         (["--warmup", "-1"], "--warmup and --weight-decay must be at least 0"),
                         (["--train-dtype", "float16"], "--train-dtype must be float32 or bfloat16"),
                         (["--label-dtype", "float16"], "--label-dtype must be target or bfloat16"),
                         (["--label-loss", "kl"], "--label-loss must be hard or soft"),
                         (["--prompts", str(empty)], "holds no prompts"),
                         (["--prompts", str(binary)], "UTF-8"),
                         (["--prompts", str(tmp_path)], "is a directory"),
                         (["--prompts", "/dev/null"], "is not a regular file"),
                         (["--prompts", str(tmp_path / "nope")], "neither 'specbench', 'specbench-asks' nor an existing file")]:
        args = [*argv[:6], str(tmp_path / "x"), *argv[7:], *bad]
        assert main(args) == 2, bad
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (bad, err)
    assert main(["distill", "--out", str(tmp_path / "y"), "--unroll", "2"]) == 2
    assert "--unroll does not apply to --kind lm" in capsys.readouterr().err


def test_lm_kind_takes_instruction_prompts_through_the_chat_template(tmp_path, prompts):
    from dynatree.distill import lm_data

    target = chat_target()
    cfg = lm_data.DistillConfig(layers=1, hidden=16, heads=2, ffn=32, corpus_tokens=0, gen_prompts=16, gen_tokens=12,
                                prompts=str(prompts), chat=True, seq_len=16, top_k=4, steps=3, batch_size=2,
                                checkpoint_every=3, eval_fraction=0.2, save_dtype="float32")
    data = lm_data.build_data(target, cfg, progress=False)
    assert data["info"]["instruction_prompts"]["used"] == 16
    windows = data["sources"]["on_policy"]["tokens"]
    assert int((windows == 3).sum()) >= 12  # the template's end-of-turn word after (most) prompts
    assert int((windows == 4).sum()) >= 12  # and its generation prompt
    with pytest.raises(DynaTreeError, match="--chat applies to --prompts"):
        lm_data.DistillConfig(chat=True).validate()


def test_a_resumed_run_may_change_its_steps_and_records_where(tmp_path, prompts):
    """--resume continues from the checkpoint with the same options; only --steps may change (a run cut
    short or extended), never below what was trained, and the history says where it changed."""
    target = chat_target()
    out = tmp_path / "head"
    cfg = EagleConfig(**{**SMALL, "prompts": str(prompts), "steps": 4, "checkpoint_every": 2})
    distill_eagle(target, out, cfg, progress=False)
    summary = distill_eagle(target, out, dataclasses.replace(cfg, steps=6), resume=True, progress=False)
    assert {"step": 4, "steps_changed": {"from": 4, "to": 6}} in summary["history"]
    assert summary["history"][-1]["step"] == 6 and summary["config"]["steps"] == 6
    with pytest.raises(DynaTreeError, match="--steps 3 is below the 6 steps"):
        distill_eagle(target, out, dataclasses.replace(cfg, steps=3), resume=True, progress=False)
    with pytest.raises(DynaTreeError, match=r"\(lr differ\); resume with the same options \(only --steps may change\)"):
        distill_eagle(target, out, dataclasses.replace(cfg, steps=6, lr=0.5), resume=True, progress=False)
    # a checkpoint written before an option existed resumes with that option at its default only
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    del state["config"]["train_dtype"]
    torch.save(state, out / "checkpoint.pt")
    with pytest.raises(DynaTreeError, match=r"\(train_dtype differ\)"):
        distill_eagle(target, out, dataclasses.replace(cfg, steps=8, train_dtype="bfloat16"), resume=True, progress=False)
    assert distill_eagle(target, out, dataclasses.replace(cfg, steps=8), resume=True, progress=False)["history"][-1]["step"] == 8


def test_feature_noise_is_a_seeded_share_of_each_features_rms_and_spares_padding():
    feats = torch.randn(2, 5, 8) * torch.tensor([0.5, 4.0])[:, None, None]
    feats[1, 3:] = 0.0  # padding rows
    assert noisy_features(feats, 0.0, 7) is feats
    before = feats.clone()
    a, b, c = noisy_features(feats, 0.2, 7), noisy_features(feats, 0.2, 7), noisy_features(feats, 0.2, 8)
    assert torch.equal(feats, before)  # a copy: the batch's own features (and the loss's targets) stay clean
    assert torch.equal(a, b) and not torch.equal(a, c)
    rms = feats.pow(2).mean(-1, keepdim=True).sqrt()
    moved = (a - feats).abs()
    assert bool((moved <= 0.2 * rms + 1e-6).all()) and bool((moved.amax(-1) > 0.1 * rms[..., 0])[rms[..., 0] > 0].all())
    assert torch.equal(a[1, 3:], feats[1, 3:])


def test_feature_noise_trains_a_head_that_drafts_exactly_and_a_resumed_run_replays_its_noise(tmp_path, prompts,
                                                                                              monkeypatch):
    """The noise changes training (another head than without it), is drawn once per training step and
    never in the held-out evaluation, is drawn per step (a run resumed half-way ends with the same
    weights as one run straight through), is recorded, and the head it trains is a drafter like any
    other (greedy output stays the target's)."""
    import dynatree.distill.eagle_train as eagle_train

    draws = []
    monkeypatch.setattr(eagle_train, "noisy_features",
                        lambda feats, share, seed: draws.append(seed) or noisy_features(feats, share, seed))
    target = chat_target()
    cfg = EagleConfig(**{**SMALL, "prompts": str(prompts), "steps": 6, "checkpoint_every": 3, "feature_noise": 0.3})
    straight = distill_eagle(target, tmp_path / "straight", cfg, progress=False)
    assert len(draws) == len(set(draws)) == 6  # one per step, each its own seed; none in the evaluations (checkpoints and the final one)
    assert straight["config"]["feature_noise"] == 0.3
    distill_eagle(target, tmp_path / "halves", dataclasses.replace(cfg, steps=3), progress=False)
    distill_eagle(target, tmp_path / "halves", cfg, resume=True, progress=False)
    distill_eagle(target, tmp_path / "plain", dataclasses.replace(cfg, feature_noise=0.0), progress=False)
    weights = {name: torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["model"]
               for name in ("straight", "halves", "plain")}
    assert all(torch.equal(v, weights["halves"][k]) for k, v in weights["straight"].items())
    assert not all(torch.equal(v, weights["plain"][k]) for k, v in weights["straight"].items())
    with pytest.raises(DynaTreeError, match=r"\(feature_noise differ\)"):
        distill_eagle(target, tmp_path / "plain", dataclasses.replace(cfg, steps=8), resume=True, progress=False)
    prompt = target.tokenizer("w9 w10 w11 w4", add_special_tokens=False).input_ids
    record = generate(prompt_ids=prompt, method="dynatree", target=target, draft=load_head(tmp_path / "straight"),
                      max_new_tokens=20, ignore_eos=True)
    assert record.new_token_ids == hf_greedy(target, prompt, 20)
    with pytest.raises(DynaTreeError, match="--feature-loss and --feature-noise at least 0"):
        EagleConfig(feature_noise=-0.1).validate()


def test_saved_pieces_of_a_low_bit_target_are_kept_apart_from_the_dense_ones(tmp_path):
    """A q4 target of the same name writes other answers: its pieces are named apart; a dense target's
    names stay what the committed data was saved under."""
    from dynatree.distill.eagle_data import _chunk_key, _part_path

    dense = chat_target()
    q4 = dataclasses.replace(dense, weights="q4")  # a new record: the shared target is not mutated
    cfg = EagleConfig(prompts="")
    name = lambda t: _part_path(tmp_path, "answers", _chunk_key(t, 0, cfg), ".json.gz")  # noqa: E731
    assert name(dense) != name(q4)
    assert _chunk_key(dense, 0, cfg)[0] == dense.name and _chunk_key(q4, 0, cfg)[0] == f"{dense.name}@q4"
    half = dataclasses.replace(dense, model=tiny("llama", seed=4, dtype=torch.bfloat16).model)  # dense bfloat16
    assert _chunk_key(half, 0, cfg)[0] == f"{dense.name}@bfloat16" and name(half) not in (name(dense), name(q4))


def test_a_new_head_is_seeded_by_its_config_and_leaves_the_callers_generator_alone():
    """new_head initializes from torch's global generator: seeded by cfg.seed (two builds equal), and the
    caller's generator state given back (rng.py), not reseeded behind its back."""
    from dynatree.distill.eagle_train import new_head

    target = tiny("llama", dtype=torch.float32)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    heads = [new_head(target, EagleConfig(**{**SMALL, "seed": s}), torch.arange(60)) for s in (7, 7, 8)]
    assert torch.equal(torch.get_rng_state(), before)
    same = [torch.equal(a, b) for a, b in zip(heads[0].state_dict().values(), heads[1].state_dict().values())]
    other = [torch.equal(a, b) for a, b in zip(heads[0].state_dict().values(), heads[2].state_dict().values())]
    assert all(same) and not all(other)


def _plain_unrolled_loss(head, embed, out_rows, batch, cfg):
    """unrolled_loss as it was before output_loss: the output layer on every row of the padded batch,
    F.cross_entropy on the learnt rows, argmax over all (the reference); also each pass's predictions."""
    from transformers import DynamicCache

    tokens, feats, labels, valid, positions = (batch[k] for k in ("tokens", "features", "labels", "valid", "positions"))
    B, L = tokens.shape
    with torch.no_grad():
        embeds = embed(tokens).float()
    cache, total, stats, preds, prev = DynamicCache(), 0.0, [], [], None
    for depth in range(1, cfg.unroll + 1):
        feature_in = feats if depth == 1 else torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        out = head(embeds, feature_in, positions, _pass_mask(L, depth).expand(B, 1, L, depth * L), cache)
        logits = out @ out_rows.T
        rows = valid & (torch.arange(L) >= depth - 1)[None]
        learn = rows & batch["covered"]
        if cfg.loss_rows == "answers":
            learn = learn & batch["answer"]
        if bool(learn.any()):
            if cfg.label_loss == "soft":  # against the target's distribution at its next feature
                p = (batch["next_features"][learn] @ out_rows.T).softmax(-1)
                ce = -(p * logits[learn].log_softmax(-1)).sum(-1).mean()
            else:
                ce = torch.nn.functional.cross_entropy(logits[learn], batch["sub_labels"][learn])
            total = total + cfg.decay ** (depth - 1) * ce
            if depth == 1 and cfg.feature_loss:
                total = total + cfg.feature_loss * torch.nn.functional.smooth_l1_loss(out[learn], batch["next_features"][learn])
        pred = batch["head_vocab"][logits.argmax(-1)]
        hit = (pred == labels) & rows
        answer = rows & batch["answer"]
        stats.append((int(hit.sum()), int(rows.sum()), int((hit & answer).sum()), int(answer.sum())))
        preds.append(pred)
        prev = out
    return total, stats, preds


@pytest.mark.skipif(not ON_CPU, reason="the reference builds its rows on the CPU")
@pytest.mark.parametrize("loss_rows,label_loss", [("all", "hard"), ("answers", "hard"), ("all", "soft"),
                                                ("answers", "soft")])
def test_the_unrolled_loss_equals_the_plain_route_on_packed_and_padded_batches(loss_rows, label_loss):
    """Packed sequences (make_batch's default) and the output layer's loss on the real rows a block at a
    time (output_loss.py) give the plain route's loss, statistics and parameter gradients (one sequence
    per batch row, right-padded, logits of every row): three passes, the feature loss, labels outside
    the sub-vocabulary, hits at every depth; float32 and bfloat16 autocast."""
    from helpers import tiny_head
    from dynatree.distill.eagle_train import unrolled_loss

    target, head = tiny("llama", dtype=torch.float32), tiny_head("llama", dtype=torch.float32)
    vocab = head.vocab_ids.cpu()
    gen = torch.Generator().manual_seed(1)
    lengths = [30, 12, 21, 5, 40]
    data = {"tokens": [torch.randint(5, 90, (n,), generator=gen) for n in lengths],
            "features": [torch.randn(n, 32, generator=gen) for n in lengths],
            "labels": [torch.randint(0, target.vocab_size, (n,), generator=gen) for n in lengths],
            "answer_from": [10, None, 4, 3, 20]}
    sub_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    sub_index[vocab] = torch.arange(len(vocab))
    picked = list(range(len(lengths)))
    embed, out_rows = target.model.get_input_embeddings(), target.model.get_output_embeddings().weight[vocab].detach()
    cfg = EagleConfig(unroll=3, feature_loss=0.1, loss_rows=loss_rows, seq_len=64, label_loss=label_loss)
    # labels the head gets right at each depth on some rows, the rest random (some outside the sub-vocabulary)
    _, _, preds = _plain_unrolled_loss(head, embed, out_rows, make_batch(data, picked, 64, sub_index, vocab, pack=False), cfg)
    for b, n in enumerate(lengths):  # batch row b, row j is sequence b's label at j + 1
        pick = torch.randint(0, 4, (n - 1,), generator=gen)
        for depth in range(3):
            data["labels"][b][1:] = torch.where(pick == depth, preds[depth][b, :n - 1], data["labels"][b][1:])
    plain = make_batch(data, picked, 64, sub_index, vocab, pack=False)
    packed = make_batch(data, picked, 64, sub_index, vocab)
    unrounded = make_batch(data, picked, 64, sub_index, vocab, multiple=1)  # (the rows' length not rounded to 64)
    assert packed["tokens"].shape[1] == 64 and unrounded["tokens"].shape[1] == 39
    assert packed["tokens"].shape[0] < plain["tokens"].shape[0]  # (sequences share batch rows)
    assert not plain["covered"][plain["valid"]].all() and not plain["valid"].all()
    for autocast in (False, True):
        grads = []
        for route, batch in ((unrolled_loss, packed), (unrolled_loss, unrounded), (unrolled_loss, plain),
                             (lambda *a: _plain_unrolled_loss(*a)[:2], plain)):
            head.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss, stats = route(head, embed, out_rows, batch, cfg)
            loss.backward()
            grads.append((loss.detach(), stats, [p.grad.clone() for p in head.parameters() if p.grad is not None]))
        ref_loss, ref_stats, ref_grad = grads[-1]
        for loss, stats, grad in grads[:-1]:
            assert all(s[0] > 0 for s in stats)  # every depth has hits
            if autocast:  # rows alike; a bfloat16 product blocked otherwise may round a near-tie apart
                assert [s[1::2] for s in stats] == [s[1::2] for s in ref_stats]
                assert all(abs(a - b) <= 2 for s, r in zip(stats, ref_stats) for a, b in zip(s[::2], r[::2]))
            else:
                assert stats == ref_stats
            torch.testing.assert_close(loss, ref_loss, rtol=5e-3 if autocast else 1e-5, atol=1e-5)
            if not autocast:  # (under autocast the two round their products apart: compared in test_output_loss)
                assert len(grad) == len(ref_grad)
                for a, b in zip(grad, ref_grad):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
