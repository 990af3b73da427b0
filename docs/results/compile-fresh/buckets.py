"""Static tree graphs per bucket size vs one graph with symbolic sizes: compile time and step time (SmolLM2)."""
import statistics, sys, time, torch
from dynatree import cache as kv
from dynatree import runtime
from dynatree.models import load_model
from dynatree.tree import additive_mask

mode = sys.argv[1]  # "symbolic" or "static"
target = load_model("smollm2-135m", compile=True)
if mode == "static":  # no dynamic sources: torch.compile with dynamic=False, one graph per size
    torch._dynamo.config.recompile_limit = 64
    target._compiled = torch.compile(target.model, dynamic=False, options={"freezing": True, "guard_filter_fn": runtime.module_guards})
ctx = list(range(100, 400))
cache = kv.new_cache(target.model)
target.forward(cache, ctx, list(range(len(ctx))), None, last_only=True)
base = len(ctx)
def step(n):
    allowed = torch.cat([torch.ones(n, base, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
    mask = additive_mask(allowed, target.dtype)
    t0 = time.perf_counter(); target.forward(cache, [5] * n, list(range(base, base + n)), mask); dt = time.perf_counter() - t0
    kv.crop(cache, base); return dt
with torch.no_grad():
    for n in (2, 4, 8, 16, 32):
        g = runtime.compiled_graphs(); first = step(n); compiled = runtime.compiled_graphs() - g
        times = [step(n) for _ in range(15)]
        print(f"{mode} n={n}: first call {first:.1f} s ({compiled} graph), step median {1e3*statistics.median(times):.1f} ms", flush=True)
