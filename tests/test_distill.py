"""`dynatree distill` on tiny random targets: the loss falls, the output loads and drafts
exactly, checkpoints resume to the same weights, HumanEval text is kept out, bad input fails."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
import torch

from helpers import DEVICE, VOCAB, hf_greedy, tiny, tokenizer
from dynatree import DynaTreeError
from dynatree.distill import lm_data, lm_train
from dynatree.api import generate
from dynatree import prompts as bench_data
from dynatree.cli import main
from dynatree.models import check_compatible, load_model

SMALL = dict(layers=2, hidden=16, heads=2, ffn=32, corpus_tokens=1200, gen_prompts=0, seq_len=32, top_k=4, steps=30,
             batch_size=4, lr=1e-2, warmup=3, checkpoint_every=10, eval_fraction=0.2, save_dtype="float32")


@pytest.fixture()
def corpus(tmp_path):
    """Word-level 'text' with repeated phrases, so the target's predictions have structure to learn."""
    rng = random.Random(0)
    phrases = [" ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(6)) for _ in range(12)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(phrases) for _ in range(8)) for _ in range(60)))
    return path


def _target():
    return tiny("llama", seed=2, dtype=torch.float32, eos_ids=[2])


def test_distillation_lowers_the_loss_and_writes_a_loadable_draft(tmp_path, corpus):
    target = _target()
    cfg = lm_data.DistillConfig(corpus=str(corpus), **SMALL)
    out = tmp_path / "draft"
    summary = lm_train.distill(target, out, cfg, progress=False, command=["test"])

    data = torch.load(out / "data.pt", weights_only=True)
    _, held = lm_train.split(data, cfg.eval_fraction)
    before = lm_train.evaluate(lm_train.init_draft(target, cfg), held, "cpu", 4)["corpus"]
    after = summary["held_out"]["corpus"]
    assert after["loss"] < before["loss"] - 0.2
    assert after["agreement"] > before["agreement"]
    assert [h["step"] for h in summary["history"]] == [10, 20, 30]
    # training figures are labelled moving averages; held-out ones are exact (issue 37)
    assert {"train_loss_moving_avg", "train_agreement_moving_avg", "held_out"} <= set(summary["history"][-1])

    on_disk = json.loads((out / "distill.json").read_text())
    assert on_disk["config"]["hidden"] == 16 and on_disk["data"]["corpus_tokens"] == 1184  # 37 windows of 32
    assert on_disk["env"]["versions"]["torch"] and on_disk["command"] == ["test"]

    draft = load_model(str(out), device=str(DEVICE))  # like any HF checkpoint directory
    assert draft.vocab_size == target.vocab_size and draft.model.config.num_hidden_layers == 2
    check_compatible(target, draft)  # same tokenizer, same ids
    for prompt in ([5, 6, 7, 5, 6], target.tokenizer(" ".join(corpus.read_text().split()[:12])).input_ids):
        rec = generate(prompt_ids=prompt, method="dynatree", target=target, draft=draft, max_new_tokens=24,
                       ignore_eos=True)
        assert rec.new_token_ids == hf_greedy(target, prompt, 24)
    assert rec.stats.accepted_tokens > 0  # on the corpus's own text the distilled draft's paths are committed


def test_resume_from_a_checkpoint_reaches_the_same_weights(tmp_path, corpus, monkeypatch):
    target = _target()
    cfg = lm_data.DistillConfig(corpus=str(corpus), **{**SMALL, "steps": 20})
    lm_train.distill(target, tmp_path / "whole", cfg, progress=False)

    real_loss, calls = lm_train.distill_loss, []

    def crash_after_step_12(*args):
        calls.append(1)
        if sum(calls) > 12 + 2:  # 12 training steps + the 2 held-out batches evaluated at step 10
            raise KeyboardInterrupt
        return real_loss(*args)

    monkeypatch.setattr(lm_train, "distill_loss", crash_after_step_12)
    with pytest.raises(KeyboardInterrupt):
        lm_train.distill(target, tmp_path / "resumed", cfg, progress=False)
    monkeypatch.setattr(lm_train, "distill_loss", real_loss)
    assert torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=False)["step"] == 10
    with pytest.raises(DynaTreeError, match="pass --resume"):
        lm_train.distill(target, tmp_path / "resumed", cfg, progress=False)
    with pytest.raises(DynaTreeError, match="lr differ"):
        lm_train.distill(target, tmp_path / "resumed", dataclasses.replace(cfg, lr=0.5), resume=True, progress=False)
    lm_train.distill(target, tmp_path / "resumed", cfg, resume=True, progress=False)

    whole, resumed = (load_model(str(tmp_path / d)).model.state_dict() for d in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_warmup_longer_than_the_run_is_cut_and_kept_when_resumed():
    """--warmup above --steps: the run warms up over all its steps (reaching --lr at the last one) and
    says so; a resumed run keeps the warm-up it started with, even with more --steps."""
    from dynatree.distill.common import lr_at, warmup_of

    cfg = lm_data.DistillConfig(**{**SMALL, "steps": 4, "warmup": 60})
    history: list = []
    warmup = warmup_of(cfg, None, history)
    assert warmup == 4 and history == [{"step": 0, "warmup_cut": {"from": 60, "to": 4}}]
    assert [lr_at(step, cfg, warmup) for step in range(4)] == pytest.approx([cfg.lr * k / 4 for k in (1, 2, 3, 4)])
    longer = dataclasses.replace(cfg, steps=100)
    assert warmup_of(longer, {"warmup": 4}, []) == 4  # resumed with more steps: its own warm-up
    assert lr_at(4, longer, 4) == pytest.approx(cfg.lr)  # decays from the peak, no second warm-up
    assert warmup_of(longer, {}, []) == 60  # a checkpoint saved before the warm-up was: as trained
    assert warmup_of(dataclasses.replace(cfg, warmup=3), None, []) == 3


def test_on_policy_data_is_the_targets_greedy_continuation(tmp_path):
    target = _target()
    prompts = ["w5 w6 w7", "w10 w11 w12 w13 w14"]
    gen = lm_data.generate_on_policy(target, prompts, 7, batch=2)
    for text, ids in zip(prompts, gen):
        prompt = tokenizer()(text, add_special_tokens=False)["input_ids"]
        assert ids == prompt + hf_greedy(target, prompt, 7)  # left padding in the batch changes nothing


def test_on_policy_text_in_another_dtype_comes_from_a_copy_of_the_target(monkeypatch):
    target = _target()
    prompts = ["w5 w6 w7", "w10 w11 w12 w13 w14"]
    half = tiny("llama", seed=2, dtype=torch.bfloat16, eos_ids=[2])  # the same weights, rounded to bf16
    generate, used = type(target.model).generate, []

    def spy(model, *args, **kwargs):
        used.append((model is target.model, model.dtype))
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(type(target.model), "generate", spy)
    gen = lm_data.generate_on_policy(target, prompts, 7, batch=2, dtype="bfloat16")
    assert used == [(False, torch.bfloat16)]
    for text, ids in zip(prompts, gen):
        prompt = tokenizer()(text, add_special_tokens=False)["input_ids"]
        assert ids == prompt + hf_greedy(half, prompt, 7)
    assert target.model.dtype == torch.float32  # the target itself (which labels the data) is untouched


def test_init_draft_continues_training_an_existing_draft(tmp_path, corpus):
    target = _target()
    first = lm_data.DistillConfig(corpus=str(corpus), **SMALL)
    lm_train.distill(target, tmp_path / "first", first, progress=False)
    start = load_model(str(tmp_path / "first")).model

    # its own sizes win over the size options, and training starts from its weights
    cfg = dataclasses.replace(first, init_draft=str(tmp_path / "first"), layers=3, hidden=32, seed=1)
    model = lm_train.init_draft(target, cfg)
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 16
    assert all(torch.equal(v, start.state_dict()[k]) for k, v in model.state_dict().items())

    summary = lm_train.distill(target, tmp_path / "second", cfg, progress=False)
    data = torch.load(tmp_path / "second" / "data.pt", weights_only=True)
    _, held = lm_train.split(data, cfg.eval_fraction)
    fresh = lm_train.evaluate(lm_train.init_draft(target, dataclasses.replace(first, seed=1)), held, "cpu", 4)["corpus"]
    continued = lm_train.evaluate(model, held, "cpu", 4)["corpus"]
    assert continued["loss"] < fresh["loss"] - 0.2  # the first draft's training carries over
    assert summary["config"]["init_draft"] == str(tmp_path / "first")
    assert "2 layers, hidden 16" in (tmp_path / "second" / "README.md").read_text()

    wrong_vocab = tiny("llama", seed=2, dtype=torch.float32, eos_ids=[2], vocab=VOCAB + 8)
    with pytest.raises(DynaTreeError, match="vocabulary of"):
        lm_train.init_draft(wrong_vocab, cfg)
    with pytest.raises(DynaTreeError, match="not a draft directory"):
        dataclasses.replace(first, init_draft=str(tmp_path / "nope")).validate()
    with pytest.raises(DynaTreeError, match=re.escape("unknown dtype 'float8'; choose one of float32, float16")):
        dataclasses.replace(first, gen_dtype="float8").validate()


def test_function_prompts_are_headers_with_docstrings_and_skip_humaneval():
    source = '''
def documented(a, b):
    """Return the sum of a and b, checking both are numbers first."""
    return a + b

def short(x):
    """Too short."""
    return x

class K:
    @staticmethod
    def method(self):
        """A method whose docstring is long enough to become a prompt."""
        return 1
'''
    prompts = lm_data.function_prompts([source], 10, seed=0, banned=set())
    assert sorted(prompts) == sorted([
        'def documented(a, b):\n    """Return the sum of a and b, checking both are numbers first."""\n',
        '@staticmethod\ndef method(self):\n    """A method whose docstring is long enough to become a prompt."""\n',
    ])
    banned = {'"""Return the sum of a and b, checking both are numbers first."""'}
    assert len(lm_data.function_prompts([source], 10, seed=0, banned=banned)) == 1


def test_humaneval_text_never_enters_the_training_data(tmp_path):
    """A corpus file holding a HumanEval prompt line is dropped (and counted); clean files stay."""
    problem = bench_data.humaneval_prompts()[0].text
    line = next(x.strip() for x in problem.splitlines() if len(x.strip()) >= 30)
    assert line in lm_data.humaneval_lines()
    (tmp_path / "leak.py").write_text("x = 1\n" + problem)
    (tmp_path / "clean.txt").write_text(" ".join(f"w{3 + i % 90}" for i in range(400)))
    target = _target()
    cfg = lm_data.DistillConfig(corpus=str(tmp_path), **{**SMALL, "corpus_tokens": 200})
    data = lm_data.build_data(target, cfg, progress=False)
    assert data["info"]["corpus_files_dropped_for_humaneval"] == 1 and data["info"]["corpus_files"] == 1
    assert torch.equal(data["sources"]["corpus"]["tokens"][0, :5], torch.tensor([3, 4, 5, 6, 7], dtype=torch.int32))


def test_copy_windows_repeat_earlier_spans_of_the_same_window():
    pool = list(range(1000, 3000))  # all distinct: a repeat can only come from copying
    windows = lm_data.copy_windows(pool, n_windows=6, seq_len=64, seed=3)
    assert windows.shape == (6, 64) and set(windows.flatten().tolist()) <= set(pool)
    assert torch.equal(windows, lm_data.copy_windows(pool, 6, 64, seed=3))  # seeded
    for row in windows.tolist():
        grams = [tuple(row[i: i + 8]) for i in range(64 - 7)]
        assert len(set(grams)) < len(grams), row  # some 8-token span comes back later in the window
    with pytest.raises(DynaTreeError, match="copy from"):
        lm_data.copy_windows(pool[:100], 1, 64, seed=0)


def test_copy_windows_come_from_training_text_only(tmp_path):
    """The copy source is labelled by the target and built from the training windows, never the held-out ones."""
    (tmp_path / "text.txt").write_text(" ".join(f"w{3 + i % 40}" for i in range(960)) + " "
                                       + " ".join(f"w{50 + i % 40}" for i in range(240)))
    target = _target()
    cfg = lm_data.DistillConfig(corpus=str(tmp_path), **{**SMALL, "copy_tokens": 320})
    data = lm_data.build_data(target, cfg, progress=False)
    corpus, copied = data["sources"]["corpus"], data["sources"]["copy"]
    _, held = lm_train.split(data, cfg.eval_fraction)
    assert set(held["corpus"]["tokens"].flatten().tolist()) == {50 + i for i in range(40)}  # the last 240 words
    assert copied["tokens"].shape == (10, 32) and max(copied["tokens"].flatten().tolist()) < 50
    ids, probs = lm_data.label(target, copied["tokens"].long(), cfg.top_k, 4)
    assert torch.equal(ids, copied["top_ids"]) and torch.equal(probs, copied["top_p"])
    assert data["info"]["copy_tokens"] == 320 and len(corpus["tokens"]) == 37


def test_stdlib_corpus_excludes_installed_packages():
    files = lm_data.corpus_files("stdlib")
    assert len(files) > 100 and not any("site-packages" in f.parts for f in files)


def test_labels_are_the_targets_top_k():
    target = _target()
    windows = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    ids, probs = lm_data.label(target, windows, top_k=3, batch=2)
    with torch.no_grad():
        full = torch.softmax(target.model(windows.to(target.device)).logits.float(), -1).cpu()
    assert ids.shape == (3, 4, 3) and probs.dtype == torch.float16
    assert torch.equal(ids.long(), full.topk(3, -1).indices)
    assert torch.allclose(probs.float(), full.topk(3, -1).values, atol=1e-3)


def test_distill_loss_and_agreement_by_hand():
    logits = torch.log(torch.tensor([[[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]]))
    top_ids = torch.tensor([[[0, 1], [1, 2]]])
    top_p = torch.tensor([[[0.5, 0.5], [0.75, 0.25]]])  # already normalised
    loss, agree = lm_train.distill_loss(logits, top_ids, top_p)
    expected = -(0.5 * torch.log(torch.tensor(0.7)) + 0.5 * torch.log(torch.tensor(0.2))
                 + 0.75 * torch.log(torch.tensor(0.3)) + 0.25 * torch.log(torch.tensor(0.6))) / 2
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert agree.item() == 0.5  # position 0: argmax 0 == 0; position 1: argmax 2 != 1


def test_cli_distill_end_to_end_and_bad_input(tmp_path, corpus, saved_tiny, capsys):
    out = tmp_path / "cli-draft"
    argv = ["distill", "--target", str(saved_tiny), "--out", str(out), "--corpus", str(corpus), "--quiet",
            "--layers", "1", "--hidden", "16", "--heads", "2", "--ffn", "32", "--corpus-tokens", "600",
            "--gen-prompts", "0", "--seq-len", "16", "--steps", "4", "--checkpoint-every", "2", "--top-k", "4",
            "--save-dtype", "float32"]
    assert main(argv) == 0
    assert "draft written to" in capsys.readouterr().out
    assert json.loads((out / "distill.json").read_text())["command"] == ["dynatree", *argv]
    assert load_model(str(out)).model.config.hidden_size == 16
    assert main(argv) == 2 and "pass --resume" in capsys.readouterr().err
    for bad, message in [(["--hidden", "15"], "multiple of --heads"), (["--steps", "0"], "--steps must be at least 1"),
                         (["--corpus", str(tmp_path / "nope")], "neither 'stdlib' nor an existing"),
                         (["--eval-fraction", "0.7"], "--eval-fraction must be in"),
                         (["--corpus-tokens", "0"], "no training data"),
                         (["--copy-tokens", "5"], "--copy-tokens must be 0 or at least --seq-len")]:
        assert main([*argv[:4], str(tmp_path / "x"), *argv[5:], *bad]) == 2
        assert message in capsys.readouterr().err, bad


def test_an_output_directory_holding_another_kind_of_draft_is_refused_before_any_work(tmp_path, capsys):
    """distill --out on a directory that holds another kind's draft (a head, a datastore, a draft LM, or
    a record of one) is a one-line error before the target loads, not an overwrite that leaves neither
    loadable; the same kind is taken (to resume, or to rebuild a datastore)."""
    from dynatree.cli import main
    from dynatree.distill.eagle_data import EagleConfig
    from dynatree.distill_cli import check_out_kind, held_kind

    markers = {"eagle": ("feature_head.json", "{}"), "store": ("datastore.json", "{}"), "lm": ("config.json", "{}")}
    for held, (name, text) in markers.items():
        (tmp_path / held).mkdir()
        (tmp_path / held / name).write_text(text)
        assert held_kind(tmp_path / held) == held
    (tmp_path / "record").mkdir()
    (tmp_path / "record" / "distill.json").write_text(json.dumps({"kind": "eagle"}))  # a record alone
    assert held_kind(tmp_path / "record") == "eagle" and held_kind(tmp_path / "new") is None
    for kind, cls in [("eagle", EagleConfig), ("lm", lm_data.DistillConfig)]:  # runs stopped before their export
        (tmp_path / f"stopped-{kind}").mkdir()
        torch.save({"step": 10, "config": dataclasses.asdict(cls())}, tmp_path / f"stopped-{kind}" / "checkpoint.pt")
        assert held_kind(tmp_path / f"stopped-{kind}") == kind
    check_out_kind(tmp_path / "store", "store", resume=False)  # rebuilding a datastore in place
    check_out_kind(tmp_path / "stopped-eagle", "eagle", resume=True)  # resuming it
    for held, kind, words in [("eagle", "lm", "holds a feature head (--kind eagle); --kind lm would overwrite it"),
                              ("store", "eagle", "holds a datastore (--kind store); --kind eagle would overwrite it"),
                              ("lm", "store", "holds a draft LM (--kind lm); --kind store would overwrite it"),
                              ("record", "lm", "holds a feature head (--kind eagle)"),
                              ("stopped-lm", "eagle", "holds a draft LM (--kind lm); --kind eagle would overwrite it"),
                              ("stopped-eagle", "lm", "holds a feature head (--kind eagle); --kind lm would")]:
        with pytest.raises(DynaTreeError, match=re.escape(words)):
            check_out_kind(tmp_path / held, kind, resume=True)
        # through the CLI: refused at once (no target is loaded: a missing one would be a later error)
        assert main(["distill", "--kind", kind, "--target", str(tmp_path / "no-such-model"), "--out",
                     str(tmp_path / held)]) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    check_out_kind(tmp_path / "new", "lm", resume=True)
    assert "has no checkpoint.pt to resume: training starts from step 0" in capsys.readouterr().err


def test_a_new_draft_is_seeded_by_its_config_and_leaves_the_callers_generator_alone():
    target = _target()
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    drafts = [lm_train.init_draft(target, lm_data.DistillConfig(**{**SMALL, "seed": s})) for s in (3, 3, 4)]
    assert torch.equal(torch.get_rng_state(), before)
    weights = [d.get_input_embeddings().weight for d in drafts]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_distill_bounds_the_kernel_caches_unless_the_user_set_them(monkeypatch):
    """`dynatree distill` caps oneDNN's and ideep's per-shape primitive caches (distill_cli: training meets a
    new product shape nearly every batch), before anything runs a product; a value the user set stays."""
    from dynatree import distill_cli

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "x")  # (recorded first, so teardown restores the session's)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert distill_cli.bound_kernel_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "7"}
    # the CLI sets them before it loads the target: a bad option fails after the call, before any load
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    seen = {}
    monkeypatch.setattr(distill_cli, "bound_kernel_caches", lambda: seen.setdefault("called", True))
    assert main(["distill", "--kind", "eagle", "--out", "/nonexistent/x", "--steps", "0"]) == 2
    assert seen == {"called": True}
