"""Held-out agreement of a feature head attending to the whole context against a window of the last W
positions (README here; issue 28). The held-out questions and the target's float32 answers of
../eagle-heldout (features recomputed from them, as measure.py does), evaluated with the distiller's own
`evaluate` whole, once per window.

    python docs/results/eagle-window/probe.py smollm2-135m-eagle > result.json
"""
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from dynatree.distill.eagle_data import EagleConfig, build_data
from dynatree.distill.eagle_train import evaluate, vocab_tables
from dynatree.embedded import EMBEDDED_DRAFTS
from dynatree.featurehead import check_head, load_head
from dynatree.models import DEFAULT_TARGET, load_model
from dynatree.prompts import SPEC_BENCH_FILE, SPEC_BENCH_TASKS, questions, task_of

HERE = Path(__file__).resolve().parent
ANSWERS = HERE.parent / "eagle-heldout" / "answers"  # the target's answers to the held-out questions (never trained on)
HELD_OUT = 10  # first questions of each task: the distiller's default --holdout
L_MAX = 4096
DECLARED = 640  # the training length (--seq-len), declared before the run
WINDOWS = [0, DECLARED, 256, 1024, 2048]  # 0: the whole context (as shipped); the others: sensitivity only

spec = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-eagle"
by_task: dict[str, list] = {}  # the first HELD_OUT questions of each task, first turns (as measure.py asks them)
for question_id, category, turns in questions(SPEC_BENCH_FILE):
    held = by_task.setdefault(task_of(category), [])
    if len(held) < HELD_OUT:
        held.append({"question_id": question_id, "category": category, "turns": turns[:1]})
target = load_model(DEFAULT_TARGET, weights="dense")
t0 = time.perf_counter()
data, tmp = {}, Path(tempfile.mkdtemp())
try:
    parts = tmp / "parts"  # a copy of the committed answers: the features written beside them stay out of the repository
    shutil.copytree(ANSWERS, parts)
    for task in SPEC_BENCH_TASKS:
        path = tmp / f"{task}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in by_task[task]) + "\n")
        data[task] = build_data(target, EagleConfig(prompts=str(path), holdout=0, self_prompts=0, l_max=L_MAX),
                                progress=True, parts=parts)
finally:
    shutil.rmtree(tmp)
build_s = time.perf_counter() - t0
every = {k: sum((data[t][k] for t in SPEC_BENCH_TASKS), []) for k in ("tokens", "features", "labels", "answer_from")}
head = load_head(EMBEDDED_DRAFTS.get(spec, Path(spec)))
check_head(head, target)
vocab = head.vocab_ids
sub_index, out_rows = vocab_tables(target, vocab)
embed = target.model.get_input_embeddings()
base = EagleConfig(prompts="", holdout=0, self_prompts=0, l_max=L_MAX, seq_len=L_MAX + 256, unroll=3, batch_size=2)
result = {"head": spec, "target": DEFAULT_TARGET, "weights": "dense", "declared_window": DECLARED,
          "held_out_questions": f"first {HELD_OUT} of each Spec-Bench task, first turns",
          "conversations": {t: len(data[t]["tokens"]) for t in SPEC_BENCH_TASKS},
          "prompt_tokens": {t: sorted(f for f in data[t]["answer_from"]) for t in SPEC_BENCH_TASKS},
          "build_s": round(build_s, 1), "windows": {}}
with torch.no_grad():
    for window in WINDOWS:
        t1 = time.perf_counter()
        scores = {name: evaluate(head, embed, out_rows, d, list(range(len(d["tokens"]))), base, sub_index, vocab,
                                 window)
                  for name, d in [("all", every), *((t, data[t]) for t in SPEC_BENCH_TASKS)]}
        result["windows"][str(window)] = scores
        print(f"window {window}: all {scores['all']['answer_agreement_by_depth'][0]:.4f} "
              f"({time.perf_counter() - t1:.0f} s)", file=sys.stderr, flush=True)
json.dump(result, sys.stdout, indent=1)
print()
