"""The memory-bandwidth limit of plain decoding.

Decoding one token reads every weight of the target once, so no decoder that runs one
target forward per token can beat

    limit (tokens/s) = measured memory bandwidth (bytes/s) / weight bytes per forward.

Weight bytes count each parameter tensor once (tied input/output embeddings are one tensor:
the output projection reads it in full every token, the input embedding reads one row, so
counting it once is a slight underestimate of the traffic and the limit is an upper bound).
Bandwidth is measured as the best of a few passes of reading a buffer much larger than
the caches (a reduction over 512 MB by default), with the same torch threads decoding uses.
"""

from __future__ import annotations

import itertools
import time

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (low-bit layers keep their weights as buffers, weights.py)."""
    seen, total = set(), 0
    for p in itertools.chain(model.parameters(), model.buffers()):
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


@torch.no_grad()
def read_bandwidth(device: torch.device | str = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of streaming reads (best of `repeats`)."""
    device = torch.device(device)
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def decode_limit(model: torch.nn.Module, device: torch.device | str = "cpu") -> dict:
    """Weight bytes, measured bandwidth, and the tokens/s limit of one-forward-per-token decoding."""
    size = weight_bytes(model)
    bandwidth = read_bandwidth(device)
    return {"weight_bytes": size, "bandwidth_bytes_per_s": bandwidth, "limit_tokens_per_s": bandwidth / size}
