"""Log-probabilities of the new tokens (`logprobs` of a request): every method of dynatree's decoder
scores each committed token from the verification pass that committed it, and the figures equal a
plain teacher-forced pass of the target over the same text (float64 tiny models: to rounding)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from helpers import DEVICE, noisy_copy, tiny
from dynatree import DynaTreeError, Request, prepare, run
from dynatree.cli import main
from dynatree.textstream import TextStream, TokenTexts

PROMPT = [5, 6, 7, 5, 6, 7, 5]


def _reference(target, prompt: list[int], new: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits before each new token, from one plain causal pass."""
    seq = torch.tensor([prompt + new], device=DEVICE)
    with torch.no_grad():
        logits = target.model(seq, attention_mask=torch.ones_like(seq)).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1].double(), dim=-1)


@pytest.mark.parametrize("method,draft,sample", [
    ("ar", None, False), ("dynatree", "draft", False), ("linear", "ngram", False), ("fixed-tree", "draft", False),
    ("wetap", "draft", False), ("specexec", "draft", False), ("opt-tree", "draft", False), ("dsbd", "draft", False),
    ("mtad", "draft", False), ("specinfer", "draft", True), ("dynatree", "draft", True), ("wetap", "draft", True)])
def test_each_new_token_is_scored_as_a_plain_pass_scores_it(method, draft, sample):
    target, drafter = tiny("llama", eos_ids=[]), noisy_copy("llama", 0, 0.1)  # a draft that agrees often
    request = Request(prompt_ids=PROMPT, method=method, target=target, draft=drafter if draft == "draft" else draft,
                      max_new_tokens=30, logprobs=3, sample=sample, seed=4)
    result = run(prepare(request))
    ids, scored = result.new_token_ids, result.logprobs
    assert run(prepare(dataclasses.replace(request, logprobs=None))).new_token_ids == ids  # scoring changes nothing
    assert [s.token for s in scored] == ids and len(ids) == 30
    want = _reference(target, PROMPT, ids)
    for i, s in enumerate(scored):
        assert math.isclose(s.logprob, want[i, s.token].item(), abs_tol=1e-9), (method, i)
        best = want[i].topk(3)
        assert [t for t, _ in s.top] == best.indices.tolist(), (method, i)
        assert all(math.isclose(v, w, abs_tol=1e-9) for (_, v), w in zip(s.top, best.values.tolist()))
        if not sample:  # greedy: the chosen token is the most likely one
            assert s.top[0][0] == s.token
    if draft == "draft":  # passes committed several tokens: drafted rows of trees were scored, not one-token steps only
        assert result.stats.tokens_per_iter > 1, method


def test_logprobs_end_with_the_ids_at_a_stop_and_zero_alternatives_list_none():
    target = tiny("llama", eos_ids=[])
    full = run(prepare(Request(prompt_ids=PROMPT, method="ar", target=target, max_new_tokens=20)))
    stop = " ".join(full.text.split()[4:6])
    got = run(prepare(Request(prompt_ids=PROMPT, method="dynatree", target=target, draft="ngram", max_new_tokens=20,
                              stop=stop, logprobs=0)))
    assert len(got.logprobs) == len(got.new_token_ids) < 20 and all(s.top == [] for s in got.logprobs)
    assert "logprobs" not in full.to_json() and full.logprobs is None
    record = got.to_json()
    assert json.loads(json.dumps(record))["logprobs"][0] == {"token": got.new_token_ids[0],
                                                             "logprob": got.logprobs[0].logprob, "top": []}


@pytest.mark.parametrize("stop", [False, True])
def test_on_logprobs_gets_the_scores_of_the_tokens_each_text_piece_shows(stop):
    target, drafter = tiny("llama", eos_ids=[]), noisy_copy("llama", 0, 0.1)
    full = run(prepare(Request(prompt_ids=PROMPT, method="ar", target=target, max_new_tokens=24)))
    words = full.text.split()
    # a stop string that never completes but whose start is word 6: that word's text is held back
    # until the next group shows it; or one that completes at words 10-11
    cut = " ".join(words[9:11]) if stop else words[5] + " w999"
    request = Request(prompt_ids=PROMPT, method="dynatree", target=target, draft=drafter, max_new_tokens=24, logprobs=2,
                      stop=cut)
    events = []
    got = run(prepare(request), on_tokens=lambda ids: events.append(("ids", ids)),
              on_text=lambda piece: events.append(("text", piece)),
              on_logprobs=lambda scored: events.append(("scores", scored)))
    assert got.finish_reason == ("stop" if stop else "length")
    assert any(len(v) > 1 for k, v in events if k == "ids")  # tree passes committed several tokens at once
    assert [s for kind, value in events if kind == "scores" for s in value] == got.logprobs  # each once, in order
    pieces = [i for i, (kind, _) in enumerate(events) if kind == "text"]
    for i in pieces:  # the scores handed just before a piece are those of the tokens it shows
        assert events[i - 1][0] == "scores", events[i - 1]
        shown = "".join(target.tokenizer.decode([s.token]) + " " for s in events[i - 1][1])
        assert shown.split() == events[i][1].split(), (shown, events[i][1])
    if stop:  # the stop string's own tokens, never shown, come last
        assert events[-1][0] == "scores" and pieces[-1] < len(events) - 1
        assert " ".join(target.tokenizer.decode([s.token]) for s in events[-1][1]) in cut
    else:  # word 6 waited for the piece after it
        held = next(i for i in pieces if words[5] in events[i][1].split())
        assert events[held][1].split()[0] == words[5] and len(events[held - 1][1]) >= 2
    with pytest.raises(DynaTreeError, match=r"on_logprobs needs a request that asks for logprobs \(logprobs=N\)"):
        run(prepare(dataclasses.replace(request, logprobs=None)), on_logprobs=print)
    with pytest.raises(DynaTreeError, match="on_logprobs must be a function"):
        run(prepare(request), on_logprobs=3)


def test_the_text_stream_counts_a_token_shown_once_its_whole_character_is():
    fast, vocab, to_char = _byte_level_tokenizer()
    smiley = " \U0001F600".encode()
    head, tail = vocab["".join(to_char[b] for b in smiley[:4])], vocab[to_char[smiley[4]]]
    the = vocab[to_char[32] + "the"]
    text = TextStream(fast)
    assert text.push([the, head]) == " the " and text.shown() == 1  # the smiley's first bytes (after a space) wait
    assert text.push([tail]) == "\U0001F600" and text.shown() == 3
    stopped = TextStream(fast, ["the"])
    assert stopped.push([the]) == " " and stopped.shown() == 0 and stopped.stopped  # " the": the stop's own token
    held = TextStream(fast, [" the end"])
    assert held.push([the]) == "" and held.shown() == 0  # " the" may begin the stop string " the end"
    assert held.finish() == " the" and held.shown() == 1


def test_a_group_cut_at_an_end_of_sequence_token_is_scored_up_to_it():
    ids = run(prepare(Request(prompt_ids=PROMPT, method="ar", target=tiny("llama", eos_ids=[]),
                              max_new_tokens=20))).new_token_ids
    eos = ids[7]
    target, drafter = tiny("llama", eos_ids=[eos]), noisy_copy("llama", 0, 0.1)
    got = run(prepare(Request(prompt_ids=PROMPT, method="dynatree", target=target, draft=drafter, max_new_tokens=20,
                              logprobs=1)))
    assert got.new_token_ids == ids[:ids.index(eos) + 1] and [s.token for s in got.logprobs] == got.new_token_ids
    want = _reference(target, PROMPT, got.new_token_ids)
    assert all(math.isclose(s.logprob, want[i, s.token].item(), abs_tol=1e-9) for i, s in enumerate(got.logprobs))


def test_under_a_kv_window_tree_methods_score_as_plain_decoding_in_the_same_window():
    target, drafter = tiny("llama", eos_ids=[]), noisy_copy("llama", 0, 0.1)
    plain = run(prepare(Request(prompt_ids=PROMPT * 3, method="ar", target=target, max_new_tokens=40, logprobs=2,
                                kv_window="4,12")))
    tree = run(prepare(Request(prompt_ids=PROMPT * 3, method="dynatree", target=target, draft=drafter,
                               max_new_tokens=40, logprobs=2, kv_window="4,12")))
    assert tree.new_token_ids == plain.new_token_ids
    for a, b in zip(plain.logprobs, tree.logprobs):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-9) and [t for t, _ in a.top] == [t for t, _ in b.top]


def _byte_level_tokenizer():
    to_char = bytes_to_unicode()
    vocab = {to_char[b]: b for b in range(256)}
    for text in (b" the", b"a", " \U0001F600".encode()[:4], b" caf\xc3\xa9"):
        vocab.setdefault("".join(to_char[b] for b in text), len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok), vocab, to_char


def test_token_texts_keep_leading_spaces_and_give_the_bytes_of_partial_characters():
    fast, vocab, to_char = _byte_level_tokenizer()
    text = TokenTexts(fast)
    assert text(vocab[to_char[32] + "the"]) == (" the", list(b" the"))
    assert text(vocab["".join(to_char[b] for b in b" caf\xc3\xa9")]) == (" café", list(" café".encode()))
    smiley = " \U0001F600".encode()  # a space and four bytes: the token holds the space and three of them
    assert text(vocab["".join(to_char[b] for b in smiley[:4])]) == (" \ufffd", list(smiley[:4]))
    assert text(vocab[to_char[smiley[4]]]) == ("\ufffd", [smiley[4]])
    # SentencePiece-style (Llama 2, Mistral): "▁the" decodes alone as "the"; byte-fallback tokens <0xHH>
    pieces = {"<unk>": 0, "▁the": 1, "▁a": 2, "a": 3, "<0xE2>": 4}
    tok = Tokenizer(models.BPE(vocab=pieces, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    spm = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    assert spm.decode([1]) == "the"  # (what decoding a token alone gives)
    text = TokenTexts(spm)
    assert text(1) == (" the", list(b" the")) and text(3) == ("a", [97]) and text(4) == ("\ufffd", [0xE2])


@pytest.mark.parametrize("value,message", [
    (21, "logprobs (--logprobs) must be an integer from 0 to 20"), (-1, "from 0 to 20"), ("3", "got '3'"),
    (True, "got True"), (2.0, "got 2.0")])
def test_bad_logprobs_are_refused_before_anything_loads(value, message):
    with pytest.raises(DynaTreeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Request(prompt_ids=PROMPT, method="ar", target="/nonexistent/model", logprobs=value).check()


def test_baselines_say_logprobs_come_from_dynatrees_decoder():
    with pytest.raises(DynaTreeError, match=r"logprobs \(--logprobs\) come from dynatree's decoder; 'hf-ar' runs"):
        Request(prompt_ids=PROMPT, method="hf-ar", target="/nonexistent/model", logprobs=2).check()


def test_the_cli_writes_logprobs_into_the_json_record(capsys, saved_tiny):
    assert main(["generate", "w5 w6 w7", "--target", str(saved_tiny), "--method", "dynatree", "--max-new-tokens", "6",
                 "--ignore-eos", "--json", "--logprobs", "2"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert [s["token"] for s in record["logprobs"]] == record["new_token_ids"]
    assert all(len(s["top"]) == 2 and s["logprob"] <= 0 for s in record["logprobs"])
    assert main(["generate", "w5 w6 w7", "--target", str(saved_tiny), "--logprobs", "2"]) == 2
    assert "--logprobs are written into the JSON record: add --json" in capsys.readouterr().err
