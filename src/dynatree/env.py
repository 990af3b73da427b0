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
