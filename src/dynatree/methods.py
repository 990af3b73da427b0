"""The method registry: name -> config dataclass, how it runs, and what draft it needs."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from .config import MethodConfig, cli_flag, field_type
from .errors import DynaTreeError
from .llamacpp import LlamaCppArConfig, LlamaCppLookupConfig
from .peers import HfArConfig, HfAssistedConfig, HfLookupConfig
from .policies.dynatree import DynaTreeConfig, DynaTreePolicy
from .policies.baselines import (
    OptTreeConfig, OptTreePolicy, SpecExecConfig, SpecExecPolicy, SpecInferConfig, SpecInferPolicy,
)
from .policies.beams import DsbdConfig, DsbdPolicy, MtadConfig, MtadPolicy
from .policies.wetap import WetapConfig, WetapPolicy
from .policies.simple import ArConfig, ArPolicy, LinearPolicy, FixedTreeConfig, FixedTreePolicy, LinearConfig


@dataclass(frozen=True)
class Method:
    name: str
    config_cls: type[MethodConfig]  # one dataclass per method; its fields are the method's CLI options
    policy_cls: type | None  # tree policy run by dynatree's engine; None for transformers' generate()
    draft: str  # "none": no draft; "any": a draft LM or the n-gram drafter; "lm": a draft LM only
    summary: str
    engine: str = "dynatree"  # who decodes: "dynatree", or a baseline's own: "transformers", "llama.cpp"
    not_compilable: str | None = None  # why --compile cannot apply to it; None: it can

    @property
    def compilable(self) -> bool:
        return self.not_compilable is None

    @property
    def baseline(self) -> str | None:
        """How a baseline decodes, for messages ("transformers' own generate()"); None for dynatree's methods."""
        return {"transformers": "transformers' own generate()", "llama.cpp": "llama.cpp's own decoding"}.get(self.engine)


METHODS = {
    m.name: m
    for m in [
        Method("ar", ArConfig, ArPolicy, "none", "plain decoding (greedy, or sampled with --sample), one target pass per token"),
        Method("linear", LinearConfig, LinearPolicy, "any", "draft chain of K tokens, verified in one pass"),
        Method("fixed-tree", FixedTreeConfig, FixedTreePolicy, "any", "static top-B tree to depth D, pruned, budgeted"),
        Method("dynatree", DynaTreeConfig, DynaTreePolicy, "any", "confidence-aware adaptive tree (the DynaTree paper's method)"),
        Method("wetap", WetapConfig, WetapPolicy, "any",
               "entropy-width tree + prob/length pruning (the WETAP paper); --verify beam is LOSSY when sampling"),
        Method("specinfer", SpecInferConfig, SpecInferPolicy, "any", "fork-shaped tree: WIDTH chains from the root"),
        Method("specexec", SpecExecConfig, SpecExecPolicy, "any", "budgeted best-first expansion of likely continuations"),
        Method("opt-tree", OptTreeConfig, OptTreePolicy, "any", "budgeted tree maximising expected accepted length"),
        Method("dsbd", DsbdConfig, DsbdPolicy, "any", "beam tree (WIDTH beams x DEPTH), one target beam per layer (DSBD)"),
        Method("mtad", MtadConfig, MtadPolicy, "any",
               "beam tree verified by joint likelihood (MTAD); LOSSY when sampling"),
        Method("hf-ar", HfArConfig, None, "none", "transformers generate() (greedy, or sampled with --sample)", "transformers"),
        Method("hf-assisted", HfAssistedConfig, None, "lm", "transformers assisted generation with a draft LM",
               "transformers"),
        Method("hf-lookup", HfLookupConfig, None, "none", "transformers prompt-lookup decoding", "transformers",
               "transformers' prompt-lookup decoding with a static cache fails inside the compiled graph "
               "(an index out of bounds in inductor's kernel)"),
        Method("llamacpp-ar", LlamaCppArConfig, None, "none",
               "llama.cpp greedy on the target's GGUF file (pip install llama-cpp-python)", "llama.cpp",
               "llama.cpp runs its own native kernels; there is no torch graph to compile"),
        Method("llamacpp-lookup", LlamaCppLookupConfig, None, "none",
               "llama.cpp's prompt-lookup speculative decoding on the target's GGUF file (llama-cpp-python)",
               "llama.cpp", "llama.cpp runs its own native kernels; there is no torch graph to compile"),
    ]
}


def lossy_reason(config: MethodConfig) -> str | None:
    """Why a method's config makes sampled output deviate from the target's distribution, or None."""
    return config.lossy()


def is_lossy(config: MethodConfig) -> bool:
    return lossy_reason(config) is not None


def get_method(name: str) -> Method:
    if not isinstance(name, str):
        raise DynaTreeError(f"method must be a method's name (one of {', '.join(METHODS)}), got {name!r}"
                            + (": run one method at a time (the CLI's --compare runs several)"
                               if isinstance(name, (list, tuple)) else ""))
    if name not in METHODS:
        raise DynaTreeError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def served_methods() -> list[str]:
    """The methods dynatree's own engine decodes with (those the server runs), not the peers' baselines."""
    return [name for name, m in METHODS.items() if m.policy_cls is not None]


def method_option_names() -> set[str]:
    """Every option any method takes (its config's fields)."""
    return {f.name for m in METHODS.values() for f in dataclasses.fields(m.config_cls)}


def make_config(method: str, **options):
    """Build and validate a method's config; options not belonging to the method are errors."""
    cls = get_method(method).config_cls
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in options:
        if key not in known:
            flag = cli_flag(key)
            valid = ", ".join(cli_flag(k) for k in known) or "none"
            raise DynaTreeError(f"option {flag} does not apply to method {method!r} (its options: {valid})")
    config = cls(**{key: _coerce(method, known[key], value) for key, value in options.items()})
    config.validate()
    return config


def _coerce(method: str, field: dataclasses.Field, value):
    """Accept what the CLI and Python callers naturally pass; reject anything else clearly."""
    kind = field_type(field)
    flag = cli_flag(field.name)
    if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)  # numpy's integers too
    if kind is int and isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise DynaTreeError(f"{flag} of method {method!r} must be {kind.__name__}, got {value!r}")
