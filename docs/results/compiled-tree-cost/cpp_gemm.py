"""Compiled cost curve with stock linears left to inductor's own CPU GEMM template (freezing + max-autotune,
CPP and ATen backends) instead of dynatree's packed oneDNN linears.
    python docs/results/compiled-tree-cost/cpp_gemm.py   (README.md beside this file; ~4 min of autotuning)"""
import torch
import torch._inductor.config as ic
from dynatree.models import load_model
from dynatree import costmeasure, kernels
ic.freezing = True
ic.max_autotune = True
ic.max_autotune_gemm_backends = "CPP,ATEN"
torch.manual_seed(0)
t = load_model("smollm2-135m", device="cpu", dtype="float32", weights="dense")
ctx = torch.randint(100, 40000, (300,)).tolist()
sizes = (1, 2, 3, 4, 6, 8, 12, 16)
with kernels.stock_linears(t.model):
    import time; t0 = time.time()
    t.warm_up(("token", "tree"))
    print("warm-up", round(time.time() - t0), "s", flush=True)
    c = costmeasure.measure(t, ctx, sizes=sizes, rounds=5, compiled=True)
print("cppgemm", " ".join(f"{n}:{s*1e3:.1f}" for n, s in zip(sizes, c.seconds)), flush=True)
