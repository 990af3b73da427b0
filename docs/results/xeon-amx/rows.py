"""Does a kernel compute each row of a product the same whatever the number of rows multiplied with
it? (Exactness needs that: a tree row must round as a one-token step's row does.) For SmolLM2-135M's
shapes, random bfloat16 activations: row 0 of an m-row product vs the same row alone, bit for bit.

  python docs/results/xeon-amx/rows.py
"""
import torch

torch.manual_seed(0)
torch.set_num_threads(2)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = (2, 3, 4, 5, 8, 16, 17, 32, 64)


def kernels(n, k):
    w = torch.randn(n, k, dtype=torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    codes = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    sz = torch.randn(k // 32, n, 2, dtype=torch.bfloat16)
    return {"int4": lambda x: torch._weight_int4pack_mm_for_cpu(x, codes, 32, sz),
            "bf16": lambda x: torch.nn.functional.linear(x, w),
            "bf16 prepacked": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], ""),
            "f32": lambda x: torch.nn.functional.linear(x.float(), w.float())}


def main():
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    for n, k in SHAPES:
        x = torch.randn(max(ROWS), k, dtype=torch.bfloat16)
        for name, f in kernels(n, k).items():
            alone = f(x[:1])
            differ = [m for m in ROWS if not torch.equal(f(x[:m])[:1], alone)]
            print(f"{n}x{k} {name:15s} row 0 differs from alone at rows: {differ or 'none'}")


if __name__ == "__main__":
    main()
