"""Log-probabilities of the new tokens (`logprobs` of a request): every method of dynatree's decoder
scores each committed token from the verification pass that committed it, and the figures equal a
plain teacher-forced pass of the target over the same text (float64 tiny models: to rounding)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import DEVICE, noisy_copy, tiny
from dynatree import DynaTreeError, Request, prepare, run
from dynatree.cli import main

PROMPT = [5, 6, 7, 5, 6, 7, 5]


def _reference(target, prompt: list[int], new: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits before each new token, from one plain causal pass."""
    seq = torch.tensor([prompt + new], device=DEVICE)
    with torch.no_grad():
        logits = target.model(seq, attention_mask=torch.ones_like(seq)).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1].double(), dim=-1)


@pytest.mark.parametrize("method,draft,sample", [
    ("ar", None, False), ("dynatree", "draft", False), ("linear", "ngram", False), ("fixed-tree", "draft", False),
    ("wetap", "draft", False), ("specinfer", "draft", True), ("dynatree", "draft", True)])
def test_each_new_token_is_scored_as_a_plain_pass_scores_it(method, draft, sample):
    target, drafter = tiny("llama", eos_ids=[]), noisy_copy("llama", 0, 0.1)  # a draft that agrees often
    result = run(prepare(Request(prompt_ids=PROMPT, method=method, target=target,
                                 draft=drafter if draft == "draft" else draft, max_new_tokens=30, logprobs=3,
                                 sample=sample, seed=4)))
    ids, scored = result.new_token_ids, result.logprobs
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
