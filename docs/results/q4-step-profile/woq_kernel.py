"""Inductor's weight-only int4 GEMM template against the eager int4 kernel (issue 32), products alone.

`python woq_kernel.py static|unbacked`: 8 products in SmolLM2-135M's shapes (two of each: 1536x576,
576x1536, 576x576, 192x576; random 4-bit codes in groups of 32), compiled with `freezing` and
`max_autotune` (CPP backend only, so the template is the only choice), either one graph per row count
(static) or one graph with the rows symbolic and not specialised at 1 (`mark_unbacked`). Prints per
row count: medians of 30 calls, eager (`_weight_int4pack_mm_for_cpu`) and compiled, whether every row
equals the same row computed alone by the compiled code, and whether the compiled output equals eager.
Inductor picks its AVX-512 micro-kernel for static row counts under 5 and its AMX micro-kernel
otherwise (and always for symbolic row counts; `cpp_micro_gemm.create_micro_gemm`)."""
import sys
import time

import torch
import torch._inductor.config as ic

torch.manual_seed(0)
torch.set_num_threads(2)
SHAPES = [(1536, 576), (576, 1536), (576, 576), (192, 576)]


class Int4(torch.nn.Module):
    def __init__(self, n, k):
        super().__init__()
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))
        scale, zero = torch.rand(k // 32, n) * 0.02 + 0.001, torch.randn(k // 32, n) * 0.02
        self.register_buffer("sz", torch.stack([scale, zero], -1).bfloat16().contiguous())

    def forward(self, x):
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, 32, self.sz)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Int4(n, k) for _ in range(2) for (n, k) in SHAPES])

    def forward(self, x):
        wide = torch.cat([x, x, x], -1)[:, :1536].contiguous()
        return [layer(x if layer.sz.shape[0] * 32 == 576 else wide) for layer in self.layers]


def median_ms(f, x, n=30):
    for _ in range(3):
        f(x)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - t)
    return sorted(times)[n // 2] * 1e3


def main(mode):
    ic.freezing, ic.max_autotune, ic.max_autotune_gemm_backends = True, True, "CPP"
    model = Block().eval()
    xs = {r: torch.randn(r, 576).bfloat16() for r in (1, 2, 4, 8, 16)}
    with torch.no_grad():
        if mode == "unbacked":
            one_graph = torch.compile(model)
            first = xs[4].clone()
            torch._dynamo.decorators.mark_unbacked(first, 0)
            one_graph(first)
            compiled = dict.fromkeys(xs, one_graph)
        else:
            compiled = {}
            for r, x in xs.items():
                compiled[r] = torch.compile(model, dynamic=False)
                compiled[r](x)
        alone = [compiled[1](xs[16][i:i + 1]) for i in range(16)]
        for r, x in xs.items():
            outs = compiled[r](xs[16][:r])
            rows_alone = all(torch.equal(o[i], alone[i][j][0]) for j, o in enumerate(outs) for i in range(r))
            eager = model(xs[16][:r])
            same = all(torch.equal(a, b) for a, b in zip(eager, outs))
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(eager, outs))
            print(f"rows={r:2d} eager {median_ms(model, x):6.3f} ms  compiled {median_ms(compiled[r], x):6.3f} ms  "
                  f"rows equal alone: {rows_alone}  equal eager: {same} (max diff {diff:.3g})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "static")
