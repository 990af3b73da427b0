"""Inductor's int4 template at static row counts 1-4 (its AVX-512 micro-kernel) against the eager int4
kernel, bit for bit: 6 shapes (SmolLM2-135M's four and two small ones) x 4 row counts x 25 random inputs
(magnitudes 1e-2 to 1e2), random codes, scales and offsets. Prints each difference and the count.
`python woq_equal.py` (about 20 s)."""
import sys, time, torch
import torch._inductor.config as ic
torch.manual_seed(0); torch.set_num_threads(2)
shapes = [(1536, 576), (576, 1536), (576, 576), (192, 576), (128, 64), (64, 128)]
ic.freezing = True; ic.max_autotune = True; ic.max_autotune_gemm_backends = "CPP"
class L(torch.nn.Module):
    def __init__(s, n, k):
        super().__init__()
        s.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1))
        s.register_buffer("sz", torch.stack([torch.rand(k // 32, n) * 0.05, torch.randn(k // 32, n) * 0.05], -1).bfloat16().contiguous())
    def forward(s, x):
        return torch._weight_int4pack_mm_for_cpu(x, s.packed, 32, s.sz)
bad = 0
with torch.no_grad():
    for n, k in shapes:
        l = L(n, k).eval()
        for rows in (1, 2, 3, 4):
            c = torch.compile(l, dynamic=False)
            for t in range(25):
                x = (torch.randn(rows, k) * (10 ** torch.empty(1).uniform_(-2, 2))).bfloat16()
                a, b = l(x), c(x)
                if not torch.equal(a, b): bad += 1; print("differs", n, k, rows, (a.float()-b.float()).abs().max().item())
            torch._dynamo.reset()
        print(n, k, "done", flush=True)
print("bad", bad)
