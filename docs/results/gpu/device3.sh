#!/usr/bin/env bash
# The second session's follow-up call: why compiled runs built a third graph on CUDA (graphs.py, with dynamo's
# recompile reasons), then the slow sampling and sliding-window tests device2.sh did not reach (full profile).
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
DYNATREE_TEST_DEVICE=cuda TORCH_LOGS=recompiles timeout 100 python3 docs/results/gpu/graphs.py > "$OUT/graphs.log" 2>&1
echo "graphs exit $?"
grep -vE "^\s*$" "$OUT/graphs.log" | cut -c1-400 | head -60
PYTHONPATH=$PYTHONPATH:$PWD/docs/results/gpu DYNATREE_TEST_DEVICE=cuda DYNATREE_TEST_PROFILE=full timeout 150 \
    python3 -m pytest -n 12 -v -p no:cacheprovider -p failures_plugin -rfE --tb=short --timeout 140 \
    tests/test_sampling.py tests/test_sliding.py > "$OUT/pytest.log" 2>&1
echo "pytest exit $? (124: stopped at 150 s)"
echo "passed $(grep -c ' PASSED ' "$OUT/pytest.log"), failed $(grep -c ' FAILED ' "$OUT/pytest.log"), skipped $(grep -c ' SKIPPED ' "$OUT/pytest.log")"
grep -E " FAILED |^(FAILED|ERROR) " "$OUT/pytest.log" | cut -c1-250 | tail -20
