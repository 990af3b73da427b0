"""Exact attention as one aligned fast prefix plus a float64 tail (2026-12-03, Intel Xeon with AMX; README.md
beside this file). Seconds each:
  python docs/results/q4-step-profile/prefix_split.py check   # tree rows against one-token rows, bit for bit
  python docs/results/q4-step-profile/prefix_split.py speed   # 30 layers of the split against the shipped float64
  python docs/results/q4-step-profile/prefix_split.py parts   # one layer's pieces at 700 keys
The design (not built): a step whose cache holds n entries attends to keys [0, C) with C = B * (n // B) through the
bfloat16 CPU flash kernel, one task per query row (K and V shared by stride 0, a position's query heads of one KV
head as the task's query rows), and to the rest [C, n + M) in float64 with the step's mask; the two merge in float64
by their log-sum-exps. A one-token step at position p computes the same task over [0, B * (p // B)), so a tree row at
depth d equals it bit for bit when n + d stays below the next multiple of B (the engine would cap a tree's depth
there). Unlike `split_attention.py` (every chunk its own task), the cost follows the context."""
import sys, time

import torch
import torch.nn.functional as F

torch.set_grad_enabled(False)
H, HK, D = 9, 3, 64
G = H // HK
SCALE = D ** -0.5
op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default  # (out, logsumexp)


def shipped(q, k64, v64, mask):
    """attention.exact_sdpa_forward: float64 over a float64 cache, rounded to the query's dtype."""
    return F.scaled_dot_product_attention(q.double(), k64, v64, attn_mask=mask, scale=SCALE, enable_gqa=True).to(q.dtype)


def split(q, k, v, mask, B):
    """q [1, H, M, D] bf16; k, v [1, HK, n + M, D] bf16 (the cache with this step's entries); mask float64."""
    M, L = q.shape[2], k.shape[2]
    C = B * ((L - M) // B)
    kt, vt = (x[:, :, C:].repeat_interleave(G, 1).double() for x in (k, v))
    out_t, lse_t = op(q.double(), kt, vt, attn_mask=mask[..., C:], scale=SCALE)
    if C == 0:
        return out_t.to(q.dtype)
    qa = q[0].transpose(0, 1).reshape(M, HK, G, D)  # one task per row
    out_a, lse_a = op(qa, k[:, :, :C].expand(M, HK, C, D), v[:, :, :C].expand(M, HK, C, D), scale=SCALE)
    out_a = out_a.reshape(M, H, D).transpose(0, 1)[None].double()
    lse_a = lse_a.reshape(M, H).transpose(0, 1)[None].double()
    w = torch.sigmoid(lse_a - lse_t)[..., None]  # the prefix's share of the softmax
    return torch.lerp(out_t, out_a, w).to(q.dtype)


def check(trials=60):
    g = torch.Generator().manual_seed(0)
    for B in (16, 64, 256):
        bad = tot = 0
        for _ in range(trials):
            n = int(torch.randint(1, 1200, (), generator=g))
            M = int(torch.randint(1, 9, (), generator=g))
            parent = [-1] + [int(torch.randint(0, r, (), generator=g)) for r in range(1, M)]
            depth = [0] * M
            for r in range(1, M):
                depth[r] = depth[parent[r]] + 1
            rows = [r for r in range(M) if n + depth[r] < B * (n // B + 1)]  # the depth cap
            at = {r: i for i, r in enumerate(rows)}
            kc, vc = (torch.randn(1, HK, n + M, D, generator=g).bfloat16() for _ in range(2))
            q = (torch.randn(1, H, M, D, generator=g) * 2).bfloat16()
            sel = torch.tensor(list(range(n)) + [n + r for r in rows])
            mask = torch.full((1, 1, len(rows), n + len(rows)), float("-inf"), dtype=torch.float64)
            mask[..., :n] = 0
            for r in rows:
                a = r
                while a >= 0:
                    mask[0, 0, at[r], n + at[a]] = 0
                    a = parent[a]
            tree = split(q[:, :, rows], kc[:, :, sel], vc[:, :, sel], mask, B)
            for r in rows:
                path, a = [], r
                while a >= 0:
                    path.append(a)
                    a = parent[a]
                one = torch.tensor(list(range(n)) + [n + a for a in reversed(path)])
                alone = split(q[:, :, [r]], kc[:, :, one], vc[:, :, one], torch.zeros(1, 1, 1, len(one), dtype=torch.float64), B)
                tot += 1
                bad += not torch.equal(alone[:, :, 0], tree[:, :, at[r]])
        print(f"B={B}: tree rows differing from their one-token rows: {bad} of {tot}")


def timed(f, reps=25, layers=30):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(layers):
            f(i)
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3


def speed(B=256):
    print(f"30 layers, ms (median of 25), B={B}")
    for n in (300, 500, 700, 1000, 2000):
        for M in (1, 4):
            k64 = [torch.randn(1, HK, n + M, D).bfloat16().double() for _ in range(30)]
            v64 = [torch.randn(1, HK, n + M, D).bfloat16().double() for _ in range(30)]
            k16, v16 = [x.bfloat16() for x in k64], [x.bfloat16() for x in v64]
            q = torch.randn(1, H, M, D).bfloat16()
            mask = torch.zeros(1, 1, M, n + M, dtype=torch.float64)
            mask[..., n:] = float("-inf")
            mask[0, 0, range(M), [n + r for r in range(M)]] = 0
            a = timed(lambda i: shipped(q, k64[i], v64[i], mask))
            b = timed(lambda i: split(q, k16[i], v16[i], mask, B))
            print(f"keys {n:5d}, {M} rows: shipped float64 {a:6.2f}   split {b:6.2f}")


def parts(n=700, C=512):
    k, v = (torch.randn(1, HK, n + 1, D).bfloat16() for _ in range(2))
    q = torch.randn(1, H, 1, D).bfloat16()
    mask = torch.zeros(1, 1, 1, n + 1, dtype=torch.float64)
    k64, v64 = k.double(), v.double()
    kt, vt = (x[:, :, C:].repeat_interleave(G, 1).double() for x in (k, v))
    qa = q[0].transpose(0, 1).reshape(1, HK, G, D)
    for name, f in (("shipped: float64 SDPA over all keys", lambda: shipped(q, k64, v64, mask)),
                    ("split: tail keys to float64 (K and V)", lambda: [x[:, :, C:].repeat_interleave(G, 1).double() for x in (k, v)]),
                    ("split: float64 tail with its log-sum-exp", lambda: op(q.double(), kt, vt, attn_mask=mask[..., C:], scale=SCALE)),
                    (f"split: bfloat16 prefix ({C} keys)", lambda: op(qa, k[:, :, :C], v[:, :, :C], scale=SCALE))):
        f()
        t0 = time.perf_counter()
        for _ in range(300):
            f()
        print(f"{name:45s} {(time.perf_counter() - t0) / 300 * 1e6:7.1f} us")


if __name__ == "__main__":
    {"check": check, "speed": speed, "parts": parts}[sys.argv[1]]()
