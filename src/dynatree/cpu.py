"""What this CPU can run, asked of PyTorch and oneDNN at run time (never by CPU model name).

Machines of the same kind differ: some have AVX-512 with bfloat16 instructions, some AVX2
only. oneDNN's packed linear (kernels.py) runs float32 everywhere, but bfloat16 only with
avx512bw/vl/dq or avx_ne_convert, and float16 only with avx512_fp16 or avx_ne_convert;
elsewhere `mkldnn._reorder_linear_weight` raises. So the kernel choice asks, per dtype, with
a tiny probe (a 2x16 by 16x8 product, packed and multiplied once, cached for the process):
the probe's error is oneDNN's own statement of what the CPU lacks, which is what a user who
asked for `--linear onednn` is told.

`describe()` is what result records store about the CPU (`env.cpu_support`), so figures from
an AVX2 and an AVX-512 machine are never mistaken for one another. An AVX2-only machine can
be imitated on an AVX-512 one for testing with `ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2` (both are read when torch starts); `describe()` records those
variables when set.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

# CPU flags worth recording next to a timing (from /proc/cpuinfo; recorded, never used to decide)
FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "avx_ne_convert", "avx_vnni",
         "amx_tile", "amx_bf16", "amx_fp16")
# environment variables that limit the instruction sets torch and oneDNN use
ISA_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
_PREFIX = "mkldnn_reorder_linear_weight: "


def capability() -> str:
    """ATen's vector instruction set for CPU kernels: "AVX512", "AVX2", "DEFAULT", ... ."""
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def onednn_linear_problem(dtype: torch.dtype) -> str | None:
    """None when oneDNN's packed linear computes `dtype` correctly on this CPU; otherwise why not,
    in oneDNN's words where it gives them (e.g. "bf16 path needs the cpu support avx_ne_convert or
    avx512bw, avx512vl and avx512dq")."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this PyTorch build has no oneDNN linear"
    weight = torch.ones(8, 16, dtype=dtype, device="cpu")  # "cpu": never a default device set by the user
    x = torch.ones(2, 16, dtype=dtype, device="cpu")
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        right = torch.equal(y, F.linear(x, weight))  # 16.0 everywhere: exact in every float dtype
    except Exception as exc:  # oneDNN raises RuntimeError; anything else means "cannot" just as well
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0].removeprefix(_PREFIX)
    if not right:
        return f"oneDNN's {_name(dtype)} linear gave wrong results in a probe"
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def describe() -> dict:
    """The CPU facts a result record keeps: ATen's capability, which dtypes oneDNN's packed linear
    runs here, the relevant CPU flags, and any instruction-set limit set in the environment."""
    flags = cpu_flags()
    info = {
        "capability": capability(),
        "onednn_linear_dtypes": [_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)
                                 if onednn_linear_problem(d) is None],
        "flags": [f for f in FLAGS if f in flags],
    }
    limits = {k: os.environ[k] for k in ISA_LIMITS if os.environ.get(k)}
    if limits:
        info["isa_limits"] = limits
    return info


def summary(info: dict | None = None) -> str:
    """One line for report headers: "AVX512, oneDNN float32/bfloat16, avx512_bf16 amx_bf16"."""
    info = describe() if info is None else info
    text = f"{info['capability']}, oneDNN linear in {'/'.join(info['onednn_linear_dtypes']) or 'no dtype'}"
    bf16 = [f for f in info["flags"] if "bf16" in f or "fp16" in f or f == "avx_ne_convert"]
    if bf16:
        text += f" ({' '.join(bf16)})"
    if info.get("isa_limits"):
        text += " [limited: " + ", ".join(f"{k}={v}" for k, v in info["isa_limits"].items()) + "]"
    return text
