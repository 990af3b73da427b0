#!/bin/bash
# Step (b) of the README's criterion, declared before the A/B's result was known (stop 86): the specialized
# head against the shipped one in ONE run per setting, the protocol of ../amd-stage11/bench.sh (Spec-Bench's
# first 3 questions of each task, first turns, chat template, EOS respected, 256 new tokens, greedy, float32,
# one warm-up) with only DynaTree +cost-aware (the issue's headline method) and `ar`, each head alone and in
# the n-gram hybrid. Compared: each head's speedup over the same run's `ar`, overall and per task.
# Usage: bash docs/results/eagle-specialize/bench.sh HEAD_DIR [OUT]   (about 25 minutes on 2 cores; nothing
# else running)
set -e
cd "$(dirname "$0")/../../.."
HEAD=${1:?usage: bench.sh HEAD_DIR [OUT]}
OUT=${2:-docs/results/eagle-specialize}
SPEC="--dataset specbench --n 3 --chat --keep-eos --max-new-tokens 256 --no-ppl --no-progress --warmup 1 --weights dense"
DRAFTS="smollm2-135m-eagle,$HEAD,ngram+smollm2-135m-eagle,ngram+$HEAD"
.venv/bin/dynatree bench --methods ar,dynatree --draft "$DRAFTS" --cost-aware $SPEC --out "$OUT/f32-eager" \
    > "$OUT/f32-eager.log" 2>&1
.venv/bin/dynatree bench --methods ar,dynatree --draft "$DRAFTS" --cost-aware --compile $SPEC --out "$OUT/f32-compiled" \
    > "$OUT/f32-compiled.log" 2>&1
