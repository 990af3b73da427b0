#!/bin/bash
# Issue 32 x the datastore (declared before the run, 2026-11-26): does the model-free drafter with the shipped
# datastore move the best speculative configuration against llama.cpp? q4 compiled (the best setting of
# bench.sh), the same prompts and protocol as bench.sh, one run: ar, dynatree[ngram], dynatree[ngram+store],
# llama.cpp greedy. Recorded whatever it shows. Usage: bash docs/results/q4-cpu/store.sh [OUT]  (~12 min)
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-runs/q4-store}
mkdir -p "$OUT"
.venv/bin/dynatree bench --methods ar,dynatree,llamacpp-ar --draft ngram,ngram+smollm2-135m-store --cost-aware \
  --dataset specbench --n 3 --chat --keep-eos --max-new-tokens 256 --no-ppl --no-progress --weights q4 --compile \
  --out "$OUT/q4-compiled" > "$OUT/q4-compiled.log" 2>&1
