"""Writing a trained feature head: the head (`--draft out/` loads it), `distill.json` (command,
config, data, held-out figures, history, timings, machine) and a README."""

from __future__ import annotations

import json
from pathlib import Path

from ..featurehead import output_signature
from .common import record


def write_head(head, target, out: Path, cfg, info: dict, final: dict, history: list, timings: dict,
               command: list[str] | None) -> dict:
    """Save the head and its record, signed for `target` (`output_signature`: whether it was new or
    continued from another model's head); return the summary written to out/distill.json."""
    head.config.output_signature = output_signature(target.model)
    summary = record("eagle", target, cfg, command, parameters=sum(p.numel() for p in head.parameters()), data=info,
                     held_out=final, history=history, timings=timings)
    head.eval().save(out, extra={"trained": {"held_out": final, "steps": cfg.steps}})
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    depth = " / ".join(f"{a:.1%}" for a in final["agreement_by_depth"])
    answers = ""
    if final.get("answer_agreement_by_depth"):  # the rows drafting meets: the target's answers
        answers = "; on answer tokens only: " + " / ".join(f"{a:.1%}" for a in final["answer_agreement_by_depth"])
    (out / "README.md").write_text(
        f"# Feature head for {target.name}\n\nTrained with `dynatree distill --kind eagle` "
        f"({summary['parameters'] / 1e6:.1f}M parameters: one decoder layer over the target's features, "
        f"proposing from the {len(head.vocab_ids)} most frequent tokens, {final['vocab_coverage']:.1%} of held-out labels).\n"
        f"Held-out top-1 agreement with the target at draft depth 1 / 2 / ...: {depth}"
        f"{answers}.\n"
        f"Use: `dynatree generate PROMPT --chat --target {target.name} --draft {out}`. Details in distill.json.\n"
    )
    return summary
