"""Every CPU of this machine kind: an AVX2-only CPU, really run (imitated on AVX-512 machines by
limiting torch's and oneDNN's instruction sets), decodes bfloat16 on stock kernels, records why,
and refuses `--linear onednn` in one line. On an AVX2-only machine the limits change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def _dynatree(*args: str) -> subprocess.CompletedProcess:
    # inductor's on-disk cache does not key on these limits: compiled kernels must not be shared
    # between imitated and native runs (seen: wrong results and heap corruption when they were)
    env = {**os.environ, **AVX2_ONLY, "TOKENIZERS_PARALLELISM": "false",
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), "dynatree-inductor-avx2-imitated")}
    return subprocess.run([sys.executable, "-m", "dynatree.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # a subprocess imitating an AVX2-only CPU
def test_an_avx2_only_cpu_decodes_bfloat16_exactly_on_stock_kernels_and_says_why(saved_tiny):
    out = _dynatree("generate", "w5 w6 w7 w5 w6 w7 w5", "--target", str(saved_tiny), "--dtype", "bfloat16",
                    "--method", "dynatree", "--compare", "ar", "--max-new-tokens", "16", "--ignore-eos", "--json")
    assert out.returncode == 0, out.stderr
    dyna, ar = json.loads(out.stdout)
    for rec in (dyna, ar):
        assert rec["run"]["dtype"] == "bfloat16" and rec["run"]["linear"] == "stock"
        assert "cannot run oneDNN's bfloat16 linear: bf16 path needs the cpu support" in rec["run"]["linear_note"]
        support = rec["env"]["cpu_support"]
        assert support["capability"] == "AVX2" and support["onednn_linear_dtypes"] == ["float32"]
    assert dyna["new_token_ids"] == ar["new_token_ids"] and len(ar["new_token_ids"]) == 16
    assert "note: linear layers on stock kernels: this CPU (AVX2) cannot run oneDNN's bfloat16 linear" in out.stderr


@pytest.mark.slow  # a subprocess imitating an AVX2-only CPU
def test_an_avx2_only_cpu_refuses_onednn_bfloat16_in_one_line(saved_tiny):
    out = _dynatree("generate", "w5 w6", "--target", str(saved_tiny), "--dtype", "bfloat16", "--linear", "onednn",
                    "--method", "ar", "--max-new-tokens", "2")
    assert out.returncode == 2
    assert [line for line in out.stderr.splitlines() if line.startswith("dynatree:")] == [
        "dynatree: error: --linear onednn: cannot pack this model's linear layers: this CPU (AVX2) cannot run "
        "oneDNN's bfloat16 linear: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and "
        "avx512dq; use --linear stock or --dtype float32"]


@pytest.mark.slow  # a subprocess imitating an AVX2-only CPU
def test_an_avx2_only_cpu_compiles_bfloat16_on_stock_kernels(saved_tiny):
    """--compile on the unsupported branch: inductor gets the stock linears, compiling is reported
    apart from the timings, and tree decoding gives compiled ar's tokens (bf16 compiled and eager
    kernels round differently, so eager tokens are not the reference)."""
    out = _dynatree("generate", "w5 w6 w7 w5 w6 w7 w5", "--target", str(saved_tiny), "--dtype", "bfloat16",
                    "--method", "dynatree", "--compare", "ar", "--max-new-tokens", "16", "--ignore-eos", "--json",
                    "--compile")
    assert out.returncode == 0, out.stderr
    dyna, ar = json.loads(out.stdout)
    assert dyna["run"]["compile"] and dyna["run"]["linear"] == "stock" and "bf16 path" in dyna["run"]["linear_note"]
    assert dyna["stats"]["compile_s"] > 0 and dyna["stats"]["graphs_compiled_while_timed"] == 0
    assert ar["stats"]["graphs_compiled_while_timed"] == 0
    assert dyna["new_token_ids"] == ar["new_token_ids"]
