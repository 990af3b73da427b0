"""The embedded target's output layer (49152 x 576; Q8_0 in the GGUF, tied to the embeddings) on this
machine: bfloat16 through MKL (F.linear), bfloat16 through oneDNN on a prepacked weight (what `--weights q4`
runs today, `kernels.PackedLinear`), the Q8_0 values as two int4 products (q = 16 hi + lo), and the same weight requantized to int8 per
output row (`torch._weight_int8pack_mm`, what `--weights int8` runs; not the file's values), by rows.

  python docs/results/q8-output/kernels.py     # medians of interleaved blocks, ms per call
"""
import sys
from pathlib import Path

import torch

from dynatree.kernels import PackedLinear

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "q4-step-profile"))
from step import interleaved  # noqa: E402  (medians of interleaved blocks, ms per call)


def main():
    torch.manual_seed(0)
    n, k = 49152, 576
    q = torch.randint(-128, 128, (n, k), dtype=torch.int32)
    d = (torch.rand(n, k // 32) * 0.01 + 0.001).bfloat16().float()
    dense_w = (q.float().view(n, k // 32, 32) * d[..., None]).view(n, k).to(torch.bfloat16)
    lin = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    lin.weight = torch.nn.Parameter(dense_w, requires_grad=False)
    packed_lin = PackedLinear(lin)
    hi = torch.div(q, 16, rounding_mode="floor")
    packed = [torch._convert_weight_to_int4pack_for_cpu(c.contiguous(), 1) for c in (hi + 8, q - 16 * hi)]
    pairs = [torch.stack([s.t(), z.t()], -1).to(torch.bfloat16).contiguous()
             for s, z in ((16 * d, torch.zeros_like(d)), (d, 8 * d))]

    wanted = dense_w.float().abs().amax(dim=1) / 127
    row_scale = wanted.to(torch.bfloat16)
    int8 = torch.round(dense_w.float() / row_scale.float()[:, None]).clamp(-127, 127).to(torch.int8)

    def two(x):
        return torch._weight_int4pack_mm_for_cpu(x, packed[0], 32, pairs[0]).float() + \
            torch._weight_int4pack_mm_for_cpu(x, packed[1], 32, pairs[1]).float()

    x8 = torch.randn(8, k, dtype=torch.bfloat16)
    full = two(x8)
    print("two int4, rows alone equal rows in a batch of 8:", torch.equal(two(x8[:1]), full[:1]) and torch.equal(two(x8[2:5]), full[2:5]))
    print("two int4 vs float32 reference, max rel err:", float(((full - x8.float() @ (q.float().view(n, -1, 32) * d[..., None]).view(n, k).t()).abs().max() / full.abs().max())))
    for rows in (1, 2, 4, 8, 16):
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        runs = {"bf16 MKL": lambda: torch.nn.functional.linear(x, dense_w),
                "bf16 oneDNN packed": lambda: packed_lin(x),
                "two int4": lambda: two(x),
                "int8 per row": lambda: torch._weight_int8pack_mm(x, int8, row_scale)}
        for _ in range(3):
            [f() for f in runs.values()]
        times = interleaved(runs, blocks=15, calls=10)
        print(f"{rows:3d} rows: " + "  ".join(f"{name} {v:.2f} ms" for name, v in times.items()), flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
