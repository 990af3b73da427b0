"""Memory of a process that runs bfloat16 work under autocast (forward and backward) on a new number of rows each
time, as distillation does: RSS every 100 calls. MODE=linear (default): a 576 x 1536 linear; MODE=sdpa: SDPA
with 9 heads of 64 and a boolean mask over as many keys. BOUND=1: `dynatree distill`'s bounded oneDNN/ideep
caches (set in-process after the CLI's imports, as `cmd_distill` does); FIXED=1: the same shape every time.
MODE=trainer: the head's attention shaped as training calls it (9 key/value heads; the shipped head has 3),
[B, 9, L, depth * L] with B 1..8, L 64..640 and depth 1..3 drawn anew each call; ROUND=64 rounds L up to a multiple of 64, as make_batch now does.

    BOUND=1 python docs/results/eagle-train-speed/kernel_caches.py
    MODE=sdpa BOUND=1 python docs/results/eagle-train-speed/kernel_caches.py
    MODE=trainer BOUND=1 ROUND=64 python docs/results/eagle-train-speed/kernel_caches.py
"""
import os
import random

import dynatree.cli  # noqa: F401  (what the CLI imports before cmd_distill runs)
import torch
import torch.nn.functional as F
from dynatree.distill_cli import bound_kernel_caches

if os.environ.get("BOUND"):
    print(bound_kernel_caches())
MODE = os.environ.get("MODE", "linear")
ROUND = int(os.environ.get("ROUND", "1"))  # MODE=trainer: L rounded up to a multiple of this


def rss() -> float:
    return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * 4096 / 2**20


lin = torch.nn.Linear(576, 1536)
random.seed(0)
for i in range(1, 401):
    if MODE == "trainer":
        B, L, depth = random.randint(1, 8), random.randint(64, 640), random.randint(1, 3)
        L = -(-L // ROUND) * ROUND
        q = torch.randn(B, 9, L, 64, requires_grad=True)
        kv = torch.randn(B, 9, depth * L, 64, requires_grad=True)
        mask = torch.rand(B, 1, L, depth * L) > 0.5
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
        y.float().sum().backward()
        if i % 100 == 0:
            print(MODE, ROUND, i, round(rss()), "MB", flush=True)
        continue
    rows = 3000 if os.environ.get("FIXED") else random.randint(200, 6000)
    x = torch.randn(rows, 576, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if MODE == "linear":
            y = lin(x)
        else:
            q = x.view(1, -1, 9, 64).transpose(1, 2)
            mask = torch.rand(1, 1, rows, rows) > 0.5
            y = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    y.float().sum().backward()
    if i % 100 == 0:
        print(MODE, i, round(rss()), "MB", flush=True)
