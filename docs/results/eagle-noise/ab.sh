#!/bin/bash
# A/B of --feature-noise (docs/results/eagle-noise/README.md, declared before the run): new heads trained from
# scratch on the Spec-Bench sources' committed answers, identical but for the noise, then the held-out measure
# (float32 labels of the 60 held-out questions' answers) of all arms in one run. Rerun to resume.
# Usage: bash docs/results/eagle-noise/ab.sh RUNS_DIR [NOISE ...]   (default arms: 0 0.2)
echo 19 > /proc/self/autogroup 2>/dev/null
cd "$(dirname "$0")/../../.."
runs=${1:?usage: ab.sh RUNS_DIR [NOISE ...]}; shift
arms=${*:-0 0.2}
mkdir -p "$runs"
heads=()
for a in $arms; do
  out="$runs/noise-$a"
  heads+=("$out")
  [ -f "$out/feature_head.json" ] && continue
  nice -n 19 .venv/bin/dynatree distill --kind eagle --target smollm2-135m \
    --prompts specbench,specbench-asks --self-prompts 0 --self-documents 0 --data-dir data/distill/smollm2-135m \
    --out "$out" --steps 300 --batch-size 16 --lr 1e-3 --warmup 30 --train-dtype bfloat16 --label-dtype bfloat16 \
    --checkpoint-every 50 --eval-fraction 0.02 --seed 0 --feature-noise "$a" \
    $( [ -f "$out/checkpoint.pt" ] && echo --resume ) >> "$out.log" 2>&1 || exit 1
done
nice -n 19 .venv/bin/python docs/results/eagle-heldout/measure.py smollm2-135m-eagle "${heads[@]}" \
  > "$runs/heldout.json" 2>> "$runs/measure.log"
