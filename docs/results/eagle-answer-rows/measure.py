"""Held-out agreement of the shipped feature head over all rows vs answer rows only (issue 28).

The training record's held-out agreement (distill.json) counts every row of a conversation,
prompt and chat template included; drafting meets only the target's answers. This builds the
data of Spec-Bench questions the head never trained on (the first 10 of each task, first turns,
the target's greedy chat answers, float32) exactly as `distill --kind eagle` does, and evaluates
the shipped head on it with the distiller's own `evaluate`, both ways.

    python docs/results/eagle-answer-rows/measure.py > docs/results/eagle-answer-rows/result.json
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dynatree.distill.eagle_data import EagleConfig, build_data
from dynatree.distill.eagle_train import evaluate
from dynatree.embedded import EMBEDDED_DRAFTS
from dynatree.featurehead import load_head
from dynatree.models import DEFAULT_TARGET, load_model
from dynatree.prompts import SPEC_BENCH_FILE, task_of

HELD_OUT = 10  # the distiller's default --holdout: these questions were never trained on

rows = [json.loads(line) for line in SPEC_BENCH_FILE.read_text().splitlines() if line.strip()]
seen, keep = {}, []
for row in rows:
    task = task_of(row["category"])
    seen[task] = seen.get(task, 0) + 1
    if seen[task] <= HELD_OUT:
        keep.append({**row, "turns": row["turns"][:1]})
questions = Path(tempfile.mkdtemp()) / "held-out.jsonl"
questions.write_text("\n".join(json.dumps(r) for r in keep) + "\n")

target = load_model(DEFAULT_TARGET, weights="dense")
cfg = EagleConfig(prompts=str(questions), holdout=0, self_prompts=0)
t0 = time.perf_counter()
data = build_data(target, cfg, progress=True)
build_s = time.perf_counter() - t0
head = load_head(EMBEDDED_DRAFTS["smollm2-135m-eagle"])
vocab = head.vocab_ids
sub_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
sub_index[vocab] = torch.arange(len(vocab))
embed = target.model.get_input_embeddings()
out_rows = target.model.get_output_embeddings().weight.detach()[vocab].float()
with torch.no_grad():
    result = evaluate(head, embed, out_rows, data, list(range(len(data["tokens"]))), cfg, sub_index, vocab)
answer_tokens = sum(len(t) - s for t, s in zip(data["tokens"], data["answer_from"]))
json.dump({"head": "smollm2-135m-eagle", "target": DEFAULT_TARGET, "conversations": len(data["tokens"]),
           "tokens": sum(len(t) for t in data["tokens"]), "answer_tokens": answer_tokens,
           "held_out_questions": f"first {HELD_OUT} of each Spec-Bench task, first turns", "build_s": build_s,
           **result}, sys.stdout, indent=1)
print()
