#!/usr/bin/env bash
# The third lent GPU session's call: the compile tests again (the warm-up fix of the second session for
# torch 2.11, which reads no per-dimension dynamic sources, was only imitated on the CPU), then the slow
# sampling and sliding-window tests no session has finished on a GPU, with more time and one worker each.
#   OUT=... bash docs/results/gpu/device4.sh [COMPILE_SECONDS] [SLOW_SECONDS]
set -uo pipefail
export PYTHONUNBUFFERED=1
compile_s=${1:-150}
slow_s=${2:-300}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/docs/results/gpu
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
run() {  # name seconds workers pytest-args...
    local name=$1 secs=$2 workers=$3; shift 3
    DYNATREE_TEST_DEVICE=cuda DYNATREE_TEST_PROFILE=full timeout "$secs" python3 -m pytest -n "$workers" -v \
        -p no:cacheprovider -p failures_plugin -rfE --tb=short --timeout "$secs" --durations=0 "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $? (124: stopped at $secs s); passed $(grep -c ' PASSED ' "$OUT/$name.log"), failed $(grep -c ' FAILED ' "$OUT/$name.log"), skipped $(grep -c ' SKIPPED ' "$OUT/$name.log")"
    grep -E "^(FAILED|ERROR) " "$OUT/$name.log" | cut -c1-250 | tail -12
}
run compile "$compile_s" 8 tests/test_compile.py
run slow "$slow_s" 16 -m slow tests/test_sampling.py tests/test_sliding.py
