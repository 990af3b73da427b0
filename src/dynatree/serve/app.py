"""The HTTP side: OpenAI's chat and text completion endpoints over an `Engine`, with FastAPI.

Every error a client can cause is answered in OpenAI's error format (400 bad request, 404 unknown
model or path, 429 queue full with Retry-After, 503 still loading); the server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ..errors import DynaTreeError
from ..result import TokenLogprob
from ..textstream import TokenTexts
from .engine import Engine, Finished, Job, QueueFull, RequestError
from .protocol import ChatRequest, CompletionRequest, error_body, validation_message

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _usage(done: Finished) -> dict:
    n = len(done.completion_ids)
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": n, "total_tokens": done.prompt_tokens + n}


def _extra(done: Finished) -> dict:
    """dynatree's own figures for one request (the `dynatree` field of a response)."""
    result, stats, run = done.result, done.result.stats, done.result.run
    return {
        "method": result.method, "draft": result.draft, "config": result.config,
        "seed": run.seed, "sampling": run.sampling, "lossy": run.lossy, "compile": run.compile,
        "tokens_per_pass": stats.tokens_per_iter, "acceptance_rate": stats.acceptance_rate,
        "tokens_per_s": stats.tokens_per_s, "ttft_s": stats.ttft_s, "queue_s": done.queue_s,
        "completion_token_ids": done.completion_ids,
    }


def create_app(engine: Engine, load: bool = True) -> FastAPI:
    """The app; with `load`, the engine loads (and warms up) in a thread when the app starts, while
    /health answers 'loading'."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if load and engine.state == "loading":
            asyncio.get_running_loop().run_in_executor(None, engine.load)
        yield
        engine.close()

    app = FastAPI(title="dynatree", lifespan=lifespan)
    if engine.settings.allow_origins:  # a web page on these origins may call the API (browsers ask first)
        app.add_middleware(CORSMiddleware, allow_origins=list(engine.settings.allow_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600)
    metrics = engine.metrics

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, message, param=param)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # a bug, answered in OpenAI's format; still serving
        metrics.requests.labels(request.url.path, "500").inc()
        return _error(500, f"{type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        path = request.url.path  # unknown paths share one label: a scanner must not add a series per path
        known = path in {route.path for route in app.routes}
        metrics.requests.labels(path if known else "other", str(exc.status_code)).inc()
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.get("/health")
    async def health():
        if engine.state == "ready":
            return {"status": "ready", "model": engine.model_id, **({"notes": engine.notes} if engine.notes else {})}
        body = {"status": engine.state, **({"error": engine.error} if engine.error else {})}
        return JSONResponse(body, status_code=503)

    def model_card() -> dict:
        return {"id": engine.model_id, "object": "model", "created": engine.loaded_at, "owned_by": "dynatree"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.model_id:
            return _error(404, f"model {model_id!r} is not served here; this server serves {engine.model_id!r}",
                          "not_found_error", "model", "model_not_found")
        return model_card()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        return await _complete(body, request, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(body, request, chat=False)

    async def _complete(body: ChatRequest | CompletionRequest, request: Request, chat: bool):
        endpoint = request.url.path

        def answer(response):
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        if engine.state != "ready":
            return answer(_error(503, f"the model is {engine.state}" + (f": {engine.error}" if engine.error else ""),
                                 "service_unavailable", headers={"Retry-After": "5"}))
        if body.model != engine.model_id:
            return answer(_error(404, f"model {body.model!r} is not served here; this server serves "
                                      f"{engine.model_id!r} (GET /v1/models)", "not_found_error", "model",
                                 "model_not_found"))
        try:
            prepared = engine.prepare(body, engine.prompt_ids(body))
        except RequestError as exc:
            return answer(_error(400, str(exc), param=exc.param, code=exc.code))
        except DynaTreeError as exc:  # a check outside the request's fields
            return answer(_error(400, str(exc)))
        job = Job(prepared, asyncio.get_running_loop())
        try:
            engine.submit(job)
        except QueueFull as exc:
            return answer(_error(429, str(exc), "rate_limit_error", code="queue_full",
                                 headers={"Retry-After": str(exc.retry_after)}))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        shape = _Shape(ident, engine.model_id, chat, engine.tokenizer)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return answer(StreamingResponse(_stream(job, shape, usage, request), media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache"}))  # proxies must not buffer it
        return answer(await _whole(job, shape, request))

    return app


class _Shape:
    """The JSON shapes of one response: chat or text completion, whole or in chunks."""

    def __init__(self, ident: str, model: str, chat: bool, tokenizer):
        self.ident, self.model, self.chat = ident, model, chat
        self.tokenizer = tokenizer  # the HTTP side's copy: token texts for logprobs
        self.created = int(time.time())

    def logprobs(self, scored: list[TokenLogprob] | None, before: list[int] = ()) -> dict | None:
        """A choice's `logprobs` for the tokens `scored` (None: not asked), which follow the tokens
        `before` in the answer: chat's `content` list, or text completions' `tokens`/`token_logprobs`/
        `top_logprobs`/`text_offset` columns (offsets into the whole completion's text, from 0 as
        vLLM's without echo)."""
        if scored is None:
            return None
        text = TokenTexts(self.tokenizer)
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                word, raw = text(token)
                return {"token": word, "logprob": logprob, "bytes": raw}
            return {"content": [{**entry(s.token, s.logprob), "top_logprobs": [entry(t, v) for t, v in s.top]}
                                for s in scored]}
        ids = [*before, *(s.token for s in scored)]  # offsets into the completion's text, decoded as it was (a
        # first SentencePiece token's space dropped, special tokens skipped): the length of the text before each token
        offsets = [len(self.tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(before), len(ids))]
        return {"tokens": [text(s.token)[0] for s in scored], "token_logprobs": [s.logprob for s in scored],
                "top_logprobs": [{text(t)[0]: v for t, v in s.top} for s in scored], "text_offset": offsets}

    def _head(self, obj: str) -> dict:
        return {"id": self.ident, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, done: Finished) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if self.chat
                  else {"index": 0, "text": text})
        choice.update(finish_reason=done.finish_reason, logprobs=self.logprobs(done.result.logprobs))
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": _usage(done), "dynatree": _extra(done)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              scored: list[TokenLogprob] | None = None, before: list[int] = ()) -> dict:
        """One streamed chunk; `scored`: the scores of the tokens it shows (when asked, and there are
        any), which follow the tokens `before`."""
        if self.chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        choice.update(finish_reason=finish_reason, logprobs=self.logprobs(scored or None, before))
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, done: Finished) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": _usage(done)}


async def _events(job: Job, request: Request):
    """The job's events up to its end; checks every DISCONNECT_POLL_S, however often text arrives, that the
    client is still there, and if not cancels the decode (it stops at its next iteration) and ends."""
    checked = time.monotonic()
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            event = None
        if event is None or time.monotonic() - checked >= DISCONNECT_POLL_S:
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancelled.set()
                return
        if event is not None:
            yield event
            if event[0] != "text":
                return


async def _stream(job: Job, shape: _Shape, include_usage: bool, request: Request):
    """Server-sent events: a chunk per piece of text (one per committed group, unless held back),
    with the logprobs of the tokens it shows, when asked; the finish chunk (with the logprobs of
    tokens no text showed: a stop string's, an end-of-sequence token's), [DONE]. Token texts for
    logprobs are built off the event loop."""
    sent: list[int] = []  # the tokens whose logprobs went out
    try:
        if shape.chat:
            yield _sse(shape.chunk(role=True))
        async for kind, value in _events(job, request):
            if kind == "text":
                text, scored = value
                chunk = (await asyncio.to_thread(shape.chunk, text, scored=scored, before=list(sent)) if scored
                         else shape.chunk(text))
                sent += [s.token for s in scored]
                yield _sse(chunk)
            elif kind == "error":
                yield _sse(error_body(value, "server_error"))
            else:
                rest = (value.result.logprobs or [])[len(sent):]
                last = await asyncio.to_thread(shape.chunk, finish_reason=value.finish_reason, scored=rest, before=sent)
                yield _sse({**last, "dynatree": _extra(value)})
                if include_usage:
                    yield _sse(shape.usage_chunk(value))
        if not job.cancelled.is_set():
            yield _sse("[DONE]")
    finally:
        job.cancelled.set()  # nothing if the decode ended; otherwise it stops at its next iteration


async def _whole(job: Job, shape: _Shape, request: Request):
    """The whole answer once the decode ends; a client that goes away first cancels the decode."""
    parts: list[str] = []
    async for kind, value in _events(job, request):
        if kind == "text":
            parts.append(value[0])
        elif kind == "error":
            return _error(500, value, "server_error")
        else:  # (token texts for logprobs are built off the event loop)
            return JSONResponse(await asyncio.to_thread(shape.whole, "".join(parts), value))
    return Response(status_code=499)  # the client left: nobody reads it
