"""Memory of a process that runs bfloat16 products (autocast, a 576 x 1536 linear, forward and backward) on a
new number of rows each time, as distillation does: RSS every 100 products, with `dynatree distill`'s bounded
kernel caches (BOUND=1) or the libraries' defaults.

    BOUND=1 python docs/results/eagle-train-speed/kernel_caches.py; python docs/results/eagle-train-speed/kernel_caches.py
"""
import os, random
import dynatree.cli  # noqa: F401  (what the CLI imports before cmd_distill runs)
from dynatree.distill_cli import bound_kernel_caches
import torch
if os.environ.get("BOUND"): print(bound_kernel_caches())
def rss(): return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * 4096 / 2**20
lin = torch.nn.Linear(576, 1536)
random.seed(0)
for i in range(1, 401):
    x = torch.randn(random.randint(200, 6000), 576, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    y.float().sum().backward()
    if i % 100 == 0: print(i, round(rss()), "MB", flush=True)
