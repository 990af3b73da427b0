"""The Python API: `generate()` returns a typed `Result` whose `to_json()` is the record of
`dynatree generate --json`."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Callable

import torch

from . import env, rng
from .decode import Decoder
from .drafters.factory import make_drafter
from .drafters.ngram import NGRAM_MAX
from .draftload import Draft, load_draft
from .draftspec import Hybrid  # noqa: F401 (re-exported: dynatree.api.Hybrid(model) is a --draft ngram+MODEL)
from .errors import DynaTreeError
from .featurehead import FeatureHead
from .kernels import linear_kernel
from .llamacpp import LlamaCppArConfig, LlamaCppLookupConfig, gguf_format, llamacpp_generate
from .weights import inexact_greedy
from .llamacpp import check_target as check_llamacpp
from .config import renamed_options
from .methods import METHODS, get_method, is_lossy, method_option_names
from .models import DEFAULT_TARGET, load_model, resolve_device, resolve_dtype, same_device
from .runtime import LoadedModel
from .peers import hf_generate, universal_assisted
from .prompts import encode_conversation, encode_prompt
from .sampling import Sampler, SamplingConfig
from .stats import PeakMemory, Stats
from .textstream import TextStream
from .wording import counted
from .request import Checked, Request, is_int, template_messages
from .result import Result, RunInfo, TokenLogprob
from .window import KVWindow

def _method_draft(method: str, draft, target: LoadedModel, linear: str) -> Draft | None:
    """The method's draft loaded and checked against `target` (None for methods that draft nothing);
    the spec's rules were checked by `Request.check()`."""
    spec = get_method(method)
    if spec.draft == "none":
        return None
    loaded = load_draft(draft, target, linear)
    if isinstance(loaded.model, FeatureHead) and spec.policy_cls is None:
        raise DynaTreeError(f"{method!r} runs transformers' generate(), which takes a draft LM; feature head "
                            f"{loaded.model.name!r} drafts in dynatree's own methods only")
    return loaded


def _ngram_max(ngram_max, draft: Draft | None) -> int:
    """The n-gram drafter's longest match: NGRAM_MAX unless given; given for a loaded draft without the
    n-gram drafter, an error (`Request.check` decides it for draft specs)."""
    if ngram_max is None:
        return NGRAM_MAX
    if draft is None or not draft.ngram:
        raise DynaTreeError(f"ngram_max (--ngram-max) applies only where dynatree's n-gram drafter runs; the draft "
                            f"{'(none)' if draft is None else repr(draft.name)} has none (leave ngram_max out)")
    return int(ngram_max)


def _token_ids(ids, vocab_size: int) -> list[int]:
    """`prompt_ids` as a list of ints (a list, a 1-D integer tensor or array), each a row of the
    target's output layer."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise DynaTreeError(f"prompt_ids as a tensor must be 1-D integer token ids, got shape {tuple(ids.shape)} "
                                f"of {str(ids.dtype).removeprefix('torch.')} (one prompt: ids[0] of a batch)")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise DynaTreeError(f"prompt_ids must be a list of token ids, got {type(ids).__name__}")
    ids = list(ids)
    if not ids:
        raise DynaTreeError("the prompt is empty")
    for i, token in enumerate(ids):
        if not is_int(token) or not 0 <= token < vocab_size:
            raise DynaTreeError(f"prompt_ids[{i}] = {token!r} is not a token id of the target (0..{vocab_size - 1})")
    return [int(t) for t in ids]


@dataclasses.dataclass
class Prepared:
    """One validated `generate()` request with its models loaded: everything a decode needs.

    `prepare()` builds it (all argument checks, model loading, prompt encoding; no forward pass),
    `decoder()` gives a fresh seeded decoder for one run of it, `result()` a run's typed result.
    The server prepares each request in its handler (bad requests fail there) and decodes it later
    on its worker thread (`run` with its `on_text` and `cancel`).
    """

    method: str
    config: object  # the method's validated config dataclass
    target: LoadedModel
    draft: Draft | None  # the drafters and draft model, checked against the target; None: the method drafts nothing
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool
    chat: bool  # the prompt went through the chat template (recorded only)
    seed: int
    ngram_max: int
    window: KVWindow | None
    sampling: SamplingConfig | None  # None: greedy
    compile: bool  # decode steps through torch.compile (dynatree's methods; hf-ar with a static cache)
    stops: tuple[str, ...] = ()  # stop strings: the decode ends at the first one
    logprobs: int | None = None  # score each new token, with this many alternatives (dynatree's decoder); None: not

    @property
    def ours(self) -> bool:
        """Dynatree's own decoder runs it (not transformers' generate())."""
        return get_method(self.method).policy_cls is not None

    @property
    def uses_ngram(self) -> bool:
        return self.draft is not None and self.draft.ngram

    @property
    def draft_model(self) -> LoadedModel | FeatureHead | None:
        """The draft LM or feature head, if any."""
        return None if self.draft is None else self.draft.model

    @property
    def models(self) -> list[LoadedModel | FeatureHead]:
        """The models a run of it uses and holds for its whole span (`run`): the target, and the draft LM
        or feature head if any (either may serve other decodes too: a head checked against two targets
        of the same architecture, a draft LM that is another decode's target)."""
        draft = self.draft_model
        return [self.target] + ([draft] if draft is not None and draft is not self.target else [])

    @property
    def uses_global_rng(self) -> bool:
        """transformers' generate() samples from torch's global generators (the hf-* methods, sampling):
        such runs fork and seed them one at a time (`run`)."""
        return self.sampling is not None and get_method(self.method).engine == "transformers"

    def decoder(self) -> Decoder:
        """A fresh policy, drafter and sampler for one run (dynatree's methods only); the sampler draws from
        a generator of its own, seeded by `seed` (torch's global one is left as the caller had it)."""
        policy = get_method(self.method).policy_cls(self.config)
        drafter = None if self.draft is None else make_drafter(self.draft, self.target, self.ngram_max, self.window,
                                                               compile=self.compile)
        sampler = Sampler(self.sampling, self.seed) if self.sampling is not None else None
        return Decoder(self.target, policy, drafter, self.window, sampler, compile=self.compile, logprobs=self.logprobs)

    def text_stream(self) -> TextStream:
        """What watches a run's text for the stop strings (textstream.py)."""
        return TextStream(self.target.tokenizer, self.stops)

    def result(self, new_ids: list[int], stats: Stats, policy_state: dict | None = None,
               text: TextStream | None = None, cancelled: bool = False, logprobs: list | None = None) -> Result:
        """The typed result of a run (`Result.to_json()` is the JSON of `dynatree generate --json`);
        `text`, the stream that watched the run, cuts the ids and text at a stop string it saw
        (OpenAI's rule: the ids end with the token that completed it, the text just before it);
        `cancelled`: the caller ended the run early; `logprobs`, one per new token, are cut with the ids."""
        tgt, draft, ours = self.target, self.draft_model, self.ours
        kept = None
        if text is not None and text.stopped:
            new_ids, words, reason = new_ids[:text.stop_at], text.text, "stop"
            kept = len(new_ids)
        else:
            words = tgt.tokenizer.decode(new_ids, skip_special_tokens=True)
            ended = bool(new_ids) and new_ids[-1] in tgt.eos_ids and not self.ignore_eos
            early = not ended and len(new_ids) < self.max_new_tokens  # (transformers asks its criteria at the end too)
            reason = "cancelled" if cancelled and early else "stop" if ended else "length"
        engine = get_method(self.method).engine
        llama = engine == "llama.cpp"  # llama.cpp decodes the GGUF file as stored, whatever the target's format
        info = RunInfo(
            max_new_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
            chat=self.chat,
            device=str(tgt.device),
            dtype="gguf" if llama else str(tgt.dtype).removeprefix("torch."),
            weights=gguf_format(tgt.gguf) if llama else tgt.weights,
            weights_note=None if llama else tgt.weights_note,
            compile=self.compile,
            engine=engine,
            inexact_greedy=inexact_greedy(tgt.dtype, tgt.weights, tgt.row_dependent)
            if ours and self.sampling is None and self.draft is not None else None,
            linear=tgt.linear if ours else "llama.cpp" if llama else "stock",  # hf-*: stock kernels
            linear_note=tgt.linear_note if ours else None,
            draft_linear=(draft.linear if isinstance(draft, LoadedModel) else linear_kernel(draft))
            if draft is not None and ours else None,
            draft_linear_note=draft.linear_note if isinstance(draft, LoadedModel) else None,
            draft_weights=draft.weights if draft is not None and ours else None,
            seed=self.seed,
            hf_universal_assisted=self.method == "hf-assisted" and universal_assisted(tgt, draft),
            ngram_max=self.ngram_max if self.uses_ngram else None,
            kv_window=str(self.window) if self.window is not None else None,
            sampling=dataclasses.asdict(self.sampling) if self.sampling is not None else None,
            lossy=self.sampling is not None and is_lossy(self.config),
            stop=list(self.stops) or None,
        )
        return Result(method=self.method, target=tgt.name, draft=None if self.draft is None else self.draft.name,
                      prompt_tokens=len(self.prompt_ids),
                      new_token_ids=new_ids, text=words, finish_reason=reason, stats=stats.summary(kept),
                      config=dataclasses.asdict(self.config), run=info,
                      env=env.describe(tgt.device), policy_state=policy_state,
                      logprobs=None if logprobs is None else logprobs[:len(new_ids)])


def prepare(request: Request | Checked) -> Prepared:
    """Validate a request (`Request.check()`, unless it comes checked), load its models, check the
    draft against the target and the prompt against both, and encode the prompt (no forward pass).
    Any bad value is a `DynaTreeError` naming it."""
    if not isinstance(request, (Request, Checked)):
        raise DynaTreeError(f"prepare() takes a dynatree.Request, got {type(request).__name__} "
                            "(dynatree.generate takes the prompt and options directly)")
    checked = request if isinstance(request, Checked) else _checked(request)
    r, spec = checked.request, checked.method
    if isinstance(r.target, LoadedModel):
        tgt = r.target
        if r.device is not None and not same_device(resolve_device(str(r.device)), tgt.device):
            raise DynaTreeError(f"device {str(r.device)!r} given, but the target is already loaded on {tgt.device}; "
                                "load it there (load_model(..., device=...)) or leave device out")
        if r.dtype is not None and resolve_dtype(r.dtype) != tgt.dtype:
            raise DynaTreeError(f"dtype {r.dtype!r} given, but the target is already loaded in "
                                f"{str(tgt.dtype).removeprefix('torch.')}; load it so (load_model(..., dtype=...)) "
                                "or leave dtype out")
        if r.linear != "auto" and r.linear != tgt.linear:
            raise DynaTreeError(f"linear {r.linear!r} given, but the target is already loaded with {tgt.linear!r} "
                                "linear layers; load it so (load_model(..., linear=...)) or leave linear out")
    else:
        tgt = load_model(r.target, device=str(r.device or "cpu"), dtype=r.dtype, linear=r.linear, weights=r.weights or "dense")
    compile = tgt.compile if r.compile is None else r.compile
    draft = _method_draft(r.method, r.draft, tgt, r.linear)
    readable = tgt.prompt_id_bound  # every prompt token must be a row the target reads
    if r.prompt_ids is None:
        if isinstance(r.prompt, list):
            prompt_ids = encode_conversation(tgt.tokenizer, template_messages(r.prompt), tgt.name,
                                             "a conversation (prompt as a list of messages) needs a chat template; "
                                             f"{tgt.name!r} has none: give the prompt as text")
        else:
            prompt_ids = encode_prompt(tgt.tokenizer, r.prompt, r.chat)
        beyond = [t for t in prompt_ids if t >= readable]
        if beyond:
            raise DynaTreeError(f"the prompt encodes to token {beyond[0]}, which {tgt.name!r} cannot read (its embedding "
                                f"and output layer cover ids 0..{readable - 1}, its tokenizer {len(tgt.tokenizer)} tokens)")
    else:
        prompt_ids = _token_ids(r.prompt_ids, readable)
    window = checked.window
    for model in filter(None, (tgt, None if draft is None else draft.model)):
        limit = model.context_length
        if window is not None:
            window.check_context(limit, model.name)
        if limit is not None and len(prompt_ids) + r.max_new_tokens > limit:
            raise DynaTreeError(
                f"prompt ({counted(len(prompt_ids), 'token')}) + max_new_tokens ({r.max_new_tokens}) exceeds the "
                f"context length {limit} of {model.name!r}"
            )
    if spec.engine == "llama.cpp":
        check_llamacpp(tgt, len(prompt_ids), r.max_new_tokens, checked.sampling, r.method)
    return Prepared(method=r.method, config=checked.config, target=tgt, draft=draft,
                    prompt_ids=prompt_ids, max_new_tokens=int(r.max_new_tokens), ignore_eos=r.ignore_eos,
                    chat=r.chat or isinstance(r.prompt, list),  # (numpy integers made ints: the record is JSON)
                    seed=int(r.seed), ngram_max=_ngram_max(r.ngram_max, draft), window=window, sampling=checked.sampling,
                    compile=bool(compile) and spec.compilable, stops=checked.stops,
                    logprobs=None if r.logprobs is None else int(r.logprobs))


def _checked(request: Request) -> Checked:
    """`request.check()`, its method options named as the Python API names them (`tau_h`, not the
    CLI's `--tau-h`)."""
    dashed = [k for k in request.options if isinstance(k, str) and "-" in k] if isinstance(request.options, dict) else []
    if dashed:  # (renamed below, --tau-h would read as an option tau_h that "does not apply")
        raise DynaTreeError(f"option {dashed[0]!r}: the Python API names options with underscores "
                            f"({dashed[0].replace('-', '_')})")
    try:
        return request.check()
    except DynaTreeError as exc:
        names = set(request.options) if isinstance(request.options, dict) else set()
        if isinstance(request.method, str) and request.method in METHODS:
            names |= {f.name for f in dataclasses.fields(METHODS[request.method].config_cls)}
        message, named = renamed_options(str(exc), names, lambda name: name)
        if not named:
            raise
        raise DynaTreeError(message) from None


def run(job: Prepared, on_tokens: Callable[[list[int]], None] | None = None,
        on_text: Callable[[str], None] | None = None, cancel: Callable[[], bool] | None = None,
        peak_memory: bool = True, on_logprobs: Callable[[list[TokenLogprob]], None] | None = None) -> Result:
    """Decode a prepared request once and return its result (transformers' generate()
    for the hf-* methods, llama.cpp's loop for llama-*, dynatree's decoder for the others).

    `on_tokens` gets every group of tokens as it is committed. `on_text` gets the text as it may
    be shown: pieces of the decoded text, holding back an incomplete character and what may begin
    a stop string (their concatenation is the result's `text`). With stop strings the decode ends
    after the group that completes one, and `on_tokens`, `on_text`, the result's ids and its text
    end there. `cancel`, asked between steps, ends the decode when it returns True (a client
    gone): the result's `finish_reason` is then "cancelled". `peak_memory` False leaves the peak
    memory of dynatree's decoder unmeasured (None; a server's decodes share the process with its HTTP
    side, and resetting the peak-RSS counter costs time per request). `on_logprobs` (a request with
    `logprobs`) gets the new tokens' scores as their text is shown, just before the `on_text` piece
    that shows it (a token holding part of a character, or of a possible stop string, waits for the
    piece that shows it; an end-of-sequence token shows nothing and goes at once); the scores of a stop
    string's own tokens, which no piece shows, come last, once the decode has ended. Together they are
    the result's `logprobs`."""
    if not isinstance(job, Prepared):
        raise DynaTreeError(f"run() takes what prepare() returns, got {type(job).__name__}"
                            + (": run(prepare(request))" if isinstance(job, (Request, Checked)) else ""))
    for name, fn, takes in (("on_tokens", on_tokens, "the new token ids"), ("on_text", on_text, "the new text"),
                            ("cancel", cancel, "no arguments returning True to end the decode"),
                            ("on_logprobs", on_logprobs, "the new tokens' TokenLogprobs")):
        if fn is not None and not callable(fn):
            raise DynaTreeError(f"{name} must be a function of {takes}, got {type(fn).__name__}")
    if on_logprobs is not None and job.logprobs is None:
        raise DynaTreeError("on_logprobs needs a request that asks for logprobs (logprobs=N)")
    with _holding(job):  # one decode at a time on a model (another thread's waits for this one to end)
        if cancel is not None and cancel():  # ended while it waited for the models: nothing is compiled or measured
            return job.result([], Stats(compile_s=0.0 if job.compile else None), cancelled=True,
                              logprobs=[] if job.logprobs is not None else None)
        return _decode(job, on_tokens, on_text, cancel, peak_memory, on_logprobs)


class _Held(threading.local):
    """What the current thread's decodes hold (`run`): their models, innermost last, and how many of
    them hold torch's global generators."""

    def __init__(self):
        self.models: list[LoadedModel | FeatureHead] = []
        self.rng = 0


_HELD = _Held()
_HEAD_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # feature head -> its `busy` lock
_HEAD_LOCKS_MADE = threading.Lock()


def _busy(model: LoadedModel | FeatureHead) -> threading.RLock:
    """The lock a decode holds on `model` (`LoadedModel.busy`; a feature head's, kept beside it)."""
    if isinstance(model, LoadedModel):
        return model.busy
    with _HEAD_LOCKS_MADE:
        return _HEAD_LOCKS.setdefault(model, threading.RLock())


@contextlib.contextmanager
def _holding(job: Prepared):
    """Hold what a decode of `job` uses for its whole span: every model's lock in one fixed order (by id),
    so that two top-level decodes sharing models the other way round (one's draft LM the other's target)
    cannot each wait on the other, then torch's global generators where it samples through transformers
    (last: a decode waiting for a busy model holds nothing that the busy one's callbacks may need).
    A callback that decodes on further models can still deadlock with decodes on other threads: its
    locks come after the outer decode's, whatever their order."""
    with contextlib.ExitStack() as stack:
        for model in sorted(job.models, key=id):
            stack.enter_context(_busy(model))
        if job.uses_global_rng:
            stack.enter_context(rng.LOCK)  # (rng.py: one user of torch's global generators at a time)
        _HELD.models.extend(job.models)
        _HELD.rng += job.uses_global_rng
        try:
            yield
        finally:
            del _HELD.models[len(_HELD.models) - len(job.models):]
            _HELD.rng -= job.uses_global_rng


def blocked_here(job: Prepared) -> str | None:
    """What a decode of `job` needs that a decode on the current thread holds (a callback of that decode is
    running), named; None when nothing: a decode of `job` on another thread would wait for that decode's end."""
    for model in job.models:
        if any(held is model for held in _HELD.models):
            return model.name
    if job.uses_global_rng and _HELD.rng:
        return "torch's global random generators (a sampled hf-* decode)"
    return None


def _decode(job: Prepared, on_tokens, on_text, cancel, peak_memory: bool, on_logprobs) -> Result:
    """`run`'s decode, its arguments checked, the target held."""
    tgt = job.target
    decoder = job.decoder() if job.ours else None
    scores = None if on_logprobs is None else _Scores(decoder, on_logprobs)
    # the text is decoded at every commit only when someone reads it (it costs time)
    text = job.text_stream() if job.stops or on_text is not None or scores is not None else None
    watch = on_tokens if text is None else _watching(text, on_tokens, on_text, scores)
    ends = _Ends(text if job.stops else None, cancel)
    stopped = ends if ends.asks else None  # (None: the engines ask nothing per step)
    if isinstance(job.config, (LlamaCppArConfig, LlamaCppLookupConfig)):
        lookup = job.config if isinstance(job.config, LlamaCppLookupConfig) else None
        new_ids, stats = llamacpp_generate(tgt, job.prompt_ids, job.max_new_tokens, job.ignore_eos, watch,
                                           job.sampling, lookup, stopped)
        result = job.result(new_ids, stats, text=text, cancelled=ends.cancelled)
    elif not job.ours:
        with _seeded(job):
            new_ids, stats = hf_generate(tgt, job.config, job.prompt_ids, job.max_new_tokens, job.ignore_eos,
                                         job.draft_model, watch, job.sampling, compile=job.compile, stopped=stopped)
        result = job.result(new_ids, stats, text=text, cancelled=ends.cancelled)
    else:
        decoder.prepare(job.prompt_ids, job.max_new_tokens)  # compiled graphs and cost curve, before the span measured
        memory = PeakMemory(tgt.device) if peak_memory else None
        for _ in decoder.steps(job.prompt_ids, job.max_new_tokens, job.ignore_eos, watch, stop=stopped):
            pass
        decoder.run.stats.peak_mem_mb = None if memory is None else memory.peak_mb()
        result = job.result(decoder.run.new_tokens, decoder.run.stats, decoder.policy.state(), text,
                            cancelled=ends.cancelled, logprobs=decoder.run.logprobs)
    if on_text is not None or scores is not None:
        rest = text.finish()  # what was held back (an incomplete character) once the decode ended without a stop
        if scores is not None:
            scores.hand(text.shown())
        if rest and on_text is not None:
            on_text(rest)
        if scores is not None:
            scores.hand(len(result.new_token_ids))  # a stop string's own tokens: no text shows them
    return result


@contextlib.contextmanager
def _seeded(job: Prepared):
    """transformers samples from torch's global generators: for a sampled run (`run` holds them) the CPU
    one and the target's device's are seeded with the job's seed, then given back as they were (no other
    generator is touched); a greedy run draws nothing and leaves them alone."""
    if not job.uses_global_rng:
        yield
        return
    with rng.seeded(job.seed, job.target.device):
        yield


class _Ends:
    """What the engines ask between steps: has the decode ended early? (a stop string in the text,
    or the caller's `cancel()`); `cancelled` remembers that the caller ended it."""

    def __init__(self, text: TextStream | None, cancel: Callable[[], bool] | None):
        self.text, self.cancel = text, cancel
        self.asks = text is not None or cancel is not None
        self.cancelled = False

    def __call__(self) -> bool:
        if self.text is not None and self.text.stopped:
            return True
        if self.cancel is not None and self.cancel():
            self.cancelled = True
        return self.cancelled


class _Scores:
    """Hands `on_logprobs` the decoder's scores of the new tokens, in order, each once."""

    def __init__(self, decoder: Decoder, on_logprobs: Callable[[list[TokenLogprob]], None]):
        self.decoder, self.on_logprobs = decoder, on_logprobs
        self.sent = 0

    def hand(self, upto: int) -> None:
        """The scores of the new tokens before index `upto` not handed yet (the decoder scored them
        before committing them)."""
        if upto > self.sent:
            self.on_logprobs(self.decoder.run.logprobs[self.sent: upto])
            self.sent = upto


def _watching(text: TextStream, on_tokens: Callable[[list[int]], None] | None,
              on_text: Callable[[str], None] | None, scores: _Scores | None = None) -> Callable[[list[int]], None]:
    """A commit callback that feeds `text` (which watches for the stop strings), then hands `on_tokens`
    the ids up to the token that completed a stop string, and nothing after it, `scores` the scores
    of the tokens whose text is shown now, and `on_text` that text."""
    def watch(ids: list[int]) -> None:
        if text.stopped:
            return
        before = len(text.ids)
        delta = text.push(ids)
        if text.stopped:
            ids = ids[:text.stop_at - before]
        if on_tokens is not None:
            on_tokens(ids)
        if scores is not None:
            scores.hand(text.shown())
        if on_text is not None and delta:
            on_text(delta)
    return watch


def generate(
    prompt: str | list[dict] | None = None,
    method: str = "dynatree",
    *,
    target: str | LoadedModel = DEFAULT_TARGET,
    draft: str | LoadedModel | FeatureHead | Hybrid | Draft | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 128,
    ignore_eos: bool = False,
    stop: str | list[str] | None = None,
    logprobs: int | None = None,
    chat: bool = False,
    device: str | torch.device | None = None,
    dtype: str | None = None,
    weights: str | None = None,
    seed: int = 0,
    ngram_max: int | None = None,
    kv_window: str | KVWindow | None = None,
    sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    compile: bool | None = None,
    linear: str = "auto",
    on_tokens: Callable[[list[int]], None] | None = None,
    **options,
) -> Result:
    """Decode one prompt with one method and return its `Result`: `run(prepare(Request(...)))`
    with the request's fields as keyword arguments (`request.Request` documents each).

    `target`/`draft` take a model spec (alias, directory, .gguf file, hub id) or a model
    already loaded with `load_model` (`device`, default cpu, is where a spec is loaded; with a
    loaded target it may only repeat that model's device); `draft` may also be "ngram", or "ngram+MODEL" /
    `Hybrid(model)` for n-gram copying backed by a draft LM (`HybridDrafter`), or a `Draft` from
    `draftload.load_draft` (loaded once for many calls). `options` are the
    method's config fields (e.g. k=5 for linear, d0=4 for dynatree). Give either `prompt`
    (text; or a conversation, a list of {"role", "content"} dicts with roles system (or OpenAI's
    name for it, developer), user and assistant, through the chat template) or `prompt_ids`
    (token ids, used as they are). `kv_window` ("SINK,RECENT") bounds
    the KV caches with attention sinks plus a window of recent tokens (see `window.py`).
    `sample=True` samples (temperature, then top-k, then top-p; seeded by `seed`) with lossless
    verification instead of greedy decoding (see `sampling.py`). `compile=True` runs the
    target's decode steps, and the draft model's or feature head's, through torch.compile (minutes
    to compile on first use, cached on disk; see `LoadedModel.forward`; for hf-ar: transformers'
    generate() with a static cache and its own compiled forward); None keeps the loaded target's
    own setting. `linear`
    ("auto", "onednn", "stock") picks the linear kernels of models loaded here (kernels.py).
    `stop` (a string or a list) ends the decode at the first stop string: the result's text just
    before it, its ids with the token that completed it, `finish_reason` "stop" (OpenAI's rule).
    `logprobs` (0-20) fills `Result.logprobs`: each new token's log-probability under the target
    (temperature 1) with that many most likely alternatives, from the pass that committed it.
    Method options go as keywords here (`options=` is `Request`'s field for the same dict).
    `ngram_max` (None: 4) is the longest n-gram the n-gram drafter matches; given where no n-gram
    drafter runs, an error.
    `weights` ("dense", "q4", "int8", "auto"; None: dense) is the format of a target loaded here
    (weights.py); draft LMs load dense, in the target's dtype (feature heads in int4 on a q4 target). With a loaded target, `device`,
    `dtype`, `weights` and `linear` other than their defaults must be what it was loaded with
    (an error says so; nothing is converted behind the caller's back).
    """
    request = build_request("generate", prompt, method, options, target=target, draft=draft,
                       prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=stop, logprobs=logprobs, chat=chat,
                       device=device, dtype=dtype, weights=weights, seed=seed, ngram_max=ngram_max, kv_window=kv_window,
                       sample=sample, temperature=temperature, top_k=top_k, top_p=top_p, compile=compile, linear=linear)
    return run(prepare(request), on_tokens)


def build_request(caller: str, prompt, method, options: dict, **fields) -> Request:
    """The Request of a `generate()`/`stream()` call (`caller`): its fields, and the method's options
    given as keywords."""
    if "options" in options:
        raise DynaTreeError(f"{caller}() takes the method's options as keywords (e.g. d0=4), not options={{...}} "
                            "(that is Request's field)")
    unknown = sorted(set(options) - method_option_names())
    if unknown:  # not any method's option: a misspelt or foreign keyword, not a question of which method
        import difflib

        known = sorted({f.name for f in dataclasses.fields(Request)} - {"options"} | {"on_tokens"})
        near = [_ALIASES[unknown[0]]] if unknown[0] in _ALIASES else difflib.get_close_matches(unknown[0], known, n=1)
        near = near or difflib.get_close_matches(unknown[0], sorted(f.name for f in dataclasses.fields(get_method(method).config_cls)), n=1) or [None]
        hint = f" (did you mean {near[0]}?)" if near[0] else ""
        raise DynaTreeError(f"{caller}() got an unknown argument {unknown[0]!r}{hint}")
    return Request(prompt=prompt, method=method, options=options, **fields)


# other libraries' names for generate()'s keywords (OpenAI's, transformers')
_ALIASES = {"max_tokens": "max_new_tokens", "max_length": "max_new_tokens", "do_sample": "sample",
            "model": "target", "draft_model": "draft", "assistant_model": "draft", "on_token": "on_tokens"}
