"""`dynatree distill --target T --out DIR [options]`: one flag per DistillConfig field."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .config import cli_flag, field_type
from .distill import DistillConfig
from .errors import check_out_dir


def add_distill_command(sub) -> None:
    p = sub.add_parser(
        "distill",
        help="train a small draft model for a target by distillation",
        description="Train a draft LM that shares the target's tokenizer, from the target's top-k next-token "
        "probabilities on a corpus and on its own greedy generations. Resumable (--resume); the output "
        "directory loads with --draft DIR.",
    )
    p.add_argument("--target", default=None, help="target model: hub id, local directory, .gguf file or embedded alias")
    p.add_argument("--out", required=True, help="output directory (draft, checkpoints, distill.json)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (same options required)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto [cpu]")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    g = p.add_argument_group("distillation options (defaults in brackets)")
    for f in dataclasses.fields(DistillConfig):
        kind = field_type(f)
        help_text = f"{f.metadata['help']} [{f.default}]"
        if kind is bool:
            g.add_argument(cli_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                           help=help_text)
        else:
            g.add_argument(cli_flag(f.name), dest=f.name, type=kind, default=f.default,
                           metavar=kind.__name__.upper(), help=help_text)
    p.set_defaults(run=cmd_distill)


def cmd_distill(args) -> int:
    from .distill import distill
    from .models import DEFAULT_TARGET, load_model

    cfg = DistillConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig)})
    cfg.validate()  # before the target is loaded: bad options fail at once
    check_out_dir(args.out)
    target = load_model(args.target or DEFAULT_TARGET, device=args.device, dtype="float32")
    summary = distill(target, Path(args.out), cfg, resume=args.resume, progress=not args.quiet,
                      command=["dynatree", *args.argv])
    held = ", ".join(f"{k}: loss {v['loss']:.3f}, agreement {v['agreement']:.1%}" for k, v in summary["held_out"].items())
    print(f"draft written to {args.out} ({summary['parameters'] / 1e6:.1f}M parameters; held out {held})")
    return 0
