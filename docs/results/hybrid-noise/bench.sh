#!/bin/bash
# Issue 28's "the hybrid never runs slower than the better of its two parts by more than noise", measured with
# the run's own noise: stage 9's compiled float32 protocol (../eagle-specbench/bench.sh's compiled line) with
# --repeats 3 (every variant runs every prompt three times, rounds interleaved), then analyze.py.
# Usage: bash docs/results/hybrid-noise/bench.sh [OUT]   (about 50 minutes on 2 cores; nothing else running)
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-/work/runs/hybrid-noise}
mkdir -p "$OUT"
.venv/bin/dynatree bench --methods ar,dynatree --draft smollm2-135m-eagle,ngram,ngram+smollm2-135m-eagle --cost-aware \
  --compile --dataset specbench --n 3 --warmup 1 --chat --keep-eos --max-new-tokens 256 --no-ppl --weights dense \
  --repeats 3 --no-progress --out "$OUT/f32-compiled" > "$OUT/f32-compiled.log" 2>&1
.venv/bin/python docs/results/hybrid-noise/analyze.py "$OUT/f32-compiled/results.json" > "$OUT/analysis.md"
