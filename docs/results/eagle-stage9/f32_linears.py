"""The linears of one SmolLM2-135M step at m rows in float32: the 210 products of 30 layers (q, k, v,
o, gate, up, down; distinct random weights, as `../xeon-amx/kernels.py` times them), then the output
layer (49152 x 576) alone; stock F.linear (MKL) against dynatree's oneDNN-packed linears
(`kernels.use_packed_linears`, the eager float32 path); median of 15 passes, in ms.

    python docs/results/eagle-stage9/f32_linears.py
"""

import time

import torch

from dynatree import kernels

torch.manual_seed(0)
torch.set_num_threads(2)
LAYERS = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30
OUTPUT = [(49152, 576)]


def timed(layers, m: int, reps: int = 15) -> float:
    xs = [torch.randn(m, layer.in_features) for layer in layers]
    times = []
    for rep in range(reps + 3):
        t = time.perf_counter()
        for layer, x in zip(layers, xs):
            layer(x)
        if rep >= 3:
            times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def build(shapes):
    return torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for o, i in shapes])


with torch.no_grad():
    for name, shapes in (("210 layer products", LAYERS), ("output layer", OUTPUT)):
        model = build(shapes)
        stock = {m: timed(list(model), m) for m in (1, 4, 16)}
        kernels.use_packed_linears(model, "onednn")
        packed = {m: timed(list(model), m) for m in (1, 4, 16)}
        for m in stock:
            print(f"{name}, {m} rows: stock {stock[m]:.1f} ms, oneDNN packed {packed[m]:.1f} ms", flush=True)
