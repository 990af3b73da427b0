#!/bin/bash
# A/B of specializing the shipped head on the Spec-Bench sources (docs/results/eagle-specialize/README.md,
# declared before the run): the shipped stage-10 head continued 200 steps on the Spec-Bench training
# questions' committed answers only, float32 labels (the shipped recipe's), then the held-out measure
# (60 held-out Spec-Bench questions) and the general-chat check of both heads. Rerun to resume.
# Usage: [TRAIN_DTYPE=float32] bash docs/results/eagle-specialize/ab.sh RUNS_DIR   (float32 where the CPU has no
# native bfloat16: emulated, it runs ~80x slower)
echo 19 > /proc/self/autogroup 2>/dev/null
cd "$(dirname "$0")/../../.."
runs=${1:?usage: ab.sh RUNS_DIR}
out="$runs/specialized"
mkdir -p "$runs"
if [ ! -f "$out/feature_head.json" ]; then
  nice -n 19 .venv/bin/dynatree distill --kind eagle --target smollm2-135m \
    --prompts specbench,specbench-asks --self-prompts 0 --self-documents 0 --data-dir data/distill/smollm2-135m \
    --init-head src/dynatree/drafts/smollm2-135m-eagle --out "$out" --steps 200 --batch-size 16 --lr 1e-4 \
    --warmup 20 --train-dtype "${TRAIN_DTYPE:-bfloat16}" --checkpoint-every 50 --eval-fraction 0.02 --seed 0 \
    $( [ -f "$out/checkpoint.pt" ] && echo --resume ) >> "$out.log" 2>&1 || exit 1
fi
[ -f "$runs/heldout.json" ] || nice -n 19 .venv/bin/python docs/results/eagle-heldout/measure.py smollm2-135m-eagle "$out" \
  > "$runs/heldout.json.tmp" 2>> "$runs/measure.log" && mv "$runs/heldout.json.tmp" "$runs/heldout.json"
[ -f "$runs/general.json" ] || nice -n 19 .venv/bin/python docs/results/eagle-specialize/general.py smollm2-135m-eagle "$out" \
  > "$runs/general.json.tmp" 2>> "$runs/measure.log" && mv "$runs/general.json.tmp" "$runs/general.json"
