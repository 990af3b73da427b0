#!/bin/bash
# Issue 32's measurement: the embedded SmolLM2 in q4 (eager, compiled) and float32 (eager), each run
# with llama.cpp on the same GGUF file; Spec-Bench questions, chat template, EOS respected, 256 tokens.
# Usage: bash docs/results/q4-cpu/bench.sh [OUT]   (about 25 minutes on 2 cores; a quiet machine)
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-runs/q4-cpu}
mkdir -p "$OUT"
COMMON="--methods ar,dynatree,llamacpp-ar --draft ngram,ngram+smollm2-135m-eagle --cost-aware --dataset specbench --n 3 --chat --keep-eos --max-new-tokens 256 --no-ppl --no-progress"
.venv/bin/dynatree bench $COMMON --weights q4 --out "$OUT/q4-eager" > "$OUT/q4-eager.log" 2>&1
.venv/bin/dynatree bench $COMMON --weights q4 --compile --out "$OUT/q4-compiled" > "$OUT/q4-compiled.log" 2>&1
.venv/bin/dynatree bench $COMMON --weights dense --out "$OUT/f32-eager" > "$OUT/f32-eager.log" 2>&1
