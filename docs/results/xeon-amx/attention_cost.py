"""SDPA cost of one decode step of SmolLM2-135M (30 layers, 9 query heads over 3 KV heads, head size 64, one
query row, distinct K/V per layer as a cache holds them) by the dtype the attention runs in and the keys
it reads: float64 (what low-bit targets run, attention.EXACT_SDPA), float32, bfloat16. Medians of 30.

    python docs/results/xeon-amx/attention_cost.py
"""
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)

def t(dtype, L, rows=1, reps=30):
    qs = [torch.randn(1, 9, rows, 64, dtype=dtype) for _ in range(30)]
    ks = [torch.randn(1, 3, L, 64, dtype=dtype) for _ in range(30)]
    vs = [torch.randn(1, 3, L, 64, dtype=dtype) for _ in range(30)]
    mask = torch.zeros(1, 1, rows, L, dtype=dtype)
    for _ in range(3):
        for q, k, v in zip(qs, ks, vs): F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for q, k, v in zip(qs, ks, vs): F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        best.append(time.perf_counter() - t0)
    best.sort(); return best[len(best)//2] * 1e3
for L in (300, 1000, 2000):
    print(L, {str(d).split('.')[1]: round(t(d, L), 2) for d in (torch.float64, torch.float32, torch.bfloat16)}, "ms per 30 layers")
