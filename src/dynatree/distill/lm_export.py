"""Writing a distilled draft LM: a transformers checkpoint (`--draft out/` loads it), the tokenizer,
`distill.json` (command, config, data, timings, machine, final metrics) and a README."""

from __future__ import annotations

import json
from pathlib import Path

from ..models import resolve_dtype
from .common import record


def write_draft(model, target, out: Path, cfg, info, final, history, timings, command) -> dict:
    model.eval()
    model.to(resolve_dtype(cfg.save_dtype)).save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    summary = record("lm", target, cfg, command, parameters=params, data=info, held_out=final, history=history,
                     timings=timings)
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    agreement = ", ".join(f"{k} {v['agreement']:.1%}" for k, v in final.items()) or "n/a"
    (out / "README.md").write_text(
        f"# Draft model for {target.name}\n\nDistilled with `dynatree distill` "
        f"({params / 1e6:.1f}M parameters, {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}); "
        f"held-out top-1 agreement with the target: {agreement}.\n"
        f"Use: `dynatree generate PROMPT --target {target.name} --draft {out}`. Details in distill.json.\n"
    )
    return summary
