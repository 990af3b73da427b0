"""float64 attention over a bfloat16 KV cache written out as products and sums for inductor (torch.compile,
dynamic shapes), against the shipped float64 SDPA over a float64 cache: 30 layers of SmolLM2 heads, 1 and 8 query
rows, medians of 20. `python docs/results/xeon-amx/attention_inductor.py`"""
import time, torch, torch.nn.functional as F
torch.set_num_threads(2)
def ref(q, k, v, mask):  # shipped: float64 cache, float64 SDPA
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, enable_gqa=True).to(q.dtype)
def fused(q, k, v, mask):  # bf16 cache, float64 math written out for inductor
    B, H, R, D = q.shape; G = k.shape[1]
    qg = q.view(B, G, H // G, R, D).double()
    s = (qg[..., None, :] * k[:, :, None, None, :, :].double()).sum(-1) * D ** -0.5 + mask[:, :, None]  # [B,G,h,R,L]
    p = torch.softmax(s, -1)
    o = (p[..., None] * v[:, :, None, None, :, :].double()).sum(-2)  # [B,G,h,R,D]
    return o.reshape(B, H, R, D).to(q.dtype)
cf = torch.compile(fused, dynamic=True)
def bench(fn, qs, ks, vs, mask, reps=20):
    for _ in range(3):
        for q, k, v in zip(qs, ks, vs): fn(q, k, v, mask)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for q, k, v in zip(qs, ks, vs): fn(q, k, v, mask)
        ts.append(time.perf_counter() - t0)
    ts.sort(); return round(ts[len(ts)//2] * 1e3, 2)
for L in (300, 1000, 2000):
    for R in (1, 8):
        qs = [torch.randn(1, 9, R, 64).bfloat16() for _ in range(30)]
        k16 = [torch.randn(1, 3, L, 64).bfloat16() for _ in range(30)]
        v16 = [torch.randn(1, 3, L, 64).bfloat16() for _ in range(30)]
        k64 = [k.double() for k in k16]; v64 = [v.double() for v in v16]
        mask = torch.zeros(1, 1, R, L, dtype=torch.float64)
        a = ref(qs[0], k64[0], v64[0], mask); b = cf(qs[0], k16[0], v16[0], mask)
        print(L, R, "equal" if torch.equal(a, b) else f"maxdiff {(a.float()-b.float()).abs().max():.2e}",
              "sdpa64", bench(ref, qs, k64, v64, mask), "inductor-bf16cache", bench(cf, qs, k16, v16, mask), flush=True)
