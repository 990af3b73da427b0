"""Several rows' products written for inductor with the rows innermost (README.md beside this file, 2026-11-27).

  python docs/results/compiled-tree-cost/rows_inner.py alone    210 SmolLM2-shaped float32 layers, inputs given:
                                                               row-inner multiply-sum vs oneDNN's packed product
  python docs/results/compiled-tree-cost/rows_inner.py block    the same form after an RMSNorm inside the graph,
                                                               as in the model, plain and behind an opaque copy
  python docs/results/compiled-tree-cost/rows_inner.py q4       the int4 kernel vs a row-inner dequantize-multiply-sum
  python docs/results/compiled-tree-cost/rows_inner.py nmk      the block with [N, M, K] products behind an opaque
                                                               contiguous copy, against the one-row multiply-sum
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


def _layers(lin):
    """10 norm, up and down blocks (20 layers) with the weights fixed in the graph, as a model's are
    (the same weights on every call)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.rand(576, generator=gen) + 0.5
    w1, w2 = torch.randn(1536, 576, generator=gen) * 0.02, torch.randn(576, 1536, generator=gen) * 0.02

    def layers(h):
        for _ in range(10):
            x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * g
            h = h + lin(torch.nn.functional.silu(lin(x, w1)), w2)
        return h
    return layers


def _opaque(name, impl, fake):  # an operator inductor cannot see into: the rows are materialized before the product
    lib = torch.library.Library(name, "DEF")
    lib.define("copy(Tensor x) -> Tensor")
    lib.impl("copy", impl, "CPU")
    torch.library.register_fake(f"{name}::copy", fake)
    return lib, getattr(torch.ops, name).copy


def _rows(m):
    x = torch.randn(m, 576)
    torch._dynamo.mark_dynamic(x, 0)
    return x


def block():
    lib, copy_t = _opaque("rows_inner", lambda x: x.t().contiguous(), lambda x: x.new_empty(x.shape[1], x.shape[0]))
    for opaque in (False, True):
        compiled = torch.compile(_layers(lambda x, w: (w[:, :, None] * (copy_t(x) if opaque else x.t())[None]).sum(1).t()))
        for m in (2, 4, 8):
            print(f"{'opaque copy' if opaque else 'plain'}, {m} rows: {bench(compiled, _rows(m), 10):.2f} ms for 20 layers")


def nmk():
    lib, copy = _opaque("rows_nmk", lambda x: x.contiguous().clone(), lambda x: x.new_empty(x.shape))
    many = torch.compile(_layers(lambda x, w: (w[:, None, :] * copy(x)[None]).sum(-1).t()))
    one = torch.compile(_layers(lambda x, w: (x.unsqueeze(-2) * w).sum(-1)))
    h8 = _rows(8)
    full = many(h8)
    print(f"1 row (the one-row multiply-sum): {bench(one, h8[:1]):.2f} ms for 20 layers")
    for m in (2, 4, 8):
        print(f"{m} rows: {bench(many, _rows(m)):.2f} ms for 20 layers")
    rows_one = torch.cat([one(h8[i : i + 1]) for i in range(8)])
    print("rows bit-equal to the one-row graph's:", torch.equal(full, rows_one),
          f"(max difference {(full - rows_one).abs().max().item():.1e})")


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
    {"alone": alone, "block": block, "q4": q4, "nmk": nmk}[sys.argv[1]]()
