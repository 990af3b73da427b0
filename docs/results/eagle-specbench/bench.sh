#!/bin/bash
# Pre-declared configurations (issue 28), Spec-Bench held-out questions (first 3 per task; the head
# trained on questions 11+ of each task), chat template, EOS respected, T=256, greedy, float32.
# Headline: dynatree --draft smollm2-135m-eagle --cost-aware against our own ar at the same setting.
set -e
cd /work/main
HEAD=${HEAD:-smollm2-135m-eagle}
COMMON="--dataset specbench --n 3 --warmup 1 --chat --keep-eos --max-new-tokens 256 --no-ppl"
.venv/bin/dynatree bench --methods ar,linear,fixed-tree,dynatree --draft $HEAD,ngram --cost-aware $COMMON \
   --out /work/runs/s27/bench-eager > /work/runs/s27/bench-eager.log 2>&1
.venv/bin/dynatree bench --methods ar,dynatree --draft $HEAD,ngram,ngram+$HEAD --cost-aware --compile $COMMON \
   --out /work/runs/s27/bench-compiled > /work/runs/s27/bench-compiled.log 2>&1
