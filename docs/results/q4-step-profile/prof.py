import sys, torch
from torch.profiler import profile, ProfilerActivity
from dynatree.models import load_model
from dynatree import cache as kv
torch.manual_seed(0)
t = load_model("smollm2-135m", device="cpu", weights="q4", compile=True)
t.warm_up(["token"])
ctx = 300
ids = [int(x) for x in torch.randint(100, 40000, (ctx,))]
cache = kv.new_cache(t.model)
with torch.no_grad():
    t.forward(cache, ids[:-1], list(range(ctx - 1)), None, last_only=True)
    for _ in range(10):
        t.forward(cache, [ids[-1]], [ctx - 1], None, compiled=True); kv.crop(cache, ctx - 1)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(50):
                t.forward(cache, [ids[-1]], [ctx - 1], None, compiled=True); kv.crop(cache, ctx - 1)
print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
