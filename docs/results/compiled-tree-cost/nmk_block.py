"""[N, M, K] several-row products behind an opaque contiguous copy, in a model-like graph (README.md beside this file).

  python docs/results/compiled-tree-cost/nmk_block.py   10 norm/up/down blocks (20 float32 layers), 1-8 rows
"""
import torch, time, statistics
torch.set_grad_enabled(False)
lib = torch.library.Library("rq", "DEF")
lib.define("copy(Tensor x) -> Tensor")
lib.impl("copy", lambda x: x.contiguous().clone(), "CPU")
torch.library.register_fake("rq::copy", lambda x: x.new_empty(x.shape))
g, w1, w2 = torch.rand(576) + 0.5, torch.randn(1536, 576) * 0.02, torch.randn(576, 1536) * 0.02
def lin_many(x, w):
    return (w[:, None, :] * torch.ops.rq.copy(x)[None]).sum(-1).t()
def lin_one(x, w):
    return (x.unsqueeze(-2) * w).sum(-1)
def make(lin):
    def layers(h):
        for _ in range(10):
            x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * g
            h = h + lin(torch.nn.functional.silu(lin(x, w1)), w2)
        return h
    return layers
many, one = torch.compile(make(lin_many)), torch.compile(make(lin_one))
def bench(f, x, n=20):
    f(x); f(x); t = []
    for _ in range(n):
        s = time.perf_counter(); f(x); t.append(time.perf_counter() - s)
    return statistics.median(t) * 1e3
h8 = torch.randn(8, 576)
torch._dynamo.mark_dynamic(h8, 0)
full = many(h8)
print("one row (one-row multiply-sum):", f"{bench(one, h8[:1]):.2f} ms")
for m in (2, 4, 8):
    x = h8[:m].clone(); torch._dynamo.mark_dynamic(x, 0)
    print(m, f"rows: {bench(many, x):.2f} ms")
rows_one = torch.cat([one(h8[i:i+1]) for i in range(8)])
print("several-row graph rows bit-equal to one-row graph:", torch.equal(full, rows_one), (full - rows_one).abs().max().item())
