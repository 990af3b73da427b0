"""The linears of one SmolLM2-135M step at m rows in float32 (30 layers' q, k, v, o, gate, up, down
with distinct random weights, plus the output layer): stock F.linear (MKL) against dynatree's
oneDNN-packed linears (`kernels.use_packed_linears`); median of 12 passes, in ms.

    python docs/results/eagle-stage9/f32_linears.py
"""

import time

import torch

from dynatree import kernels

torch.manual_seed(0)
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]


def timed(layers, m: int) -> float:
    xs = [torch.randn(m, layer.in_features) for layer in layers]
    times = []
    for _ in range(12):
        t = time.perf_counter()
        for layer, x in zip(layers, xs):
            layer(x)
        times.append(time.perf_counter() - t)
    return sorted(times)[6] * 1e3


holder = torch.nn.Sequential(*[torch.nn.Linear(i, o, bias=False) for o, i in SHAPES])
with torch.no_grad():
    stock = {m: timed(list(holder), m) for m in (1, 4, 16)}
    kernels.use_packed_linears(holder, "onednn")
    packed = {m: timed(list(holder), m) for m in (1, 4, 16)}
for m in stock:
    print(f"{m} rows: stock {stock[m]:.1f} ms, oneDNN packed {packed[m]:.1f} ms")
