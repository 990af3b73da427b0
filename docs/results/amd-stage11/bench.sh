#!/bin/bash
# Stage 9's declared protocol (../amd-stage9/bench.sh: q4-compiled with llama.cpp, f32-compiled, f32-eager),
# unchanged, on the 2-core AMD EPYC of the README's tables, after the drafters' prefill moved into `reset`
# (commit beedfef: a cost-aware policy had learnt the whole prompt's feed as the first draft forward). The head
# is stage 10's, as in ../amd-stage10. This file runs that script with this folder as its output.
# Usage: bash docs/results/amd-stage11/bench.sh   (about 35-45 minutes on 2 cores; nothing else running;
# llama-cpp-python installed in .venv)
set -e
cd "$(dirname "$0")/../../.."
exec bash docs/results/amd-stage9/bench.sh docs/results/amd-stage11
