"""What a `--draft` value names, parsed in one place (the API, the CLI and the bench all ask here).

  ngram        the model-free n-gram drafter (also what None and "auto" mean)
  ngram+SPEC   the n-gram drafter where the text repeats itself, SPEC elsewhere (`HybridDrafter`)
  ngram+STORE[+SPEC]  the same, the n-gram drafter also looking up a datastore of the target's own
               text where the text so far has no long match (datastore.py; an alias such as
               smollm2-135m-store or a directory with datastore.json)
  SPEC         a draft model: a draft LM (alias, directory, .gguf file or hub id) or a feature head
               (a directory with feature_head.json, or a shipped alias such as smollm2-135m-eagle)

Nothing here loads a model; `draftload.load_draft` does, from a `DraftSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .embedded import EMBEDDED_DRAFTS
from .errors import DynaTreeError

NGRAM = "ngram"
HYBRID = "ngram+"  # --draft ngram+MODEL
AUTO = (None, "auto")  # the method's default drafter
HEAD_CONFIG_FILE = "feature_head.json"  # what makes a directory a feature head (featurehead.py)
STORE_CONFIG_FILE = "datastore.json"  # what makes a directory a datastore (datastore.py)


@dataclass(frozen=True)
class DraftSpec:
    """A parsed --draft value."""

    text: str  # as given ("ngram" for None/"auto")
    ngram: bool  # the n-gram drafter takes part
    model: str | None  # the draft model's spec (draft LM or feature head), if any
    store: str | None = None  # the datastore the n-gram drafter also reads, if any

    @property
    def model_alone(self) -> bool:
        """A draft model without the n-gram drafter (what hf-assisted and draft-LM-only methods take)."""
        return self.model is not None and not self.ngram


@dataclass(frozen=True)
class Hybrid:
    """A draft model (loaded, or a spec) used together with the n-gram drafter: `ngram+SPEC` once loaded
    (`ngram+STORE+SPEC` with a datastore)."""

    lm: object  # LoadedModel | FeatureHead | str; None: the n-gram drafter alone (with `store`: 'ngram+STORE')
    store: object = None  # a datastore (loaded, or a spec) the n-gram drafter also reads; None: none


def parse(spec: str | None) -> DraftSpec:
    """`spec` as a DraftSpec; an empty spec, or `ngram+` without a model after it, is a one-line error."""
    if isinstance(spec, str):
        spec = spec.strip()
    if spec in AUTO or spec == NGRAM:
        return DraftSpec(NGRAM, True, None)
    if not isinstance(spec, str):
        raise DynaTreeError(f"draft must be a spec string ('ngram', a model, 'ngram+MODEL'), a loaded model or "
                            f"feature head, or Hybrid(...), got {type(spec).__name__}")
    if not spec.strip():
        raise DynaTreeError("the draft spec is empty: pass 'ngram', a draft model, or 'ngram+MODEL'")
    if is_store_spec(spec):
        raise DynaTreeError(f"{spec!r} is a datastore, which the n-gram drafter reads: pass {HYBRID}{spec} "
                            f"(or {HYBRID}{spec}+MODEL)")
    if spec.startswith(HYBRID):
        model, store = _split_store(spec[len(HYBRID):].strip())
        if store is not None and model is None:
            return DraftSpec(HYBRID + store, True, None, store)
        if model in ("", NGRAM):
            raise DynaTreeError(f"{HYBRID}{'STORE+' if store else ''}MODEL needs a draft model after "
                                f"{HYBRID + store + '+' if store else HYBRID!r}, got {spec!r}")
        if model.startswith(HYBRID):
            raise DynaTreeError(f"{HYBRID}MODEL takes one draft model, got {spec!r}")
        if is_store_spec(model) or any(is_store_spec(model[:i].strip()) or is_store_spec(model[i + 1:].strip())
                                       for i, c in enumerate(model) if c == "+"):
            raise DynaTreeError(f"{spec!r}: a datastore comes right after {HYBRID!r}, before the model "
                                f"({HYBRID}STORE+MODEL), and there is one")
        return DraftSpec(HYBRID + (store + "+" if store else "") + model, True, model, store)
    return DraftSpec(spec, False, spec)


def _split_store(rest: str) -> tuple[str | None, str | None]:
    """(model or None, store or None) of what follows 'ngram+': the longest prefix that names a
    datastore (a directory name may hold '+') is the store, what follows its '+' the model."""
    if is_store_spec(rest):
        return None, rest
    cuts = [i for i, c in enumerate(rest) if c == "+"]
    for i in reversed(cuts):
        if is_store_spec(rest[:i].strip()):
            return rest[i + 1:].strip(), rest[:i].strip()
    return rest, None


def spec_path(spec: str) -> Path:
    """Where a shipped alias lives, else the spec as a path."""
    return Path(EMBEDDED_DRAFTS.get(spec, Path(spec).expanduser()))


def is_head_dir(path) -> bool:
    """Whether `path` is a directory holding a feature head."""
    return (Path(path) / HEAD_CONFIG_FILE).is_file()


def is_store_spec(spec) -> bool:
    """Whether a spec names a datastore (a shipped alias or a directory with datastore.json)."""
    if not isinstance(spec, str) or not spec:
        return False
    return (spec_path(spec) / STORE_CONFIG_FILE).is_file()


def head_dir(spec) -> Path | None:
    """The directory of the feature head a draft model spec names (a shipped alias or a path), else None."""
    if not isinstance(spec, str):
        return None
    path = spec_path(spec)
    return path if is_head_dir(path) else None
