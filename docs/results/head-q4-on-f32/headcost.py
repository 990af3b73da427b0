import sys, time, torch
# (run from the repository root: python docs/results/head-q4-on-f32/headcost.py [CACHE_ENTRIES])
from dynatree.models import load_model
from dynatree.draftload import load_draft
from dynatree.drafters.feature import FeatureDrafter
from dynatree.tree import additive_mask
from dynatree import cache as kv
torch.set_grad_enabled(False)
t = load_model("smollm2-135m", dtype="float32")
print(t.weights, t.dtype)
dense = load_draft("smollm2-135m-eagle", t).model
tq = load_model("smollm2-135m", weights="q4")
dq = FeatureDrafter(load_draft("smollm2-135m-eagle", tq).model, tq)
dd = FeatureDrafter(dense, t)
H = 576; n_ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 500
res = {}
for name, d in (("dense-f32", dd), ("q4-bf16", dq)) * 3:
    head = d.head; dt = next(head.parameters()).dtype if head.weights == "dense" else torch.bfloat16
    c = kv.new_cache(head.body)
    head(torch.randn(1, n_ctx, H, dtype=dt), torch.randn(1, n_ctx, H, dtype=dt), torch.arange(n_ctx)[None], None, c)
    L = kv.length(c)
    for rows in (1, 3, 8):
        ts = []
        for _ in range(40):
            kv.reserve(c, rows)
            mask = additive_mask(torch.ones(rows, L + rows, dtype=torch.bool), dt, "cpu")
            s = time.perf_counter()
            d.out(head(torch.randn(1, rows, H, dtype=dt), torch.randn(1, rows, H, dtype=dt), torch.arange(L, L + rows)[None], mask, c)[0])
            ts.append(time.perf_counter() - s)
            kv.crop(c, L)
        res.setdefault((name, rows), []).append(sorted(ts)[20] * 1e3)
for k, v in res.items(): print(k, ["%.2f" % x for x in v])
