"""Drafters propose next-token candidates for tree nodes (see `base.Drafter`).

Imported on first use (PEP 562): the policies need only `base`, and the feature head's drafter
pulls in transformers' Llama modules."""

from importlib import import_module

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


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dynatree.drafters' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
