#!/usr/bin/env bash
# Soft vs hard labels for the feature head, an A/B fine-tune of the shipped head (issue 28; README.md).
# Resumable: each arm's --out keeps its checkpoint (rerun the same command). Run from the repository root.
set -euo pipefail
OUT=${OUT:-/work/runs/eagle-soft}
PY=${PY:-.venv/bin/python}  # (the CLI: .venv/bin/dynatree)
mkdir -p "$OUT"
common=(--kind eagle --target smollm2-135m --prompts specbench,specbench-asks --self-prompts 4096
        --self-documents 1024 --data-dir data/distill/smollm2-135m --label-dtype bfloat16
        --init-head src/dynatree/drafts/smollm2-135m-eagle --steps 400 --batch-size 8 --lr 3e-4 --warmup 20
        --train-dtype bfloat16 --checkpoint-every 100 --eval-fraction 0.02)
for arm in hard soft; do
  resume=(); [ -e "$OUT/$arm/checkpoint.pt" ] && resume=(--resume)
  [ -e "$OUT/$arm/feature_head.json" ] && continue
  .venv/bin/dynatree distill "${common[@]}" --label-loss "$arm" --out "$OUT/$arm" "${resume[@]}"
done
"$PY" docs/results/eagle-heldout/measure.py smollm2-135m-eagle "$OUT/hard" "$OUT/soft" > "$OUT/heldout.json"
cp "$OUT/heldout.json" docs/results/eagle-soft/heldout.json
for arm in hard soft; do cp "$OUT/$arm/distill.json" "docs/results/eagle-soft/distill-$arm.json"; done
