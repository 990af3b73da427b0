"""The request type (request.py): every model-free check runs before anything loads, each a
one-line error naming the argument; the same request drives the Python API, the CLI, the bench
and the server (their own tests run through it)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from helpers import hf_greedy, tiny
from dynatree import DynaTreeError, Request, Result, prepare, run
from dynatree import rng
from dynatree.draftspec import Hybrid
from dynatree.result import RunInfo, Summary
from dynatree.window import KVWindow

MISSING = "/nonexistent/model-that-would-fail-to-load"  # check() must never load it


@pytest.mark.parametrize("fields, message", [
    ({"method": "nope"}, "unknown method"),
    ({"options": [("d0", 3)]}, "options must be a dict"),
    ({"options": {"d0": 0}}, "d0"),
    ({"options": {"k": 3}}, "does not apply"),
    ({"max_new_tokens": 0}, "max_new_tokens (--max-new-tokens) must be a positive integer"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"ngram_max": True}, "ngram_max (--ngram-max)"),
    ({"seed": "1"}, "seed (--seed) must be an integer"),
    ({"chat": "yes"}, "chat (--chat) must be True or False, got 'yes'"),
    ({"ignore_eos": 1}, "ignore_eos (--ignore-eos) must be True or False"),
    ({"sample": None}, "sample (--sample) must be True or False"),
    ({"compile": "no"}, "compile (--compile) must be True, False or None"),
    ({"prompt_ids": [1, 2]}, "either prompt (text) or prompt_ids"),
    ({"prompt": None}, "prompt must be a string"),
    ({"prompt": 12}, "prompt must be a string"),
    ({"kv_window": "4"}, "--kv-window takes SINK,RECENT"),
    ({"kv_window": (4, 8)}, "kv_window (--kv-window) must be"),
    ({"temperature": 0.7}, "only with sample=True (--sample)"),
    ({"sample": True, "top_p": 1.5}, "top_p (--top-p) must be in (0, 1], got 1.5"),
    ({"method": "hf-ar", "kv_window": "4,8"}, "not available for 'hf-ar'"),
    ({"method": "hf-lookup", "compile": True}, "compile (--compile) does not apply to 'hf-lookup'"),
    ({"device": 0}, "device (--device) must be a string"),
    ({"target": 3}, "target must be a model spec string or a LoadedModel"),
    ({"linear": "fast"}, "unknown linear kernel"),
    ({"method": "ar", "draft": "ngram"}, "draft (--draft) does not apply to 'ar'"),
    ({"method": "hf-assisted"}, "needs a draft language model: pass --draft MODEL"),
    ({"method": "hf-assisted", "draft": "ngram"}, "not the n-gram drafter"),
    ({"method": "hf-assisted", "draft": "ngram+some/model"}, "takes a draft language model alone"),
    ({"method": "hf-assisted", "draft": Hybrid("some/model")}, "takes a draft language model alone"),
    ({"draft": "ngram+"}, "ngram+MODEL needs a draft model after 'ngram+', got 'ngram+'"),
    ({"draft": 5}, "draft must be a spec string"),
    ({"stop": 5}, "stop (--stop) must be a string or a list of strings, got 5"),
    ({"stop": ["w5", None]}, "stop (--stop) must be a string or a list of strings"),
    ({"stop": ["w5", ""]}, "stop (--stop) strings must not be empty"),
    ({"prompt": None, "prompt_ids": [1, 2], "chat": True}, "chat (--chat) wraps a text prompt"),
    ({"method": ["ar", "dynatree"]}, "run one method at a time"),
    ({"dtype": ["float32"]}, "unknown dtype"),
    ({"weights": ["q4"]}, "unknown weight format"),
    ({"method": "ar", "ngram_max": 3}, "ngram_max (--ngram-max) applies only where dynatree's n-gram drafter runs; 'ar' drafts nothing"),
    ({"method": "hf-lookup", "ngram_max": 3}, "'hf-lookup' runs transformers"),
    ({"draft": "some/model", "ngram_max": 3}, "the draft 'some/model' runs alone"),
])
def test_every_model_free_value_is_checked_before_loading(fields, message):
    request = Request(**{"prompt": "hello", "target": MISSING, **fields})
    with pytest.raises(DynaTreeError) as info:
        request.check()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_check_resolves_the_config_window_and_sampling_without_loading():
    checked = Request("hello", method="dynatree", options={"d0": 3}, target=MISSING, kv_window="4,64",
                      sample=True, temperature=0.5).check()
    assert checked.config.d0 == 3 and checked.method.name == "dynatree"
    assert checked.window == KVWindow(4, 64) and checked.sampling.temperature == 0.5
    greedy = Request("hello", target=MISSING).check()
    assert greedy.window is None and greedy.sampling is None
    with pytest.raises(DynaTreeError, match="does not exist"):  # loading is prepare's job
        prepare(Request("hello", target=MISSING))


def test_prepare_and_run_decode_like_plain_greedy_and_the_request_is_reusable():
    target = tiny("llama", eos_ids=[])
    request = Request(prompt_ids=[5, 6, 7, 5, 6], method="dynatree", target=target, draft="ngram",
                      max_new_tokens=12, ignore_eos=True, dtype="float64", options={"d0": 2})
    first = run(prepare(request))
    again = run(prepare(dataclasses.replace(request, method="linear", options={"k": 3})))
    assert first.new_token_ids == again.new_token_ids == hf_greedy(target, [5, 6, 7, 5, 6], 12)
    assert first.config["d0"] == 2 and again.config["k"] == 3


def test_the_result_is_typed_and_its_json_is_the_cli_record():
    target = tiny("llama", eos_ids=[])
    request = Request(prompt_ids=[5, 6, 7, 5, 6], method="dynatree", target=target, draft="ngram",
                      max_new_tokens=10, ignore_eos=True, dtype="float64")
    result = run(prepare(request))
    assert isinstance(result, Result) and isinstance(result.stats, Summary) and isinstance(result.run, RunInfo)
    assert result.stats.new_tokens == len(result.new_token_ids) == 10 and result.run.max_new_tokens == 10
    record = result.to_json()
    # policy_state: dynatree has one; logprobs only when asked
    assert list(record) == [f.name for f in dataclasses.fields(Result) if f.name != "logprobs"]
    assert list(record["stats"]) == [f.name for f in dataclasses.fields(Summary)]
    assert json.loads(json.dumps(record)) == record  # plain JSON values only
    plain = run(prepare(dataclasses.replace(request, method="ar", draft=None))).to_json()
    assert "policy_state" not in plain and plain["new_token_ids"] == record["new_token_ids"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.text = "changed"


def _chat_target():
    import copy

    from dynatree.runtime import LoadedModel
    base = tiny("llama", eos_ids=[])
    tok = copy.deepcopy(base.tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ {'system': 'w8', 'user': 'w3', 'assistant': 'w4'}[m['role']] }} "
                         "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}")
    return LoadedModel(model=base.model, tokenizer=tok, name="tiny-chat-template", eos_ids=[])


def test_a_conversation_goes_through_the_chat_template():
    target = _chat_target()
    talk = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w5 w6"},
            {"role": "assistant", "content": "w7"}, {"role": "user", "content": "w10 w11"}]
    got = run(prepare(Request(talk, method="dynatree", target=target, draft="ngram", max_new_tokens=12)))
    ids = target.tokenizer("w8 w9 w3 w5 w6 w4 w7 w3 w10 w11 w4").input_ids  # the template's text
    want = run(prepare(Request(prompt_ids=ids, method="ar", target=target, max_new_tokens=12)))
    assert got.prompt_tokens == len(ids) and got.new_token_ids == want.new_token_ids and got.run.chat is True
    one = run(prepare(Request([{"role": "user", "content": "w5 w6"}], method="ar", target=target, max_new_tokens=6)))
    text = run(prepare(Request("w5 w6", method="ar", target=target, max_new_tokens=6, chat=True)))
    assert one.new_token_ids == text.new_token_ids and one.prompt_tokens == text.prompt_tokens
    with pytest.raises(DynaTreeError, match="needs a chat template; 'tiny-llama-0' has none"):
        prepare(Request(talk, method="ar", target=tiny("llama"), max_new_tokens=4))
    # OpenAI's newer name for the system message reaches the template as `system` (as the server's does)
    developer = [{"role": "developer", "content": "w9"}, *talk[1:]]
    as_system = run(prepare(Request(developer, method="dynatree", target=target, draft="ngram", max_new_tokens=12)))
    assert as_system.prompt_tokens == len(ids) and as_system.new_token_ids == want.new_token_ids
    strict = _chat_target()
    strict.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception("
                                      "'System role not supported') }}{% endif %}{{ m['content'] }} {% endfor %}")
    with pytest.raises(DynaTreeError, match="the chat template of 'tiny-chat-template' rejects these messages: "
                                            "System role not supported"):
        prepare(Request(talk, method="ar", target=strict, max_new_tokens=4))


@pytest.mark.parametrize("prompt,message", [
    ([], "the prompt is an empty conversation"),
    (["w5"], "prompt[0] must be a dict with the keys 'role' and 'content', got 'w5'"),
    ([{"role": "user"}], "prompt[0] must be a dict with the keys 'role' and 'content'"),
    ([{"role": "user", "content": "w5", "name": "me"}], "prompt[0] must be a dict with the keys 'role' and 'content'"),
    ([{"role": "user", "content": "w5"}, {"role": "robot", "content": "w6"}],
     "prompt[1]['role'] must be one of system, developer, user, assistant, got 'robot'"),
    ([{"role": "user", "content": 5}], "prompt[0]['content'] must be a string, got int"),
    ([{"role": "user", "content": "  "}], "the prompt is empty (every message's content is blank)"),
    ((("user", "w5"),), "prompt must be a string or a list of {'role', 'content'} messages"),
    ([5, 6, 7], "prompt is a list of integers: give token ids as prompt_ids"),
])
def test_a_bad_conversation_is_refused_before_anything_loads(prompt, message):
    with pytest.raises(DynaTreeError, match=re.escape(message)):
        Request(prompt, method="ar", target=MISSING).check()


def test_the_python_api_names_method_options_by_their_keywords_and_the_cli_by_its_flags():
    target = tiny("llama")
    for options, message in (({"d0": 0}, "^d0 must be at least 1, got 0"),
                             ({"d0": 8, "d_max": 6}, "^d0 must be smaller than d_max, got 8 >= 6"),
                             ({"tau_h": 2.0}, r"^tau_h must be in \(0, 1\)")):
        with pytest.raises(DynaTreeError, match=message):
            prepare(Request(prompt_ids=[5, 6], target=target, draft="ngram", options=options))
        with pytest.raises(DynaTreeError, match=message.replace("d0", "--d0").replace("d_max", "--d-max")
                           .replace("tau_h", "--tau-h")):
            Request(prompt_ids=[5, 6], target=target, draft="ngram", options=options).check()  # (what the CLI shows)
    with pytest.raises(DynaTreeError, match=r"^option 'tau-h': the Python API names options with underscores \(tau_h\)"):
        prepare(Request(prompt_ids=[5, 6], target=target, draft="ngram", options={"tau-h": 0.5}))


def test_stop_strings_end_every_method_at_the_same_text():
    """OpenAI's rule, as the server keeps it: the text ends just before the first stop string, the
    ids with the token that completed it, the finish reason is "stop"; every method cuts alike."""
    target, draft = tiny("llama", eos_ids=[]), tiny("llama", seed=1, eos_ids=[])
    prompt = [5, 6, 7, 5, 6]
    full = run(prepare(Request(prompt_ids=prompt, method="ar", target=target, max_new_tokens=30)))
    words = full.text.split()
    assert full.finish_reason == "length" and len(words) == 30
    stop = " ".join(words[9:11])  # two words: the stop may straddle two committed groups
    want = full.text[:full.text.find(stop)]
    for method, drafted in (("ar", None), ("dynatree", draft), ("linear", "ngram"), ("wetap", draft),
                            ("hf-ar", None), ("hf-assisted", draft)):
        seen = []
        got = run(prepare(Request(prompt_ids=prompt, method=method, target=target, draft=drafted, max_new_tokens=30,
                                  stop=["w95 w95 w95", stop])), on_tokens=seen.extend)
        assert got.text == want and got.finish_reason == "stop" and got.run.stop == ["w95 w95 w95", stop], method
        ids = got.new_token_ids  # up to the token that completed the stop string
        assert ids == full.new_token_ids[:len(ids)] and stop in target.tokenizer.decode(ids)
        assert stop not in target.tokenizer.decode(ids[:-1]) and seen == ids, method  # nothing past the stop
        # the figures count the tokens returned, not those decoded past the stop (a tree step commits a
        # group; hf-ar's criteria run a step late)
        s = got.stats
        assert s.new_tokens == len(ids) and s.tokens_per_iter == len(ids) / s.iterations, method
        assert s.accepted_tokens < len(ids) and s.accepted_len <= s.tokens_per_iter, method  # (drafts past it dropped too)
        assert s.tokens_per_s == pytest.approx(len(ids) / s.wall_s) and s.tpot_s == pytest.approx(
            (s.wall_s - s.ttft_s) / (len(ids) - 1)), method
    unseen = run(prepare(Request(prompt_ids=prompt, method="dynatree", target=target, draft=draft, max_new_tokens=30,
                                 stop="w95 w95 w95")))
    assert unseen.new_token_ids == full.new_token_ids and unseen.finish_reason == "length"
    assert full.run.stop is None and unseen.run.stop == ["w95 w95 w95"]


def test_a_stop_cut_drops_the_bonus_token_then_the_drafted_tokens_from_the_figures():
    from dynatree.stats import Stats

    stats = Stats(new_tokens=1, iterations=1, wall_s=1.0, ttft_s=0.1)  # the prefill's token
    stats.count_iteration(drafted=8, accepted=5, committed=6, draft_s=0, verify_s=0, commit_s=0)  # 5 drafts + bonus
    whole, cut = stats.summary(), stats.summary(kept=3)  # a stop completed by the second of the group's tokens
    assert (whole.new_tokens, whole.accepted_tokens, whole.accepted_len) == (7, 5, 2.5)
    assert (cut.new_tokens, cut.accepted_tokens, cut.accepted_len, cut.acceptance_rate) == (3, 2, 1.0, 2 / 8)
    assert (cut.tokens_per_iter, cut.mean_generated_len) == (1.5, 2.0) and cut.tpot_s == pytest.approx(0.45)
    assert stats.summary(kept=6).accepted_tokens == 5  # only the bonus token was past the stop
    hf = Stats(new_tokens=9, iterations=3, accepted_tokens=6)  # an engine that does not say its groups: one bonus a pass
    assert hf.summary(kept=5).accepted_tokens == 3


def test_the_finish_reason_is_stop_at_an_end_of_sequence_token():
    target = tiny("llama", eos_ids=[])
    prompt = [5, 6, 7, 5, 6]
    ids = run(prepare(Request(prompt_ids=prompt, method="ar", target=target, max_new_tokens=12))).new_token_ids
    eos = tiny("llama", eos_ids=[ids[5]])  # the same model, its sixth new token an end of sequence
    for method in ("ar", "dynatree"):
        got = run(prepare(Request(prompt_ids=prompt, method=method, target=eos, draft=None if method == "ar"
                                  else "ngram", max_new_tokens=12)))
        assert got.new_token_ids == ids[:ids.index(ids[5]) + 1] and got.finish_reason == "stop"
        kept = run(prepare(Request(prompt_ids=prompt, method=method, target=eos, draft=None if method == "ar"
                                   else "ngram", max_new_tokens=12, ignore_eos=True)))
        assert kept.new_token_ids == ids and kept.finish_reason == "length"


@pytest.mark.parametrize("method,reason", [
    ("hf-lookup", "prompt-lookup decoding with a static cache fails inside the compiled graph"),
    ("llamacpp-ar", "no torch graph to compile"),
])
def test_compile_is_refused_with_the_reason_where_it_cannot_apply(method, reason, saved_tiny, capsys):
    from dynatree.bench import runner
    from dynatree.cli import main

    with pytest.raises(DynaTreeError, match=rf"compile \(--compile\) does not apply to '{method}': .*{reason}"):
        Request(prompt_ids=[5, 6], method=method, target=MISSING, compile=True).check()
    with pytest.raises(DynaTreeError, match=f"--compile does not apply to '{method}'"):
        runner.check_variants([runner.Variant("ar", "ar"), runner.Variant(method, method, compile=True)])
    assert main(["generate", "--target", str(saved_tiny), "--method", method, "--compile", "w5 w6"]) == 2
    assert reason in capsys.readouterr().err
    assert Request(prompt_ids=[5, 6], method="hf-ar", target=MISSING, compile=True).check().method.compilable


def test_a_checked_request_is_bound_to_loaded_models_without_a_second_check(monkeypatch):
    """The CLI checks each request before loading anything, then binds it to the loaded target, draft
    and encoded prompt: prepare() takes the Checked request and does not run check() again."""
    from dynatree.draftload import load_draft

    target = tiny("llama", eos_ids=[])
    prompt = [3, 4, 5, 3, 4, 5, 3]
    checked = Request(prompt="text", method="linear", target=MISSING, draft="ngram", max_new_tokens=6,
                      options={"k": 2}).check()
    bound = checked.bind(target, load_draft("ngram", target), prompt)
    calls = []
    monkeypatch.setattr(Request, "check", lambda self: calls.append(self) or pytest.fail("checked twice"))
    job = prepare(bound)
    assert not calls and job.config.k == 2 and job.draft.name == "ngram"
    assert run(job).new_token_ids == hf_greedy(target, prompt, 6)
    monkeypatch.undo()
    with pytest.raises(DynaTreeError, match="drafts: bind.. needs its Draft"):
        checked.bind(target, None, prompt)
    with pytest.raises(DynaTreeError, match="Draft loaded for this target"):
        checked.bind(target, load_draft("ngram", tiny("llama", seed=1)), prompt)
    ar = Request(prompt="text", method="ar", target=MISSING).check()
    with pytest.raises(DynaTreeError, match="drafts nothing"):
        ar.bind(target, load_draft("ngram", target), prompt)
    with pytest.raises(DynaTreeError, match="loaded target"):
        ar.bind(MISSING, None, prompt)
    assistant = Request(prompt="text", method="hf-assisted", target=MISSING, draft=MISSING).check()
    with pytest.raises(DynaTreeError, match="draft language model alone"):
        assistant.bind(target, load_draft(Hybrid(target), target), prompt)


def test_peak_memory_is_read_by_run_over_the_timed_span_not_by_the_decoder():
    """api.run prepares the decoder (graphs, cost curve) and reads peak memory over the timed run;
    a decoder driven directly (as the server does) leaves it unmeasured, not 0."""
    target = tiny("llama", eos_ids=[])
    job = prepare(Request(method="dynatree", target=target, prompt_ids=[3, 4, 5, 3, 4], max_new_tokens=6,
                          options={"cost_aware": True}))
    assert run(job).stats.peak_mem_mb > 0
    direct = job.decoder().generate(job.prompt_ids, job.max_new_tokens)
    assert direct.stats.peak_mem_mb is None and direct.new_tokens == hf_greedy(target, job.prompt_ids, 6)


def test_prepare_and_run_name_what_they_take():
    import numpy as np
    import torch

    from dynatree import load_model

    target = tiny("llama")
    with pytest.raises(DynaTreeError, match=r"^run\(\) takes what prepare\(\) returns, got Request: run\(prepare\(request\)\)$"):
        run(Request(prompt_ids=[5], target=target, method="ar"))
    with pytest.raises(DynaTreeError, match=r"^prepare\(\) takes a dynatree.Request, got str"):
        prepare("hello")
    with pytest.raises(DynaTreeError, match=r"^load_model takes a model spec \(alias, directory, .gguf file or hub id\), got int$"):
        load_model(5)
    for kwargs, message in (({"device": 0}, "device must be a string"), ({"compile": "no"}, "compile must be True or False"),
                            ({"dtype": ["float32"]}, "unknown dtype")):
        with pytest.raises(DynaTreeError, match=message):  # before any loading: MISSING is never opened
            load_model(MISSING, **kwargs)
    with pytest.raises(DynaTreeError, match="does not exist"):  # weights=None is dense, as in generate()
        load_model(MISSING, weights=None)
    from dynatree import stream
    with pytest.raises(DynaTreeError, match="on_tokens must be a function"):  # at the call, not on the decode's thread
        stream(prompt_ids=[5, 6], target=target, method="ar", on_tokens=5)
    # a 1-D tensor of ids (a tokenizer's return_tensors="pt", row 0) and numpy integers in method options are taken
    plain = run(prepare(Request(prompt_ids=[5, 6, 7], target=target, method="dynatree", draft="ngram", max_new_tokens=6)))
    other = run(prepare(Request(prompt_ids=torch.tensor([5, 6, 7]), target=target, method="dynatree", draft="ngram",
                                max_new_tokens=6, options={"d0": np.int64(2), "tau_h": np.float32(0.5)})))
    assert other.new_token_ids == plain.new_token_ids and other.config["d0"] == 2 and type(other.config["d0"]) is int


def test_a_decode_leaves_torchs_global_generator_as_it_was():
    """dynatree's sampler draws from a generator of its own, and transformers' from the global one
    seeded for the run and then given back: the caller's random stream goes on as if nothing ran."""
    import torch

    target = tiny("llama")
    for fields in ({"method": "dynatree", "draft": "ngram"}, {"method": "dynatree", "draft": "ngram", "sample": True},
                   {"method": "hf-ar", "sample": True}):
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        run(prepare(Request(prompt_ids=[5, 6, 7], target=target, max_new_tokens=4, seed=7, **fields)))
        assert torch.equal(torch.rand(3), expected), fields


def test_hf_runs_seed_only_the_generators_they_give_back(monkeypatch):
    """An hf-* run seeds the CPU generator (and its own CUDA device's), never every CUDA device's
    (`torch.manual_seed` would, and only the target's is restored)."""
    import torch

    target = tiny("llama")
    job = prepare(Request(prompt_ids=[5, 6, 7], target=target, method="hf-ar", sample=True, max_new_tokens=8, seed=3))
    first = run(job).new_token_ids
    every = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", every.append)
    assert run(job).new_token_ids == first and every == []


def test_concurrent_sampled_hf_runs_on_two_targets_draw_their_own_seeded_streams():
    """transformers samples from torch's global generator: two hf-* runs on other threads fork and
    seed it one at a time, so each gives what it gives alone."""
    import threading

    jobs = [prepare(Request(prompt_ids=[5, 6, 7], target=tiny("llama", seed=s, eos_ids=[]), method="hf-ar", sample=True,
                            temperature=1.5, max_new_tokens=32, seed=s)) for s in (1, 2)]
    alone = [run(job).new_token_ids for job in jobs]
    for _ in range(3):
        got = [None, None]
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, run(jobs[i]).new_token_ids)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == alone


def test_a_decode_holds_its_draft_model_too():
    """A draft LM is held like the target (it may be another decode's target: its kernel switches and
    compiled graphs are shared too); both are free again at the end."""
    import threading

    target, draft = tiny("llama"), tiny("llama", seed=1)
    seen = []

    def other_thread_could_take_them(ids):
        for model in (target, draft):
            attempt = threading.Thread(target=lambda m=model: seen.append(m.busy.acquire(blocking=False)))
            attempt.start()
            attempt.join()

    run(prepare(Request(prompt_ids=[5, 6, 7], target=target, draft=draft, max_new_tokens=3)),
        on_tokens=other_thread_could_take_them)
    assert seen and not any(seen)
    for model in (target, draft):
        assert model.busy.acquire(blocking=False)
        model.busy.release()


def test_a_decode_holds_its_feature_head_too():
    """A feature head may serve decodes on two targets (checked against each): it is held like a model."""
    import threading

    from helpers import tiny_head

    target, head = tiny("llama"), tiny_head("llama")
    seen = []

    def other_thread_could_take_it(ids):
        from dynatree.api import _busy

        attempt = threading.Thread(target=lambda: seen.append(_busy(head).acquire(blocking=False)))
        attempt.start()
        attempt.join()

    run(prepare(Request(prompt_ids=[5, 6, 7], target=target, draft=head, max_new_tokens=3)),
        on_tokens=other_thread_could_take_it)
    assert seen and not any(seen)


def test_a_sampled_hf_decode_inside_a_sampled_hf_decodes_callback_runs(monkeypatch):
    """A callback's own decode runs on the callback's thread: a sampled hf-* one inside a sampled hf-*
    decode nests its seeded fork of the global generators in the outer one's (no deadlock), and the outer
    run's draws are what they are without it."""
    import threading

    outer, inner = tiny("llama", eos_ids=[]), tiny("llama", seed=1, eos_ids=[])
    job = lambda t, seed: prepare(Request(prompt_ids=[5, 6, 7], target=t, method="hf-ar", sample=True,  # noqa: E731
                                          max_new_tokens=8, seed=seed))
    alone, inner_alone = run(job(outer, 1)).new_token_ids, run(job(inner, 2)).new_token_ids
    got, nested = [], []

    def decode():
        got.append(run(job(outer, 1), on_tokens=lambda ids: nested or nested.append(run(job(inner, 2)))))

    thread = threading.Thread(target=decode, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the nested decode waited forever"
    assert got[0].new_token_ids == alone and nested[0].new_token_ids == inner_alone


def test_a_sampled_hf_decode_waiting_for_its_model_does_not_hold_the_generators():
    """Thread B decodes on X, its callback a sampled hf-* decode on an idle model Z; thread A's sampled
    hf-* decode on X waits for B. A waits holding nothing B's callback needs: both end."""
    import threading
    import time

    x, z = tiny("llama", eos_ids=[]), tiny("llama", seed=1, eos_ids=[])
    sampled = lambda t: prepare(Request(prompt_ids=[5, 6, 7], target=t, method="hf-ar", sample=True,  # noqa: E731
                                        max_new_tokens=4, seed=1))
    a_started, done = threading.Event(), []

    def callback(ids):
        if not a_started.is_set():
            threading.Thread(target=lambda: done.append(("a", run(sampled(x)))), daemon=True).start()
            a_started.set()
            time.sleep(0.5)  # (A now waits for X)
            done.append(("inner", run(sampled(z))))

    b = threading.Thread(target=lambda: done.append(("b", run(prepare(Request(
        prompt_ids=[5, 6, 7], target=x, method="dynatree", draft="ngram", max_new_tokens=6)), on_tokens=callback))),
        daemon=True)
    b.start()
    b.join(120)
    for _ in range(120):
        if len(done) == 3:
            break
        time.sleep(1)
    assert sorted(name for name, _ in done) == ["a", "b", "inner"], "a decode waited forever"


def test_greedy_hf_runs_leave_the_global_generators_alone(monkeypatch):
    """A greedy hf-* run draws nothing: it neither forks nor seeds torch's generators (restoring them at
    its end would undo another thread's draws) and does not wait for sampled runs."""
    import torch

    monkeypatch.setattr(torch.random, "fork_rng", lambda *a, **k: pytest.fail("a greedy run forked the generators"))
    job = prepare(Request(prompt_ids=[5, 6, 7], target=tiny("llama"), method="hf-ar", max_new_tokens=4))
    assert not job.uses_global_rng
    with rng.LOCK:  # (held here: a greedy run on another thread would still go on)
        import threading

        done = []
        thread = threading.Thread(target=lambda: done.append(run(job)), daemon=True)
        thread.start()
        thread.join(60)
    assert done and len(done[0].new_token_ids) == 4


@pytest.mark.parametrize("method,draft", (("dynatree", "ngram"), ("hf-ar", None)))
def test_a_decode_cancelled_before_it_starts_runs_nothing(monkeypatch, method, draft):
    """A decode whose cancel is already set when it gets its models (a stream closed while it waited
    for another decode) ends at once: no prefill, no compile, no cost curve."""
    from dynatree.decode import Decoder

    monkeypatch.setattr(Decoder, "prepare", lambda *a: pytest.fail("prepared a cancelled decode"))
    result = run(prepare(Request(prompt_ids=[5, 6, 7], target=tiny("llama"), method=method, draft=draft,
                                 max_new_tokens=8)), cancel=lambda: True)
    assert result.finish_reason == "cancelled" and result.new_token_ids == [] and result.text == ""
    assert result.stats.iterations == 0
    if method == "dynatree":  # shaped as a run's: logprobs asked for are an empty list
        scored = run(prepare(Request(prompt_ids=[5, 6, 7], target=tiny("llama"), method=method, draft=draft,
                                     max_new_tokens=8, logprobs=2)), cancel=lambda: True)
        assert scored.logprobs == [] and scored.to_json()["logprobs"] == []


def test_device_may_be_a_torch_device(saved_tiny):
    import torch

    from dynatree import load_model

    model = load_model(str(saved_tiny), device=torch.device("cpu"))
    assert model.device == torch.device("cpu")
    result = run(prepare(Request(prompt_ids=[5, 6, 7], target=str(saved_tiny), device=torch.device("cpu"),
                                 method="ar", max_new_tokens=3)))
    assert result.run.device == "cpu" and len(result.new_token_ids) == 3
    again = run(prepare(Request(prompt_ids=[5, 6, 7], target=model, device=torch.device("cpu"), method="ar",
                                max_new_tokens=3)))
    assert again.new_token_ids == result.new_token_ids


def test_decodes_on_one_target_run_one_after_the_other():
    """While a decode runs, the target is held: another thread's decode waits for it (no two decodes
    share the model's kernel switches, compiled graphs and measured costs at once)."""
    import threading

    target = tiny("llama")
    seen = []

    def other_thread_could_take_it(ids):
        attempt = threading.Thread(target=lambda: seen.append(target.busy.acquire(blocking=False)))
        attempt.start()
        attempt.join()

    run(prepare(Request(prompt_ids=[5, 6, 7], target=target, max_new_tokens=3, method="dynatree", draft="ngram")),
        on_tokens=other_thread_could_take_it)
    assert seen and not any(seen)
    assert target.busy.acquire(blocking=False)  # and free again once it has ended
    target.busy.release()


def test_numpy_integers_give_a_json_record():
    np = pytest.importorskip("numpy")
    result = run(prepare(Request(prompt_ids=[5, 6, 7], target=tiny("llama"), max_new_tokens=np.int64(3),
                                 seed=np.int64(2), ngram_max=np.int32(3), logprobs=np.int64(1), draft="ngram")))
    record = json.loads(json.dumps(result.to_json()))
    assert record["run"]["max_new_tokens"] == 3 and record["run"]["seed"] == 2 and record["run"]["ngram_max"] == 3


def test_ngram_max_is_the_n_gram_drafters_setting_and_refused_where_it_does_not_run():
    """Given where a loaded draft has no n-gram drafter, an error (it was silently unused); left out,
    the record shows 4 where the drafter runs and null where it does not."""
    from dynatree.draftload import load_draft

    target = tiny("llama")
    assert run(prepare(Request(prompt_ids=[5, 6], target=target, draft="ngram", max_new_tokens=3))).run.ngram_max == 4
    assert run(prepare(Request(prompt_ids=[5, 6], target=target, draft="ngram", max_new_tokens=3,
                               ngram_max=2))).run.ngram_max == 2
    alone = tiny("llama", seed=1)
    assert run(prepare(Request(prompt_ids=[5, 6], target=target, draft=alone, max_new_tokens=3))).run.ngram_max is None
    with pytest.raises(DynaTreeError, match=r"^ngram_max \(--ngram-max\) applies only .* runs alone"):
        Request(prompt_ids=[5, 6], target=target, draft=alone, ngram_max=3).check()
    draft = load_draft(alone, target, "auto")  # a Draft: only prepare knows it holds no n-gram drafter
    with pytest.raises(DynaTreeError, match=r"^ngram_max \(--ngram-max\) applies only .* has none"):
        prepare(Request(prompt_ids=[5, 6], target=target, draft=draft, ngram_max=3))
    hybrid = load_draft(Hybrid(alone), target, "auto")
    assert run(prepare(Request(prompt_ids=[5, 6], target=target, draft=hybrid, max_new_tokens=3,
                               ngram_max=3))).run.ngram_max == 3


def test_a_list_of_methods_through_prepare_is_the_one_line_error():
    with pytest.raises(DynaTreeError, match="run one method at a time"):
        prepare(Request(prompt="hi", method=["ar", "dynatree"], target=MISSING))
