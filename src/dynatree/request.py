"""One decode request, as every entry point states it, validated once.

Python callers (`dynatree.generate`), the CLI (`dynatree generate`, one request per compared
method), the bench (one per variant and prompt) and the server (one per HTTP request) all build
a `Request`. `Request.check()` validates every field that needs no model, before anything
loads, and returns a `Checked` request (the method's config, the KV window, the sampling
settings resolved); `api.prepare` then loads the models and checks what needs them (the draft
against the target, prompt ids against the vocabulary, the context length).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from .draftload import Draft
from .draftspec import AUTO, HYBRID, Hybrid, is_store_spec, parse
from .embedded import DEFAULT_TARGET
from .errors import DynaTreeError
from .featurehead import FeatureHead
from .kernels import check_linear_kernel
from .methods import Method, get_method, make_config
from .models import resolve_dtype
from .runtime import LoadedModel
from .sampling import SamplingConfig, sampling_config
from .weights import weights_dtype
from .window import KVWindow


@dataclass
class Request:
    """One decode: what to run, on which models, with which prompt and settings."""

    prompt: str | list[dict] | None = None  # the text to continue (the user turn with `chat`), or a conversation
    # ({"role", "content"} dicts, through the chat template); or give prompt_ids
    method: str = "dynatree"  # a registered method (dynatree.METHODS)
    options: dict = field(default_factory=dict)  # the method's options by config field name, e.g. {"d0": 4}
    target: str | LoadedModel = DEFAULT_TARGET  # model spec (alias, directory, .gguf file, hub id) or a loaded model
    draft: object = None  # 'ngram', 'ngram+MODEL', a model spec, a loaded draft LM or head, Hybrid(...), a Draft; None: default
    prompt_ids: list[int] | None = None  # token ids instead of `prompt`, used as they are (a 1-D integer tensor too)
    max_new_tokens: int = 128  # at most this many new tokens
    ignore_eos: bool = False  # go on after an end-of-sequence token
    chat: bool = False  # wrap `prompt` in the tokenizer's chat template
    device: str | torch.device | None = None  # where specs are loaded (None: cpu; a loaded target's own device)
    dtype: str | None = None  # dtype specs are loaded in; None: float32 (bfloat16 for low-bit weights)
    weights: str | None = None  # format of a target loaded here: dense, q4, int8, auto (weights.py); None: dense
    seed: int = 0  # seeds sampling (and any random choice of a run)
    ngram_max: int | None = None  # longest n-gram the n-gram drafter matches (None: NGRAM_MAX); only where it runs
    kv_window: str | KVWindow | None = None  # attention-sink KV window 'SINK,RECENT', or None (full caches)
    sample: bool = False  # sample (lossless verification) instead of greedy decoding
    temperature: float | None = None  # sampling temperature (only with sample)
    top_k: int | None = None  # keep the k most likely tokens (only with sample)
    top_p: float | None = None  # nucleus sampling mass (only with sample)
    compile: bool | None = None  # decode steps through torch.compile (hf-ar: transformers' static cache + compile); None: the loaded target's own setting
    linear: str = "auto"  # linear-layer kernels of models loaded here: auto, onednn, stock (kernels.py)
    stop: str | list[str] | None = None  # stop strings: the decode ends at the first, the text just before it
    logprobs: int | None = None  # each new token's log-probability under the target with this many alternatives (0-20); None: none

    def check(self) -> Checked:
        """Every check that needs no model, each a one-line DynaTreeError naming the argument
        (and its flag); the method's config, window and sampling settings resolved."""
        spec = get_method(self.method)
        if not isinstance(self.options, dict):
            raise DynaTreeError(f"options must be a dict of the method's options, got {type(self.options).__name__}")
        config = make_config(self.method, **self.options)
        _positive_int("max_new_tokens (--max-new-tokens)", self.max_new_tokens)
        if self.ngram_max is not None:
            _positive_int("ngram_max (--ngram-max)", self.ngram_max)
        for name, flag in (("ignore_eos", "--ignore-eos"), ("chat", "--chat"), ("sample", "--sample")):
            if not isinstance(getattr(self, name), bool):  # ("yes" or 0 would be read as a truth value)
                raise DynaTreeError(f"{name} ({flag}) must be True or False, got {getattr(self, name)!r}")
        if self.compile is not None and not isinstance(self.compile, bool):
            raise DynaTreeError(f"compile (--compile) must be True, False or None, got {self.compile!r}")
        if not is_int(self.seed) or not -2**63 <= self.seed < 2**64:
            raise DynaTreeError(f"seed (--seed) must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.prompt is not None and self.prompt_ids is not None:
            raise DynaTreeError("give either prompt (text) or prompt_ids (token ids), not both")
        if self.prompt_ids is None and not isinstance(self.prompt, (str, list)):
            raise DynaTreeError("prompt must be a string or a list of {'role', 'content'} messages (or give "
                                f"prompt_ids), got {type(self.prompt).__name__}")
        if isinstance(self.prompt, list) and self.prompt and all(is_int(t) for t in self.prompt):
            raise DynaTreeError("prompt is a list of integers: give token ids as prompt_ids (a prompt list is a "
                                "conversation of {'role', 'content'} messages)")
        if self.chat and self.prompt_ids is not None:
            raise DynaTreeError("chat (--chat) wraps a text prompt in the chat template, but prompt_ids are used as "
                                "they are: give the prompt as text (or as a list of messages), or leave chat out")
        if isinstance(self.prompt, list):
            _check_messages(self.prompt)
        elif self.prompt_ids is None and not self.prompt.strip():
            raise DynaTreeError("the prompt is empty")  # before any model loads (encode_prompt says so too)
        if self.dtype is not None:
            resolve_dtype(self.dtype)  # an unknown name, before any model loads
        if isinstance(self.kv_window, KVWindow):
            window = self.kv_window.validated()
        elif self.kv_window is None or isinstance(self.kv_window, str):
            window = KVWindow.parse(self.kv_window)
        else:
            raise DynaTreeError("kv_window (--kv-window) must be 'SINK,RECENT' or a KVWindow, got "
                                f"{type(self.kv_window).__name__}")
        sampling = sampling_config(self.sample, self.temperature, self.top_k, self.top_p)
        stops = _stops(self.stop)
        if self.logprobs is not None:
            if not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise DynaTreeError(f"logprobs (--logprobs) must be an integer from 0 to {MAX_LOGPROBS} (the most likely "
                                    f"alternatives to list beside each token) or None, got {self.logprobs!r}")
            if spec.policy_cls is None:
                raise DynaTreeError(f"logprobs (--logprobs) come from dynatree's decoder; {self.method!r} runs "
                                    f"{spec.baseline}")
        if window is not None and spec.policy_cls is None:
            raise DynaTreeError(f"kv_window (--kv-window) is not available for {self.method!r} ({spec.baseline})")
        if self.compile and not spec.compilable:
            raise DynaTreeError(f"compile (--compile) does not apply to {self.method!r}: {spec.not_compilable}")
        if self.device is not None and not isinstance(self.device, (str, torch.device)):
            raise DynaTreeError(f"device (--device) must be a string such as 'cpu' or 'cuda' (or a torch.device), "
                                f"got {self.device!r}")
        if not isinstance(self.target, (str, LoadedModel)):
            raise DynaTreeError(f"target must be a model spec string or a LoadedModel, got {type(self.target).__name__}")
        check_linear_kernel(self.linear)
        self._check_weights()
        self._check_draft(spec)
        self._check_ngram_max(spec)
        return Checked(self, spec, config, window, sampling, stops)

    def _check_weights(self) -> None:
        """The weight format exists and takes the dtype; a loaded target keeps its own format."""
        if self.weights is None:
            return
        weights_dtype(self.weights, self.dtype)
        if isinstance(self.target, LoadedModel) and self.weights not in ("auto", self.target.weights):
            raise DynaTreeError(f"weights (--weights) {self.weights!r} given, but the target is already loaded with "
                                f"{self.target.weights!r} weights; load it with load_model(..., weights=...)")

    def _check_ngram_max(self, spec: Method) -> None:
        """ngram_max given where no n-gram drafter runs is an error, not a setting silently unused (what
        the draft spec alone decides; `api.prepare` checks a loaded draft)."""
        if self.ngram_max is None:
            return
        draft = self.draft
        fix = "leave ngram_max out"
        if spec.policy_cls is None or spec.draft == "none":
            why = f"{self.method!r} " + (f"runs {spec.baseline}" if spec.policy_cls is None else "drafts nothing")
        elif isinstance(draft, (LoadedModel, FeatureHead)):
            why, fix = f"the draft {draft.name!r} runs alone", fix + ", or draft with Hybrid(model)"
        elif isinstance(draft, Hybrid) or isinstance(draft, Draft) or parse(draft).ngram:
            return  # (a Draft is checked by api.prepare, where it is known whether it holds the n-gram drafter)
        else:
            why, fix = f"the draft {draft!r} runs alone", fix + f", or draft with 'ngram+{draft}'"
        raise DynaTreeError(f"ngram_max (--ngram-max) applies only where dynatree's n-gram drafter runs; {why} ({fix})")

    def _check_draft(self, spec: Method) -> None:
        """The draft spec parses and suits the method (loaded drafts are checked against the target later)."""
        draft = self.draft
        if spec.draft == "none":
            if draft not in AUTO:
                raise DynaTreeError(f"draft (--draft) does not apply to {self.method!r}: it drafts nothing")
            return
        if isinstance(draft, Draft):  # loaded and checked against its target (by draftload.load_draft)
            if spec.draft == "lm" and not draft.model_alone:
                raise DynaTreeError(f"method {self.method!r} needs a draft language model alone, not {draft.name!r}")
            return
        if isinstance(draft, Hybrid):
            if spec.draft == "lm":
                raise DynaTreeError(f"method {self.method!r} takes a draft language model alone, not {HYBRID}MODEL")
            if isinstance(draft.store, str) and not is_store_spec(draft.store):
                raise DynaTreeError(f"Hybrid(store=...) names no datastore: {draft.store!r} (an alias or a directory "
                                    "with datastore.json)")
            if isinstance(draft.lm, str):
                parsed = parse(HYBRID + draft.lm)  # the same rules as --draft ngram+MODEL
                if parsed.store is not None or parsed.model is None:
                    raise DynaTreeError(f"Hybrid(lm) takes a draft model, got {draft.lm!r}; give a datastore as "
                                        "Hybrid(lm, store=STORE)")
            elif draft.lm is not None and not isinstance(draft.lm, (LoadedModel, FeatureHead)):  # None: store alone
                raise DynaTreeError(f"Hybrid(...) takes a draft model spec or a loaded model, got {type(draft.lm).__name__}")
            return
        if not isinstance(draft, (LoadedModel, FeatureHead)):
            parsed = parse(draft)  # a bad spec or type is a one-line error naming it
            if parsed.model is None and spec.draft == "lm":
                raise DynaTreeError(f"method {self.method!r} needs a draft language model: pass --draft MODEL"
                                    if draft in AUTO else
                                    f"method {self.method!r} needs a draft language model, not the n-gram drafter")
            if parsed.ngram and parsed.model is not None and spec.draft == "lm":
                raise DynaTreeError(f"method {self.method!r} takes a draft language model alone, not {HYBRID}MODEL")


@dataclass(frozen=True)
class Checked:
    """A request that passed `Request.check()`, with what the check resolved."""

    request: Request
    method: Method  # the registered method
    config: object  # the method's validated config dataclass
    window: KVWindow | None  # the KV window, or None
    sampling: SamplingConfig | None  # the sampling settings, or None (greedy)
    stops: tuple[str, ...] = ()  # the stop strings, validated

    def bind(self, target: LoadedModel, draft: Draft | None, prompt_ids: list[int]) -> Checked:
        """This checked request with its models loaded and its prompt encoded by the caller (the CLI
        loads them once for several methods): nothing checked before is checked again; `api.prepare`
        checks the draft, the prompt ids and the context length against the target, as always."""
        if not isinstance(target, LoadedModel):
            raise DynaTreeError(f"bind() takes a loaded target, got {type(target).__name__}")
        if draft is not None and not (isinstance(draft, Draft) and draft.target is target):
            raise DynaTreeError("bind() takes a Draft loaded for this target (draftload.load_draft), or None")
        if (draft is None) != (self.method.draft == "none"):
            raise DynaTreeError(f"{self.request.method!r} " + ("drafts: bind() needs its Draft" if draft is None
                                                                else "drafts nothing: bind() takes no Draft"))
        request = dataclasses.replace(self.request, target=target, draft=draft, prompt=None, prompt_ids=prompt_ids)
        if draft is not None:
            request._check_draft(self.method)  # a Draft of the wrong kind for the method (hybrid for hf-assisted)
        return dataclasses.replace(self, request=request)


Role = Literal["system", "developer", "user", "assistant"]  # the roles a conversation's messages take
ROLES = get_args(Role)
# OpenAI's API calls the system message `developer` in newer clients; chat templates know only `system`
TEMPLATE_ROLES = {"developer": "system"}


def template_role(role: str) -> str:
    """A message's role as chat templates take it (`developer` read as `system`)."""
    return TEMPLATE_ROLES.get(role, role)


def template_messages(messages: list[dict]) -> list[dict]:
    """A checked conversation as the chat template takes it (`template_role`)."""
    return [{"role": template_role(m["role"]), "content": m["content"]} for m in messages]


def _check_messages(messages: list) -> None:
    """A conversation: {"role", "content"} dicts, roles from ROLES, string contents, not all blank."""
    if not messages:
        raise DynaTreeError("the prompt is an empty conversation (give at least one message)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise DynaTreeError(f"prompt[{i}] must be a dict with the keys 'role' and 'content', got {m!r}"[:300])
        if m["role"] not in ROLES:
            raise DynaTreeError(f"prompt[{i}]['role'] must be one of {', '.join(ROLES)}, got {m['role']!r}")
        if not isinstance(m["content"], str):
            raise DynaTreeError(f"prompt[{i}]['content'] must be a string, got {type(m['content']).__name__}")
    if not any(m["content"].strip() for m in messages):
        raise DynaTreeError("the prompt is empty (every message's content is blank)")


MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs bound)


def is_int(value) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _stops(stop) -> tuple[str, ...]:
    """`stop` as a tuple of non-empty strings (one string or a list of them)."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop if isinstance(stop, (list, tuple)) else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise DynaTreeError(f"stop (--stop) must be a string or a list of strings, got {stop!r}")
    if not all(stops):
        raise DynaTreeError("stop (--stop) strings must not be empty (an empty one would stop at once)")
    return tuple(stops)


def _positive_int(name: str, value) -> None:
    if not is_int(value) or value < 1:
        raise DynaTreeError(f"{name} must be a positive integer, got {value!r}")
