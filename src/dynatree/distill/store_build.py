"""`dynatree distill --kind store`: a datastore (datastore.py) of the target's own chat answers.

The same on-policy data as `--kind eagle` (the target's greedy answers, through its chat
template, to instruction prompts; Spec-Bench's benchmark questions held out), without features
or training: the answers are indexed for the n-gram drafter to look up (`--draft ngram+OUT`).
Answers files are shared with `--kind eagle` (`--data-dir`): a build one kind made serves the other.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import option, require
from ..datastore import MAX_ORDER, MIN_ORDER, from_answers, save_datastore
from ..runtime import LoadedModel
from .common import record
from .eagle_data import ChatDataConfig, answers_only


@dataclass
class StoreConfig(ChatDataConfig):
    order: int = option(MAX_ORDER, f"longest n-gram the drafter looks up in the datastore ({MIN_ORDER}..{MAX_ORDER}; fewer "
                        "for vocabularies over 65535 tokens, whose ids take more bits of the packed key)")

    def validate(self) -> None:
        super().validate()
        require(MIN_ORDER <= self.order <= MAX_ORDER, f"--order must be in {MIN_ORDER}..{MAX_ORDER}, got {self.order}")


def distill_store(target: LoadedModel, out: Path, cfg: StoreConfig, progress: bool = True,
                  command: list[str] | None = None) -> dict:
    """Build (or resume building) the answers and write the datastore to `out`; return the summary
    written to out/distill.json."""
    t0 = time.perf_counter()
    parts = Path(cfg.data_dir).expanduser() if cfg.data_dir else out / "data"
    answers, info = answers_only(target, cfg, progress, parts)
    build_s = time.perf_counter() - t0
    summary = record("store", target, cfg, command, data=info, timings={"build_s": build_s})
    store = from_answers(target, answers, cfg.order, name=str(out))
    save_datastore(store, out, record={"command": summary["command"], "data": info})
    summary["store"] = dataclasses.asdict(store.info)
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(
        f"# Datastore for {target.name}\n\nBuilt with `dynatree distill --kind store`: the target's own greedy answers "
        f"to {info['sequences']} chat turns ({info['answer_tokens']} answer tokens), indexed for n-gram look-ups of up "
        f"to {store.order} tokens.\nUse: `dynatree generate PROMPT --chat --target {target.name} --draft ngram+{out}` "
        f"(or `ngram+{out}+MODEL` beside a draft model). Details in distill.json.\n")
    return summary
