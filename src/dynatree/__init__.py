"""dynatree: exact tree-based speculative decoding for HuggingFace causal LMs.

The names below are imported on first use (PEP 562), so `import dynatree.cli` and
`dynatree --help` do not pay for torch and transformers before they are needed.
"""

from .lazy import lazy_exports

_EXPORTS = {
    "encode_prompt": "prompts",
    "generate": "api",
    "prepare": "api",
    "run": "api",
    "stream": "streaming",
    "Request": "request",
    "Result": "result",
    "Decoder": "decode",
    "DynaTreeError": "errors",
    "METHODS": "methods",
    "make_config": "methods",
    "DEFAULT_TARGET": "models",
    "LoadedModel": "runtime",
    "load_model": "models",
    "Tree": "tree",
    "TreeBuilder": "tree",
    "Hybrid": "draftspec",  # draft=Hybrid(loaded_lm): n-gram copying backed by a loaded draft
    "Draft": "draftload",
    "load_draft": "draftload",
    "KVWindow": "window",
    "TokenLogprob": "result",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
