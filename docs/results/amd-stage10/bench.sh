#!/bin/bash
# The shipped stage-10 feature head (smollm2-135m-eagle since 2026-11-29) on the 2-core AMD EPYC of the README's
# tables (issues 28 and 32): stage 9's declared protocol (../amd-stage9/bench.sh: q4-compiled with llama.cpp,
# f32-compiled, f32-eager), unchanged: this file runs that script with this folder as its output. (At commit 6c84b3e, when it ran, this file held a copy of
# that script's commands with this folder as the output.)
# Usage: bash docs/results/amd-stage10/bench.sh   (about 35 minutes on 2 cores; nothing else running;
# llama-cpp-python installed in .venv)
set -e
cd "$(dirname "$0")/../../.."
exec bash docs/results/amd-stage9/bench.sh docs/results/amd-stage10
