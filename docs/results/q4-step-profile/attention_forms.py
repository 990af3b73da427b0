"""Float64 attention of one query, 30 layers of SmolLM2's shapes on a float64 cache: SDPA (shipped) against
matmul-softmax-matmul, eager and compiled (2026-11-29; README.md beside this file, "Inductor's own int4
GEMM template"). `python attention_forms.py` (about 1 minute)."""
import torch, time, statistics
import torch.nn.functional as F
torch.set_grad_enabled(False); torch.set_num_threads(2)
L, H, HK, D = 30, 9, 3, 64
def bench(f, *a, n=20):
    f(*a); f(*a); t=[]
    for _ in range(n):
        s=time.perf_counter(); f(*a); t.append(time.perf_counter()-s)
    return statistics.median(t)*1e3
def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.double(), k, v, scale=0.125, enable_gqa=True).bfloat16()
def explicit(q, k, v):
    qg = q.double().reshape(1, HK, H // HK, D)          # [1, HK, G, D] (one query: heads of a group as rows)
    s = torch.matmul(qg, k.transpose(-1, -2)) * 0.125    # [1, HK, G, K]
    p = torch.softmax(s, -1)
    return torch.matmul(p, v).reshape(1, H, 1, D).bfloat16()
csdpa = torch.compile(sdpa, dynamic=True); cexp = torch.compile(explicit, dynamic=True)
for K in (300, 700, 1000, 2000):
    g = torch.Generator().manual_seed(0)
    q = [torch.randn(1, H, 1, D, generator=g).bfloat16() for _ in range(L)]
    k64 = [torch.randn(1, HK, K, D, generator=g).bfloat16().double() for _ in range(L)]
    v64 = [torch.randn(1, HK, K, D, generator=g).bfloat16().double() for _ in range(L)]
    run = lambda f: [f(a, b, c) for a, b, c in zip(q, k64, v64)]
    same = sum(torch.equal(x, y) for x, y in zip(run(sdpa), run(explicit)))
    print(f"K={K}: sdpa {bench(run, sdpa):.2f}  explicit {bench(run, explicit):.2f}  compiled sdpa {bench(run, csdpa):.2f}  compiled explicit {bench(run, cexp):.2f} ms; equal layers {same}/{L}", flush=True)
