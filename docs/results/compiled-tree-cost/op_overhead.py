"""Call overhead of a tiny product: torch.compile(dynamic=True) (dynamo's guards on every call) against the
same graph compiled by inductor directly (make_fx, torch._inductor.compile: no guards), and eager matmul.
    python docs/results/compiled-tree-cost/op_overhead.py   (README.md beside this file, the row-inner addendum)"""
import time, statistics, torch
from torch.fx.experimental.proxy_tensor import make_fx
torch.set_grad_enabled(False)
def row_inner(x, w):
    return (w[:, :, None] * x.t()[None]).sum(1).t()
def bench(f, n=2000):
    f(); f()
    ts=[]
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(n): f()
        ts.append((time.perf_counter()-t)/n)
    return statistics.median(ts)*1e6
w = torch.randn(64, 64); x = torch.randn(2, 64)
c = torch.compile(row_inner, dynamic=True)
print("torch.compile dynamic, tiny:", round(bench(lambda: c(x, w)),1), "us")
# inductor directly on an fx graph with symbolic shapes
gm = make_fx(row_inner, tracing_mode="symbolic")(x, w)
print(gm.graph)
from torch._inductor import compile as icompile
fn = icompile(gm, [x, w])
print(type(fn))
print("inductor compile (no dynamo):", round(bench(lambda: fn(x, w)),1), "us")
print(torch.equal(fn(x,w), c(x,w)))
print("eager matmul:", round(bench(lambda: x @ w.t()),1), "us")
