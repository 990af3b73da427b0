cd /work/main
OUT=runs/q4-xeon
COMMON="--methods ar,dynatree,llamacpp-ar --draft ngram,ngram+smollm2-135m-eagle --cost-aware --dataset specbench --n 3 --chat --keep-eos --max-new-tokens 256 --no-ppl --no-progress"
.venv/bin/dynatree bench $COMMON --weights q4 --compile --out "$OUT/q4-compiled" > "$OUT/q4-compiled.log" 2>&1
.venv/bin/dynatree bench $COMMON --weights q4 --out "$OUT/q4-eager" > "$OUT/q4-eager.log" 2>&1
echo done > $OUT/DONE
