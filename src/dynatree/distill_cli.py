"""`dynatree distill --target T --out DIR [--kind lm|eagle] [options]`: one flag per config field.

`--kind lm` (distill.lm_data.DistillConfig) trains a small draft LM; `--kind eagle`
(distill.eagle_data.EagleConfig) a feature head; `--kind store` (distill.store_build.StoreConfig)
builds a datastore of the target's own answers for the n-gram drafter (no training). Options both kinds have share a flag; an option
of the other kind only is a one-line error, never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .config import argparse_help, cli_flag, field_type
from .draftspec import STORE_CONFIG_FILE, is_head_dir
from .distill.lm_data import DistillConfig
from .distill.eagle_data import EagleConfig
from .distill.store_build import StoreConfig
from .errors import DynaTreeError, check_out_dir

KINDS = {"lm": DistillConfig, "eagle": EagleConfig, "store": StoreConfig}
KIND_NAMES = {"lm": "draft LM", "eagle": "feature head", "store": "datastore"}


def add_distill_command(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="train a draft for a target: a small LM (--kind lm), a feature head (--kind eagle), or build a "
        "datastore of its own answers (--kind store)",
        description="--kind lm: a draft LM sharing the target's tokenizer, from the target's top-k next-token "
        "probabilities on a corpus and on its own greedy generations. --kind eagle: a feature head (one decoder "
        "layer over the target's hidden states, EAGLE-style) from the target's own chat answers. --kind store: those "
        "answers indexed for the n-gram drafter (--draft ngram+DIR). Training resumes with --resume; a stopped "
        "data build resumes from its saved parts by itself. A draft LM or head loads with --draft DIR.",
    )
    p.add_argument("--kind", choices=list(KINDS), default="lm", help="what to train [lm]")
    p.add_argument("--target", default=None, help="target model: hub id, local directory, .gguf file or embedded "
                   "alias [smollm2-135m]")
    p.add_argument("--out", required=True, help="output directory (draft, checkpoints, distill.json)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (same options; only --steps may change)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto [cpu]")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    g = p.add_argument_group("options (defaults in brackets, per kind where they differ)")
    fields: dict[str, dict[str, dataclasses.Field]] = {}
    for kind, cls in KINDS.items():
        for f in dataclasses.fields(cls):
            fields.setdefault(f.name, {})[kind] = f
    for name, per_kind in fields.items():
        first = next(iter(per_kind.values()))
        kind_type = field_type(first)
        defaults = {k: f.default for k, f in per_kind.items()}
        if len(per_kind) == len(KINDS) and len(set(map(repr, defaults.values()))) == 1:
            shown = f"[{first.default}]"
        else:
            shown = "[" + ", ".join(f"{k}: {v if v != '' else 'none'}" for k, v in defaults.items()) + "]"
        help_text = argparse_help(f"{_per_kind_help(per_kind)} {shown}")
        if kind_type is bool:
            g.add_argument(cli_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            g.add_argument(cli_flag(name), dest=name, type=kind_type, default=None, metavar=kind_type.__name__.upper(),
                           help=help_text)
    p.set_defaults(run=cmd_distill)


def _per_kind_help(per_kind: dict[str, dataclasses.Field]) -> str:
    """An option's help: its one text when every kind having it says the same, else each kind's own
    text after its name ('lm: ...; eagle, store: ...'); an option of some kinds only says which."""
    texts: dict[str, list[str]] = {}
    for kind, f in per_kind.items():
        texts.setdefault(f.metadata["help"], []).append(kind)
    if len(texts) == 1:
        only = "" if len(per_kind) == len(KINDS) else f"({', '.join(per_kind)} only) "
        return only + next(iter(texts))
    return "; ".join(f"{', '.join(kinds)}: {text}" for text, kinds in texts.items())


def options_of(kind: str) -> set[str]:
    """The option names of one kind's config."""
    return {f.name for f in dataclasses.fields(KINDS[kind])}


def config_of(args):
    """The chosen kind's config from the given flags; a flag of the other kind only is an error."""
    cls = KINDS[args.kind]
    own = options_of(args.kind)
    others = set().union(*map(options_of, KINDS)) - own
    given_other = [cli_flag(n) for n in sorted(others) if getattr(args, n, None) is not None]
    if given_other:
        verb = "does" if len(given_other) == 1 else "do"
        raise DynaTreeError(f"{', '.join(given_other)} {verb} not apply to --kind {args.kind}")
    return cls(**{n: getattr(args, n) for n in own if getattr(args, n, None) is not None})


def held_kind(out: Path) -> str | None:
    """The kind of draft `out` already holds (from the file that makes a directory one, from its
    distillation record, or, for a run stopped before its export, from its checkpoint's options), or None."""
    if is_head_dir(out):
        return "eagle"
    if (out / STORE_CONFIG_FILE).is_file():
        return "store"
    if (out / "config.json").is_file():
        return "lm"
    try:
        kind = json.loads((out / "distill.json").read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind in KINDS:
        return kind
    return checkpoint_kind(out / "checkpoint.pt") if (out / "checkpoint.pt").is_file() else None


def checkpoint_kind(path: Path) -> str | None:
    """The kind whose options a training checkpoint records (the fields only that kind's config has)."""
    import pickle

    import torch

    try:
        options = set(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("config", {}))
    except (OSError, RuntimeError, ValueError, AttributeError, pickle.UnpicklingError):
        return None
    lm = len(options & (options_of("lm") - options_of("eagle")))  # options only the draft LM has
    eagle = len(options & (options_of("eagle") - options_of("lm")))
    return "lm" if lm > eagle else "eagle" if eagle > lm else None


def check_out_kind(out: Path, kind: str, resume: bool) -> None:
    """Another kind's draft in `out` is refused before any work (it would be overwritten, or its files
    mixed with this kind's); `--resume` with no checkpoint says training starts afresh."""
    held = held_kind(out)
    if held is not None and held != kind:
        raise DynaTreeError(f"--out {str(out)!r} holds a {KIND_NAMES[held]} (--kind {held}); --kind {kind} would "
                            "overwrite it: choose another --out")
    if resume and not (out / "checkpoint.pt").is_file():
        print(f"dynatree: {out} has no checkpoint.pt to resume: training starts from step 0 (saved data parts "
              "are still reused)", file=sys.stderr)


# oneDNN, and ideep in front of it (PyTorch's CPU bfloat16 and packed float32 products), keep a compiled primitive
# per product shape, up to 1024 each and several MB apiece. Decoding meets few shapes (one row, tree sizes) and
# gains from keeping them all; distillation meets new ones nearly every batch (packed training rows, labelling
# batches). These bound both caches for `distill`, unless the user set them; the libraries read them at their
# first product, which comes after `cmd_distill` starts. Only part of a long training run's growth: the head's
# bfloat16 attention keeps its own per-shape state that no variable bounds (docs/results/eagle-train-speed,
# "Memory": still 13.6 -> 20.6 GB in ~110 steps with these set).
DISTILL_CACHE_CAPACITY = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"}


def bound_kernel_caches() -> dict[str, str]:
    """Set `DISTILL_CACHE_CAPACITY`'s variables where the environment does not; what they are now."""
    for name, value in DISTILL_CACHE_CAPACITY.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in DISTILL_CACHE_CAPACITY}


def cmd_distill(args) -> int:
    bound_kernel_caches()  # before anything runs a product (the target's load probes oneDNN)
    from .models import DEFAULT_TARGET, load_model

    cfg = config_of(args)
    cfg.validate()  # before the target is loaded: bad options fail at once
    if args.kind == "store" and args.resume:
        raise DynaTreeError("--resume does not apply to --kind store: nothing is trained, and a stopped build "
                            "resumes from its saved answers (--data-dir) by itself")
    check_out_dir(args.out)
    check_out_kind(Path(args.out), args.kind, args.resume)
    target = load_model(args.target or DEFAULT_TARGET, device=args.device, dtype="float32")
    command = ["dynatree", *args.argv]
    if args.kind == "store":
        from .distill.store_build import distill_store

        summary = distill_store(target, Path(args.out), cfg, progress=not args.quiet, command=command)
        print(f"datastore written to {args.out} ({summary['data']['answer_tokens']} answer tokens of "
              f"{summary['data']['sequences']} turns; use --draft ngram+{args.out})")
        return 0
    if args.kind == "eagle":
        from .distill.eagle_train import distill_eagle

        summary = distill_eagle(target, Path(args.out), cfg, resume=args.resume, progress=not args.quiet,
                                command=command)
        depth = " / ".join(f"{a:.1%}" for a in summary["held_out"]["agreement_by_depth"])
        print(f"feature head written to {args.out} ({summary['parameters'] / 1e6:.1f}M parameters; held-out "
              f"agreement by draft depth {depth})")
        return 0
    from .distill.lm_train import distill

    summary = distill(target, Path(args.out), cfg, resume=args.resume, progress=not args.quiet, command=command)
    held = ", ".join(f"{k}: loss {v['loss']:.3f}, agreement {v['agreement']:.1%}" for k, v in summary["held_out"].items())
    print(f"draft written to {args.out} ({summary['parameters'] / 1e6:.1f}M parameters; held out {held})")
    return 0
