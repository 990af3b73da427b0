"""Per-run statistics, with one definition for every method (see README, "Metrics").

  throughput (tokens_per_s) = new tokens / wall time (prefill included, model load excluded)
  acceptance_rate  = drafted tokens committed / drafted tokens proposed   (never above 1)
  tokens_per_iter L = new tokens / target passes (the prefill counts as the first pass)
  mean_generated_len M = tokens committed per verification pass, prefill excluded
                    (paper 004's M: accepted draft tokens + the bonus token, per iteration);
                    where the first pass verified drafts too (transformers' assisted and
                    prompt-lookup generation), it counts as a verification pass
  accepted_len l    = committed drafted tokens / target passes (bonus tokens excluded)
  ttft_s = time from the call to the first new token; tpot_s = (wall - ttft) / (new - 1)
  new tokens are those the result returns: where a stop string cut the last committed group, the
                tokens decoded past it are not counted, nor, among them, its drafted ones
  draft_ms / verify_ms / commit_ms = mean time per decode iteration spent growing the tree
                (drafter + policy), in the target's verification pass (+ acceptance, whose host
                sync waits for the device), and committing caches and drafter state; our
                methods only (None for transformers' generate())
  compile_s = seconds spent compiling the target's decode steps before the clock started
                (--compile; 0.0 when this process had built them already, None without --compile);
                graphs_compiled_while_timed = graphs compiled inside the timed span (0 expected)
  peak_mem_mb = peak resident memory of the process during the run (CPU; the kernel's
                high-water mark is reset at the start) or peak allocated device memory (CUDA),
                measured by `api.run` around the timed span; None where nobody measured it (a
                server's decodes share one process) or the system has no resettable peak (not Linux)
"""

from __future__ import annotations

import ctypes
import re
import time
from dataclasses import dataclass, field

import torch

from .result import Summary


@dataclass
class Stats:
    new_tokens: int = 0
    iterations: int = 0  # target forward passes, prefill included
    drafted_tokens: int = 0  # drafted tree nodes sent to verification
    accepted_tokens: int = 0  # drafted tokens committed (bonus tokens excluded)
    ttft_s: float = 0.0
    wall_s: float = 0.0
    peak_mem_mb: float | None = None  # set by whoever measured the run's span (api.run); None: not measured
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes per iteration
    accepted_lens: list[int] = field(default_factory=list)  # committed draft tokens per iteration
    draft_s: float | None = None  # total time of the decode loop's phases (None: not measured, e.g. hf-*)
    verify_s: float | None = None
    commit_s: float | None = None
    compile_s: float | None = None  # compiling the target's decode steps before the clock started (--compile)
    graphs_compiled_while_timed: int | None = None  # graphs compiled inside the timings (--compile; 0 expected)
    prefill_verified: bool = False  # the first pass verified drafted tokens too (hf-assisted, hf-lookup)
    last_group: int = 0  # new tokens the last verification committed (0: none, or an engine that does not say)

    def count_iteration(self, drafted: int, accepted: int, committed: int, draft_s: float, verify_s: float,
                        commit_s: float) -> None:
        """One verification: `drafted` nodes verified, `accepted` of them committed (bonus excluded),
        `committed` new tokens in all, and the seconds each phase of the iteration took."""
        self.iterations += 1
        self.new_tokens += committed
        self.last_group = committed
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.tree_sizes.append(drafted)
        self.accepted_lens.append(accepted)
        self.draft_s = (self.draft_s or 0.0) + draft_s
        self.verify_s = (self.verify_s or 0.0) + verify_s
        self.commit_s = (self.commit_s or 0.0) + commit_s

    def summary(self, kept: int | None = None) -> Summary:
        """The figures of a result (`Result.stats`), derived from the counts above. `kept`: the new
        tokens the result returns when a stop string cut the last committed group; the token count
        and the rates derived from it (L, M, tok/s, TPOT) are over those, what was decoded past the
        stop being thrown away; so are the drafted tokens among them (the accepted count, l and the
        acceptance rate), which a cut group loses after its bonus token (the last of a group; one per
        pass where the engine does not say)."""
        n, it = self.new_tokens if kept is None else min(kept, self.new_tokens), self.iterations
        accepted = self.accepted_tokens
        if n < self.new_tokens:
            bonus = self.last_group - self.accepted_lens[-1] if self.last_group and self.accepted_lens else 1
            accepted = max(0, accepted - max(0, self.new_tokens - n - bonus))

        def per_iteration(total: float | None) -> float | None:  # ms per decode iteration, prefill excluded
            return None if total is None or it < 2 else 1e3 * total / (it - 1)

        return Summary(
            new_tokens=n,
            iterations=it,
            acceptance_rate=accepted / self.drafted_tokens if self.drafted_tokens else None,
            tokens_per_iter=n / it if it else None,
            mean_generated_len=(n / it if it else None) if self.prefill_verified
            else (n - 1) / (it - 1) if it > 1 else None,
            accepted_len=accepted / it if it else None,
            ttft_s=self.ttft_s,
            tpot_s=(self.wall_s - self.ttft_s) / (n - 1) if n > 1 else None,
            wall_s=self.wall_s,
            tokens_per_s=n / self.wall_s if self.wall_s > 0 else None,
            peak_mem_mb=self.peak_mem_mb,
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=accepted,
            compile_s=self.compile_s,
            graphs_compiled_while_timed=self.graphs_compiled_while_timed,
            draft_ms=per_iteration(self.draft_s),
            verify_ms=per_iteration(self.verify_s),
            commit_ms=per_iteration(self.commit_s),
        )


class Clock:
    """Wall-clock timer that waits for queued device work before reading the time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def elapsed(self) -> float:
        return self.now() - self.start


class PeakMemory:
    """Peak memory of one run: device allocations on CUDA, resident set size on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self.resettable = _reset_rss_peak()

    def peak_mb(self) -> float | None:
        """The peak since this meter started, or None where the system cannot say (no resettable
        high-water mark: the process-lifetime peak would count earlier runs' and loads' memory)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        if not self.resettable:
            return None
        match = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())
        return int(match.group(1)) / 1024 if match else None


def _reset_rss_peak() -> bool:
    """Reset the kernel's peak-RSS counter (Linux `clear_refs` 5); False where unsupported.

    Freed heap is first handed back to the OS (glibc `malloc_trim`), so that memory an
    earlier run freed but the allocator kept does not count as this run's peak.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
