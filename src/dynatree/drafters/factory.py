"""The one place a loaded draft becomes a drafter (`draftload.load_draft` loads and checks it)."""

from __future__ import annotations

from ..draftload import Draft
from ..featurehead import FeatureHead
from ..runtime import LoadedModel
from ..window import KVWindow
from .base import Drafter
from .feature import FeatureDrafter
from .hybrid import HybridDrafter
from .lm import LMDrafter
from .ngram import NgramDrafter


def make_drafter(draft: Draft, target: LoadedModel, ngram_max: int, window: KVWindow | None = None,
                 compile: bool = False) -> Drafter:
    """A fresh drafter for one run: the n-gram drafter, a draft LM's or a feature head's drafter, or
    both (`HybridDrafter`: n-gram copying where the text repeats, the model elsewhere). `compile`:
    the model's steps through torch.compile, as the target's are in a `--compile` run."""
    model, ngram = draft.model, draft.ngram
    ngrams = (NgramDrafter(max_n=ngram_max, vocab_size=target.vocab_size, store=draft.store)
              if ngram or model is None else None)
    if model is None:
        return ngrams
    if isinstance(model, FeatureHead):
        own = FeatureDrafter(model, target, window=window, compile=compile)
    else:
        own = LMDrafter(model, vocab_limit=target.vocab_size, window=window, compile=compile)
    return HybridDrafter(ngrams, own) if ngram else own
