"""Compiled float32 cost curve with the several-row linears (2..MAX_ROWS rows) through an opaque operator whose body
is one inductor kernel compiled once with symbolic sizes, the rows innermost (`rows_inner.py alone`'s form), instead
of oneDNN; then tree rows against one-token steps (README.md beside this file, 2026-11-27 evening).
    python docs/results/compiled-tree-cost/rows_op.py ri [MAX_ROWS [lm_head]] | base"""
import sys, torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._inductor import compile as icompile
from dynatree.models import load_model
from dynatree import costmeasure, kernels
MODE = sys.argv[1]
MAXR = int(sys.argv[2]) if len(sys.argv) > 2 else 8
LMHEAD = len(sys.argv) > 3

def row_inner(x, w):  # [M, K] x [N, K] -> [M, N]
    return (w[:, :, None] * x.t()[None]).sum(1).t().contiguous()

from torch._guards import tracing, TracingContext
with torch.no_grad():
    _gm = make_fx(row_inner, tracing_mode="symbolic")(torch.randn(3, 40), torch.randn(24, 40))
    _fakes = [n.meta["val"] for n in _gm.graph.nodes if n.op == "placeholder"]
    with tracing(TracingContext(_fakes[0].fake_mode)):
        _fn = icompile(_gm, _fakes)
lib = torch.library.Library("ri", "DEF")
lib.define("rows_product(Tensor x, Tensor w) -> Tensor")
lib.impl("rows_product", lambda x, w: _fn(x.contiguous(), w), "CPU")  # the outer graph may hand the rows transposed
torch.library.register_fake("ri::rows_product", lambda x, w: x.new_empty(x.shape[0], w.shape[0]))

orig = kernels.PackedLinear.forward
def forward(self, x):
    if MODE == "ri" and torch.compiler.is_compiling() and x.dtype == torch.float32 and not torch.is_grad_enabled():
        rows = x.numel() // x.shape[-1]
        if 1 < rows <= MAXR and (self.weight.shape[0] < 10000 or LMHEAD):
            y = torch.ops.ri.rows_product(x.reshape(-1, x.shape[-1]).contiguous(), self.weight).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
    return orig(self, x)
kernels.PackedLinear.forward = forward
torch.manual_seed(0)
t = load_model("smollm2-135m", device="cpu", dtype="float32", weights="dense")
ctx = torch.randint(100, 40000, (300,)).tolist()
sizes = (1, 2, 3, 4, 6, 8, 12, 16)
t.warm_up(("token", "tree"))
c = costmeasure.measure(t, ctx, sizes=sizes, rounds=5, compiled=True)
print(MODE, MAXR, " ".join(f"{n}:{s*1e3:.1f}" for n, s in zip(sizes, c.seconds)), flush=True)
from dynatree import cache as kv
with torch.no_grad():
    for n in (2, 4, 8):
        cache = kv.new_cache(t.model); t.forward(cache, ctx, list(range(300)), None, last_only=True)
        ids = [11, 22, 33, 44, 55, 66, 77, 88][:n]
        allowed = torch.cat([torch.ones(n, 300, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        tree = t.forward(cache, ids, list(range(300, 300 + n)), t.masks(allowed, torch.arange(300, 300 + n), torch.arange(300 + n)), compiled=True)
        kv.crop(cache, 300)
        one = torch.cat([t.forward(cache, [i], [300 + k], None, compiled=True) for k, i in enumerate(ids)])
        print(n, "max diff tree vs steps", (tree - one).abs().max().item(), "bit-equal", torch.equal(tree, one), "argmax equal", bool((tree.argmax(-1) == one.argmax(-1)).all()), flush=True)
