"""Several rows' products written for inductor with the rows innermost (README.md beside this file, 2026-11-27).

  python docs/results/compiled-tree-cost/rows_inner.py alone    210 SmolLM2-shaped float32 layers, inputs given:
                                                               row-inner multiply-sum vs oneDNN's packed product
  python docs/results/compiled-tree-cost/rows_inner.py block    the same form after an RMSNorm inside the graph,
                                                               as in the model, plain and behind an opaque copy
  python docs/results/compiled-tree-cost/rows_inner.py q4       the int4 kernel vs a row-inner dequantize-multiply-sum
"""
import statistics
import sys
import time

import torch
import torch._dynamo.config as dynamo_config

torch.set_grad_enabled(False)
dynamo_config.recompile_limit = 256
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # one layer's


def bench(f, x, n=20):
    f(x)
    f(x)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def row_inner(x, w):  # [M, K] x [N, K] -> [M, N]: for each weight element, every row's product
    return (w[:, :, None] * x[:, : w.shape[1]].t()[None]).sum(1).t()


def alone():
    weights = [torch.randn(n, k) * 0.02 for _ in range(30) for n, k in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    one_row = torch.compile(lambda x, ws: [(x[:, None, : w.shape[1]] * w).sum(-1) for w in ws])
    several = torch.compile(lambda x, ws: [row_inner(x, w) for w in ws], dynamic=True)

    def onednn(x):
        for w, p in zip(weights, packed):
            torch.ops.mkldnn._linear_pointwise(x[:, : w.shape[1]].contiguous(), p, None, "none", [], "")
    x16 = torch.randn(16, 1536)
    full = several(x16, weights)
    ones = one_row(x16[:1], weights)
    print("one-row multiply-sum equals the 16-row call's first row bit for bit:",
          all(torch.equal(a, b[:1]) for a, b in zip(ones, full)))
    print("1 row: multiply-sum", f"{bench(lambda x: one_row(x, weights), x16[:1]):.2f} ms,", "oneDNN",
          f"{bench(onednn, x16[:1]):.2f} ms")
    for m in (2, 3, 4, 8, 16):
        x = x16[:m]
        same = all(torch.equal(a, b[:m]) for a, b in zip(several(x, weights), full))
        print(f"{m} rows: row-inner {bench(lambda x: several(x, weights), x):.2f} ms, oneDNN {bench(onednn, x):.2f} ms,"
              f" rows equal to the 16-row call's: {same}")


def block():
    lib = torch.library.Library("rows_inner", "DEF")  # an opaque copy: inductor cannot inline the norm into the sum
    lib.define("copy_t(Tensor x) -> Tensor")
    lib.impl("copy_t", lambda x: x.t().contiguous(), "CPU")
    torch.library.register_fake("rows_inner::copy_t", lambda x: x.new_empty(x.shape[1], x.shape[0]))
    g, w1, w2 = torch.rand(576) + 0.5, torch.randn(1536, 576) * 0.02, torch.randn(576, 1536) * 0.02
    for opaque in (False, True):
        def lin(x, w):
            xt = torch.ops.rows_inner.copy_t(x) if opaque else x.t()
            return (w[:, :, None] * xt[None]).sum(1).t()

        def layers(h):  # 10 norm + up + down blocks: 20 layers
            for _ in range(10):
                x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * g
                h = h + lin(torch.nn.functional.silu(lin(x, w1)), w2)
            return h
        compiled = torch.compile(layers)
        for m in (2, 4, 8):
            x = torch.randn(m, 576)
            torch._dynamo.mark_dynamic(x, 0)
            print(f"{'opaque copy' if opaque else 'plain'}, {m} rows: {bench(compiled, x, 10):.2f} ms for 20 layers")


def q4():
    group, layers = 32, []
    for _ in range(30):
        for n, k in SHAPES:
            codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
            scale = (torch.rand(n, k // group) * 0.01).to(torch.bfloat16)
            zero = (torch.randn(n, k // group) * 0.01).to(torch.bfloat16)
            nibbles = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).contiguous()  # rows 2i low, 2i+1 high
            layers.append((n, k, nibbles, scale.float(), zero.float(), torch._convert_weight_to_int4pack_for_cpu(codes, 1),
                           torch.stack([scale.t(), zero.t()], -1).contiguous()))

    def fused(x, layers):
        out = []
        for n, k, nibbles, scale, zero, _, _ in layers:
            xt = x[:, :k].float().t().reshape(k // group, group, -1)
            halves = []
            for codes, s, z in (((nibbles & 15), scale[0::2], zero[0::2]), ((nibbles >> 4), scale[1::2], zero[1::2])):
                w = (codes.float().view(n // 2, k // group, group, 1) - 8) * s[..., None, None] + z[..., None, None]
                halves.append((w * xt).sum((1, 2)))
            out.append(torch.stack(halves, 1).reshape(n, -1).t().to(torch.bfloat16))
        return out
    compiled = torch.compile(fused)

    def int4(x):
        for n, k, _, _, _, packed, pairs in layers:
            torch._weight_int4pack_mm_for_cpu(x[:, :k].contiguous(), packed, group, pairs)
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, 1536).to(torch.bfloat16)
        print(f"{m} rows: int4 kernel {bench(int4, x):.2f} ms, row-inner dequantize-multiply-sum "
              f"{bench(lambda x: compiled(x, layers), x):.2f} ms")


if __name__ == "__main__":
    {"alone": alone, "block": block, "q4": q4}[sys.argv[1]]()
