"""Spec-Bench offline: the shipped question file, task selection, question files, multi-turn
questions asked with the run's own history, and Spec-Bench's per-task table."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from helpers import tiny, tokenizer
from dynatree.bench import presets, report, results, runner
from dynatree import api
from dynatree.prompts import SPEC_BENCH_FILE, SPEC_BENCH_TASKS, Prompt, load_texts, tokenize
from dynatree.cli import main
from dynatree.errors import DynaTreeError
from dynatree.runtime import LoadedModel

# a chat template for the word-level test tokenizer: user turns after w3, answers after w4
TEMPLATE = ("{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w4{% endif %}")


def chat_tiny() -> LoadedModel:
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = TEMPLATE
    base = tiny("llama", seed=5, eos_ids=[])
    return LoadedModel(model=base.model, tokenizer=tok, name="tiny-chat", eos_ids=[])


@pytest.fixture()
def questions(tmp_path):
    """A question file in Spec-Bench's format: two two-turn MT-Bench rows, two single-turn qa rows."""
    rows = [{"question_id": 1, "category": "writing", "turns": ["w5 w6 w7", "w8 w9"]},
            {"question_id": 2, "category": "coding", "turns": ["w10 w11", "w12 w13 w14"]},
            {"question_id": 3, "category": "qa", "turns": ["w20 w21 w22"]},
            {"question_id": 4, "category": "qa", "turns": ["w23 w24"], "reference": ["ignored"]}]
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_the_shipped_question_file_and_its_license_notice():
    assert SPEC_BENCH_FILE.is_file()
    folder = SPEC_BENCH_FILE.parent
    assert "Apache License" in (folder / "LICENSE").read_text() and "Spec-Bench" in (folder / "NOTICE").read_text()
    prompts = load_texts("specbench", 2)
    assert [p.category for p in prompts] == list(SPEC_BENCH_TASKS) * 2  # n per task, taken in turn
    assert all(p.turn == 1 and p.text.strip() for p in prompts)
    rows = [json.loads(line) for line in SPEC_BENCH_FILE.read_text().splitlines() if line.strip()]
    first = next(r for r in rows if r["category"] == "translation")
    assert prompts[1].text == first["turns"][0] and prompts[1].id == f"specbench:{first['question_id']}"


def test_tasks_categories_and_named_subsets():
    qa_rag = load_texts("specbench:qa,rag", 3)
    assert [p.category for p in qa_rag] == ["qa", "rag"] * 3
    coding = load_texts("specbench:coding", 1, turns="all")  # an MT-Bench category: both of its turns
    assert [(p.category, p.turn) for p in coding] == [("coding", 1), ("coding", 2)]
    assert coding[1].earlier == (coding[0].text,) and coding[1].question == coding[0].question
    assert {p.category for p in load_texts("mtbench", 4)} == {"mt_bench"}  # offline, from Spec-Bench's rows
    assert {p.category for p in load_texts("gsm8k", 4)} == {"math_reasoning"}
    with pytest.raises(DynaTreeError, match="unknown Spec-Bench task 'chat'; choose from mt_bench, translation"):
        load_texts("specbench:chat", 1)
    with pytest.raises(DynaTreeError, match="task 'rag' has 77 questions, fewer than the 78 asked for"):
        load_texts("specbench:rag", 78)
    with pytest.raises(DynaTreeError, match="--turns must be one of first, all"):
        load_texts("specbench", 1, turns="both")


def test_dataset_lists_keep_tasks_with_their_specbench():
    proto = runner.Protocol(dataset="specbench:qa,rag,humaneval,specbench,gsm8k")
    assert proto.datasets == ["specbench:qa,rag", "humaneval", "specbench", "gsm8k"]


def test_question_files_and_their_errors(questions, tmp_path):
    prompts = load_texts(str(questions), 1, turns="all")  # 1 question per task: mt_bench and qa
    assert [(p.id, p.category, p.turn) for p in prompts] == [
        ("questions.jsonl:1", "mt_bench", 1), ("questions.jsonl:1/2", "mt_bench", 2), ("questions.jsonl:3", "qa", 1)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["w5"]}) + "\n"
                   + json.dumps({"question_id": 2, "turns": ["w6"]}) + "\n")
    with pytest.raises(DynaTreeError, match=r"bad.jsonl:2: expected a Spec-Bench question"):
        load_texts(str(bad), 1)
    empty = tmp_path / "empty-turn.jsonl"
    empty.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": [" "]}) + "\n")
    with pytest.raises(DynaTreeError, match="empty-turn.jsonl:1: \"turns\" must be a non-empty list"):
        load_texts(str(empty), 1)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DynaTreeError, match="is not UTF-8 text"):
        load_texts(str(binary), 1)
    with pytest.raises(DynaTreeError, match="is a directory"):
        load_texts(str(tmp_path), 1)


def test_later_turns_carry_the_history_and_chat_prompts_are_shortened_whole():
    tok = chat_tiny().tokenizer
    turn2 = Prompt(id="q/2", text="w8 w9", question="q", earlier=("w5 w6 w7",))
    ids = tokenize(tok, turn2, 100, chat=True, answers=("w40 w41",))
    assert tok.decode(ids) == "w3 w5 w6 w7 w4 w40 w41 w3 w8 w9 w4"
    with pytest.raises(DynaTreeError, match="need the chat template"):
        tokenize(tok, turn2, 100, chat=False, answers=("w40 w41",))
    long = Prompt(id="long", text=" ".join(f"w{i}" for i in range(10, 60)))
    cut = tokenize(tok, long, 12, chat=True)
    assert len(cut) <= 12 and tok.decode(cut).startswith("w3 w10 w11") and tok.decode(cut).endswith("w4")
    assert tokenize(tok, long, 12)[:3] == tok("w10 w11 w12").input_ids  # no template: the first 12 tokens
    with pytest.raises(DynaTreeError, match="the chat template and history alone exceed --l-max 3"):
        tokenize(tok, turn2, 3, chat=True, answers=("w40 w41",))


def test_multi_turn_run_asks_later_turns_with_the_answers_and_reports_per_task(questions, tmp_path):
    target = chat_tiny()
    variants = presets.method_variants(["ar", "dynatree"], ["ngram"])
    proto = runner.Protocol(dataset=str(questions), n=2, warmup=1, max_new_tokens=[6], chat=True, turns="all")
    res = runner.run("spec", variants, proto, target, {}, out_dir=tmp_path, progress=False)
    recs = res["records"]
    assert [(r["prompt_id"], r["turn"], r["category"]) for r in recs if r["variant"] == "ar"] == [
        ("questions.jsonl:1", 1, "mt_bench"), ("questions.jsonl:1/2", 2, "mt_bench"), ("questions.jsonl:3", 1, "qa"),
        ("questions.jsonl:2", 1, "mt_bench"), ("questions.jsonl:2/2", 2, "mt_bench"), ("questions.jsonl:4", 1, "qa")]
    assert all(r["matches_ar"] for r in recs)
    # the second turn of question 2 was asked after its first turn and the (greedy: common) answer to it
    prompts = load_texts(str(questions), 2, turns="all")
    first = tokenize(target.tokenizer, prompts[3], proto.l_max[0], chat=True)
    answer = api.generate(method="ar", target=target, prompt_ids=first, max_new_tokens=6, ignore_eos=True).text
    expected = tokenize(target.tokenizer, prompts[4], proto.l_max[0], chat=True, answers=(answer,))
    assert len(expected) > len(first) + 3  # the history is in it
    second = [r for r in recs if r["prompt_id"] == "questions.jsonl:2/2"]
    assert {r["prompt_sha1"] for r in second} == {hashlib.sha1(json.dumps(expected).encode()).hexdigest()}
    table = report.category_table(results.load(tmp_path), 6, proto.l_max[0])
    assert "| Variant | mt_bench | qa | overall |" in table
    assert "prompts per task: mt_bench 2, qa 2, overall 4" in table  # the warm-up question (both its turns) left out
    assert [r["warmup"] for r in recs if r["variant"] == "ar"] == [True, True, False, False, False, False]
    rows = {(c["variant"], c["category"]): c for c in results.by_category(recs)}
    ar, dyna = rows[("ar", "overall")], rows[("dynatree", "overall")]
    assert ar["speedup"] == 1.0 and dyna["n"] == 4
    measured = [r for r in recs if r["variant"] == "dynatree" and not r["warmup"]]
    total = sum(r["stats"]["new_tokens"] for r in measured) / sum(r["stats"]["wall_s"] for r in measured)
    assert dyna["tokens_per_s"] == pytest.approx(total)
    written = report.write(tmp_path)
    assert "**Spec-Bench tasks**" in (tmp_path / "report.md").read_text()
    assert tmp_path / "tasks.png" in written and (tmp_path / "tasks.png").stat().st_size > 0


def test_each_variant_asks_a_later_turn_after_its_own_answer(questions):
    """Spec-Bench's protocol: a sampled run's variants answer the first turn differently, and each
    is asked the second turn with its own answer in the history (not ar's); a greedy record asked
    after another history than ar's does not count as matching ar."""
    target = chat_tiny()
    variants = presets.method_variants(["ar", "dynatree"], ["ngram"])
    proto = runner.Protocol(dataset=str(questions), n=1, warmup=0, max_new_tokens=[6], chat=True, turns="all",
                            sample=True, ppl=False, seed=1)
    recs = runner.run("spec", variants, proto, target, {}, progress=False)["records"]
    prompts = load_texts(str(questions), 1, turns="all")
    first = tokenize(target.tokenizer, prompts[0], proto.l_max[0], chat=True)
    asked = {}
    for v in variants:  # each variant's own first answer, drawn again with the run's seed
        own = api.generate(method=v.method, target=target, prompt_ids=first, max_new_tokens=6, ignore_eos=True,
                           sample=True, seed=1)
        second = tokenize(target.tokenizer, prompts[1], proto.l_max[0], chat=True, answers=(own.text,))
        asked[v.label] = hashlib.sha1(json.dumps(second).encode()).hexdigest()
    assert asked["ar"] != asked["dynatree"]  # the two drew different answers (else the test shows nothing)
    got = {r["variant"]: r["prompt_sha1"] for r in recs if r["turn"] == 2}
    assert got == asked



def test_a_later_turn_s_history_ends_at_the_answer_s_first_eos():
    target = chat_tiny()
    target.eos_ids = [2]
    assert runner._answer(target, [40, 41, 2, 50, 51]) == "w40 w41"  # a run ignoring EOS went on past it
    assert runner._answer(target, [40, 41]) == "w40 w41"


def test_turns_all_needs_chat_and_cli_errors(capsys, saved_tiny):
    with pytest.raises(DynaTreeError, match="--turns all asks later turns"):
        runner.Protocol(dataset="specbench", turns="all").validate()
    assert main(["bench", "--target", str(saved_tiny), "--methods", "ar", "--dataset", "specbench:chit-chat",
                 "--n", "2", "--warmup", "0", "--max-new-tokens", "4", "--no-progress"]) == 2
    assert "unknown Spec-Bench task 'chit-chat'" in capsys.readouterr().err
