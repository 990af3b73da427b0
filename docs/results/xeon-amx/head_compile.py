"""One feature-head call (the head's layer and its 8192-row output layer, bfloat16 as on a q4 target)
over a 500-entry cache at 1 and 3 rows, eager against torch.compile(dynamic=True) of the same call;
medians of 60 calls. A measurement for issue 32 (would a compiled head pay?), nothing shipped.
(Runs at commit f85893e or before: it reads `FeatureDrafter.out_rows`, which later commits removed.)

    python docs/results/xeon-amx/head_compile.py [CACHE_ENTRIES [eager]]   (default 500; README: 500, and 2000 eager)
"""
import sys
import time

import torch
from dynatree.models import load_model
from dynatree.draftload import load_draft
from dynatree.drafters.feature import FeatureDrafter
from dynatree.tree import additive_mask
from dynatree import cache as kv
t = load_model("smollm2-135m", weights="q4")
head = load_draft("smollm2-135m-eagle", t).model
d = FeatureDrafter(head, t)
H = 576; dt = d.out_rows.dtype; n_ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 500
def setup():
    c = kv.new_cache(head.body)
    with torch.no_grad():
        head(torch.randn(1, n_ctx, H, dtype=dt), torch.randn(1, n_ctx, H, dtype=dt), torch.arange(n_ctx)[None], None, c)
    return c
def fwd(e, f, p, m, c):
    return d.out(head(e, f, p, m, c)[0])
cfwd = torch.compile(fwd, dynamic=True)
runs = (("eager", fwd),) if sys.argv[2:] == ["eager"] else (("eager", fwd), ("compiled", cfwd))
for name, fn in runs:
    cache = setup(); L = kv.length(cache)
    def call(rows):
        kv.reserve(cache, rows)
        mask = additive_mask(torch.ones(rows, L + rows, dtype=torch.bool), dt, "cpu")
        out = fn(torch.randn(1, rows, H, dtype=dt), torch.randn(1, rows, H, dtype=dt), torch.arange(L, L + rows)[None], mask, cache)
        kv.crop(cache, L)
        return out
    with torch.no_grad():
        t0 = time.perf_counter()
        for rows in (1, 3, 1, 3): call(rows)
        print(name, "warm-up %.1f s" % (time.perf_counter() - t0))
        for rows in (1, 3):
            ts = []
            for _ in range(60):
                s = time.perf_counter(); call(rows); ts.append(time.perf_counter() - s)
            print(name, rows, "rows: %.2f ms" % (sorted(ts)[30] * 1e3))
