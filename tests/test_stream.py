"""What a caller sees while a decode runs (api.run's `on_text` and `cancel`, `dynatree.stream`): the
text pieces add up to the result's text in every engine, a stop string completed by the prefill's
first token ends the run there, a cancelled run ends early with "cancelled", and the stream's
errors reach the reading thread."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from helpers import tiny
from dynatree import DynaTreeError, Request, generate, prepare, run, stream
from dynatree.streaming import TextIterator

PROMPT = [5, 6, 7, 5, 6]
METHODS = (("ar", None), ("dynatree", "draft"), ("linear", "ngram"), ("hf-ar", None), ("hf-assisted", "draft"))


def _models():
    return tiny("llama", eos_ids=[]), tiny("llama", seed=1, eos_ids=[])


def _job(method, drafted, **fields):
    target, draft = _models()
    return prepare(Request(prompt_ids=PROMPT, method=method, target=target,
                           draft=draft if drafted == "draft" else drafted, **{"max_new_tokens": 24, **fields}))


@pytest.mark.parametrize("method,drafted", METHODS)
def test_text_pieces_add_up_to_the_result_text_with_and_without_stops(method, drafted):
    pieces = []
    full = run(_job(method, drafted), on_text=pieces.append)
    assert "".join(pieces) == full.text and len(pieces) > 1 and all(pieces)
    stop = " ".join(full.text.split()[6:8])
    cut = []
    got = run(_job(method, drafted, stop=stop), on_text=cut.append)
    assert "".join(cut) == got.text == full.text[:full.text.find(stop)] and got.finish_reason == "stop"


@pytest.mark.parametrize("method,drafted", METHODS)
def test_text_pieces_add_up_to_the_result_text_when_the_run_ends_at_an_end_of_sequence_token(method, drafted):
    ids = run(_job("ar", None)).new_token_ids
    target, draft = tiny("llama", eos_ids=[ids[5]]), tiny("llama", seed=1, eos_ids=[ids[5]])
    pieces = []
    got = run(prepare(Request(prompt_ids=PROMPT, method=method, target=target, draft=draft if drafted == "draft"
                              else drafted, max_new_tokens=24)), on_text=pieces.append)
    assert got.finish_reason == "stop" and got.new_token_ids == ids[:ids.index(ids[5]) + 1]
    assert "".join(pieces) == got.text


@pytest.mark.parametrize("method,drafted", (("ar", None), ("dynatree", "draft"), ("linear", "ngram")))
def test_a_stop_completed_by_the_first_token_ends_the_run_after_the_prefill(method, drafted):
    first = run(_job("ar", None, max_new_tokens=1)).text  # the first new token's text
    got = run(_job(method, drafted, stop=first))
    assert got.text == "" and got.new_token_ids == run(_job("ar", None, max_new_tokens=1)).new_token_ids
    assert got.stats.new_tokens == 1 and got.stats.iterations == 1  # no verification after the prefill


@pytest.mark.parametrize("method,drafted", METHODS)
def test_cancel_ends_the_decode_early_with_the_reason_cancelled(method, drafted):
    full = run(_job(method, drafted)).new_token_ids
    seen = []
    got = run(_job(method, drafted), on_tokens=seen.extend, cancel=lambda: len(seen) >= 5)
    ids = got.new_token_ids
    assert got.finish_reason == "cancelled" and 5 <= len(ids) < len(full) and ids == full[:len(ids)]
    never = run(_job(method, drafted), cancel=lambda: False)
    assert never.finish_reason == "length" and never.new_token_ids == full
    seen.clear()  # a cancel that comes with the last token: the run had ended by itself
    late = run(_job(method, drafted), on_tokens=seen.extend, cancel=lambda: len(seen) >= len(full))
    assert late.finish_reason == "length" and late.new_token_ids == full


def test_run_refuses_callbacks_that_are_not_functions():
    job = _job("ar", None)
    with pytest.raises(DynaTreeError, match="on_text must be a function of the new text, got str"):
        run(job, on_text="print")
    with pytest.raises(DynaTreeError, match="cancel must be a function of no arguments"):
        run(job, cancel=True)


def test_stream_gives_the_text_as_it_comes_and_the_result_at_the_end():
    target, draft = _models()
    want = run(_job("dynatree", "draft", stop="w95 w95 w95"))
    with stream(prompt_ids=PROMPT, target=target, draft=draft, max_new_tokens=24, stop="w95 w95 w95") as pieces:
        got = list(pieces)
    assert "".join(got) == want.text and len(got) > 1
    result = pieces.result
    assert result.new_token_ids == want.new_token_ids and result.finish_reason == "length"
    assert list(pieces) == []  # read to its end once
    stop = " ".join(want.text.split()[6:8])
    cut = stream(prompt_ids=PROMPT, method="hf-ar", target=target, max_new_tokens=24, stop=stop)
    assert "".join(cut) == cut.result.text == want.text[:want.text.find(stop)] and cut.result.finish_reason == "stop"


def test_a_stream_closed_early_ends_its_decode_cancelled():
    target, _ = _models()
    s = stream(prompt_ids=PROMPT, method="ar", target=target, max_new_tokens=400, ignore_eos=True)
    first = next(s)
    s.close()
    result = s.result
    assert first and result.finish_reason == "cancelled" and len(result.new_token_ids) < 400
    assert result.text.startswith(first)


def test_a_dropped_stream_ends_its_decode_and_the_result_waits_for_the_end():
    target, _ = _models()
    seen = []
    s = stream(prompt_ids=PROMPT, method="ar", target=target, max_new_tokens=400, ignore_eos=True,
               on_tokens=lambda ids: seen.extend(ids) or time.sleep(0.005))  # (400 tokens take 2 s at least)
    assert next(s)
    thread = s._thread
    del s  # dropped without close(): the decode is asked to end
    thread.join(60)
    assert not thread.is_alive() and len(seen) < 400
    unread = stream(prompt_ids=PROMPT, method="dynatree", target=target, draft="ngram", max_new_tokens=20)
    result = unread.result  # before any piece was read: the pieces wait
    assert result.finish_reason == "length" and "".join(unread) == result.text


def test_a_stream_checks_its_arguments_before_decoding_and_raises_the_decodes_error_where_read():
    target, _ = _models()
    with pytest.raises(DynaTreeError, match="max_new_tokens"):
        stream(prompt_ids=PROMPT, target=target, method="ar", max_new_tokens=0)
    with pytest.raises(DynaTreeError, match=r"stream\(\) takes the method's options as keywords"):
        stream(prompt_ids=PROMPT, target=target, options={"d0": 3})
    with pytest.raises(DynaTreeError, match=r"^option k does not apply to method 'dynatree' \(its options: d0, d_max,"):
        stream(prompt_ids=PROMPT, target=target, k=3)  # (the API's keywords, not the CLI's --flags)
    with pytest.raises(DynaTreeError, match=r"^stream\(\) got an unknown argument 'colour'$"):  # no method's option
        stream(prompt_ids=PROMPT, target=target, colour=3)
    with pytest.raises(DynaTreeError, match=r"^stream\(\) got an unknown argument 'max_tokens' \(did you mean "
                                            r"max_new_tokens\?\)$"):  # OpenAI's name
        stream(prompt_ids=PROMPT, target=target, max_tokens=3)
    with pytest.raises(DynaTreeError, match=r"^generate\(\) got an unknown argument 'max_new_token' \(did you mean "
                                            r"max_new_tokens\?\)$"):  # a typo
        generate(prompt_ids=PROMPT, target=target, max_new_token=3)
    for given, meant in (("model", "target"), ("assistant_model", "draft"), ("on_token", "on_tokens"),
                         ("cost_awar", "cost_aware")):  # other libraries' names first, then the method's own options
        with pytest.raises(DynaTreeError, match=rf"^generate\(\) got an unknown argument '{given}' \(did you mean {meant}\?\)$"):
            generate(prompt_ids=PROMPT, target=target, **{given: 1})
    linear = stream(prompt_ids=PROMPT, method="linear", target=target, draft="ngram", k=3, max_new_tokens=6)
    assert linear.result.config["k"] == 3 and "".join(linear) == linear.result.text  # method options as keywords
    started = threading.Event()

    def fail(ids):
        started.set()
        raise RuntimeError("a failing callback")

    job = dataclasses.replace(_job("ar", None), max_new_tokens=8)
    failing = TextIterator(job, on_tokens=fail)
    with pytest.raises(RuntimeError, match="a failing callback"):
        list(failing)
    assert started.is_set()
    with pytest.raises(RuntimeError, match="a failing callback"):
        failing.result


@pytest.mark.parametrize("as_draft", (False, True))
def test_a_stream_inside_a_decodes_callback_on_its_models_is_refused(as_draft):
    """Its thread would wait for the decode whose callback started it, and that callback for the stream:
    refused at once; generate() in the callback (same thread) runs."""
    target, draft = _models()
    errors, inner = [], []

    def callback(ids):
        if errors or inner:
            return
        try:
            s = stream(prompt_ids=PROMPT, method="dynatree" if as_draft else "ar", target=draft if as_draft else target,
                       draft=target if as_draft else None, max_new_tokens=4)
            s._channel.cancel.set()  # (the check failed: let it end after this decode, without waiting here)
        except DynaTreeError as exc:
            errors.append(str(exc))
        inner.append(run(prepare(Request(prompt_ids=PROMPT, method="ar", target=target, max_new_tokens=4))))

    run(prepare(Request(prompt_ids=PROMPT, method="ar", target=target, max_new_tokens=24)), on_tokens=callback)
    assert errors and "cannot start inside a callback of a decode that holds" in errors[0]
    assert inner[0].finish_reason == "length" and len(inner[0].new_token_ids) == 4


def test_a_sampled_hf_stream_inside_a_sampled_hf_decodes_callback_is_refused():
    """Torch's global generators are held by a sampled hf-* decode: a sampled hf-* stream on another
    model, read in its callback, would wait for it; refused at once."""
    target, other = _models()
    errors = []

    def callback(ids):
        if errors:
            return
        try:
            s = stream(prompt_ids=PROMPT, method="hf-ar", target=other, sample=True, max_new_tokens=4)
            s._channel.cancel.set()
        except DynaTreeError as exc:
            errors.append(str(exc))

    run(prepare(Request(prompt_ids=PROMPT, method="hf-ar", target=target, sample=True, max_new_tokens=6)),
        on_tokens=callback)
    assert errors and "holds torch's global random generators" in errors[0]
