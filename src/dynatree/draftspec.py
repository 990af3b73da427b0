"""What a `--draft` value names, parsed in one place (the API, the CLI and the bench all ask here).

  ngram        the model-free n-gram drafter (also what None and "auto" mean)
  ngram+SPEC   the n-gram drafter where the text repeats itself, SPEC elsewhere (`HybridDrafter`)
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


@dataclass(frozen=True)
class DraftSpec:
    """A parsed --draft value."""

    text: str  # as given ("ngram" for None/"auto")
    ngram: bool  # the n-gram drafter takes part
    model: str | None  # the draft model's spec (draft LM or feature head), if any

    @property
    def model_alone(self) -> bool:
        """A draft model without the n-gram drafter (what hf-assisted and draft-LM-only methods take)."""
        return self.model is not None and not self.ngram


@dataclass(frozen=True)
class Hybrid:
    """A draft model (loaded, or a spec) used together with the n-gram drafter: `ngram+SPEC` once loaded."""

    lm: object  # LoadedModel | FeatureHead | str


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
    if spec.startswith(HYBRID):
        model = spec[len(HYBRID):].strip()
        if model in ("", NGRAM):
            raise DynaTreeError(f"{HYBRID}MODEL needs a draft model after {HYBRID!r}, got {spec!r}")
        if model.startswith(HYBRID):
            raise DynaTreeError(f"{HYBRID}MODEL takes one draft model, got {spec!r}")
        return DraftSpec(HYBRID + model, True, model)
    return DraftSpec(spec, False, spec)


def is_head_dir(path) -> bool:
    """Whether `path` is a directory holding a feature head."""
    return (Path(path) / HEAD_CONFIG_FILE).is_file()


def head_dir(spec) -> Path | None:
    """The directory of the feature head a draft model spec names (a shipped alias or a path), else None."""
    if not isinstance(spec, str):
        return None
    path = EMBEDDED_DRAFTS.get(spec, Path(spec).expanduser())
    return path if is_head_dir(path) else None
