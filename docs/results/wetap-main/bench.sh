#!/bin/bash
# Paper 004's Table 1 on this CPU, every row (issue 33): AR, SpecInfer, DSBD, SpecExec, MTAD (lossy),
# OPT-Tree, WETAP (beam rule, lossy; and its tree verified exactly), DynaTree. The preset's protocol:
# sampling at temperature 1, top-k 10, top-p 0.9 (prompt i drawn with seed i by every variant), its
# data sets (MT-Bench and GSM8K from the shipped Spec-Bench questions, HumanEval), EOS ignored.
# Declared before the run: 5 prompts per data set of which the first is warm-up, 128 new tokens,
# float32 weights (--weights dense, as the run it replaces), both drafters in one interleaved run:
# the n-gram drafter (the preset's default) and the shipped draft LM (the paper's setting: a small
# draft model proposes the trees).
set -e
cd "$(dirname "$0")/../../.."
OUT=${OUT:-docs/results/wetap-main}
.venv/bin/dynatree bench --preset wetap-main --scale small --n 5 --warmup 1 --max-new-tokens 128 \
    --weights dense --draft ngram,smollm2-135m-draft --out "$OUT"
