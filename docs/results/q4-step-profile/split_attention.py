"""Exact attention split into a fast part and a float64 part (2026-11-28, Intel Xeon with AMX; README.md beside
this file). Two checks, seconds each:
  python docs/results/q4-step-profile/split_attention.py rows    # are the CPU flash kernel's rows independent?
  python docs/results/q4-step-profile/split_attention.py speed   # cost of the chunked design vs the shipped one
The idea: a row at position p sees keys [0, p]; compute the full aligned chunks of B keys with the fast
(bfloat16 or float32) flash kernel, one query per task so each (row, chunk) is computed as a one-token step
would, take each chunk's log-sum-exp, and merge the chunks and a float64 tail in float64."""
import statistics, sys, time

import torch
import torch.nn.functional as F

torch.set_grad_enabled(False)
L, H, HK, D = 30, 9, 3, 64
G = H // HK
op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, logsumexp)


def rows():
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float32):
        for S in (37, 700, 2048):  # batch elements (K shared by stride 0) against the same query alone
            K = torch.randn(1, HK, S, D, generator=g).to(dt); V = torch.randn(1, HK, S, D, generator=g).to(dt)
            q = torch.randn(12, H, 1, D, generator=g).to(dt)
            o, lse = op(q, K.expand(12, -1, -1, -1), V.expand(12, -1, -1, -1), scale=0.125)
            same = sum(torch.equal(op(q[i:i + 1], K, V, scale=0.125)[0], o[i:i + 1]) for i in range(12))
            print(f"{dt} keys {S}: batch rows equal to one-query calls: {same}/12")
        for B in (64, 256):  # M query rows in one call against one-query calls
            K = torch.randn(4, HK, B, D, generator=g).to(dt); V = torch.randn(4, HK, B, D, generator=g).to(dt)
            bad = tot = 0
            for M in (2, 3, 5, 8, 16, 31, 64):
                q = torch.randn(1, H, M, D, generator=g).to(dt).expand(4, -1, -1, -1)
                o, _ = op(q, K, V, scale=0.125)
                for i in range(M):
                    tot += 1; bad += not torch.equal(op(q[:, :, i:i + 1], K, V, scale=0.125)[0], o[:, :, i:i + 1])
            print(f"{dt} chunk {B}: rows of an M-query call differing from one-query calls: {bad}/{tot}")


def bench(f, n=15):
    f(); f(); t = []
    for _ in range(n):
        s = time.perf_counter(); f(); t.append(time.perf_counter() - s)
    return statistics.median(t) * 1e3


def chunked(q, K, V, N, B, dt):
    """One query [1,H,1,D] over keys [0,N) of a [1,HK,maxlen,D] cache: every chunk of the cache as a head
    (the only single-stride view), one query per task, merged with a float64 tail in float64."""
    nall, nch = K.shape[2] // B, N // B
    Kc = K.as_strided((1, HK * nall, B, D), (K.stride(0), B * D, D, 1))
    Vc = V.as_strided((1, HK * nall, B, D), (V.stride(0), B * D, D, 1))
    qq = q.to(dt).view(1, HK, 1, G, D).expand(1, HK, nall, G, D).reshape(1, HK * nall * G, 1, D)
    o, lse = op(qq, Kc, Vc, scale=0.125)
    o = o.view(1, HK, nall, G, D)[:, :, :nch].double(); lse = lse.view(1, HK, nall, G)[:, :, :nch].double()
    ot, lt = op(q.double(), K[:, :, nch * B:N].double(), V[:, :, nch * B:N].double(), scale=0.125)
    allo = torch.cat([o, ot.view(1, HK, 1, G, D)], 2); alll = torch.cat([lse, lt.view(1, HK, 1, G)], 2)
    w = torch.exp(alll - alll.amax(2, keepdim=True))
    return ((allo * w[..., None]).sum(2) / w.sum(2)[..., None]).reshape(1, H, 1, D).to(q.dtype)


def speed(maxlen=2304):
    for N in (300, 700, 1000, 2000):
        g = torch.Generator().manual_seed(0)
        q = [torch.randn(1, H, 1, D, generator=g).bfloat16() for _ in range(L)]
        k16 = [torch.randn(1, HK, maxlen, D, generator=g).bfloat16() for _ in range(L)]
        v16 = [torch.randn(1, HK, maxlen, D, generator=g).bfloat16() for _ in range(L)]
        k64 = [x.double() for x in k16]; v64 = [x.double() for x in v16]

        def shipped():
            return [F.scaled_dot_product_attention(a.double(), b[:, :, :N], c[:, :, :N], scale=0.125,
                                                   enable_gqa=True).bfloat16() for a, b, c in zip(q, k64, v64)]
        line = f"keys {N}: shipped (float64 SDPA) {bench(shipped):.2f} ms"
        for dt, ks, vs in ((torch.bfloat16, k16, v16), (torch.float32, [x.float() for x in k16], [x.float() for x in v16])):
            for B in (128, 256):
                line += f" | {str(dt)[6:]} chunks of {B} {bench(lambda: [chunked(a, b, c, N, B, dt) for a, b, c in zip(q, ks, vs)]):.2f}"
        print(line, flush=True)


{"rows": rows, "speed": speed}[sys.argv[1]]()
