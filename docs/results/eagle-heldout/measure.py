"""Held-out agreement of feature heads per Spec-Bench task (issue 28).

The first 10 questions of each Spec-Bench task (first turns; never trained on: the distiller's
--holdout) are answered by the target (greedy, chat template, float32) exactly as
`distill --kind eagle` builds data (so a re-measure generates nothing: answers/); each head is evaluated with the distiller's own `evaluate`:
top-1 agreement with the target per depth (3 levels: the head's own features fed back twice),
over answer rows (what drafting meets) and all rows (every row: no prompt is cut, sequences are
evaluated whole). The held-out answers are kept in answers/ here, never in the training data
directory.

    python docs/results/eagle-heldout/measure.py smollm2-135m-eagle /work/runs/eagle-s5 > result.json
    python docs/results/eagle-heldout/measure.py --weights=q4 smollm2-135m-eagle > heldout-q4.json

`--weights=q4` answers and labels with the target in that format (its own greedy answers, its features:
what a head meets on a q4 target), its answers kept in answers-q4/.
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
from dynatree.prompts import SPEC_BENCH_FILE, SPEC_BENCH_TASKS, task_of

HELD_OUT = 10  # the distiller's default --holdout: these questions were never trained on
WEIGHTS = sys.argv.pop(1).removeprefix("--weights=") if sys.argv[1].startswith("--weights=") else "dense"
ANSWERS = Path(__file__).resolve().parent / ("answers" if WEIGHTS == "dense" else f"answers-{WEIGHTS}")  # never training data
L_MAX = 4096  # the bench's prompt cap for Spec-Bench: no held-out question is left out

rows = [json.loads(line) for line in SPEC_BENCH_FILE.read_text().splitlines() if line.strip()]
by_task: dict[str, list] = {}
for row in rows:
    task = task_of(row["category"])
    if len(by_task.setdefault(task, [])) < HELD_OUT:
        by_task[task].append({**row, "turns": row["turns"][:1]})

target = load_model(DEFAULT_TARGET, weights=WEIGHTS)
cfg = EagleConfig(prompts="", holdout=0, self_prompts=0, l_max=L_MAX, seq_len=L_MAX + 256, unroll=3)
t0 = time.perf_counter()
data = {}
tmp = Path(tempfile.mkdtemp())
for task in SPEC_BENCH_TASKS:
    path = tmp / f"{task}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in by_task[task]) + "\n")
    data[task] = build_data(target, EagleConfig(prompts=str(path), holdout=0, self_prompts=0, l_max=L_MAX),
                            progress=True, parts=ANSWERS)
    for part in ANSWERS.glob("part-*.pt"):  # features: large, recomputed from the answers
        part.unlink()
build_s = time.perf_counter() - t0
every = {k: sum((data[t][k] for t in SPEC_BENCH_TASKS), []) for k in ("tokens", "features", "labels", "answer_from")}

embed = target.model.get_input_embeddings()
result = {"target": DEFAULT_TARGET, "weights": WEIGHTS, "held_out_questions": f"first {HELD_OUT} of each Spec-Bench task, first turns",
          "depths": cfg.unroll, "l_max": L_MAX,
          "conversations": {t: len(data[t]["tokens"]) for t in SPEC_BENCH_TASKS},
          "answer_tokens": sum(len(t) - s for t, s in zip(every["tokens"], every["answer_from"])),
          "build_s": build_s, "heads": {}}
for spec in sys.argv[1:]:
    head = load_head(EMBEDDED_DRAFTS.get(spec, Path(spec)))
    check_head(head, target)
    vocab = head.vocab_ids
    sub_index, out_rows = vocab_tables(target, vocab)
    scores = {}
    with torch.no_grad():
        for name, d in [("all", every), *((t, data[t]) for t in SPEC_BENCH_TASKS)]:
            scores[name] = evaluate(head, embed, out_rows, d, list(range(len(d["tokens"]))), cfg, sub_index, vocab)
    result["heads"][spec] = scores
shutil.rmtree(tmp)
json.dump(result, sys.stdout, indent=1)
print()
