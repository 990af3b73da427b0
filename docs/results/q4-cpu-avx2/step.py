"""One-token decode step time of the embedded model per weight format, eager, on this CPU:
the cost of `ar`'s step at a 300-token context (median of 60 steps), interleaved rounds."""
import statistics, time, sys, json
import torch
from dynatree import load_model, cache as kv

fmts = {"float32": dict(weights="dense"), "bfloat16": dict(weights="dense", dtype="bfloat16"), "q4": dict(weights="q4")}
models = {k: load_model("smollm2-135m", **v) for k, v in fmts.items()}
ctx = 300
res = {k: [] for k in models}
for rnd in range(3):
    for name, m in models.items():
        cache = kv.new_cache(m.model)
        m.forward(cache, [1] * ctx, list(range(ctx)), None, last_only=True)
        times = []
        for i in range(60):
            t = time.perf_counter()
            m.forward(cache, [5], [ctx + i], None)
            times.append(time.perf_counter() - t)
        res[name].append(statistics.median(times[10:]) * 1e3)
out = {k: {"ms_per_step": round(statistics.median(v), 2), "rounds": [round(x, 2) for x in v], "weights": models[k].weights, "dtype": str(models[k].dtype)} for k, v in res.items()}
out["cpu"] = torch.backends.cpu.get_cpu_capability(); out["threads"] = torch.get_num_threads()
print(json.dumps(out, indent=1))
