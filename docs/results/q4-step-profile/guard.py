"""Time compiled one-token q4 steps with and without skip_guard_eval_unsafe (interleaved)."""
import statistics, sys, time, torch
from dynatree.models import load_model
from dynatree import cache as kv
torch.manual_seed(0)
weights = sys.argv[1] if len(sys.argv) > 1 else "q4"
t = load_model("smollm2-135m", device="cpu", weights=weights, compile=True)
t.warm_up(["token"])
ctx = 300
ids = [int(x) for x in torch.randint(100, 40000, (ctx,))]
cache = kv.new_cache(t.model)
with torch.no_grad():
    t.forward(cache, ids[:-1], list(range(ctx - 1)), None, last_only=True)
    def run(n, unsafe):
        out = []
        with torch.compiler.set_stance(skip_guard_eval_unsafe=unsafe):
            for i in range(n):
                s = time.perf_counter()
                t.forward(cache, [ids[-1]], [ctx - 1], None, compiled=True)
                out.append(time.perf_counter() - s)
                kv.crop(cache, ctx - 1)
        return statistics.median(out) * 1e3
    a = t.forward(cache, [ids[-1]], [ctx - 1], None, compiled=True); kv.crop(cache, ctx - 1)
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        b = t.forward(cache, [ids[-1]], [ctx - 1], None, compiled=True); kv.crop(cache, ctx - 1)
    print("same logits:", torch.equal(a, b))
    res = {False: [], True: []}
    for r in range(6):
        for u in (False, True):
            res[u].append(run(40, u))
    for u in res: print("unsafe" if u else "guards", [f"{x:.2f}" for x in res[u]], f"median {statistics.median(res[u]):.2f} ms")
