#!/bin/bash
# Pre-declared configurations (issue 28), Spec-Bench held-out questions (first 3 per task; the head
# trained on questions 11+ of each task), chat template, EOS respected, T=256, greedy, float32.
# Headline: dynatree --draft smollm2-135m-eagle --cost-aware against our own ar at the same setting.
set -e
cd /work/main
HEAD=${HEAD:-smollm2-135m-eagle}
OUT=${OUT:-/work/runs/eagle-specbench}
mkdir -p $OUT
COMMON="--dataset specbench --n 3 --warmup 1 --chat --keep-eos --max-new-tokens 256 --no-ppl --weights dense"  # float32, as measured before --weights auto (q4) became the default
.venv/bin/dynatree bench --methods ar,linear,fixed-tree,dynatree --draft $HEAD,ngram,ngram+$HEAD --cost-aware $COMMON \
   --out $OUT/bench-eager > $OUT/bench-eager.log 2>&1
.venv/bin/dynatree bench --methods ar,dynatree --draft $HEAD,ngram,ngram+$HEAD --cost-aware --compile $COMMON \
   --out $OUT/bench-compiled > $OUT/bench-compiled.log 2>&1
