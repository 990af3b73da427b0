"""Drafters propose next-token candidates for tree nodes (see `base.Drafter`).

Imported on first use (PEP 562): the policies need only `base`, and the feature head's drafter
pulls in transformers' Llama modules."""

from ..lazy import lazy_exports

_EXPORTS = {
    "Drafter": "base",
    "Proposal": "base",
    "FeatureDrafter": "feature",
    "HybridDrafter": "hybrid",
    "LMDrafter": "lm",
    "NgramDrafter": "ngram",
    "make_drafter": "factory",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
