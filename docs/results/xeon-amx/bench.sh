#!/bin/bash
# Issue 32's protocol (../q4-cpu/bench.sh) on the Intel Xeon with AMX, q4 runs only (README.md, section 3).
# Usage: bash docs/results/xeon-amx/bench.sh [OUT]   (about 15 minutes here; a quiet machine; llama-cpp-python
# built without AMX: docs/cli.md)
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-runs/q4-xeon}
mkdir -p "$OUT"
COMMON="--methods ar,dynatree,llamacpp-ar --draft ngram,ngram+smollm2-135m-eagle --cost-aware --dataset specbench --n 3 --chat --keep-eos --max-new-tokens 256 --no-ppl --no-progress"
.venv/bin/dynatree bench $COMMON --weights q4 --compile --out "$OUT/q4-compiled" > "$OUT/q4-compiled.log" 2>&1
.venv/bin/dynatree bench $COMMON --weights q4 --out "$OUT/q4-eager" > "$OUT/q4-eager.log" 2>&1
