#!/bin/bash
# Pre-declared configurations (issue 28, the datastore), the protocol of ../eagle-specbench: Spec-Bench held-out
# questions (first 3 per task; neither the head nor the datastore saw them), chat template, EOS respected, T=256,
# greedy, float32, dynatree --cost-aware against our own ar at the same setting; eager, then compiled.
set -e
cd /work/main
OUT=${OUT:-/work/runs/store-specbench}
mkdir -p $OUT
COMMON="--dataset specbench --n 3 --warmup 1 --chat --keep-eos --max-new-tokens 256 --no-ppl --weights dense"
DRAFTS=ngram,ngram+smollm2-135m-store,ngram+smollm2-135m-eagle,ngram+smollm2-135m-store+smollm2-135m-eagle
.venv/bin/dynatree bench --methods ar,dynatree --draft $DRAFTS --cost-aware $COMMON \
   --out $OUT/bench-eager > $OUT/bench-eager.log 2>&1
.venv/bin/dynatree bench --methods ar,dynatree --draft $DRAFTS --cost-aware --compile $COMMON \
   --out $OUT/bench-compiled > $OUT/bench-compiled.log 2>&1
