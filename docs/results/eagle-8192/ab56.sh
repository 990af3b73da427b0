#!/bin/bash
# Stage 5 vs stage 6 head in one interleaved run (the eagle-specbench protocol, eager), after the stage-6 rerun
# of eagle-specbench came out below stage 5's earlier run: separates the heads from run-to-run noise.
# STAGE5: a directory holding stage 5's head (git show b50aa04:src/dynatree/drafts/smollm2-135m-eagle/...).
set -e
cd /work/main
STAGE5=${STAGE5:-/tmp/stage5-head}
OUT=${OUT:-/work/runs/ab56}
.venv/bin/dynatree bench --methods ar,dynatree --draft smollm2-135m-eagle,$STAGE5,ngram+smollm2-135m-eagle,ngram+$STAGE5 \
   --cost-aware --dataset specbench --n 3 --warmup 1 --chat --keep-eos --max-new-tokens 256 --no-ppl --weights dense \
   --out $OUT > $OUT.log 2>&1
