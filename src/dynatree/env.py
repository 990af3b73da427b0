"""What a result was measured on: package versions and machine."""

from __future__ import annotations

import functools
import os
import platform
import time
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


BUSY_CPUS = 0.25  # CPUs' worth of other processes' time beyond which a run's timing is flagged
AUTOGROUP = "/proc/sys/kernel/sched_autogroup_enabled"  # Linux: 1 when each session is scheduled as one group


def contention_advice() -> str:
    """What to do when other processes shared the CPU with timed runs. Where the kernel's autogroup is on
    (most Linux distributions), each terminal session is scheduled as one group and `nice` only orders
    processes within their own group: a job niced in another terminal still takes its equal share, and
    with OpenMP's threads waiting on one another at every kernel a step can run tens of times slower (a
    decode measured here at 0.8 instead of 51 tokens/s beside a `nice -n 19` job in another session). The
    group's own niceness is what lowers it."""
    try:
        with open(AUTOGROUP) as f:
            grouped = f.read().strip() == "1"
    except OSError:
        grouped = False
    advice = "stop them or measure when the machine is idle"
    if grouped:
        advice += ("; a job started from another terminal is not lowered by `nice` alone here (the kernel's "
                   "autogroup): `echo 19 > /proc/PID/autogroup` lowers its whole session")
    return advice


class OtherCpu:
    """A run's token callback that also reads how much CPU other processes used from its first streamed
    tokens to `result()` (after any compiling, which happens before the clock and may run in worker
    processes): on a machine of few cores a busy neighbour slows a run without a sign in its own figures."""

    MIN_WINDOW_S = 1.0  # /proc/stat counts in 10 ms ticks: shorter windows would give noise

    def __init__(self, forward=None):
        self.forward, self.start = forward, None  # forward: the callback it wraps, or None

    def __call__(self, new: list[int]) -> None:
        if self.start is None:
            self.start = (cpu_seconds(), time.perf_counter())
        if self.forward is not None:
            self.forward(new)

    def result(self) -> float | None:
        """CPUs' worth of time other processes used while this run decoded; None when unknown."""
        if self.start is None:
            return None
        wall = time.perf_counter() - self.start[1]
        return other_cpu(self.start[0], cpu_seconds(), wall) if wall >= self.MIN_WINDOW_S else None


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
