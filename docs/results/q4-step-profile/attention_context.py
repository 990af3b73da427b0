"""Exact (float64) attention of a q4 step at longer contexts: 30 layers of SmolLM2's shapes (9 query heads,
3 KV heads, head size 64), one query, random bfloat16 keys and values (2026-11-27; README.md beside this file).
  python docs/results/q4-step-profile/attention_context.py
Per context: SDPA on a float64 cache (as shipped), on a bfloat16 cache copied into a float64 buffer per
layer (4x fewer bytes kept), and plain bfloat16 SDPA (not exact across tree layouts; for scale)."""
import torch, time, statistics, sys
import torch.nn.functional as F
torch.set_grad_enabled(False)
L, H, HK, D = 30, 9, 3, 64
def bench(f, *a, n=20):
    f(*a); f(*a); t=[]
    for _ in range(n):
        s=time.perf_counter(); f(*a); t.append(time.perf_counter()-s)
    return statistics.median(t)*1e3
for K in (300, 1000, 2000, 4000):
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(1, H, 1, D, generator=g).bfloat16() for _ in range(L)]
    k16 = [torch.randn(1, HK, K, D, generator=g).bfloat16() for _ in range(L)]
    v16 = [torch.randn(1, HK, K, D, generator=g).bfloat16() for _ in range(L)]
    k64 = [x.double() for x in k16]; v64 = [x.double() for x in v16]
    kb = torch.empty(1, HK, K, D, dtype=torch.float64); vb = torch.empty_like(kb)
    def shipped():
        return [F.scaled_dot_product_attention(a.double(), b, c, scale=0.125, enable_gqa=True).bfloat16() for a, b, c in zip(q, k64, v64)]
    def buffered():
        out = []
        for a, b, c in zip(q, k16, v16):
            kb.copy_(b); vb.copy_(c)
            out.append(F.scaled_dot_product_attention(a.double(), kb, vb, scale=0.125, enable_gqa=True).bfloat16())
        return out
    def bf16():
        return [F.scaled_dot_product_attention(a, b, c, scale=0.125, enable_gqa=True) for a, b, c in zip(q, k16, v16)]
    same = all(torch.equal(x, y) for x, y in zip(shipped(), buffered()))
    print(f"K={K}: f64 cache {bench(shipped):.2f} ms, bf16 cache + f64 buffer {bench(buffered):.2f} ms (equal {same}), bf16 sdpa {bench(bf16):.2f}", flush=True)
