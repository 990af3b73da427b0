"""The 4-bit products torch itself offers on this CPU, at SmolLM2-135M's shapes, one row (a
one-token step), ms per call: the shipped weight-only kernel (`_weight_int4pack_mm_for_cpu`,
bfloat16 activations) against `_dyn_quant_matmul_4bit` (activations quantized to 8 bits per row, as
llama.cpp does for Q4_1; on x86 torch runs its reference implementation, KleidiAI being ARM-only).
Random codes and scales: only the time is read. Medians of 5 interleaved blocks of 100 calls.

    python docs/results/q4-step-profile/other_kernels.py
"""

import statistics
import time

import torch

G = 32  # Q4_1's group size
SHAPES = ((576, 1536), (1536, 576), (576, 576), (576, 192))  # (in, out): MLP up/gate, MLP down, q/o, k/v


def block(fn, calls=100):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


torch.manual_seed(0)
print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads")
for k, n in SHAPES:
    weight_only = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    scales_zeros = torch.randn(k // G, n, 2, dtype=torch.bfloat16)
    x16 = torch.randn(1, k, dtype=torch.bfloat16)
    dyn = torch._dyn_quant_pack_4bit_weight(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                                            torch.rand(n, k // G), torch.zeros(n), G, k, n)
    x32 = torch.randn(1, k)
    kernels = {"int4pack_mm_for_cpu (shipped)": lambda: torch._weight_int4pack_mm_for_cpu(x16, weight_only, G, scales_zeros),
               "dyn_quant_matmul_4bit": lambda: torch._dyn_quant_matmul_4bit(x32, dyn, G, k, n)}
    for fn in kernels.values():
        block(fn, 20)  # warm-up
    times = {name: [] for name in kernels}
    for _ in range(5):
        for name, fn in kernels.items():
            times[name].append(block(fn))
    print(f"{k}x{n}: " + ", ".join(f"{name} {statistics.median(t):.4f} ms" for name, t in times.items()))
