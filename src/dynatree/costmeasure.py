"""Measuring the target's verification cost curve (`costmodel.CostCurve`): forwards of `SIZES`
tokens (every size up to 12, then 16 to 64; larger trees are priced by the curve's linear
extension, `CostCurve.at`) timed on the model itself, once per model, compile setting and
one-token mask, and kept for the life of the process. The decoder calls `curve_for` before a
run's timings and hands the curve to the policy, which stays pure.
"""

from __future__ import annotations

import statistics
import time
import weakref

import torch

from . import cache as kv
from .costmodel import CostCurve
from .runtime import LoadedModel, compiled_graphs
from .tree import causal_allowed

# Every size up to 12, then coarser: small sizes are where trees live and where CPU GEMM kernels
# change (docs/methods.md, "cost-aware size").
SIZES = (*range(1, 13), 16, 24, 32, 48, 64)
_CURVES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(compiled?, masked_token?): CostCurve}


@torch.no_grad()
def measure(target: LoadedModel, context: list[int], sizes=SIZES, rounds: int = 5,
            masked_token: bool = False, compiled: bool = False) -> CostCurve:
    """Time forwards of n chained tokens on top of a cache holding `context` (at least 1 token).

    Sizes are timed in whole sweeps: one untimed sweep first (compiled, that is where graphs not
    built yet are built, and steps right after compiling run slower, which made one token look
    dearer than it is), then `rounds` timed sweeps, each
    size's time being its median over the sweeps. A timed sweep during which torch.compile built a
    graph is thrown away and swept again, at most `rounds` times (a graph rebuilt on every sweep
    would otherwise never end the loop; such sweeps then count, and the median leaves out a
    minority of them). Sweeping, rather than timing one size's repeats in a row, spreads a slow
    spell of the machine (a shared machine's memory bandwidth varies within minutes) over every
    size instead of inflating a few, which would bend the curve's shape. One token runs as the decoder runs it
    (the same compiled graph): without a mask, or with one under a KV window (`masked_token`)."""
    cache = kv.new_cache(target.model)
    target.forward(cache, context, list(range(len(context))), None, last_only=True)
    base = len(context)
    steps = []  # per size: ids, positions, mask of n chained tokens after the context
    for n in sizes:
        allowed = causal_allowed(base, n)
        mask = None if n == 1 and not masked_token else target.masks(allowed, torch.arange(base, base + n),
                                                                         torch.arange(base + n))
        steps.append(([context[-1]] * n, list(range(base, base + n)), mask))
    times: list[list[float]] = [[] for _ in sizes]
    sweeps, redone = 0, 0
    while sweeps <= rounds:
        graphs, sweep = compiled_graphs(), []
        for ids, pos, mask in steps:
            t0 = time.perf_counter()
            target.forward(cache, ids, pos, mask, compiled=compiled)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            sweep.append(time.perf_counter() - t0)
            kv.crop(cache, base)  # back to the context
        if sweeps and compiled_graphs() != graphs and redone < rounds:
            redone += 1
            continue  # this sweep compiled: its times are not the steps' cost
        if sweeps:
            for i, t in enumerate(sweep):
                times[i].append(t)
        sweeps += 1
    seconds = [statistics.median(t) for t in times]
    for i in range(1, len(seconds)):  # more tokens never cost less; what looks cheaper is noise
        seconds[i] = max(seconds[i], seconds[i - 1])
    return CostCurve(tuple(sizes), tuple(seconds))


def curve_for(target: LoadedModel, context: list[int], masked_token: bool = False, compiled: bool = False) -> CostCurve:
    """The target's cost curve, measured on first use (on `context`) and then reused; one per
    `compiled` setting (compiled steps cost differently, see `LoadedModel.compiled`) and
    of `masked_token` (one-token steps masked, as under a KV window: another compiled graph)."""
    curves = _CURVES.setdefault(target.model, {})
    key = (compiled, masked_token)
    if key not in curves:
        curves[key] = measure(target, context, masked_token=masked_token, compiled=compiled)
    return curves[key]
