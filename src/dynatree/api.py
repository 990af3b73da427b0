"""The Python API: `generate()` returns a typed `Result` whose `to_json()` is the record of
`dynatree generate --json`."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from . import env
from .decode import Decoder
from .drafters.factory import make_drafter
from .draftspec import AUTO, HYBRID, NGRAM, Hybrid, head_dir, parse  # noqa: F401 (NGRAM, HYBRID, Hybrid re-exported)
from .errors import DynaTreeError
from .featurehead import FeatureHead, check_head, load_head
from .kernels import linear_kernel
from .llamacpp import LlamaCppArConfig, llamacpp_generate
from .weights import inexact_greedy
from .llamacpp import check_target as check_llamacpp
from .methods import get_method, is_lossy
from .models import DEFAULT_TARGET, check_compatible, load_model, resolve_device, resolve_dtype
from .runtime import LoadedModel
from .peers import hf_generate, universal_assisted
from .sampling import Sampler, SamplingConfig
from .stats import Stats
from .request import Request, is_int
from .result import Result, RunInfo
from .window import KVWindow

def _load_draft_model(spec: str, device: str, dtype, linear: str) -> LoadedModel | FeatureHead:
    """A draft LM, or a feature head (in the target's dtype) when the spec names one."""
    directory = head_dir(spec)
    if directory is not None:
        return load_head(directory, name=spec, device=resolve_device(device), dtype=resolve_dtype(dtype or "float32"),
                         linear=linear)
    return load_model(spec, device=device, dtype=dtype, linear=linear)


def encode_prompt(tokenizer, prompt: str, chat: bool = False, history=()) -> list[int]:
    """Token ids of a prompt; with `chat`, wrapped in the tokenizer's chat template as a user turn
    after `history`, earlier (user, assistant) turns of the conversation."""
    if not prompt or not prompt.strip():
        raise DynaTreeError("the prompt is empty")
    if history and not chat:
        raise DynaTreeError("a conversation history needs the chat template (--chat)")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise DynaTreeError("--chat needs a tokenizer with a chat template; this one has none")
        messages = [m for user, answer in history
                    for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
        return encode_messages(tokenizer, [*messages, {"role": "user", "content": prompt}])
    return _nonempty(tokenizer(prompt).input_ids)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat `messages` ({"role", "content"} dicts) through the tokenizer's chat template,
    ready for the assistant's answer (the template's own special tokens, none added twice)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _nonempty(tokenizer(text, add_special_tokens=False).input_ids)


def _nonempty(ids) -> list[int]:
    if not ids:
        raise DynaTreeError("the prompt encodes to zero tokens")
    return list(ids)


def load_draft(spec, device: str = "cpu", dtype: str | torch.dtype | None = None, linear: str = "auto"):
    """A --draft value with its model loaded once: None/'auto'/'ngram' as they are, 'ngram+SPEC' as
    Hybrid(loaded model), any other spec as the loaded model (no compatibility check here)."""
    if spec in AUTO or isinstance(spec, (LoadedModel, FeatureHead, Hybrid)):
        return spec
    parsed = parse(spec)
    if parsed.model is None:
        return NGRAM
    model = _load_draft_model(parsed.model, device, dtype, linear)
    return Hybrid(model) if parsed.ngram else model


def load_checked_draft(target: LoadedModel, spec: str, device: str, dtype, linear: str = "auto"):
    """A draft LM or feature head by spec, checked against `target` (one-line errors otherwise)."""
    draft = _load_draft_model(spec, device, dtype, linear)
    _check_draft(target, draft)
    return draft


def _check_draft(target: LoadedModel, draft: LoadedModel | FeatureHead) -> None:
    """A draft LM must share the target's tokenizer; a feature head must be built for the target."""
    if isinstance(draft, FeatureHead):
        check_head(draft, target)
    else:
        check_compatible(target, draft)


def resolve_draft(method: str, draft, target: LoadedModel, device: str, dtype, linear: str = "auto"):
    """(draft LM or head, or None; draft name or None) for a method: None/'auto'/'ngram', a spec
    ('MODEL', 'ngram+MODEL'), a loaded model or head, or Hybrid(model or spec) (the name then
    starts with 'ngram+'). The spec's rules were checked by `Request.check()`; this loads the model
    and checks it against the target."""
    if get_method(method).draft == "none":
        return None, None
    if not isinstance(draft, (LoadedModel, FeatureHead, Hybrid)):
        parsed = parse(draft)
        if parsed.model is None:
            return None, NGRAM
        draft = Hybrid(parsed.model) if parsed.ngram else parsed.model
    hybrid = isinstance(draft, Hybrid)
    if hybrid:
        draft = draft.lm
    lm = draft if isinstance(draft, (LoadedModel, FeatureHead)) else _load_draft_model(draft, device, dtype, linear)
    if isinstance(lm, FeatureHead) and get_method(method).policy_cls is None:
        raise DynaTreeError(f"{method!r} runs transformers' generate(), which takes a draft LM; feature head "
                            f"{lm.name!r} drafts in dynatree's own methods only")
    _check_draft(target, lm)
    return lm, (HYBRID if hybrid else "") + lm.name


def _token_ids(ids, vocab_size: int) -> list[int]:
    """`prompt_ids` as a list of ints, each a row of the target's output layer."""
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
    on its worker thread, one `Decoder.steps` iteration at a time.
    """

    method: str
    config: object  # the method's validated config dataclass
    target: LoadedModel
    draft: LoadedModel | FeatureHead | None  # the draft LM or feature head; None: n-gram drafter or none
    draft_name: str | None  # None (no drafter), 'ngram', a model name, or 'ngram+NAME'
    prompt_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool
    chat: bool  # the prompt went through the chat template (recorded only)
    seed: int
    ngram_max: int
    window: KVWindow | None
    sampling: SamplingConfig | None  # None: greedy
    compile: bool  # decode steps through torch.compile (dynatree's methods; hf-ar with a static cache)

    @property
    def ours(self) -> bool:
        """Dynatree's own decoder runs it (not transformers' generate())."""
        return get_method(self.method).policy_cls is not None

    @property
    def uses_ngram(self) -> bool:
        return self.draft_name is not None and (self.draft_name == NGRAM or self.draft_name.startswith(HYBRID))

    def decoder(self) -> Decoder:
        """A fresh policy, drafter and sampler for one run, seeded by `seed` (dynatree's methods only)."""
        torch.manual_seed(self.seed)
        policy = get_method(self.method).policy_cls(self.config)
        drafter = None if self.draft_name is None else make_drafter(
            self.draft, self.uses_ngram, self.target, self.ngram_max, self.window)
        sampler = Sampler(self.sampling, self.seed) if self.sampling is not None else None
        return Decoder(self.target, policy, drafter, self.window, sampler, compile=self.compile)

    def result(self, new_ids: list[int], stats: Stats, policy_state: dict | None = None) -> Result:
        """The typed result of a run (`Result.to_json()` is the JSON of `dynatree generate --json`)."""
        tgt, draft, ours = self.target, self.draft, self.ours
        engine = get_method(self.method).engine
        llama = engine == "llama.cpp"  # llama.cpp decodes the GGUF file as stored, whatever the target's format
        info = RunInfo(
            max_new_tokens=self.max_new_tokens,
            ignore_eos=self.ignore_eos,
            chat=self.chat,
            device=str(tgt.device),
            dtype="gguf" if llama else str(tgt.dtype).removeprefix("torch."),
            weights="gguf" if llama else tgt.weights,
            weights_note=None if llama else tgt.weights_note,
            compile=self.compile,
            engine=engine,
            inexact_greedy=inexact_greedy(tgt.dtype, tgt.weights, tgt.row_dependent)
            if ours and self.sampling is None and self.draft_name is not None else None,
            linear=tgt.linear if ours else "llama.cpp" if llama else "stock",  # hf-*: stock kernels
            linear_note=tgt.linear_note if ours else None,
            draft_linear=(draft.linear if isinstance(draft, LoadedModel) else linear_kernel(draft))
            if draft is not None and ours else None,
            draft_linear_note=draft.linear_note if isinstance(draft, LoadedModel) else None,
            seed=self.seed,
            hf_universal_assisted=self.method == "hf-assisted" and universal_assisted(tgt, draft),
            ngram_max=self.ngram_max if self.uses_ngram else None,
            kv_window=str(self.window) if self.window is not None else None,
            sampling=dataclasses.asdict(self.sampling) if self.sampling is not None else None,
            lossy=self.sampling is not None and is_lossy(self.config),
        )
        return Result(method=self.method, target=tgt.name, draft=self.draft_name, prompt_tokens=len(self.prompt_ids),
                      new_token_ids=new_ids, text=tgt.tokenizer.decode(new_ids, skip_special_tokens=True),
                      stats=stats.summary(), config=dataclasses.asdict(self.config), run=info,
                      env=env.describe(tgt.device), policy_state=policy_state)


def prepare(request: Request) -> Prepared:
    """Validate a request (`Request.check()`), load its models, check the draft against the target
    and the prompt against both, and encode the prompt (no forward pass). Any bad value is a
    `DynaTreeError` naming it."""
    checked = request.check()
    r, spec = request, checked.method
    if isinstance(r.target, LoadedModel):
        tgt = r.target
        if r.device is not None and resolve_device(r.device) != tgt.device:
            raise DynaTreeError(f"device {r.device!r} given, but the target is already loaded on {tgt.device}; "
                                "load it there (load_model(..., device=...)) or leave device out")
    else:
        tgt = load_model(r.target, device=r.device or "cpu", dtype=r.dtype, linear=r.linear, weights=r.weights or "dense")
    device = str(tgt.device)
    compile = tgt.compile if r.compile is None else r.compile
    draft_lm, draft_name = resolve_draft(r.method, r.draft, tgt, device, tgt.dtype, r.linear)  # drafts: target's dtype
    readable = min(tgt.vocab_size, tgt.embedding_rows)  # every prompt token must be a row the target reads
    if r.prompt_ids is None:
        prompt_ids = encode_prompt(tgt.tokenizer, r.prompt, r.chat)
        beyond = [t for t in prompt_ids if t >= readable]
        if beyond:
            raise DynaTreeError(f"the prompt encodes to token {beyond[0]}, which {tgt.name!r} cannot read (its embedding "
                                f"and output layer cover ids 0..{readable - 1}, its tokenizer {len(tgt.tokenizer)} tokens)")
    else:
        prompt_ids = _token_ids(r.prompt_ids, readable)
    window = checked.window
    for model in filter(None, (tgt, draft_lm)):
        limit = model.context_length
        if window is not None:
            window.check_context(limit, model.name)
        if limit is not None and len(prompt_ids) + r.max_new_tokens > limit:
            raise DynaTreeError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({r.max_new_tokens}) exceeds the "
                f"context length {limit} of {model.name!r}"
            )
    if spec.engine == "llama.cpp":
        check_llamacpp(tgt, len(prompt_ids), r.max_new_tokens, checked.sampling)
    return Prepared(method=r.method, config=checked.config, target=tgt, draft=draft_lm, draft_name=draft_name,
                    prompt_ids=prompt_ids, max_new_tokens=r.max_new_tokens, ignore_eos=r.ignore_eos, chat=r.chat,
                    seed=r.seed, ngram_max=r.ngram_max, window=window, sampling=checked.sampling,
                    compile=bool(compile) and spec.compilable)


def run(job: Prepared, on_tokens: Callable[[list[int]], None] | None = None) -> Result:
    """Decode a prepared request once and return its result (transformers' generate()
    for the hf-* methods, dynatree's decoder for the others)."""
    tgt = job.target
    if isinstance(job.config, LlamaCppArConfig):
        new_ids, stats = llamacpp_generate(tgt, job.prompt_ids, job.max_new_tokens, job.ignore_eos, on_tokens,
                                           job.sampling)
        return job.result(new_ids, stats)
    if not job.ours:
        torch.manual_seed(job.seed)
        new_ids, stats = hf_generate(tgt, job.config, job.prompt_ids, job.max_new_tokens, job.ignore_eos, job.draft,
                                     on_tokens, job.sampling, compile=job.compile)
        return job.result(new_ids, stats)
    decoder = job.decoder()
    run = decoder.generate(job.prompt_ids, job.max_new_tokens, job.ignore_eos, on_tokens)
    return job.result(run.new_tokens, run.stats, decoder.policy.state())


def generate(
    prompt: str | None = None,
    method: str = "dynatree",
    *,
    target: str | LoadedModel = DEFAULT_TARGET,
    draft: str | LoadedModel | None = None,
    prompt_ids: list[int] | None = None,
    max_new_tokens: int = 128,
    ignore_eos: bool = False,
    chat: bool = False,
    device: str | None = None,
    dtype: str | None = None,
    weights: str | None = None,
    seed: int = 0,
    ngram_max: int = 4,
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
    `Hybrid(model)` for n-gram copying backed by a draft LM (`HybridDrafter`). `options` are the
    method's config fields (e.g. k=5 for linear, d0=4 for dynatree). Give either `prompt`
    (text) or `prompt_ids` (token ids, used as they are). `kv_window` ("SINK,RECENT") bounds
    the KV caches with attention sinks plus a window of recent tokens (see `window.py`).
    `sample=True` samples (temperature, then top-k, then top-p; seeded by `seed`) with lossless
    verification instead of greedy decoding (see `sampling.py`). `compile=True` runs the
    target's decode steps through torch.compile (minutes to compile on first use, cached on
    disk; see `LoadedModel.forward`; for hf-ar: transformers' generate() with a static cache and
    its own compiled forward); None keeps the loaded target's own setting. `linear`
    ("auto", "onednn", "stock") picks the linear kernels of models loaded here (kernels.py).
    `weights` ("dense", "q4", "int8", "auto"; None: dense) is the format of a target loaded here
    (weights.py); drafts load dense, in the target's dtype.
    """
    request = Request(prompt=prompt, method=method, options=options, target=target, draft=draft,
                      prompt_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, chat=chat,
                      device=device, dtype=dtype, weights=weights, seed=seed, ngram_max=ngram_max, kv_window=kv_window, sample=sample,
                      temperature=temperature, top_k=top_k, top_p=top_p, compile=compile, linear=linear)
    return run(prepare(request), on_tokens)
