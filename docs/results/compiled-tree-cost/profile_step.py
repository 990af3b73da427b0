"""torch.profiler over 20 compiled steps of 1 and of 4 tree tokens (float32 target, 300-token context).
    python docs/results/compiled-tree-cost/profile_step.py   (README.md beside this file)"""
import torch
from torch.profiler import profile, ProfilerActivity
from dynatree.models import load_model
from dynatree import cache as kv
torch.manual_seed(0)
t = load_model("smollm2-135m", device="cpu", dtype="float32", weights="dense")
ctx = torch.randint(100, 40000, (300,)).tolist()
t.warm_up(("token", "tree"))
cache = kv.new_cache(t.model)
t.forward(cache, ctx, list(range(300)), None, last_only=True)
@torch.no_grad()
def step(n):
    allowed = torch.cat([torch.ones(n, 300, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
    mask = None if n == 1 else t.masks(allowed, torch.arange(300, 300 + n), torch.arange(300 + n))
    t.forward(cache, [5] * n, list(range(300, 300 + n)), mask, compiled=True)
    kv.crop(cache, 300)
from dynatree import kernels
for n in (1, 4):
    for _ in range(5): step(n)
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20): step(n)
    print(f"==== n={n}")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
print("fell back", len(kernels._FELL_BACK))
