"""The command line: JSON record, streamed text, prompt files, and one-line errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from helpers import DEVICE, tiny, tokenizer
from dynatree.runtime import LoadedModel
from dynatree.draftspec import Hybrid
from dynatree.window import KVWindow
from dynatree.cli import main

STATS_KEYS = {"new_tokens", "iterations", "acceptance_rate", "tokens_per_iter", "accepted_len",
              "ttft_s", "tpot_s", "wall_s", "tokens_per_s", "peak_mem_mb"}


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def generate_json(capsys, target, *extra):
    code, out, err = run_cli(capsys, "generate", "w5 w6 w7 w5 w6", "--target", str(target), "--json", *extra)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("method", ["dynatree", "fixed-tree", "linear", "wetap", "specinfer", "specexec", "opt-tree",
                                    "dsbd", "mtad", "hf-lookup", "hf-ar"])
def test_json_record(capsys, saved_tiny, method):
    rec = generate_json(capsys, saved_tiny, "--method", method, "--max-new-tokens", "12", "--ignore-eos")
    assert {"method", "target", "draft", "prompt_tokens", "new_token_ids", "text", "stats", "config"} <= set(rec)
    assert STATS_KEYS <= set(rec["stats"])
    assert rec["method"] == method and rec["prompt_tokens"] == 5  # the word-level tokenizer adds no BOS
    assert rec["stats"]["new_tokens"] == len(rec["new_token_ids"]) == 12
    assert rec["env"]["versions"]["torch"] and rec["run"]["max_new_tokens"] == 12
    assert rec["env"]["cpu_support"]["capability"] == torch.backends.cpu.get_cpu_capability()  # never mix CPUs
    assert rec["stats"]["compile_s"] is None and rec["run"]["linear_note"] is None  # float32 packs on every CPU
    ar = generate_json(capsys, saved_tiny, "--method", "ar", "--max-new-tokens", "12", "--ignore-eos")
    assert rec["new_token_ids"] == ar["new_token_ids"]


def test_json_config_is_the_resolved_method_config(capsys, saved_tiny):
    rec = generate_json(capsys, saved_tiny, "--method", "dynatree", "--d0", "3", "--tau-h", "0.8", "--no-history",
                        "--max-new-tokens", "4")
    assert rec["config"]["d0"] == 3 and rec["config"]["tau_h"] == 0.8 and rec["config"]["history"] is False
    assert rec["config"]["n_max"] == 256 and rec["draft"] == "ngram"
    assert rec["policy_state"]["d0"] == 3


def test_linear_kernel_option_is_recorded(capsys, saved_tiny):
    args = ("--method", "dynatree", "--max-new-tokens", "8", "--ignore-eos")
    packed = generate_json(capsys, saved_tiny, *args)
    stock = generate_json(capsys, saved_tiny, *args, "--linear", "stock")
    assert packed["run"]["linear"] == "onednn" and stock["run"]["linear"] == "stock"
    assert packed["new_token_ids"] == stock["new_token_ids"]
    hf = generate_json(capsys, saved_tiny, "--method", "hf-ar", "--max-new-tokens", "8", "--ignore-eos")
    assert hf["run"]["linear"] == "stock" and hf["new_token_ids"] == stock["new_token_ids"]


def test_lossy_method_is_labelled_when_sampling(capsys, saved_tiny):
    argv = ["generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "6", "--json", "--sample",
            "--top-k", "10", "--method", "wetap"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0 and "lossy when sampling" in err and json.loads(out)["run"]["lossy"] is True
    code, out, err = run_cli(capsys, *argv, "--verify", "exact")
    assert code == 0 and "lossy" not in err and json.loads(out)["run"]["lossy"] is False
    greedy = [a for a in argv if a not in ("--sample", "--top-k", "10")]
    code, out, err = run_cli(capsys, *greedy)  # greedy, the beam rule is exact: no note
    assert code == 0 and "lossy" not in err and json.loads(out)["run"]["lossy"] is False
    assert "note: wetap: WETAP's beam rule (--verify beam) is lossy when sampling" in run_cli(capsys, *argv)[2]
    mtad = argv[:-1] + ["mtad"]
    code, out, err = run_cli(capsys, *mtad)  # its own reason, and no --verify to suggest (mtad has none)
    assert code == 0 and json.loads(out)["run"]["lossy"] is True
    assert "note: mtad: MTAD's joint rule is lossy when sampling" in err and "--verify" not in err
    code, out, err = run_cli(capsys, *(argv[:-1] + ["dsbd"]))
    assert code == 0 and "lossy" not in err and json.loads(out)["run"]["lossy"] is False


def test_streamed_text_and_stats_line(capsys, saved_tiny):
    code, out, err = run_cli(capsys, "generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "6",
                             "--ignore-eos")
    assert code == 0
    assert len(out.split()) == 6 and all(w.startswith("w") or w in ("<s>",) for w in out.split())
    assert "[dynatree] 6 tokens" in err and "acceptance" in err


def test_stop_strings_end_the_printed_text_and_the_record(capsys, saved_tiny):
    full = generate_json(capsys, saved_tiny, "--method", "ar", "--max-new-tokens", "20", "--ignore-eos")
    words = full["text"].split()
    stop = " ".join(words[6:8])
    want = full["text"][:full["text"].find(stop)]
    code, out, err = run_cli(capsys, "generate", "w5 w6 w7 w5 w6", "--target", str(saved_tiny), "--max-new-tokens", "20",
                             "--ignore-eos", "--stop", "w95 w95 w95", "--stop", stop, "--compare", "ar")
    assert code == 0 and out == want + "\n" and err.count("yes") == 2  # both methods cut at the same token
    rec = generate_json(capsys, saved_tiny, "--max-new-tokens", "20", "--ignore-eos", "--stop", stop)
    assert rec["text"] == want and rec["finish_reason"] == "stop" and rec["run"]["stop"] == [stop]
    assert rec["new_token_ids"] == full["new_token_ids"][:len(rec["new_token_ids"])]
    assert full["finish_reason"] == "length" and full["run"]["stop"] is None
    code, _, err = run_cli(capsys, "generate", "w5", "--target", str(saved_tiny), "--stop", "")
    assert code == 2 and "stop (--stop) strings must not be empty" in err


def test_compare_table(capsys, saved_tiny):
    code, out, err = run_cli(capsys, "generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "8",
                             "--compare", "ar,linear", "--k", "3")
    assert code == 0
    assert "speedup" in err and err.count("yes") == 3


def test_compare_warms_up_every_compared_method_with_its_own_settings(capsys, saved_tiny, monkeypatch):
    from dynatree import api

    calls, real = [], api.run
    monkeypatch.setattr(api, "run", lambda job, **callbacks: calls.append(
        (job.method, job.max_new_tokens, getattr(job.config, "k", None))) or real(job, **callbacks))
    code, _, _ = run_cli(capsys, "generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "12",
                         "--method", "dynatree", "--compare", "ar,linear", "--k", "3")
    assert code == 0
    assert calls == [("dynatree", 8, None), ("ar", 8, None), ("linear", 8, 3),  # untimed warm-ups first
                     ("dynatree", 12, None), ("ar", 12, None), ("linear", 12, 3)]


def test_prompt_file_and_stdin(capsys, saved_tiny, tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("w5 w6 w7 w5 w6")
    code, out, _ = run_cli(capsys, "generate", "--prompt-file", str(f), "--target", str(saved_tiny), "--json",
                           "--max-new-tokens", "3")
    assert code == 0 and json.loads(out)["prompt_tokens"] == 5
    monkeypatch.setattr(sys, "stdin", open(f))
    code, out, _ = run_cli(capsys, "generate", "--prompt-file", "-", "--target", str(saved_tiny), "--json",
                           "--max-new-tokens", "3")
    assert code == 0 and json.loads(out)["prompt_tokens"] == 5
    f.write_text("w5 w6 w7 w5 w6\n")  # the line end an editor or echo adds is not part of the prompt
    code, with_newline, _ = run_cli(capsys, "generate", "--prompt-file", str(f), "--target", str(saved_tiny), "--json",
                                    "--max-new-tokens", "3")
    assert code == 0 and json.loads(with_newline)["new_token_ids"] == json.loads(out)["new_token_ids"]
    # issue 29: binary input is a one-line error, not a UnicodeDecodeError (file) or TypeError (stdin)
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00bad")
    code, _, err = run_cli(capsys, "generate", "--prompt-file", str(binary), "--target", str(saved_tiny))
    assert code == 2 and f"prompt file '{binary}' is not UTF-8 text (byte 0)" in err and err.count("\n") == 1, err
    monkeypatch.setattr(sys, "stdin", open(binary, encoding="utf-8", errors="surrogateescape"))
    code, _, err = run_cli(capsys, "generate", "--prompt-file", "-", "--target", str(saved_tiny))
    assert code == 2 and "the prompt on stdin is not UTF-8 text (byte 0)" in err, err


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    cfg = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertForMaskedLM(cfg).save_pretrained(path)  # an encoder: masked LM, attends both ways
    tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("other-vocab")
    m = tiny("gpt2", vocab=80, dtype=torch.float32)
    m.model.save_pretrained(path)
    m.tokenizer.save_pretrained(path)
    return path


BAD_INPUTS = {
    "empty prompt": (["", "--max-new-tokens", "4"], "prompt is empty"),
    "blank prompt": (["   ", "--max-new-tokens", "4"], "prompt is empty"),
    "no prompt": ([], "no prompt given"),
    "too long": (["w5 w6", "--max-new-tokens", "63"], "exceeds the context length 64"),
    "too long, one token": (["w5", "--max-new-tokens", "64"], "prompt (1 token) + max_new_tokens (64) exceeds"),
    "zero tokens": (["w5", "--max-new-tokens", "0"], "must be a positive integer"),
    "negative tokens": (["w5", "--max-new-tokens", "-3"], "must be a positive integer"),
    "not a number": (["w5", "--max-new-tokens", "ten"], "invalid int value"),
    "unknown method": (["w5", "--method", "medusa"], "unknown method 'medusa'"),
    "unknown compare method": (["w5", "--compare", "ar,nope"], "unknown method 'nope'"),
    "unknown option": (["w5", "--frobnicate", "3"], "unrecognized arguments: --frobnicate"),
    "option of another method": (["w5", "--method", "dynatree", "--k", "4"], "--k does not apply to method 'dynatree'"),
    "b_min > b_max": (["w5", "--b-min", "3", "--b-max", "1"], "--b-min <= --b-mid <= --b-max"),
    "tau_h above 1": (["w5", "--tau-h", "1.5"], "--tau-h must be in (0, 1)"),
    "tau_l zero": (["w5", "--tau-l", "0"], "--tau-l must be in (0, 1)"),
    "tau_l above tau_h": (["w5", "--tau-l", "0.95"], "--tau-l must be below --tau-h"),
    "d0 >= d_max": (["w5", "--d0", "8", "--d-max", "8"], "--d0 must be smaller than --d-max"),
    "n_max < 1": (["w5", "--n-max", "0"], "--n-max must be at least 1"),
    "fixed n_max < 1": (["w5", "--method", "fixed-tree", "--n-max", "0"], "--n-max must be at least 1"),
    "fixed tau": (["w5", "--method", "fixed-tree", "--tau", "1.2"], "--tau must be in [0, 1)"),
    "linear k": (["w5", "--method", "linear", "--k", "0"], "--k must be at least 1"),
    "rho order": (["w5", "--rho-stop", "0.6", "--rho-deep", "0.5"], "--rho-stop must be below --rho-deep"),
    "assisted without draft": (["w5", "--method", "hf-assisted"], "needs a draft language model"),
    "assisted with ngram": (["w5", "--method", "hf-assisted", "--draft", "ngram"], "not the n-gram drafter"),
    "bad dtype": (["w5", "--dtype", "float8"], "unknown dtype"),
    "unknown linear kernel": (["w5", "--linear", "mkl"], "invalid choice: 'mkl'"),
    "onednn in float64": (["w5", "--linear", "onednn", "--dtype", "float64"], "cannot pack this model's linear layers"),
    "missing prompt file": (["--prompt-file", "/nonexistent/p.txt"], "cannot read prompt file"),
    "prompt twice": (["w5", "--prompt-file", "x"], "not both"),
    # issue 37 item 6: an option that does not apply is an error, never dropped
    "draft with ar": (["w5", "--method", "ar", "--draft", "ngram"], "--draft does not apply to ar"),
    "draft with hf-ar": (["w5", "--method", "hf-ar", "--compare", "ar", "--draft", "x"], "--draft does not apply to hf-ar, ar"),
    "ngram-max with ar": (["w5", "--method", "ar", "--ngram-max", "3"], "--ngram-max does not apply here"),
    "ngram-max with hf-lookup": (["w5", "--method", "hf-lookup", "--ngram-max", "3"], "--ngram-max does not apply"),
    "empty compare": (["w5", "--compare", ""], "--compare needs a comma-separated list"),
    # issue 37: messages that said something else
    "empty draft": (["w5", "--draft", ""], "the draft spec is empty"),
    "ngram+ without a model": (["w5", "--draft", "ngram+"], "needs a draft model after 'ngram+'"),
    "ngram+ngram": (["w5", "--draft", "ngram+ngram"], "needs a draft model after 'ngram+'"),
    "value starting with a dash": (["w5", "--kv-window", "-1,8"], "a value that starts with '-' is written --kv-window=VALUE"),
    "negative window": (["w5", "--kv-window=-1,8"], "--kv-window needs SINK >= 0"),
    "one sampling option without --sample": (["w5", "--temperature", "0.5"], "temperature (--temperature) applies only with sample=True (--sample)"),
    "two without --sample": (["w5", "--top-k", "3", "--top-p", "0.5"], "top_k (--top-k), top_p (--top-p) apply only with sample=True (--sample)"),
    "padded draft spec": (["w5", "--draft", " ngram+ "], "needs a draft model after 'ngram+'"),
    "blank compare": (["w5", "--compare", " , "], "--compare needs a comma-separated list"),
    "compare with itself": (["w5", "--method", "ar", "--compare", "ar"],
                            "--compare repeats ar (--method ar runs already); name each method once"),
    "compare twice": (["w5", "--compare", "ar,linear,ar"], "--compare repeats ar; name each method once"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_error(capsys, saved_tiny, case):
    argv, message = BAD_INPUTS[case]
    code, out, err = run_cli(capsys, "generate", *argv, "--target", str(saved_tiny))
    assert code == 2
    assert err.startswith("dynatree: error: ") and err.count("\n") == 1, err
    assert message in err


@pytest.mark.parametrize("target, message", [
    ("./no/such/model", "does not exist"),
    ("/tmp/definitely-missing-model.gguf", "does not exist"),
    ("EleutherAI/pythia-70m", "hub is unreachable and the model is not in the local cache; pass a local"),
    ("smollm2-135n", "local cache; did you mean 'smollm2-135m'? pass a local directory"),  # a mistyped alias
])
def test_missing_models(capsys, monkeypatch, target, message):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: the hub is unreachable
    code, _, err = run_cli(capsys, "generate", "w5", "--target", target)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_gguf_named_file_that_is_not_gguf_fails_before_any_conversion(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DYNATREE_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model")
    code, _, err = run_cli(capsys, "generate", "w5", "--target", str(bad))
    assert code == 2 and err == f"dynatree: error: cannot read GGUF file {bad}: it does not start with the GGUF magic bytes\n"


def test_non_causal_model(capsys, bert_dir):
    code, _, err = run_cli(capsys, "generate", "w5", "--target", str(bert_dir))
    assert code == 2 and "not a causal language model" in err, err


def test_draft_with_other_vocabulary(capsys, saved_tiny, other_vocab_dir):
    code, _, err = run_cli(capsys, "generate", "w5", "--target", str(saved_tiny), "--draft", str(other_vocab_dir))
    assert code == 2 and "different vocabularies" in err, err


def test_draft_whose_embedding_does_not_cover_its_tokenizer(capsys, saved_tiny, tmp_path, prompt_file):
    """Issue 37 item 4: a draft whose config vocab_size (40) is below its tokenizer's 96 tokens is named
    as such by the CLI and the bench, not an IndexError in the draft's forward."""
    small = tiny("llama", seed=4, dtype=torch.float32, vocab=40)
    small.model.save_pretrained(tmp_path / "small")
    tokenizer().save_pretrained(tmp_path / "small")
    capsys.readouterr()  # transformers' saving progress
    expected = f"draft '{tmp_path / 'small'}' has 40 embedding rows but its tokenizer has 96 tokens"
    for argv in (["generate", "w5", "--method", "linear"], ["bench", "--methods", "ar,linear", "--n", "1", "--warmup", "0",
                                                             "--dataset", str(prompt_file)]):
        code, _, err = run_cli(capsys, *argv, "--target", str(saved_tiny), "--draft", str(tmp_path / "small"),
                               *(["--out", str(tmp_path / "out")] if argv[0] == "bench" else []))
        assert code == 2 and expected in err and err.count("\n") == 1, err


def test_hf_assisted_with_a_padded_draft_runs_and_says_how(capsys, saved_tiny, tmp_path):
    """Issue 37 item 4: transformers' 'different tokenizers' ValueError was a traceback; now the run
    completes (universal assisted decoding) and a note after it says so."""
    padded = tiny("llama", seed=4, dtype=torch.float32, vocab=128)
    padded.model.save_pretrained(tmp_path / "padded")
    tokenizer().save_pretrained(tmp_path / "padded")
    capsys.readouterr()  # transformers' saving progress
    code, _, err = run_cli(capsys, "generate", "w5 w6 w7", "--target", str(saved_tiny), "--method", "hf-assisted",
                           "--draft", str(tmp_path / "padded"), "--max-new-tokens", "6")
    assert code == 0 and "note: hf-assisted: the draft's vocabulary size (128) differs from the target's (96)" in err
    assert err.index("note: hf-assisted") > err.index("[hf-assisted]")  # after the run's stats line, err


def test_entry_point_exits_nonzero_without_traceback(saved_tiny):
    proc = subprocess.run([sys.executable, "-m", "dynatree.cli", "generate", "w5", "--target", str(saved_tiny),
                           "--d0", "9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "dynatree: error: --d0 must be smaller than --d-max, got 9 >= 8"


@pytest.mark.parametrize("kwargs,message", [
    ({"prompt_ids": [999999]}, r"prompt_ids\[0\] = 999999 is not a token id of the target \(0\.\.95\)"),
    ({"prompt_ids": [5, -5]}, r"prompt_ids\[1\] = -5 is not a token id"),
    ({"prompt_ids": [5, 2.5]}, r"prompt_ids\[1\] = 2.5 is not a token id"),
    ({"prompt_ids": "w5 w6"}, "prompt_ids must be a list of token ids, got str"),
    ({"prompt_ids": []}, "the prompt is empty"),
    ({"prompt": "w5", "prompt_ids": [5]}, "give either prompt .* or prompt_ids .*, not both"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"prompt_ids": [5], "max_new_tokens": 4.5}, r"max_new_tokens \(--max-new-tokens\) must be a positive integer, got 4.5"),
    ({"prompt_ids": [5], "max_new_tokens": 0}, "max_new_tokens .* must be a positive integer, got 0"),
    ({"prompt_ids": [5], "seed": "abc"}, r"seed \(--seed\) must be an integer in \[-2\*\*63, 2\*\*64\), got 'abc'"),
    ({"prompt_ids": [5], "seed": 2**64}, r"seed \(--seed\) must be an integer in \[-2\*\*63, 2\*\*64\), got 18446744073709551616"),
    ({"prompt_ids": [5], "seed": -2**63 - 1}, r"seed \(--seed\) must be an integer in \[-2\*\*63, 2\*\*64\), got -9223372036854775809"),
    ({"prompt_ids": [5], "sample": True, "temperature": float("inf")}, r"temperature \(--temperature\) must be > 0 and finite when sampling, got inf"),
    ({"prompt_ids": torch.tensor([[5, 6]])}, r"prompt_ids as a tensor must be 1-D integer token ids, got shape \(1, 2\) of int64"),
    ({"prompt_ids": [5], "options": {"d0": 4}}, r"generate\(\) takes the method's options as keywords \(e.g. d0=4\), not options="),
    ({"prompt_ids": [5], "on_tokens": 5}, "on_tokens must be a function of the new token ids, got int"),
    ({"prompt_ids": [5], "ngram_max": 0}, r"ngram_max \(--ngram-max\) must be a positive integer"),
    ({"prompt_ids": [5], "draft": "ngram"}, r"draft \(--draft\) does not apply to 'ar': it drafts nothing"),
    ({"prompt_ids": [5], "device": "meta"}, "device 'meta' is not supported; choose cpu, cuda, cuda:N or auto"),
    ({"prompt_ids": [5], "device": "cpu" if DEVICE.type != "cpu" else "cuda"},
     f"target is already loaded on {DEVICE.type}" if DEVICE.type != "cpu" else "CUDA is not available"),
    ({"prompt_ids": [5], "method": "dynatree", "draft": 3}, "draft must be a spec string .*got int"),
    ({"prompt_ids": [5], "method": "dynatree", "draft": ["ngram"]}, "draft must be a spec string .*got list"),
    ({"prompt_ids": [5], "method": "dynatree", "draft": Hybrid(3)}, r"Hybrid\(\.\.\.\) takes a draft model spec or a loaded model, got int"),
    ({"prompt_ids": [5], "method": "dynatree", "draft": Hybrid("")}, "needs a draft model after 'ngram\\+'"),
    ({"prompt_ids": [5], "method": "dynatree", "draft": "ngram+ngram+x"}, "takes one draft model"),
    ({"prompt_ids": [5], "method": "hf-assisted", "draft": ""}, "the draft spec is empty"),
    # the same rule for every argument's type (second review of issue 37)
    ({"prompt_ids": [5], "sample": True, "temperature": "hot"}, r"temperature \(--temperature\) must be a number, got 'hot'"),
    ({"prompt_ids": [5], "sample": True, "top_k": "3"}, r"top_k \(--top-k\) must be an integer, got '3'"),
    ({"prompt_ids": [5], "sample": True, "top_k": 2.5}, r"top_k \(--top-k\) must be an integer, got 2.5"),
    ({"prompt_ids": [5], "sample": True, "top_p": True}, r"top_p \(--top-p\) must be a number, got True"),
    ({"prompt_ids": [5], "kv_window": 8}, r"kv_window \(--kv-window\) must be 'SINK,RECENT' or a KVWindow, got int"),
    ({"prompt_ids": [5], "kv_window": KVWindow(4, 2)}, r"--kv-window sink \(4\) must be smaller"),
    ({"prompt_ids": [5], "method": "hf-ar", "kv_window": "1,4"}, r"kv_window \(--kv-window\) is not available"),
    ({"prompt_ids": [5], "device": 1.5}, r"device \(--device\) must be a string"),
    ({"prompt": "   "}, "the prompt is empty"),
    ({"prompt_ids": [5], "dtype": "float8"}, "unknown dtype 'float8'; choose one of float32"),
    # a loaded target is used as it was loaded: another dtype or linear kernel is an error, not ignored
    ({"prompt_ids": [5], "dtype": "float32"}, r"dtype 'float32' given, but the target is already loaded in float64"),
    ({"prompt_ids": [5], "linear": "onednn"},
     r"linear 'onednn' given, but the target is already loaded with 'stock' linear layers"),
])
def test_python_api_names_every_bad_argument(kwargs, message):
    """Issue 37: the API's bad arguments are DynaTreeErrors naming the argument, never raw exceptions."""
    from dynatree import api
    from dynatree.errors import DynaTreeError

    with pytest.raises(DynaTreeError, match=message):
        api.generate(target=tiny("llama"), **{"method": "ar", "max_new_tokens": 2, **kwargs})


def test_a_loaded_targets_own_dtype_and_linear_kernel_may_be_named(capsys):
    from dynatree import api

    target = tiny("llama")
    named = api.generate(prompt_ids=[5, 6], method="ar", target=target, max_new_tokens=3, dtype="float64", linear="stock")
    plain = api.generate(prompt_ids=[5, 6], method="ar", target=target, max_new_tokens=3)
    assert named.new_token_ids == plain.new_token_ids and named.run.dtype == "float64"


def test_an_empty_prompt_is_refused_before_any_model_loads(monkeypatch):
    from dynatree import api
    from dynatree.errors import DynaTreeError

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded for an empty prompt")

    monkeypatch.setattr(api, "load_model", no_loading)
    with pytest.raises(DynaTreeError, match="the prompt is empty"):
        api.generate(" \n", target="no/such-model")


def test_api_target_of_another_type_and_a_prompt_the_target_cannot_read():
    from dynatree import api
    from dynatree.errors import DynaTreeError

    with pytest.raises(DynaTreeError, match="target must be a model spec string or a LoadedModel, got int"):
        api.generate("w5", target=3)
    # a target whose config vocab_size (40) is below its tokenizer (96 tokens): a one-line error, not IndexError
    short = LoadedModel(model=tiny("llama", seed=4, vocab=40).model, tokenizer=tokenizer(), name="short", eos_ids=[2])
    with pytest.raises(DynaTreeError, match="the prompt encodes to token 70, which 'short' cannot read"):
        api.generate("w5 w70", method="ar", target=short, max_new_tokens=2)
    with pytest.raises(DynaTreeError, match=r"prompt_ids\[1\] = 70 is not a token id of the target \(0\.\.39\)"):
        api.generate(prompt_ids=[5, 70], method="ar", target=short, max_new_tokens=2)


@pytest.mark.parametrize("draft,message", [
    ("no-such-owner/no-such-draft", "cannot download 'no-such-owner/no-such-draft': the Hugging Face hub is unreachable"),
    ("ngram+smollm2-135m-eagel", "did you mean 'smollm2-135m-eagle'?"),
    ("./no/such/draft", "model path './no/such/draft' does not exist"),
])
def test_a_draft_that_names_nothing_is_refused_before_the_target_loads(capsys, monkeypatch, draft, message):
    """A mistyped --draft must not cost the target's load (seconds to minutes) before it is reported."""
    from dynatree import models

    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the target loaded before the draft's check"))
    for argv in (["generate", "w5", "--method", "dynatree", "--draft", draft], ["serve", "--draft", draft],
                 ["bench", "--methods", "dynatree", "--draft", draft, "--dataset", "specbench", "--n", "1"]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_findable_draft_passes_the_early_check(monkeypatch, saved_tiny):
    from dynatree import models
    from dynatree.errors import DynaTreeError

    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: False)
    for spec in ("smollm2-135m-eagle", "smollm2-135m-draft", str(saved_tiny)):
        models.check_findable(spec)  # aliases and existing paths: nothing to download
    monkeypatch.setattr(models, "hub_reachable", lambda timeout=3.0: True)
    models.check_findable("some-owner/some-draft")  # a hub id the hub may have: left to the load
    with pytest.raises(DynaTreeError, match="neither an alias .* nor a hub id"):
        models.check_findable("not a repo id")


def test_the_equals_hint_only_for_values_that_start_with_a_dash(capsys, saved_tiny):
    code, _, err = run_cli(capsys, "generate", "w5", "--target", str(saved_tiny), "--draft", "--sample")
    assert code == 2 and "expected one argument" in err and "=VALUE" not in err, err


def test_compare_while_sampling_has_no_token_column_and_labels_lossy_rules(capsys, saved_tiny):
    """Issue 37: sampled runs are not comparable token by token; WETAP's beam rule is labelled lossy."""
    code, _, err = run_cli(capsys, "generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "6",
                           "--sample", "--method", "dynatree", "--compare", "ar,wetap")
    assert code == 0
    table = err[err.index("method"):]
    assert "tokens (sampled)" in table and "same tokens" not in table and "NO" not in table
    assert "wetap (lossy)" in table and "dynatree (lossy)" not in table
    code, _, err = run_cli(capsys, "generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "6",
                           "--method", "linear", "--compare", "dynatree")
    assert "speedup over linear" in err  # no ar compared: the reference is said


def test_compare_labels_what_changes_a_method(capsys, saved_tiny):
    """Issue 37 item 7: --cost-aware (and --compile) rows say so, as the bench's presets do."""
    code, _, err = run_cli(capsys, "generate", "w5 w6 w7", "--target", str(saved_tiny), "--max-new-tokens", "6",
                           "--method", "dynatree", "--cost-aware", "--compare", "ar,linear")
    assert code == 0
    rows = {line.split()[0] + (" " + line.split()[1] if line.split()[1].startswith("+") else ""): line
            for line in err[err.index("method"):].splitlines()[2:]}
    assert set(rows) == {"dynatree +cost-aware", "ar", "linear"}, rows


def test_help_does_not_import_the_model_runtime():
    """`dynatree --help` parses options without importing transformers' model code or the engine
    (issue 37: it took 3-4 s)."""
    code = ("import sys\n"
            "from dynatree.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['bench', '--help'], ['distill', '--help']):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.models.', 'dynatree.api', "
            "'dynatree.decode'))), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "usage: dynatree" in done.stdout and done.stderr.strip().splitlines()[-1] == "[]", done.stderr


@pytest.mark.parametrize("argv, message", [
    (["--method", "dynatree", "--d0", "9", "--d-max", "8"], "--d0 must be smaller than --d-max"),
    (["--kv-window", "4"], "--kv-window takes SINK,RECENT"),
    (["--temperature", "0.5"], "only with sample=True (--sample)"),
    (["--method", "ar", "--compare", "dynatree", "--d0", "0"], "d0"),
])
def test_bad_values_are_named_before_any_model_loads(capsys, argv, message):
    """Greedy or sampled, every compared method's request is checked before loading: a bad value is
    named even when the target could not be loaded at all."""
    code, _, err = run_cli(capsys, "generate", "hello", "--target", "/nonexistent/model", *argv)
    assert code == 2 and message in err and "does not exist" not in err, err


def test_a_run_that_shared_the_cpu_is_flagged(capsys, saved_tiny, monkeypatch):
    """On a machine of few cores another process slows a run with no sign in its own figures: the CLI
    says which runs shared the CPU (scripted readings: other processes used 1.5 CPUs' worth)."""
    from types import SimpleNamespace

    from dynatree import env

    now = [0.0]
    readings = iter([(10.0 + 4 * i, 1.0 + i) for i in range(100)])  # each reading: machine +4 CPU-s, this process +1
    monkeypatch.setattr(env, "time", SimpleNamespace(perf_counter=lambda: now.__setitem__(0, now[0] + 1) or now[0]))
    monkeypatch.setattr(env, "cpu_seconds", lambda: next(readings))
    code, _, err = run_cli(capsys, "generate", "w5 w6", "--target", str(saved_tiny), "--max-new-tokens", "6",
                           "--compare", "ar")
    assert code == 0 and "note: other processes used the CPU while these runs decoded" in err
    assert "dynatree (3.00), ar (3.00); their timings are not reliable (stop them or measure when" in err
    monkeypatch.setattr(env, "cpu_seconds", lambda: (5.0, 5.0))  # nothing else ran
    code, _, err = run_cli(capsys, "generate", "w5 w6", "--target", str(saved_tiny), "--max-new-tokens", "6")
    assert code == 0 and "other processes" not in err
