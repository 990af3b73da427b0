"""One 576x576 linear at 4 rows: dynatree::packed_linear (the operator a compiled tree step calls) vs its
Python body vs oneDNN called directly, microseconds per call.  python docs/results/compiled-tree-cost/op_cost.py"""
import time, torch
from dynatree import kernels
torch.manual_seed(0)
lin = torch.nn.Linear(576, 576, bias=False)
m = torch.nn.Sequential(lin); kernels.use_packed_linears(m, "onednn")
layer = m[0]
x = torch.randn(4, 576)
def bench(f, n=20000):
    for _ in range(1000): f()
    t0 = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t0) / n * 1e6
with torch.no_grad():
    a = bench(lambda: torch.ops.dynatree.packed_linear(x, layer.weight, None, layer.slot))
    b = bench(lambda: torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], ""))
    c = bench(lambda: kernels.packed_linear(x, layer.weight, None, layer.slot))
print(f"op {a:.1f} us, direct mkldnn {b:.1f} us, python body {c:.1f} us")
