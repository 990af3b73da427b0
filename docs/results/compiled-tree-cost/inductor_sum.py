"""Compiled cost curve of the float32 target as shipped (`base`), or with multi-row linears written as a
multiply-sum with the weight outermost for inductor (`wouter`: [N, M, K] summed over K; `kinner`: [N, K, M]
summed over K, the rows innermost, 2026-11-27); then tree rows vs one-token steps.
    python docs/results/compiled-tree-cost/inductor_sum.py base|wouter|kinner|nmk   (README.md beside this file)"""
import torch, sys
from dynatree.models import load_model
from dynatree import costmeasure, kernels
MODE = sys.argv[1]
if MODE == "nmk":  # the rows behind an opaque contiguous copy, then [N, M, K] summed over K
    lib = torch.library.Library("isum", "DEF")
    lib.define("copy(Tensor x) -> Tensor")
    lib.impl("copy", lambda x: x.contiguous().clone(), "CPU")
    torch.library.register_fake("isum::copy", lambda x: x.new_empty(x.shape))
orig = kernels.PackedLinear.forward
def forward(self, x):
    if torch.compiler.is_compiling() and x.dtype == torch.float32 and not torch.is_grad_enabled():
        rows = x.numel() // x.shape[-1]
        if MODE in ("wouter", "kinner", "nmk") or rows == 1:
            if rows == 1:
                y = (x.unsqueeze(-2) * self.weight).sum(-1)
            else:
                x2 = x.reshape(-1, x.shape[-1])
                y = ((self.weight.unsqueeze(1) * x2.unsqueeze(0)).sum(-1) if MODE == "wouter" else (self.weight[:, None, :] * torch.ops.isum.copy(x2)[None]).sum(-1) if MODE == "nmk" else (self.weight[:, :, None] * x2.t()[None]).sum(1)).t().reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias
    return orig(self, x)
kernels.PackedLinear.forward = forward
torch.manual_seed(0)
t = load_model("smollm2-135m", device="cpu", dtype="float32", weights="dense")
ctx = torch.randint(100, 40000, (300,)).tolist()
sizes = (1, 2, 3, 4, 6, 8, 12, 16)
t.warm_up(("token", "tree"))
c = costmeasure.measure(t, ctx, sizes=sizes, rounds=5, compiled=True)
print(MODE, " ".join(f"{n}:{s*1e3:.1f}" for n, s in zip(sizes, c.seconds)), flush=True)
# same logits? compare tree rows with one-token steps
from dynatree import cache as kv
with torch.no_grad():
    cache = kv.new_cache(t.model); t.forward(cache, ctx, list(range(300)), None, last_only=True)
    n = 4; ids = [11, 22, 33, 44]
    allowed = torch.cat([torch.ones(n, 300, dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
    tree = t.forward(cache, ids, list(range(300, 304)), t.masks(allowed, torch.arange(300, 304), torch.arange(304)), compiled=True)
    kv.crop(cache, 300)
    one = torch.cat([t.forward(cache, [i], [300 + k], None, compiled=True) for k, i in enumerate(ids)])
    print("max diff tree vs steps", (tree - one).abs().max().item(), "bit-equal", torch.equal(tree, one), "argmax equal", bool((tree.argmax(-1) == one.argmax(-1)).all()))
