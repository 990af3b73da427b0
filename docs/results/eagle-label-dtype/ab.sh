#!/bin/bash
# A/B of --label-dtype (docs/results/eagle-label-dtype): the same fine-tune of the shipped head on the Spec-Bench
# sources' committed answers, labelled in float32 and in bfloat16, then the held-out measure (float32 labels) of both.
echo 19 > /proc/self/autogroup 2>/dev/null
cd /work/main
for dt in target bfloat16; do  # (run as "float32", the first name of "target")
  [ -f /work/runs/lab/$dt/feature_head.json ] || nice -n 19 .venv/bin/dynatree distill --kind eagle --target smollm2-135m \
    --prompts specbench,specbench-asks --self-prompts 0 --self-documents 0 --data-dir data/distill/smollm2-135m \
    --out /work/runs/lab/$dt --init-head src/dynatree/drafts/smollm2-135m-eagle --steps 150 --batch-size 16 --lr 5e-4 \
    --warmup 20 --train-dtype bfloat16 --checkpoint-every 50 --eval-fraction 0.02 --label-dtype $dt \
    $( [ -f /work/runs/lab/$dt/checkpoint.pt ] && echo --resume ) >> /work/runs/lab/$dt.log 2>&1
done
nice -n 19 .venv/bin/python docs/results/eagle-heldout/measure.py smollm2-135m-eagle /work/runs/lab/target /work/runs/lab/bfloat16 > /work/runs/lab/heldout.json 2>> /work/runs/lab/measure.log
