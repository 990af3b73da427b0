"""One feature-head step eager vs compiled (`runtime.compile_steps`), the shipped head on random inputs at a
300-token head cache, medians of 5 interleaved blocks of 20 calls; then with the 8192-row output layer and
softmax in the compiled function too (2026-11-27; README.md beside this file).

  python docs/results/compiled-drafters/head_step.py float32|bfloat16
"""
import torch, time, statistics, sys
from dynatree import cache as kv
from dynatree.featurehead import load_head
from dynatree.kernels import PackedLinear
from dynatree.runtime import compile_steps
from dynatree.tree import additive_mask
torch.set_grad_enabled(False)
dtype = getattr(torch, sys.argv[1])
head = load_head("src/dynatree/drafts/smollm2-135m-eagle", dtype=dtype, linear="auto")
comp = head.compiled()  # as a drafter compiles it (runtime.compile_steps)
CTX = 300
def setup():
    cache = kv.new_cache(head.body)
    with kv.advancing(cache, CTX, "h"):
        head(embeds=torch.randn(1, CTX, 576, dtype=dtype), features=torch.randn(1, CTX, 576, dtype=dtype),
             positions=torch.arange(CTX)[None], mask=None, cache=cache)
    return cache
def step(f, cache, n):
    allowed = torch.ones(n, CTX + n, dtype=torch.bool).tril(CTX)
    mask = additive_mask(allowed, dtype, torch.device("cpu"))
    with kv.advancing(cache, n, "h"):
        out = f(embeds=torch.randn(1, n, 576, dtype=dtype), features=torch.randn(1, n, 576, dtype=dtype), positions=torch.arange(CTX, CTX + n)[None], mask=mask, cache=cache)
    kv.crop(cache, CTX)
    return out


def compare(label, eager, compiled):
    """Medians of 5 interleaved blocks of 20 calls, ms per call, at 1, 2, 4 and 8 fed tokens."""
    for n in (1, 2, 4, 8):
        res = {"eager": [], "compiled": []}
        for _ in range(5):
            for name, f in (("eager", eager), ("compiled", compiled)):
                s = time.perf_counter()
                for _ in range(20):
                    step(f, cache, n)
                res[name].append((time.perf_counter() - s) / 20 * 1e3)
        print(label, n, {k: round(statistics.median(v), 3) for k, v in res.items()}, flush=True)


class Step(torch.nn.Module):  # the head, then the 8192-row output layer and the softmax
    def __init__(s, head, out):
        super().__init__()
        s.head, s.out = head, out

    def forward(s, embeds, features, positions, mask, cache):
        f = s.head(embeds, features, positions, mask, cache)
        return f, torch.softmax(s.out(f).float(), -1)


cache = setup()
t0 = time.perf_counter()
for n in (1, 3, 4):
    step(comp, cache, n)
print(f"compile {time.perf_counter()-t0:.1f} s")
compare("head", head, comp)
st = Step(head, PackedLinear(torch.nn.Linear(576, 8192, bias=False).to(dtype)))
cst = compile_steps(st, dtype, torch.device("cpu"))
for n in (1, 3, 4):
    step(cst, cache, n)
compare("with output+softmax", st, cst)
