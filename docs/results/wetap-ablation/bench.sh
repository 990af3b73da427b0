#!/bin/bash
# Paper 004's Table 2 (WETAP's ablation) on this CPU, with DSBD and MTAD beside it for scale
# (issue 33). The preset's protocol: sampling at temperature 1, top-k 10, top-p 0.9, MT-Bench and
# GSM8K from the shipped Spec-Bench questions, HumanEval, EOS ignored. Declared before the run:
# 5 prompts per data set of which the first is warm-up, 128 new tokens, float32 weights
# (--weights dense, as the run it replaces), the preset's n-gram drafter (WETAP's 128-wide layers
# with the draft LM run at about 2 tok/s here, see ../wetap-main).
set -e
cd "$(dirname "$0")/../../.."
OUT=${OUT:-docs/results/wetap-ablation}
.venv/bin/dynatree bench --preset wetap-ablation --scale small --n 5 --warmup 1 --max-new-tokens 128 \
    --weights dense --out "$OUT"
