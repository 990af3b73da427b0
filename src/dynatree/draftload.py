"""From a --draft value to a checked `Draft`: the one path by which the API, the CLI, the bench
and the server load a draft model (`draftspec.parse` reads the value; `drafters.make_drafter`
turns a `Draft` into the drafter of one run).

A draft model is a draft LM (alias, directory, .gguf file or hub id; it must share the target's
tokenizer) or a feature head (a directory with feature_head.json, or a shipped alias; it must be
built for the target). It is loaded once, in the target's dtype on the target's device, and
checked against the target (a feature head on a q4 target in 4 bits too: featurehead.py); a `Draft` can then be handed to any number of requests. A datastore
(`ngram+STORE...`) is loaded and checked against the target's tokenizer the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from .datastore import Datastore, check_store, load_datastore
from .draftspec import AUTO, NGRAM, Hybrid, head_dir, parse
from .errors import DynaTreeError
from .featurehead import FeatureHead, check_head, load_head, q4_fits, read_config
from .models import check_compatible, load_model
from .runtime import LoadedModel


@dataclass(frozen=True)
class Draft:
    """A --draft value resolved against one target: which drafters run, the draft model loaded."""

    ngram: bool  # the n-gram drafter takes part (alone when `model` is None)
    model: LoadedModel | FeatureHead | None  # the draft LM or feature head, checked against `target`; None: none
    target: LoadedModel  # the target it was checked against
    store: Datastore | None = None  # the datastore the n-gram drafter also reads, checked against `target`

    def __post_init__(self):
        if not self.ngram and self.model is None:
            raise ValueError("a Draft drafts with the n-gram drafter, a model, or both")
        if self.store is not None and not self.ngram:
            raise ValueError("a datastore is read by the n-gram drafter: a Draft with a store has ngram=True")

    @property
    def name(self) -> str:
        """As a --draft value: 'ngram', the model's name, 'ngram+NAME', 'ngram+STORE' or 'ngram+STORE+NAME'."""
        parts = ([NGRAM] if self.ngram else []) + ([self.store.name] if self.store is not None else [])
        return "+".join(parts + ([self.model.name] if self.model is not None else []))

    @property
    def model_alone(self) -> bool:
        """A draft model without the n-gram drafter (what hf-assisted and draft-LM-only methods take)."""
        return self.model is not None and not self.ngram


def load_draft(draft, target: LoadedModel, linear: str = "auto") -> Draft:
    """`draft` resolved against `target`: None/'auto'/'ngram', a spec ('MODEL', 'ngram+MODEL',
    'ngram+STORE', 'ngram+STORE+MODEL'), a loaded draft LM or feature head, `Hybrid(model or spec,
    store=None)`, or a `Draft` (returned as it is when it was checked against this target). A model
    named by a spec is loaded in the target's dtype on its device with `linear` kernels. Any mismatch
    with the target is a one-line DynaTreeError."""
    store = None
    if isinstance(draft, Draft):
        if draft.target is target:
            return draft
        ngram, store, draft = draft.ngram, draft.store, draft.model
    elif isinstance(draft, Hybrid):
        ngram, store, draft = True, draft.store, draft.lm
    elif isinstance(draft, (LoadedModel, FeatureHead)):
        ngram = False
    else:
        parsed = parse(draft)
        ngram, store, draft = parsed.ngram, parsed.store, parsed.model
    store = load_store(store, target)
    if draft is None:
        return Draft(ngram=True, model=None, target=target, store=store)
    model = draft if isinstance(draft, (LoadedModel, FeatureHead)) else load_draft_model(draft, target, linear)
    if isinstance(model, FeatureHead):
        check_head(model, target)
    else:
        check_compatible(target, model)
    return Draft(ngram=ngram, model=model, target=target, store=store)


def load_store(store, target: LoadedModel) -> Datastore | None:
    """The datastore `store` names (a spec, or a loaded Datastore), checked against `target`; None for None."""
    if store is None:
        return None
    if isinstance(store, str):
        store = load_datastore(store)
    elif not isinstance(store, Datastore):
        raise DynaTreeError(f"a datastore is a spec (alias or directory) or a loaded Datastore, got {type(store).__name__}")
    check_store(store, target)
    return store


def load_draft_model(spec: str, target: LoadedModel, linear: str = "auto") -> LoadedModel | FeatureHead:
    """The draft LM or feature head a model spec names, in the target's dtype on its device (unchecked)."""
    if not isinstance(spec, str) or spec in AUTO or spec == NGRAM:
        raise DynaTreeError(f"a draft model spec is a model name or path, got {spec!r}")
    directory = head_dir(spec)
    if directory is not None:
        # a head drafts in 4 bits for a q4 target, where its shapes fit the int4 kernel (featurehead.to_q4)
        weights = "q4" if target.weights == "q4" and q4_fits(read_config(directory)) else "dense"
        return load_head(directory, name=spec, device=target.device, dtype=target.dtype, linear=linear, weights=weights)
    return load_model(spec, device=str(target.device), dtype=target.dtype, linear=linear)
