#!/bin/bash
# Peak resident memory per process (issue 32's third target): the embedded default as a user runs it
# (`dynatree generate`, q4 by --weights auto, dynatree + n-gram drafter) against llama.cpp on the
# same GGUF file (llama_cpp_generate.py), one chat question, 128 tokens, whole processes (farm-bench).
cd "$(dirname "$0")/../../.."
Q="Explain how vaccines train the immune system, in a few paragraphs."
farm-bench -n 3 --timeout 600 --vs ".venv/bin/python docs/results/q4-cpu/llamacpp_generate.py '$Q' 128" -- \
    .venv/bin/dynatree generate "$Q" --chat --max-new-tokens 128
