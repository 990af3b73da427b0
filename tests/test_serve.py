"""`dynatree serve`: a real uvicorn server on 127.0.0.1, called through the `openai` client and httpx.

Greedy answers must be `dynatree.generate`'s tokens; every bad request a 400 (404, 429) in OpenAI's
error format, after which the server still serves.
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from helpers import EOS, hf_greedy, tiny, tokenizer
from dynatree import api
from dynatree.prompts import encode_prompt
from dynatree.cli import main
from dynatree.runtime import LoadedModel
from dynatree.serve.app import create_app
from dynatree.serve.engine import Engine, ServeSettings
from dynatree.textstream import TextStream

TEMPLATE = ("{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w4{% endif %}")
MODEL = "tiny-chat"


def chat_model(seed: int, name: str) -> LoadedModel:
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = TEMPLATE
    base = tiny("llama", seed=seed, eos_ids=[EOS])
    return LoadedModel(model=base.model, tokenizer=tok, name=name, eos_ids=[EOS])


TARGET = chat_model(0, MODEL)
DRAFT = chat_model(1, "tiny-draft")


class Server:
    """An Engine + app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, target: LoadedModel = TARGET, **settings):
        self.engine = Engine(ServeSettings(target=target, **settings))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.engine), log_level="error"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while self.engine.state == "loading" and time.time() < deadline:
            time.sleep(0.05)
        assert self.engine.state == "ready", self.engine.error
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def post(self, path: str, body, **kw) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=60, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server():
    s = Server(draft=DRAFT, method="dynatree", queue=4, max_tokens=200)
    yield s
    s.stop()


def expected(prompt: str, max_new_tokens: int, chat: bool = True, method: str = "dynatree", **options) -> api.Result:
    draft = DRAFT if method not in ("ar",) else None
    return api.generate(prompt, method, target=TARGET, draft=draft, chat=chat, max_new_tokens=max_new_tokens,
                        **options)


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ready", "model": MODEL}
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    card = server.client.models.retrieve(MODEL)  # GET /v1/models/{id}, as OpenAI's clients call it
    assert card.id == MODEL and 0 < card.created <= time.time()
    with pytest.raises(openai.NotFoundError, match="not served here"):
        server.client.models.retrieve("gpt-4")
    ok = 'dynatree_requests_total{endpoint="/v1/completions",status="200"}'
    before = {name: server.metric(name) for name in (ok, "dynatree_completion_tokens_total",
                                                     "dynatree_tokens_per_pass_count", "dynatree_request_seconds_count",
                                                     "dynatree_time_to_first_token_seconds_count")}
    server.client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=4, temperature=0)
    assert server.metric(ok) == before[ok] + 1
    assert server.metric("dynatree_completion_tokens_total") == before["dynatree_completion_tokens_total"] + 4
    for name in ("dynatree_tokens_per_pass_count", "dynatree_request_seconds_count",
                 "dynatree_time_to_first_token_seconds_count"):
        assert server.metric(name) == before[name] + 1, name
    assert server.metric("dynatree_queue_depth") == 0


@pytest.mark.parametrize("prompt", ["w5 w6 w7", "w9 w10 w9 w10 w9 w10 w11"])
def test_greedy_chat_equals_generate_and_plain_decoding(server, prompt):
    want = expected(prompt, 40)
    assert want.new_token_ids == expected(prompt, 40, method="ar").new_token_ids
    got = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                temperature=0, max_tokens=40)
    assert got.choices[0].message.content == want.text
    assert got.dynatree["completion_token_ids"] == want.new_token_ids
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.completion_tokens == len(want.new_token_ids)
    assert got.choices[0].finish_reason == ("stop" if want.new_token_ids[-1] == EOS else "length")
    assert got.dynatree["method"] == "dynatree" and got.dynatree["tokens_per_pass"] >= 1

    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=40, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].dynatree["completion_token_ids"] == want.new_token_ids
    assert chunks[-1].usage.completion_tokens == len(want.new_token_ids) and chunks[-1].choices == []


def test_text_completion_streamed_and_whole_equal_generate(server):
    want = expected("w7 w8 w9 w7 w8", 30, chat=False)
    whole = server.client.completions.create(model=MODEL, prompt="w7 w8 w9 w7 w8", temperature=0, max_tokens=30)
    assert whole.choices[0].text == want.text
    parts = list(server.client.completions.create(model=MODEL, prompt="w7 w8 w9 w7 w8", temperature=0,
                                                  max_tokens=30, stream=True))
    assert len(parts) > 2  # one chunk per committed group, not one blob
    assert "".join(p.choices[0].text for p in parts) == want.text
    ids = TARGET.tokenizer("w7 w8 w9 w7 w8").input_ids
    by_ids = server.client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=30)
    assert by_ids.choices[0].text == want.text


def test_logprobs_are_the_decodes_own_in_openais_shapes(server):
    want = expected("w5 w6 w7", 12, logprobs=2)
    assert [s.token for s in want.logprobs] == want.new_token_ids
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}],
                                                 temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    # each token's text as it reads after others (this word-level tokenizer puts a space between tokens)
    assert [c.token for c in content] == [" " + TARGET.tokenizer.decode([t]) for t in want.new_token_ids]
    assert [c.logprob for c in content] == [s.logprob for s in want.logprobs]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(" " + TARGET.tokenizer.decode([t]), v) for t, v in s.top] for s in want.logprobs]
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], temperature=0, max_tokens=12, logprobs=True,
        stream=True))
    scored = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert len(scored) > 1  # each chunk carries the logprobs of the tokens whose text it shows
    assert [c.logprob for part in scored for c in part.content] == [s.logprob for s in want.logprobs]
    assert all(c.top_logprobs == [] for part in scored for c in part.content)
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.delta.content:  # this word-level tokenizer holds nothing back: the chunk's text is its tokens'
            assert "".join(c.token for c in choice.logprobs.content).strip() == choice.delta.content.strip()
    plain = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}],
                                                  temperature=0, max_tokens=12)
    assert plain.choices[0].logprobs is None

    text = expected("w5 w6 w7", 12, chat=False, logprobs=1)
    whole = server.client.completions.create(model=MODEL, prompt="w5 w6 w7", temperature=0, max_tokens=12, logprobs=1)
    columns = whole.choices[0].logprobs
    words = [" " + TARGET.tokenizer.decode([t]) for t in text.new_token_ids]
    assert columns.tokens == words and columns.token_logprobs == [s.logprob for s in text.logprobs]
    assert columns.top_logprobs == [{" " + TARGET.tokenizer.decode([t]): v for t, v in s.top} for s in text.logprobs]
    completion = whole.choices[0].text
    assert completion == text.text and columns.text_offset[0] == 0
    for offset, word in zip(columns.text_offset, words):  # each token's text begins at its offset in the text
        assert completion[offset:].startswith(word) or completion[offset:].startswith(word.lstrip()), (offset, word)
    assert columns.text_offset == sorted(set(columns.text_offset))
    parts = [c.choices[0].logprobs for c in server.client.completions.create(
        model=MODEL, prompt="w5 w6 w7", temperature=0, max_tokens=12, logprobs=1, stream=True)]
    parts = [p for p in parts if p is not None]
    assert len(parts) > 1  # streamed, each chunk's columns; offsets run on into the whole completion's text
    for column in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for p in parts for v in getattr(p, column)] == getattr(columns, column), column


def test_streamed_logprobs_end_with_the_token_that_completed_a_stop_string(server):
    full = expected("w5 w6 w7", 20, logprobs=0)
    stop = " ".join(full.text.split()[5:7])
    want = expected("w5 w6 w7", 20, logprobs=0, stop=stop)
    chunks = list(server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "w5 w6 w7"}], temperature=0, max_tokens=20, logprobs=True,
        stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text and want.finish_reason == "stop"
    scored = [t.logprob for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert scored == [s.logprob for s in want.logprobs] and len(scored) == len(want.new_token_ids)
    last = chunks[-1].choices[0]  # the stop's tokens show no text: their logprobs come with the finish
    assert last.finish_reason == "stop" and last.logprobs is not None and last.logprobs.content


def test_method_and_options_per_request(server):
    for extra in ({"method": "fixed-tree", "depth": 3}, {"method": "ar"}, {"method": "linear", "k": 3},
                  {"cost_aware": True}, {"method": "dynatree", "n-max": 8}):
        method = extra.get("method", "dynatree")
        options = {k.replace("-", "_"): v for k, v in extra.items() if k != "method"}
        want = expected("w11 w12 w13", 24, method=method, **options)
        got = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w11 w12 w13"}], temperature=0, max_tokens=24,
            extra_body={"dynatree": extra})
        assert got.dynatree["method"] == method
        assert {k: got.dynatree["config"][k] for k in options} == options
        assert got.dynatree["completion_token_ids"] == want.new_token_ids, extra


def test_stop_strings_cut_the_text_before_the_stop(server):
    full = expected("w20 w21", 40).text.split()
    assert len(full) > 6
    stop = " ".join(full[3:5])  # two words in the middle: the stop may straddle committed groups
    prefix = " ".join(full)[: " ".join(full).find(stop)]
    for stream in (False, True):
        got = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w20 w21"}], temperature=0, max_tokens=40,
            stop=[stop, "w95 w95 w95"], stream=stream)
        if stream:
            chunks = list(got)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            text, reason = got.choices[0].message.content, [got.choices[0].finish_reason]
            ids = got.dynatree["completion_token_ids"]
            assert got.usage.completion_tokens == len(ids) < 40  # the tokens up to the one completing the stop
            assert TARGET.tokenizer.decode(ids).find(stop) >= 0 > TARGET.tokenizer.decode(ids[:-1]).find(stop)
        assert text == prefix and reason == ["stop"]
    plain = expected("w5 w6 w7", 40, chat=False).text
    assert len(plain.split()) > 3
    cut = plain.split()[2]
    got = server.client.completions.create(model=MODEL, prompt="w5 w6 w7", temperature=0, max_tokens=40, stop=cut)
    assert got.choices[0].text == plain[: plain.find(cut)] and got.choices[0].finish_reason == "stop"


def test_seed_reproduces_sampled_answers(server):
    def ask(seed):
        return server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "w30 w31"}], temperature=1.0, top_p=0.95,
            max_tokens=20, seed=seed).dynatree["completion_token_ids"]

    first = ask(7)
    assert ask(7) == first
    assert len({tuple(ask(s)) for s in (1, 2, 3, 4)}) > 1  # random models sample different tokens per seed
    want = api.generate("w30 w31", "dynatree", target=TARGET, draft=DRAFT, chat=True, max_new_tokens=20, seed=7,
                        sample=True, temperature=1.0, top_p=0.95)
    assert first == want.new_token_ids


BAD = [  # (path, body, what the message says, the `param` it names)
    ("/v1/chat/completions", "{not json", "not valid JSON", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "colour": 1},
     "unknown field 'colour'", "colour"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": -3},
     "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "n": 2}, "n must be 1", "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5"}]}, "missing field 'model'", "model"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "w5"}]}, "messages.0.role", "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "top_p": 0},
     "top_p", "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "presence_penalty": 0.5}, "presence_penalty is not supported", "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "dynatree": {"method": "beam-search"}},
     "unknown method 'beam-search'; this server decodes with ar, linear, fixed-tree, dynatree, wetap", "dynatree.method"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "dynatree": {"method": "hf-ar"}}, "transformers' own generate()", "dynatree.method"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "dynatree": {"method": "fixed-tree", "depth": -1}}, "dynatree.depth must be at least 1",
     "dynatree.depth"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "dynatree": {"colour": 3}}, "option dynatree.colour does not apply to method 'dynatree' "
     "(its options: dynatree.d0, dynatree.d_max", "dynatree.colour"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "dynatree": {"method": "linear", "k": "3"}}, "dynatree.k of method 'linear' must be int",
     "dynatree.k"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": 5.5}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "top_k": -2}, "top_k", "top_k"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 500},
     "exceeds this server's limit 200", "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5 " * 520}]},
     "fills the context length 512", "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5 " * 400, "max_tokens": 150}, "exceed the context length 512", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "the prompt is empty", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5, 999]}, "not a token id", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["w5", "w6"]}, "one prompt per request", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "stop": ["a", "b", "c", "d", "e"]}, "at most 4 stop", "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "echo": True}, "echo is not supported", "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "temperature": "0.5"}, "temperature", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "max_tokens": True}, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "seed": 2**64}, "seed", "seed"),
    ("/v1/completions", '{"model": "tiny-chat", "prompt": "w5", "temperature": NaN}', "temperature", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "logit_bias": {"5": 3}}, "logit_bias is not supported", "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "dynatree": {"eta_depth": 1e400}}, "finite", "dynatree.eta_depth"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "dynatree": {"method": "fixed-tree", "n_max": 10**7}},
     "beyond this server's limit", "dynatree.n_max"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5", "tool_calls": [{}]}]},
     "tool_calls is not supported", "messages.0"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": None}]}, "needs content", "messages.0"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "only text content parts are supported by this (text) model, got a part of type 'image_url'", "messages.0.content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\ud83d w5"}]},
     "messages.0.content: the text is not valid Unicode: a lone surrogate '\\ud83d' at character 0", "messages.0.content"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5 \ud800"},
     "prompt: the prompt is not valid Unicode: a lone surrogate '\\ud800' at character 3", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "stop": [1]}, "stop must be a string or a list of strings, got [1]", "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2]]},
     "prompt must be a string, a list of one string or a list of token ids (one prompt per request), got [[1, 2]]", "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "best_of": 2},
     "best_of is not supported by this server (got 2; accepted: null, 1)", "best_of"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 5,
                              "max_completion_tokens": 6}, "disagree", "max_completion_tokens"),
    ("/v1/chat/completions", "", "no JSON body", None),
    ("/v1/completions", "[1, 2]", "must be a JSON object", None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "stream_options": {"include_usage": True}}, "applies only with stream", "stream_options"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                              "max_completion_tokens": 500}, "exceeds this server's limit 200", "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "top_logprobs": 2},
     "top_logprobs needs logprobs: true", "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}], "logprobs": 2},
     "logprobs", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "logprobs": 21}, "logprobs", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "logprobs": True}, "logprobs", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "w5", "logprobs": 2, "top_logprobs": 2},
     "top_logprobs is a chat completions field; text completions take logprobs: N", "top_logprobs"),
]


@pytest.mark.parametrize("path,body,message,param", BAD, ids=[b[2] for b in BAD])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, path, body, message, param):
    response = server.post(path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert "\n" not in error["message"]
    ok = server.client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, temperature=0)
    assert ok.choices[0].text


def test_openai_fields_at_their_defaults_and_echoed_messages_are_accepted(server):
    first = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5 w6"}],
                                                  temperature=0, max_completion_tokens=6, logit_bias={},
                                                  response_format={"type": "text"}, user="me")
    assert first.usage.completion_tokens <= 6
    history = [{"role": "user", "content": "w5 w6"}, first.choices[0].message.model_dump(),
               {"role": "user", "content": "w7"}]
    again = server.client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=6)
    prompt = encode_prompt(TARGET.tokenizer, "w7", chat=True, history=[("w5 w6", first.choices[0].message.content)])
    assert again.dynatree["completion_token_ids"] == api.generate(
        method="dynatree", target=TARGET, draft=DRAFT, prompt_ids=prompt, max_new_tokens=6).new_token_ids


def test_a_temperature_too_small_to_sample_decodes_greedily(server):
    tiny_t = server.client.completions.create(model=MODEL, prompt="w5 w6", temperature=1e-9, max_tokens=10)
    assert tiny_t.dynatree["sampling"] is None
    assert tiny_t.choices[0].text == expected("w5 w6", 10, chat=False).text


def test_a_chat_template_that_rejects_the_messages_is_a_400(server):
    tok = server.engine.tokenizer
    template, tok.chat_template = tok.chat_template, "{{ raise_exception('roles must alternate') }}"
    try:
        response = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}]})
    finally:
        tok.chat_template = template
    assert response.status_code == 400 and "roles must alternate" in response.json()["error"]["message"]


def test_health_says_loading_and_completions_wait_with_503():
    from fastapi.testclient import TestClient

    engine = Engine(ServeSettings(target=TARGET))
    client = TestClient(create_app(engine, load=False))
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"
    busy = client.post("/v1/completions", json={"model": MODEL, "prompt": "w5"})
    assert busy.status_code == 503 and busy.json()["error"]["message"] == "the model is loading"


def test_health_and_the_log_say_when_greedy_speculation_may_differ_from_ar(capsys):
    """Dense bfloat16 weights round tree steps otherwise than one-token steps (weights.inexact_greedy):
    the server says so once loaded, as `dynatree generate` does; a float64 model has nothing to say."""
    from fastapi.testclient import TestClient

    base = tiny("llama", seed=0, dtype=torch.bfloat16, eos_ids=[EOS])
    target = LoadedModel(model=base.model, tokenizer=TARGET.tokenizer, name=MODEL, eos_ids=[EOS])
    engine = Engine(ServeSettings(target=target, draft="ngram", warmup=False))
    engine.load()
    assert engine.state == "ready", engine.error
    notes = TestClient(create_app(engine, load=False)).get("/health").json()["notes"]
    assert len(notes) == 1 and "greedy output may differ from ar's" in notes[0]
    exact = Engine(ServeSettings(target=TARGET, draft="ngram", warmup=False))
    exact.load()
    assert exact.notes == []
    engine.close()
    exact.close()


def test_unknown_model_and_path_are_404_in_openai_format(server):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        server.client.completions.create(model="gpt-4", prompt="w5", max_tokens=3)
    before = server.metric('dynatree_requests_total{endpoint="other",status="404"}')
    response = httpx.get(server.url + "/v1/embeddings")
    assert response.status_code == 404 and "error" in response.json()
    httpx.get(server.url + "/v1/random-path-1")  # every unknown path counts under one label
    assert server.metric('dynatree_requests_total{endpoint="other",status="404"}') == before + 2
    wrong_method = httpx.get(server.url + "/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"
    assert server.metric('dynatree_requests_total{endpoint="/v1/completions",status="405"}') >= 1


def test_null_means_the_default_for_openai_nullable_fields(server):
    """Clients that send every field, the unset ones as null, get the defaults (OpenAI's fields are nullable)."""
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "presence_penalty": None,
             "frequency_penalty": None, "stop": None, "seed": None, "max_tokens": 4}
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6"}], **nulls})
    text = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6", "echo": None, **nulls})
    assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
    assert chat.json()["object"] == "chat.completion"  # not streamed: stream null is false
    assert chat.json()["dynatree"]["sampling"] is not None  # temperature null is OpenAI's default, 1: sampled
    # a null for a field a chat request does not have stays an unknown field
    echo = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                                                "echo": None})
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"
    # OpenAI's fields the server has no use for: null, or a value that asks for nothing (no tools, one
    # candidate, text out), is accepted; any other value stays a 400
    unused = {"tools": None, "tool_choice": None, "best_of": None, "service_tier": None, "reasoning_effort": None}
    assert server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                                                "max_tokens": 2, **unused}).status_code == 200
    neutral = {"tools": [], "tool_choice": "none", "best_of": 1, "service_tier": "auto", "parallel_tool_calls": False,
               "modalities": ["text"]}
    assert server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                                                "max_tokens": 2, **neutral}).status_code == 200
    tools = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5"}],
                                                 "tools": [{"type": "function"}]})
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools"


def gated(engine: Engine) -> threading.Event:
    """Make the engine's next decode wait until the returned event is set (the worker is then busy)."""
    gate, decode = threading.Event(), engine._decode

    def wait_then_decode(job, observe=True):
        engine._decode = decode  # only the first
        gate.wait(30)
        return decode(job, observe)

    engine._decode = wait_then_decode
    return gate


def wait_until(condition, timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_a_full_queue_answers_429_with_retry_after_and_the_rest_complete(server):
    gate = gated(server.engine)
    body = {"model": MODEL, "prompt": "w40 w41", "max_tokens": 12, "temperature": 0}
    want = expected("w40 w41", 12, chat=False).text
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = pool.submit(server.post, "/v1/completions", body)
        wait_until(lambda: server.engine.metrics.running._value.get() == 1)  # the worker holds the first
        waiting = [pool.submit(server.post, "/v1/completions", body) for _ in range(4)]
        wait_until(lambda: server.engine._queue.qsize() == 4)
        refused = server.post("/v1/completions", body)
        with pytest.raises(openai.RateLimitError, match="busy"):  # as the openai client reports it
            server.client.completions.create(**body)
        gate.set()
        answers = [f.result() for f in [first, *waiting]]
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full"
    assert [a.status_code for a in answers] == [200] * 5
    assert all(a.json()["choices"][0]["text"] == want for a in answers)


def test_a_decode_that_decoded_nothing_leaves_the_retry_after_estimate_alone(monkeypatch):
    """A client gone after its job left the queue but before its decode took the model decodes nothing
    (finish_reason cancelled, 0 tokens in 0 s): not a timing to average into Retry-After; a decode that
    decoded something is."""
    from types import SimpleNamespace

    def worked(*decoded):
        engine = Engine(ServeSettings(target=TARGET))
        engine._token_s, engine._tokens = 0.5, 40.0
        stats = iter(decoded)
        monkeypatch.setattr(engine, "_decode", lambda job: next(stats))
        for _ in decoded:
            engine._queue.put(SimpleNamespace(cancelled=threading.Event(), prepared=SimpleNamespace(max_new_tokens=40)))
        engine._queue.put(None)
        engine._work()  # the jobs, then the stop
        return engine._token_s, engine._tokens

    nothing = SimpleNamespace(new_tokens=0, wall_s=0.0)
    assert worked(nothing) == (0.5, 40.0)
    token_s, tokens = worked(nothing, SimpleNamespace(new_tokens=10, wall_s=1.0))
    assert 0.1 < token_s < 0.5 and 10 < tokens < 40


def test_retry_after_is_what_the_running_decode_has_left():
    engine = Engine(ServeSettings(target=TARGET))
    assert engine.retry_after() == 1  # nothing running
    engine._token_s, engine._running = 0.5, (time.perf_counter() - 3.0, 40)  # 40 tokens at 0.5 s, 3 s in
    assert engine.retry_after() == 17
    engine._running = (time.perf_counter() - 30.0, 40)  # past its estimate: soon
    assert engine.retry_after() == 1
    engine._tokens, engine._running = 10.0, (time.perf_counter() - 3.0, 40)  # decodes lately ended after 10 tokens
    assert engine.retry_after() == 2


def test_context_overflows_carry_openai_code_and_streams_are_not_cached(server):
    for body in ({"model": MODEL, "messages": [{"role": "user", "content": "w5 " * 520}]},
                 {"model": MODEL, "prompt": "w5 " * 400, "max_tokens": 150}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        assert server.post(path, body).json()["error"]["code"] == "context_length_exceeded"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "w5 w6", "max_tokens": 2, "stream": True}) as response:
        assert response.headers["cache-control"] == "no-cache"
        assert response.read().decode().rstrip().endswith("data: [DONE]")


def test_eight_clients_five_requests_each_all_answered(server):
    prompts = [f"w{50 + i} w{60 + i}" for i in range(8)]
    wants = {p: expected(p, 16, chat=False).text for p in prompts}
    refusals = []

    def client(prompt):
        texts = []
        for _ in range(5):
            for _attempt in range(400):
                r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                    "temperature": 0})
                if r.status_code != 429:
                    break
                refusals.append(int(r.headers["retry-after"]))
                time.sleep(0.05)
            else:
                raise AssertionError("still refused after 400 tries")
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return prompt, texts

    gate = gated(server.engine)  # every client's first request arrives while the worker is busy
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client, p) for p in prompts]
        wait_until(lambda: server.engine._queue.qsize() == 4)
        time.sleep(0.2)
        gate.set()
        results = [f.result() for f in futures]
    assert len(results) == 8
    for prompt, texts in results:
        assert texts == [wants[prompt]] * 5
    assert refusals  # 8 at once against 1 running + 4 waiting: some were told to come back


def held_until_cancelled(engine: Engine) -> None:
    """Make the engine's next decode stop after its first text until its job is cancelled (at most 20 s):
    the decode cannot end before the server has noticed the client leave."""
    decode = engine._decode

    def hold(job, observe=True):
        engine._decode = decode  # only the first
        text = job.on_text

        def then_wait(delta):
            text(delta)
            job.cancelled.wait(20)

        job.on_text = then_wait
        return decode(job, observe)

    engine._decode = hold


def cancelled_decodes(server) -> float:
    return server.metric('dynatree_decodes_total{reason="cancelled"}')


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_decode_and_frees_the_model(server, stream):
    before = cancelled_decodes(server)
    held_until_cancelled(server.engine)
    body = {"model": MODEL, "prompt": "w70", "max_tokens": 200, "temperature": 0, "stream": stream,
            "dynatree": {"method": "ar"}}
    start = time.time()
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # the first chunk came; then the client goes away
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    wait_until(lambda: cancelled_decodes(server) == before + 1)
    assert time.time() - start < 15  # noticed by the server, not by the 20 s hold running out
    ok = server.client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=5, temperature=0)
    assert ok.choices[0].text == expected("w5 w6", 5, chat=False).text


class _Chars:
    """A tokenizer whose token i is the character chr(i); 0xFF stands for half of a 2-byte character."""

    def decode(self, ids, skip_special_tokens=True):
        out = "".join(chr(i) for i in ids)
        return out.replace("\xff\xfe", "é").replace("\xff", "\ufffd")


def test_text_stream_holds_back_stop_prefixes_and_half_characters():
    s = TextStream(_Chars(), ["END"])
    assert s.push([ord("a"), ord("b"), ord("E")]) == "ab"  # 'E' may start the stop
    assert s.push([ord("x")]) == "Ex"
    assert s.push([0xFF]) == ""  # half a character
    assert s.push([0xFE, ord("E"), ord("N")]) == "é"
    assert s.push([ord("D"), ord("z")]) == "" and s.stopped
    assert s.push([ord("q")]) == "" and s.finish() == ""
    t = TextStream(_Chars(), [])
    assert t.push([ord("a")]) == "a" and t.finish() == ""
    u = TextStream(_Chars(), ["xy"])
    assert u.push([ord("a"), ord("x")]) == "a" and u.finish() == "x"
    v = TextStream(_Chars(), [])  # the text before a half character goes out at once; the half at the end
    assert v.push([ord("a"), ord("b"), 0xFF]) == "ab" and v.finish() == "\ufffd"


def test_whole_floats_and_vllms_disabled_top_k_are_taken(server):
    """Python's json writes 5.0 for a number that went through a float; vLLM's clients send top_k -1
    (or 0) for "all tokens": both mean what they say, not a 400."""
    want = expected("w5 w6 w7", 6, chat=False)
    got = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 6.0, "temperature": 0,
                                          "top_k": -1, "seed": 3.0})
    assert got.status_code == 200, got.text
    assert got.json()["dynatree"]["completion_token_ids"] == want.new_token_ids
    sampled = [server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 6, "seed": 4,
                                               "top_k": k}).json()["dynatree"] for k in (0, -1, None)]
    assert sampled[0]["completion_token_ids"] == sampled[1]["completion_token_ids"] == sampled[2]["completion_token_ids"]
    assert sampled[0]["sampling"]["top_k"] == 0  # (SamplingConfig's "no top-k")
    chat = server.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6 w7"}],
                                                "max_completion_tokens": 6.0, "temperature": 0, "logprobs": True,
                                                "top_logprobs": 2.0})
    assert chat.status_code == 200, chat.text
    assert [len(c["top_logprobs"]) for c in chat.json()["choices"][0]["logprobs"]["content"]] == [2] * 6
    text = server.post("/v1/completions", {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0,
                                           "logprobs": 2.0})
    assert text.status_code == 200, text.text
    assert len(text.json()["choices"][0]["logprobs"]["tokens"]) == 6


def test_chat_needs_a_template_that_takes_the_messages():
    plain = LoadedModel(model=TARGET.model, tokenizer=tokenizer(), name="no-template", eos_ids=[EOS])
    strict_tok = copy.deepcopy(tokenizer())
    strict_tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception("
                                "'System role not supported') }}{% endif %}{{ m['content'] }} {% endfor %}")
    strict = LoadedModel(model=TARGET.model, tokenizer=strict_tok, name="strict", eos_ids=[EOS])
    for target, messages, message in (
            (plain, [{"role": "user", "content": "w5"}], "'no-template' has no chat template: use /v1/completions "
                                                         "with plain text"),
            (strict, [{"role": "system", "content": "w5"}, {"role": "user", "content": "w6"}],
             "the chat template of 'strict' rejects these messages: System role not supported")):
        s = Server(target=target, warmup=False)
        try:
            got = s.post("/v1/chat/completions", {"model": target.name, "messages": messages})
            assert got.status_code == 400 and message in got.json()["error"]["message"], got.text
        finally:
            s.stop()


def test_a_served_model_name_and_cors_origins():
    """--served-model-name is the id clients send and see; --allow-origin lets a web page on that origin
    call the API (a browser's preflight is answered), and no CORS header is sent without it."""
    s = Server(served_model_name="my-model", allow_origins=("http://localhost:3000",), warmup=False)
    try:
        assert [m.id for m in s.client.models.list().data] == ["my-model"]
        got = s.client.completions.create(model="my-model", prompt="w5 w6", max_tokens=3, temperature=0)
        assert got.model == "my-model" and got.dynatree["completion_token_ids"] == expected(
            "w5 w6", 3, chat=False).new_token_ids
        with pytest.raises(openai.NotFoundError, match="this server serves 'my-model'"):
            s.client.completions.create(model=MODEL, prompt="w5", max_tokens=2)
        preflight = httpx.options(s.url + "/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.get(s.url + "/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert httpx.get(s.url + "/v1/models", headers={"Origin": "http://localhost:3000"}).headers[
            "access-control-allow-origin"] == "http://localhost:3000"
    finally:
        s.stop()


def test_no_cors_headers_by_default(server):
    got = httpx.get(server.url + "/v1/models", headers={"Origin": "http://localhost:3000"})
    assert got.status_code == 200 and "access-control-allow-origin" not in got.headers


def test_serve_cli_refuses_bad_settings_before_loading(capsys):
    for argv, message in ((["serve", "--method", "hf-lookup"], "dynatree's own methods"),
                          (["serve", "--method", "nope"], "unknown method 'nope'; the server decodes with ar, linear, "
                           "fixed-tree, dynatree, wetap, specinfer, specexec, opt-tree, dsbd, mtad\n"),
                          (["serve", "--queue", "0"], "--queue must be at least 1"),
                          (["serve", "--port", "70000"], "--port must be at most 65535"),
                          (["serve", "--draft", "ngram+"], "ngram+MODEL needs a draft model after 'ngram+'"),
                          (["serve", "--kv-window", "4"], "SINK,RECENT"),
                          (["serve", "--served-model-name", " "], "--served-model-name must not be empty"),
                          (["serve", "--allow-origin", "localhost:3000"], "--allow-origin takes an origin such as"),
                          (["serve", "--allow-origin", "http://LocalHost:3000"], "lower case")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_serve_help_offers_only_what_the_server_runs(capsys):
    """The hf-* baselines' options (the server refuses those methods) are not among serve's flags."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert "--d0" in text and "--budget" in text  # dynatree's and wetap's options
    for flag in ("--num-assistant-tokens", "--prompt-lookup-num-tokens", "--max-matching-ngram-size", "hf-ar"):
        assert flag not in text
    assert main(["serve", "--num-assistant-tokens", "3"]) == 2
    assert "unrecognized arguments: --num-assistant-tokens" in capsys.readouterr().err


def test_serve_cli_busy_port_is_one_line_error(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_a_draft_with_a_shorter_context_bounds_the_requests_that_use_it():
    """The room for new tokens is the shortest context among the models a request's method runs,
    and a request over it is a 400 naming its field and the model, not an error from deep inside."""
    from dynatree.serve.engine import RequestError
    from dynatree.serve.protocol import ChatRequest

    short = LoadedModel(model=tiny("llama", seed=1, context=64).model, tokenizer=TARGET.tokenizer, name="short-draft",
                        eos_ids=[EOS])
    engine = Engine(ServeSettings(target=TARGET, draft=short, method="linear", warmup=False))
    engine.load()
    assert engine.state == "ready", engine.error
    words = " ".join(f"w{5 + i % 40}" for i in range(40))
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}]}
    ids = engine.prompt_ids(ChatRequest(**body))
    assert 40 < len(ids) < 64
    default = engine.prepare(ChatRequest(**body), ids)  # no max_tokens: what fits the draft's context
    assert len(ids) + default.max_new_tokens == 64
    with pytest.raises(RequestError, match="exceed the context length 64 of 'short-draft'") as err:
        engine.prepare(ChatRequest(**body, max_tokens=30), ids)
    assert err.value.param == "max_tokens"
    plain = engine.prepare(ChatRequest(**body, max_tokens=30, dynatree={"method": "ar"}), ids)  # ar runs no draft
    assert plain.max_new_tokens == 30 and plain.draft is None
    with pytest.raises(RequestError, match="fills the context length 64 of 'short-draft'") as err:
        long_ids = ids + ids
        engine.prepare(ChatRequest(**body), long_ids)
    assert err.value.param == "messages"
    engine.close()


def test_ngram_max_needs_a_draft_with_the_n_gram_drafter():
    """--ngram-max with a draft that runs alone is refused at load (it was silently unused); with the n-gram
    drafter it reaches the requests that draft, and requests for `ar` still decode."""
    from dynatree.serve.protocol import ChatRequest

    alone = LoadedModel(model=tiny("llama", seed=1).model, tokenizer=TARGET.tokenizer, name="alone", eos_ids=[EOS])
    refused = Engine(ServeSettings(target=TARGET, draft=alone, ngram_max=3, warmup=False))
    refused.load()
    assert refused.state == "failed" and "ngram_max (--ngram-max) applies only where" in refused.error
    assert "the draft 'alone' runs alone" in refused.error
    spec = Engine(ServeSettings(target="no/such-model-anywhere", draft="smollm2-135m-draft", ngram_max=3, warmup=False))
    spec.load()  # a spec without the n-gram drafter: refused before any model loads (the target does not exist)
    assert spec.state == "failed" and "the draft 'smollm2-135m-draft' runs alone" in spec.error, spec.error
    engine = Engine(ServeSettings(target=TARGET, draft="ngram", ngram_max=3, warmup=False))
    engine.load()
    assert engine.state == "ready", engine.error
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6 w7"}], "max_tokens": 4}
    ids = engine.prompt_ids(ChatRequest(**body))
    assert engine.prepare(ChatRequest(**body), ids).ngram_max == 3
    plain = engine.prepare(ChatRequest(**body, dynatree={"method": "ar"}), ids)
    assert plain.draft is None
    engine.close()


def test_a_target_that_fails_to_load_reports_failed():
    engine = Engine(ServeSettings(target="/nonexistent/model"))
    engine.load()
    assert engine.state == "failed" and "nonexistent" in engine.error


def test_bench_serve_reports_latency_ttft_and_throughput(server, prompt_file, tmp_path, capsys):
    out = tmp_path / "load"
    assert main(["bench-serve", "--url", server.url, "--requests", "6", "--concurrency", "3", "--max-tokens", "12",
                 "--dataset", str(prompt_file), "--n", "4", "--out", str(out), "--dynatree", '{"method": "linear", "k": 2}']) == 0
    results = json.loads((out / "results.json").read_text())
    summary = results["summary"]
    assert summary["ok"] == 6 and summary["failed"] == 0
    assert 0 < summary["ttft_p50_s"] <= summary["latency_p50_s"] <= summary["latency_p95_s"]
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in results["requests"]) > 0
    assert summary["throughput_tok_s"] > 0
    assert "| 6 | 0 |" in (out / "report.md").read_text() and "latency p50" in capsys.readouterr().out


def test_bench_serve_without_a_server_is_one_line_error(capsys):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert main(["bench-serve", "--url", f"http://127.0.0.1:{port}"]) == 2
    assert "no server at" in capsys.readouterr().err


def test_compiled_server_builds_its_graphs_in_the_warm_up_and_stays_exact():
    import torch

    from dynatree import runtime

    base = tiny("llama", seed=4, dtype=torch.float32)
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = TEMPLATE
    target = LoadedModel(model=base.model, tokenizer=tok, name="tiny-compiled", eos_ids=[])
    torch._dynamo.reset()
    before = runtime.compiled_graphs()
    s = Server(target=target, draft="ngram", method="dynatree", compile=True)
    try:
        assert runtime.compiled_graphs() - before == 2  # one-token steps and trees, before 'ready'
        got = s.client.chat.completions.create(model="tiny-compiled", messages=[{"role": "user", "content": "w5 w9"}],
                                               temperature=0, max_tokens=24)
        assert runtime.compiled_graphs() - before == 2  # nothing compiled while serving
        assert got.dynatree["compile"] is True
        assert target.compile is False  # the setting travels with each request; the caller's model is not changed
        prompt = encode_prompt(tok, "w5 w9", chat=True)
        assert got.dynatree["completion_token_ids"] == hf_greedy(target, prompt, 24)
    finally:
        s.stop()
