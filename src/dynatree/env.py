"""What a result was measured on: package versions and machine."""

from __future__ import annotations

import functools
import os
import platform
from importlib import metadata

import torch

from . import cpu


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU-seconds every process on the machine has used since boot, those this process has used), to
    tell from two readings how much of a timed run's CPU went to other processes (which make timings
    unreliable on a machine of few cores); None where /proc/stat cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        per_second = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    if len(ticks) < 8:
        return None
    busy = sum(ticks[:3]) + sum(ticks[5:8])  # user, nice, system, irq, softirq, steal: all but idle and I/O wait
    own = os.times()
    return busy / per_second, own.user + own.system


def other_cpu(before: tuple[float, float] | None, after: tuple[float, float] | None, wall_s: float) -> float | None:
    """CPUs' worth of time other processes used between two `cpu_seconds` readings `wall_s` apart."""
    if before is None or after is None or wall_s <= 0:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / wall_s


def describe(device: torch.device | str = "cpu") -> dict:
    return {**_describe(str(torch.device(device))), "torch_threads": torch.get_num_threads()}


@functools.cache
def _describe(device: str) -> dict:  # read once per process (versions, /proc/cpuinfo): a server asks per request
    device = torch.device(device)
    info = {
        "versions": {p: _version(p) for p in ("dynatree", "torch", "transformers", "accelerate", "gguf")},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "cpu_support": cpu.describe(),  # ATen capability, oneDNN dtypes, bf16/AMX flags: never mix machines
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
