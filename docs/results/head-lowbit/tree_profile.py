"""Where a compiled q4 tree step's extra rows go (issue 32): torch.profiler over 30 steps of n = 1, 2, 4, 8
tree tokens (a chain, tree mask, as verification runs them) at a 300-token context (random ids), ops grouped
as int4 products, attention, the output layer, the rest; ms per step, and the step's median wall time.

  python docs/results/head-lowbit/tree_profile.py > tree_profile.txt
"""
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dynatree import cache as kv
from dynatree.models import load_model
from dynatree.tree import causal_allowed

CONTEXT, STEPS = 300, 30
torch.manual_seed(0)
torch.set_grad_enabled(False)  # as the decoder runs
target = load_model("smollm2-135m", weights="q4", compile=True)
target.warm_up(["token", "tree"])
ids = [int(x) for x in torch.randint(100, 40000, (CONTEXT + 8,))]
cache = kv.new_cache(target.model)
target.forward(cache, ids[:CONTEXT], list(range(CONTEXT)), None, last_only=True)


def step(n):
    mask = None if n == 1 else target.masks(causal_allowed(CONTEXT, n), torch.arange(CONTEXT, CONTEXT + n),
                                            torch.arange(CONTEXT + n))
    target.forward(cache, ids[CONTEXT:CONTEXT + n], list(range(CONTEXT, CONTEXT + n)), mask, compiled=True)
    kv.crop(cache, CONTEXT)


def group(key):
    k = key.lower()
    if "int4" in k:
        return "int4 products"
    if "attention" in k or "sdpa" in k:
        return "attention (float64 SDPA)"
    if k in ("aten::mm", "aten::linear", "aten::matmul", "aten::addmm") or "onednn" in k or "mkldnn" in k or "dynatree::" in k:
        return "dense products (output layer)"
    return None


for n in (1, 2, 4, 8):
    for _ in range(5):
        step(n)
    walls = []
    for _ in range(STEPS):
        t0 = time.perf_counter(); step(n); walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step(n)
    parts = defaultdict(float)
    for e in prof.key_averages():
        g = group(e.key)
        if g:
            parts[g] += e.self_cpu_time_total / 1e3 / STEPS
    wall = 1e3 * statistics.median(walls)
    rest = wall - sum(parts.values())
    print(f"n={n}: wall {wall:.2f} ms; " + "; ".join(f"{g} {v:.2f}" for g, v in sorted(parts.items()))
          + f"; rest {rest:.2f}", flush=True)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
