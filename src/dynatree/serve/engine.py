"""The server's engine: models loaded once, one decode at a time, a bounded FIFO queue in front.

Tree speculation decodes one sequence per target pass, so requests do not share passes: a single
worker thread takes jobs from the queue in arrival order and runs each through `api.run`, which
asks between iterations whether the client went away or a stop string appeared. Text reaches
the HTTP side as events on an asyncio queue of the event loop that submitted the job.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
import queue
import secrets
import threading
import time

from .. import api
from ..request import Request
from ..result import Result, TokenLogprob
from ..draftload import Draft, load_draft
from ..draftspec import parse
from ..config import renamed_options
from ..errors import DynaTreeError
from ..methods import METHODS, Method, get_method, served_methods
from ..models import DEFAULT_TARGET, load_model
from ..prompts import encode_conversation, encode_prompt
from ..runtime import LoadedModel
from ..stats import Summary
from ..window import KVWindow
from .metrics import Metrics
from .protocol import ChatRequest, CompletionRequest
from ..weights import inexact_greedy

WARMUP_PROMPT = "Hello! Say hello back in one short sentence."
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (as vLLM does): 1/T would overflow the logits
OPTION_LIMIT = 1024  # the largest integer a request may give a method option (tree sizes, depths, budgets)


@dataclasses.dataclass
class ServeSettings:
    """What `dynatree serve` loads, and the defaults of every request."""

    target: str | LoadedModel = DEFAULT_TARGET  # a model spec (as --target), or a model already loaded
    draft: object = None  # as --draft: None/'ngram', 'ngram+MODEL', a model spec, a loaded draft, Hybrid or Draft
    method: str = "dynatree"  # the method of requests that name none
    options: dict = dataclasses.field(default_factory=dict)  # that method's options (config field -> value)
    compile: bool = False  # decode steps through torch.compile (graphs built during the warm-up)
    device: str = "cpu"
    dtype: str | None = None  # None: float32 (bfloat16 for low-bit weights)
    weights: str = "dense"  # the target's weight format: dense, q4, int8 (weights.py)
    linear: str = "auto"  # linear-layer kernels of models loaded here (kernels.py)
    ngram_max: int | None = None  # longest context the n-gram drafter matches (None: NGRAM_MAX); needs that drafter
    kv_window: str | None = None  # 'SINK,RECENT' for every request, or None
    queue: int = 16  # requests that may wait while one decodes; one more is answered 429
    max_tokens: int = 1024  # the most tokens one request may ask for (and its default, within the context)
    warmup: bool = True  # decode one short prompt before reporting ready (compiles graphs, measures costs)
    served_model_name: str | None = None  # the model id clients send and see (None: the target's name or spec)
    allow_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS; "*": any), none by default


class RequestError(DynaTreeError):
    """A bad request found when it is prepared against the loaded models: a 400 naming `param`, the
    request field at fault (OpenAI's error object), or None where no one field is."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code  # OpenAI's error code where it has one (context_length_exceeded)


def _option_error(message: str, spec: Method, options: dict) -> RequestError:
    """A method option's error (worded for the CLI: `--tau-h must be ...`) in the request's own
    terms (`dynatree.tau_h must be ...`), naming the first option it mentions as `param`."""
    names = {f.name for f in dataclasses.fields(spec.config_cls)} | set(options)
    message, named = renamed_options(message, names, lambda name: f"dynatree.{name}")
    return RequestError(message, f"dynatree.{named[0]}" if named else "dynatree")


class QueueFull(Exception):
    """The FIFO queue holds `settings.queue` waiting requests already."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is busy: {retry_after} s until a place in the queue is likely")
        self.retry_after = retry_after


@dataclasses.dataclass
class Finished:
    """The end of one decode, as the HTTP side reports it."""

    finish_reason: str  # 'stop' (EOS or a stop string), 'length' (max_tokens), 'cancelled'
    prompt_tokens: int
    completion_ids: list[int]
    result: Result  # the run's typed result (stats, method, draft, seed, ...)
    queue_s: float  # time spent waiting in the queue


class Job:
    """One prepared request on its way through the queue and the worker."""

    def __init__(self, prepared: api.Prepared, loop: asyncio.AbstractEventLoop | None):
        self.prepared = prepared
        # ('text', (str, scores of the tokens since the last text)), then ('done', Finished) or ('error', str)
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()  # set by the HTTP side when the client goes away
        self.loop = loop  # None: nobody listens (the warm-up)
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None  # since submission
        self.scored: list[TokenLogprob] = []  # the scores of the tokens committed since the last text (logprobs asked)

    def emit(self, kind: str, value) -> None:
        """Hand an event to the event loop (called from the worker thread)."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop has closed (server shutting down): nobody is listening
            self.cancelled.set()

    def on_tokens(self, ids: list[int]) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.submitted

    def on_logprobs(self, scored: list[TokenLogprob]) -> None:
        self.scored += scored

    def on_text(self, delta: str) -> None:
        """The text that may be shown now, with the scores of the tokens committed since the last
        text (a token whose text is held back, an incomplete character or a possible stop string,
        is scored with the text that shows it; what is never shown goes with the finishing chunk)."""
        scored, self.scored = self.scored, []
        self.emit("text", (delta, scored))


def _moving_average(average: float, value: float) -> float:
    """An exponential moving average (weight 0.2 on the newest value) that starts at its first value (0: none yet)."""
    return value if average == 0 else 0.8 * average + 0.2 * value


class Engine:
    """Loads the models (`load`), prepares requests (`prepare`) and decodes them on one worker thread."""

    def __init__(self, settings: ServeSettings):
        self.settings = settings
        self.window = KVWindow.parse(settings.kv_window)  # a bad window fails before any model loads
        self.state = "loading"  # 'loading' -> 'ready', or 'failed'
        self.error: str | None = None
        self.notes: list[str] = []  # what a user should know of the loaded models (/health, the CLI's log)
        self.metrics = Metrics()
        self.target: LoadedModel | None = None
        self.draft: Draft | None = None  # what api.prepare takes as `draft` for methods that draft
        self.tokenizer = None  # a copy of the target's tokenizer for the HTTP side (the worker has the original)
        self._queue: queue.Queue = queue.Queue(maxsize=settings.queue)
        self._token_s = 0.0  # a moving average of a decode's seconds per new token (the warm-up's first), for Retry-After
        self._tokens = 0.0  # a moving average of the tokens a request's decode produced (0: none yet), for Retry-After
        self._running: tuple[float, int] | None = None  # (perf_counter at its start, max_new_tokens) of the decode running
        self._worker: threading.Thread | None = None
        self.loaded_at = 0  # when the model became ready (Unix seconds; /v1/models' `created`)

    @property
    def model_id(self) -> str:
        t = self.settings.target
        if self.settings.served_model_name is not None:
            return self.settings.served_model_name
        return t.name if isinstance(t, LoadedModel) else str(t)

    # -- loading ------------------------------------------------------------------------------
    @staticmethod
    def _no_ngram(draft: str) -> str:
        return (f"ngram_max (--ngram-max) applies only where dynatree's n-gram drafter runs; the draft {draft} "
                "runs alone (leave ngram_max out, or draft with 'ngram+MODEL')")

    def load(self) -> None:
        """Load the target and draft, decode one short prompt (graphs, cost curve), start the worker.
        Any failure leaves `state` 'failed' with `error` set (the CLI prints it and exits)."""
        try:
            s = self.settings
            if s.ngram_max is not None and (s.draft is None or isinstance(s.draft, str)) and not parse(s.draft).ngram:
                raise DynaTreeError(self._no_ngram(repr(s.draft)))  # (a spec says so before the slow loads)
            target = s.target if isinstance(s.target, LoadedModel) else load_model(
                s.target, device=s.device, dtype=s.dtype, linear=s.linear, weights=s.weights)
            self.target = target
            inexact = inexact_greedy(target.dtype, target.weights, target.row_dependent)
            self.notes = [note for note in (
                f"greedy requests of speculative methods: {inexact}" if inexact else None,
                f"linear layers on stock kernels: {target.linear_note}" if target.linear_note else None) if note]
            self.tokenizer = copy.deepcopy(target.tokenizer)
            self.draft = load_draft(s.draft, target, s.linear)  # once, for every request that drafts
            if s.ngram_max is not None and not self.draft.ngram:
                raise DynaTreeError(self._no_ngram(repr(self.draft.name)))
            chat = bool(getattr(target.tokenizer, "chat_template", None))
            ids = encode_prompt(target.tokenizer, WARMUP_PROMPT, chat=chat)
            prepared = self._prepare(ids, self._spec(s.method), dict(s.options), max_new_tokens=8, seed=0)  # checks method + draft
            if s.warmup:
                warm = self._decode(Job(prepared, None), observe=False)  # its wall time leaves compiling out
                self._token_s = warm.wall_s / max(warm.new_tokens, 1)
            self._worker = threading.Thread(target=self._work, name="dynatree-decode", daemon=True)
            self._worker.start()
            self.loaded_at = int(time.time())
            self.state = "ready"
        except Exception as exc:  # noqa: BLE001 (reported by /health and the CLI, not raised into a thread)
            self.error = str(exc) if isinstance(exc, DynaTreeError) else f"{type(exc).__name__}: {exc}"
            self.state = "failed"

    # -- requests -----------------------------------------------------------------------------
    def prompt_ids(self, request: ChatRequest | CompletionRequest) -> list[int]:
        """The request's prompt as token ids (chat messages through the chat template), every id one
        the target can read (a RequestError naming `prompt` or `messages` otherwise)."""
        tok, field = self.tokenizer, "messages" if isinstance(request, ChatRequest) else "prompt"
        if isinstance(request, CompletionRequest) and not isinstance(request.prompt, str):
            ids, given = list(request.prompt), True  # token ids, as the client sent them
        else:
            given = False
            try:
                ids = encode_prompt(tok, request.prompt) if field == "prompt" else self._chat_ids(request)
            except DynaTreeError as exc:
                raise RequestError(str(exc), field) from None
        readable = self.target.prompt_id_bound
        for i, token in enumerate(ids):
            if not 0 <= token < readable:
                where = f"prompt[{i}] = {token} is not" if given else f"the prompt encodes to token {token}, not"
                raise RequestError(f"{where} a token id {self.model_id!r} can read (0..{readable - 1})", field)
        return ids

    def _chat_ids(self, request: ChatRequest) -> list[int]:
        return encode_conversation(self.tokenizer, [m.as_template_message() for m in request.messages], self.model_id,
                                   f"{self.model_id!r} has no chat template: use /v1/completions with plain text")

    def prepare(self, request: ChatRequest | CompletionRequest, ids: list[int]) -> api.Prepared:
        """A validated decode of `request` (any bad value is a RequestError naming its field: a 400)."""
        extra = dict(request.dynatree or {})
        method = extra.pop("method", None)
        options = {str(k).replace("-", "_"): v for k, v in extra.items()}
        for name, value in options.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise RequestError(f"dynatree.{name} must be a finite number, got {value}", f"dynatree.{name}")
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > OPTION_LIMIT:
                raise RequestError(f"dynatree.{name} = {value} is beyond this server's limit of {OPTION_LIMIT} "
                                   "(tree sizes and depths are bounded per request)", f"dynatree.{name}")
        if method is not None and not isinstance(method, str):
            raise RequestError(f"dynatree.method must be a method name, got {method!r}", "dynatree.method")
        if method is None or method == self.settings.method:  # the server's options, overridden per request
            method, options = self.settings.method, {**self.settings.options, **options}
        spec = self._spec(method)
        # the shortest context among the models this method runs (the draft's may be shorter than the target's)
        models = [self.target, *([self.draft.model] if spec.draft != "none" and self.draft is not None
                                 and self.draft.model is not None else [])]
        limits = [(m.context_length, m.name) for m in models if m.context_length is not None]
        context, holder = min(limits) if limits else (None, None)
        room = None if context is None else context - len(ids)
        prompt_field = "messages" if isinstance(request, ChatRequest) else "prompt"
        if room is not None and room < 1:
            raise RequestError(f"the prompt ({len(ids)} tokens) fills the context length {context} of {holder!r}",
                               prompt_field, "context_length_exceeded")
        limit = self.settings.max_tokens
        asked = ("max_completion_tokens" if isinstance(request, ChatRequest) and request.max_completion_tokens
                 is not None else "max_tokens")  # the field the client set
        if request.max_tokens is not None and request.max_tokens > limit:
            raise RequestError(f"{asked} {request.max_tokens} exceeds this server's limit {limit} (--max-tokens)", asked)
        if request.max_tokens is not None and room is not None and request.max_tokens > room:
            raise RequestError(f"{asked} {request.max_tokens} and the prompt's {len(ids)} tokens exceed the context "
                               f"length {context} of {holder!r}", asked, "context_length_exceeded")
        max_tokens = request.max_tokens or (limit if room is None else min(limit, room))
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        sample = request.temperature >= GREEDY_BELOW
        sampling = dict(sample=True, temperature=request.temperature, top_k=request.top_k,
                        top_p=request.top_p) if sample else {}
        return self._prepare(ids, spec, options, max_tokens, seed, stop=request.stops, logprobs=request.asked_logprobs,
                             **sampling)

    def _spec(self, method: str) -> Method:
        """A method the server decodes with (RequestError naming `dynatree.method` otherwise)."""
        if method not in METHODS:
            raise RequestError(f"unknown method {method!r}; this server decodes with {', '.join(served_methods())}",
                               "dynatree.method")
        spec = get_method(method)
        if spec.policy_cls is None:
            raise RequestError(f"{method!r} runs {spec.baseline}, a benchmark baseline; the server "
                               "decodes with dynatree's methods (ar, linear, dynatree, ...)", "dynatree.method")
        return spec

    def _prepare(self, ids, spec: Method, options, max_new_tokens, seed, stop=None, logprobs=None,
                 **sampling) -> api.Prepared:
        """The engine's Request for a decode with `spec` (from `_spec`): its checks (the method's options:
        RequestError naming `dynatree`), then `api.prepare` against the loaded models (an error there names
        no field)."""
        request = Request(method=spec.name, options=options, target=self.target,
                          draft=self.draft if spec.draft != "none" else None, prompt_ids=ids,
                          max_new_tokens=max_new_tokens, stop=stop, logprobs=logprobs, seed=seed,
                          ngram_max=self.settings.ngram_max if spec.draft != "none" else None,
                          kv_window=self.window, compile=self.settings.compile and spec.compilable, **sampling)
        try:
            checked = request.check()
        except DynaTreeError as exc:
            raise _option_error(str(exc), spec, options) from None
        try:
            return api.prepare(checked)
        except DynaTreeError as exc:
            raise RequestError(str(exc), None) from None

    def submit(self, job: Job) -> None:
        """Queue a job; QueueFull when `settings.queue` jobs wait already."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.metrics.rejected.inc()
            raise QueueFull(self.retry_after()) from None
        self.metrics.queue_depth.set(self._queue.qsize())

    def retry_after(self) -> int:
        """Seconds until the queue has likely moved by one place (at least 1): what the running decode
        has left at the moving average of seconds per token, if it runs to its token limit or to the
        recent average length of a decode, whichever is shorter."""
        running = self._running
        if running is None:
            return 1
        start, limit = running
        tokens = min(limit, self._tokens) if self._tokens else limit  # decodes often end (EOS) before their limit
        return max(1, math.ceil(tokens * self._token_s - (time.perf_counter() - start)))

    # -- the worker ---------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            self.metrics.queue_depth.set(self._queue.qsize())
            if job is None:
                return
            if job.cancelled.is_set():  # the client left while waiting
                continue
            start = time.perf_counter()
            self._running = (start, job.prepared.max_new_tokens)
            self.metrics.running.set(1)
            try:
                stats = self._decode(job)
                if stats.new_tokens:  # (a client gone before its decode started decoded nothing: not a timing)
                    self._token_s = _moving_average(self._token_s, stats.wall_s / stats.new_tokens)
                    self._tokens = _moving_average(self._tokens, stats.new_tokens)
            except Exception as exc:  # noqa: BLE001 (one failed request must not stop the server)
                job.emit("error", f"{type(exc).__name__}: {exc}")
            finally:
                self.metrics.running.set(0)
                self._running = None

    def _decode(self, job: Job, observe: bool = True) -> Summary:
        """Run one job to its end (length, EOS, stop string, or cancellation) through `api.run`;
        emit its events; its decode's stats (over the tokens returned: the result's ids end at a stop
        string)."""
        queue_s = time.perf_counter() - job.submitted
        scoring = job.on_logprobs if job.prepared.logprobs is not None else None
        result = api.run(job.prepared, on_tokens=job.on_tokens, on_text=job.on_text, cancel=job.cancelled.is_set,
                         peak_memory=False, on_logprobs=scoring)  # (the process's peak: the HTTP side's memory too)
        if observe:
            self.metrics.observe(result, queue_s, job.first_token_s, time.perf_counter() - job.submitted,
                                 result.finish_reason)
        job.emit("done", Finished(result.finish_reason, len(job.prepared.prompt_ids), result.new_token_ids, result,
                                  queue_s))
        return result.stats

    def close(self) -> None:
        """Stop the worker after the job it is running."""
        if self._worker is not None:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass  # a daemon thread: it ends with the process
