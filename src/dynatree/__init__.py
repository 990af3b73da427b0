"""dynatree: exact tree-based speculative decoding for HuggingFace causal LMs.

The names below are imported on first use (PEP 562), so `import dynatree.cli` and
`dynatree --help` do not pay for torch and transformers before they are needed.
"""

from importlib import import_module

_EXPORTS = {
    "encode_prompt": "api",
    "generate": "api",
    "Decoder": "decode",
    "DynaTreeError": "errors",
    "METHODS": "methods",
    "make_config": "methods",
    "DEFAULT_TARGET": "models",
    "LoadedModel": "models",
    "load_model": "models",
    "Tree": "tree",
    "TreeBuilder": "tree",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dynatree' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
