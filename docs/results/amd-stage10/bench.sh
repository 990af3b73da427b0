#!/bin/bash
# The shipped stage-10 feature head (smollm2-135m-eagle since 2026-11-29) on the 2-core AMD EPYC of the README's tables (issues 28 and 32), three
# `dynatree bench` runs with configurations declared before them (the protocols of ../eagle-specbench/bench.sh
# and ../xeon-amx/bench.sh, unchanged):
#   1. q4-compiled:  issue 32's line, --weights q4 --compile, with llama.cpp greedy on the same GGUF (llamacpp-ar)
#   2. f32-compiled: issue 28's compiled rows (float32, ar vs dynatree with the head, n-gram and their hybrid)
#   3. f32-eager:    issue 28's eager rows (linear, fixed tree and DynaTree with each drafter)
# Usage: bash docs/results/amd-stage10/bench.sh [OUT]   (about an hour on 2 cores; nothing else running;
# llama-cpp-python installed in .venv)
set -e
cd "$(dirname "$0")/../../.."
OUT=${1:-docs/results/amd-stage10}
SPEC="--dataset specbench --n 3 --chat --keep-eos --max-new-tokens 256 --no-ppl --no-progress"
.venv/bin/dynatree bench --methods ar,dynatree,llamacpp-ar --draft ngram,ngram+smollm2-135m-eagle --cost-aware $SPEC \
    --weights q4 --compile --out "$OUT/q4-compiled" > "$OUT/q4-compiled.log" 2>&1
F32="$SPEC --warmup 1 --weights dense"
.venv/bin/dynatree bench --methods ar,dynatree --draft smollm2-135m-eagle,ngram,ngram+smollm2-135m-eagle --cost-aware \
    --compile $F32 --out "$OUT/f32-compiled" > "$OUT/f32-compiled.log" 2>&1
.venv/bin/dynatree bench --methods ar,linear,fixed-tree,dynatree --draft smollm2-135m-eagle,ngram,ngram+smollm2-135m-eagle \
    --cost-aware $F32 --out "$OUT/f32-eager" > "$OUT/f32-eager.log" 2>&1
