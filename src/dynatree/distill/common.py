"""What the kinds of distillation share: the learning-rate schedule, batches, atomic writes, resuming
from a checkpoint, and the head of the distill.json record."""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from pathlib import Path

import torch

from ..errors import DynaTreeError
from ..files import replaced_atomically


def warmup_of(cfg, state: dict | None, history: list) -> int:
    """The run's warm-up steps: --warmup, cut to --steps when longer, so that a short trial still reaches
    --lr (at its last step); the cut is recorded in `history` and said on stderr. Fixed when a run starts
    (`state` None) and saved in its checkpoints: a run resumed with more --steps keeps its own warm-up
    (a checkpoint from before it was saved: --warmup as given, the schedule that run trained with)."""
    if state is not None:
        return state.get("warmup", cfg.warmup)
    if cfg.warmup <= cfg.steps:
        return cfg.warmup
    history.append({"step": 0, "warmup_cut": {"from": cfg.warmup, "to": cfg.steps}})
    print(f"distill: --warmup {cfg.warmup} is longer than --steps {cfg.steps}: warming up over all {cfg.steps} steps",
          file=sys.stderr)
    return cfg.steps


def lr_at(step: int, cfg, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over `warmup` steps to cfg.lr, then cosine decay to `floor` x cfg.lr at cfg.steps."""
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, cfg.steps - warmup)
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batches(items: list, batch_size: int, step: int, rng: random.Random):
    """Endless batches of `items`, reshuffled by `rng` at each pass, resuming where a run stopped at
    `step` would have left off (the shuffles it used are replayed, so a resumed run sees the same batches)."""
    order: list = []
    for _ in range(step * batch_size // len(items) + 1):
        order = items[:]
        rng.shuffle(order)
    cursor = step * batch_size % len(items)
    while True:
        picked = []
        while len(picked) < batch_size:
            if cursor == len(order):
                order = items[:]
                rng.shuffle(order)
                cursor = 0
            take = order[cursor: cursor + batch_size - len(picked)]
            picked += take
            cursor += len(take)
        yield picked


def save_atomic(obj, path: Path) -> None:
    """torch.save(obj, path), atomic (`files.replaced_atomically`): a run killed mid-save keeps its last checkpoint."""
    with replaced_atomically(path) as tmp:
        torch.save(obj, tmp)


def resumed(ckpt_path: Path, cfg) -> dict:
    """The checkpoint's state to continue from, checked against `cfg`: every option must be the one
    it was trained with, except `steps` (a run cut short or extended, never below the steps already
    trained): the cosine decay then follows the new total, and the history records where it changed."""
    state = torch.load(ckpt_path, weights_only=False, map_location="cpu")  # resumable on another device
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}  # an option added since: its default was the behaviour
    changed = sorted(k for k, v in dataclasses.asdict(cfg).items()
                     if state["config"].get(k, defaults[k]) != v and k != "steps")
    if changed:
        raise DynaTreeError(f"{ckpt_path} was trained with other options ({', '.join(changed)} differ); "
                            "resume with the same options (only --steps may change)")
    if cfg.steps < state["step"]:
        raise DynaTreeError(f"--steps {cfg.steps} is below the {state['step']} steps {ckpt_path} has already trained")
    if state["config"]["steps"] != cfg.steps:
        state["history"].append({"step": state["step"], "steps_changed": {"from": state["config"]["steps"], "to": cfg.steps}})
    return state


def record(kind: str, target, cfg, command: list[str] | None, **fields) -> dict:
    """A distill.json record: how it was made (command, kind, time, target, config), then `fields`,
    then the machine (env.describe)."""
    from .. import env

    return {"command": command if command is not None else sys.argv, "kind": kind,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "target": target.name,
            "config": dataclasses.asdict(cfg), **fields, "env": env.describe(target.device)}
