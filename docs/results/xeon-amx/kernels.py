"""The linear layers of one SmolLM2-135M step (30 layers x q, k, v, o, gate, up, down; distinct random
weights, so they stream from memory as a real step's do), by the number of rows multiplied, per kernel:
the int4 kernel of `--weights q4` (bfloat16 activations), oneDNN bfloat16 from plain and from prepacked
weights (what inductor's freezing would use; AMX on CPUs that have it), float32, and the int8 kernel of
`--weights int8`. Median of 15 passes, 2 threads. No model, no exactness: kernel cost only.

  python docs/results/xeon-amx/kernels.py
"""
import time

import torch

torch.manual_seed(0)
torch.set_num_threads(2)
H, I, LAYERS = 576, 1536, 30
SHAPES = [(576, H), (192, H), (192, H), (576, H), (I, H), (I, H), (H, I)]  # (out, in) of q k v o gate up down
ROWS = (1, 4, 8, 16, 32)


def median_ms(f, reps=15):
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def main():
    shapes = [s for _ in range(LAYERS) for s in SHAPES]
    int4 = [(torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
             torch.randn(k // 32, n, 2, dtype=torch.bfloat16)) for n, k in shapes]
    bf16 = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in shapes]
    f32 = [w.float() for w in bf16]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in bf16]
    int8 = [(torch.randint(-127, 127, (n, k), dtype=torch.int8), torch.rand(n, dtype=torch.bfloat16)) for n, k in shapes]
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}")
    print("| rows | int4 (q4) | bfloat16 | bfloat16 prepacked | float32 | int8 |")
    print("|---|---|---|---|---|---|")
    for m in ROWS:
        xb = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (H, I)}
        xf = {k: v.float() for k, v in xb.items()}
        kernels = [
            lambda: [torch._weight_int4pack_mm_for_cpu(xb[k], p, 32, sz) for (p, sz), (_, k) in zip(int4, shapes)],
            lambda: [torch.nn.functional.linear(xb[w.shape[1]], w) for w in bf16],
            lambda: [torch.ops.mkldnn._linear_pointwise(xb[w.shape[1]], p, None, "none", [None], "")
                     for w, p in zip(bf16, packed)],
            lambda: [torch.nn.functional.linear(xf[w.shape[1]], w) for w in f32],
            lambda: [torch._weight_int8pack_mm(xb[w.shape[1]], w, s) for w, s in int8],
        ]
        print(f"| {m} | " + " | ".join(f"{median_ms(k):.1f} ms" for k in kernels) + " |", flush=True)


if __name__ == "__main__":
    main()
