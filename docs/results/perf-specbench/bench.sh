#!/usr/bin/env bash
# Issue 27: `dynatree bench --preset perf --dataset specbench --chat --keep-eos` offline, on
# Spec-Bench's shipped questions, 2 per task (12; the first a warm-up), first turns, chat
# template, EOS respected, at most 256 new tokens, greedy, float32 (--weights dense: transformers'
# rows read the same weights). Drafters: the n-gram drafter, the shipped feature head, and the two
# together. Declared before the run by the preset's rule (presets.declared): eager cost-aware
# DynaTree with the last drafter, `dynatree[ngram+smollm2-135m-eagle] +cost-aware` (what `make
# demo` runs). hf-assisted takes a draft LM only, so it has no row with these drafters.
set -euo pipefail
OUT=${OUT:-docs/results/perf-specbench}
dynatree bench --preset perf --dataset specbench --n 2 --chat --keep-eos --max-new-tokens 256 \
    --weights dense --draft ngram,smollm2-135m-eagle,ngram+smollm2-135m-eagle --out "$OUT"
