"""The embedded target in q4, compiled, one forward of n tokens at a 300-token context (issue 32).

`python step_template.py MODE`, MODE one of
  shipped: as dynatree compiles (int4 products as inductor's extern call to the eager kernel);
  tok:     the one-token graph built under `freezing` + `max_autotune` (backends CPP and ATen), so its
           int4 products may use inductor's template (AVX-512 micro-kernel at one row); tree graphs as shipped;
  amx:     every graph under `freezing` + `max_autotune` (CPP only): tree graphs (rows symbolic) get the
           AMX micro-kernel (`AUTOTUNE=0`: freezing only; `OBLIV=1`: size-oblivious sizes, which failed).
Prints whether the 8 rows of a chain step equal 8 sequential one-token steps (logits bit for bit), the
process's peak RSS, and the median ms of 15 forwards per n (the second best of 3 rounds)."""
import os
import resource
import sys
import time

import torch
import torch._inductor.config as ic

from dynatree import cache as kv
from dynatree.models import load_model
from dynatree.tree import causal_allowed

mode = sys.argv[1]
if mode == "amx":
    ic.freezing = True
    ic.max_autotune = os.environ.get("AUTOTUNE", "1") == "1"
    ic.max_autotune_gemm_backends = "CPP"
    torch.fx.experimental._config.backed_size_oblivious = os.environ.get("OBLIV") == "1"
torch.set_num_threads(2)
m = load_model("smollm2-135m", weights="q4", compile=True)
ctx = 300
ids = torch.randint(0, 49152, (ctx + 40,), generator=torch.Generator().manual_seed(0)).tolist()


def fwd(cache, toks, pos, masked=True):
    n = len(toks)
    mask = m.masks(causal_allowed(pos[0], n), torch.arange(pos[0], pos[0] + n), torch.arange(pos[0] + n)) if masked else None
    return m.forward(cache, toks, pos, mask, compiled=True)


with torch.no_grad():
    cache = kv.new_cache(m.model)
    m.forward(cache, ids[:ctx], list(range(ctx)), None, last_only=True)
    t0 = time.time()
    if mode == "tok":
        with ic.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
            fwd(cache, ids[ctx:ctx + 1], [ctx], masked=False)
            kv.crop(cache, ctx)
        print(f"token graph {time.time() - t0:.0f}s", flush=True)
    for n in (1, 2, 3, 4):
        fwd(cache, ids[ctx:ctx + n], list(range(ctx, ctx + n)))
        kv.crop(cache, ctx)
    print(f"warm {time.time() - t0:.0f}s", flush=True)
    tree = fwd(cache, ids[ctx:ctx + 8], list(range(ctx, ctx + 8)))
    kv.crop(cache, ctx)
    seq = [fwd(cache, [ids[ctx + i]], [ctx + i], masked=False)[0] for i in range(8)]
    kv.crop(cache, ctx)
    print("rows equal sequential:", [torch.equal(tree[i], seq[i]) for i in range(8)], flush=True)
    res = {}
    for rep in range(3):
        for n in (1, 2, 4, 8, 16, 32):
            ts = []
            for _ in range(15):
                t = time.perf_counter()
                fwd(cache, ids[ctx:ctx + n], list(range(ctx, ctx + n)), masked=n > 1)
                ts.append(time.perf_counter() - t)
                kv.crop(cache, ctx)
            res.setdefault(n, []).append(sorted(ts)[7] * 1e3)
    print("maxrss MiB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    print(mode, {n: round(sorted(v)[1], 2) for n, v in res.items()}, flush=True)
