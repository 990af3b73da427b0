"""One feature-head training step on a synthetic batch without padding (16 sequences x 640 rows, random
features and labels, the shipped head, bfloat16 autocast, unroll 3): its time, or a torch.profiler table.

    python docs/results/eagle-train-speed/profile_step.py [time|profile] [BATCH]     (from the repository root)

`BLOCK=n` sets output_loss's rows per block. `git checkout 0d92e77^ -- src/dynatree/distill/eagle_train.py`
(restored afterwards) gives the step before output_loss.
"""

import os
import sys
import time
from pathlib import Path

import torch

import dynatree.distill.eagle_train as eagle_train
from dynatree.distill.eagle_data import EagleConfig
from dynatree.featurehead import load_head

if os.environ.get("BLOCK") and hasattr(eagle_train, "output_loss"):
    eagle_train.output_loss.__defaults__ = (int(os.environ["BLOCK"]),)
mode = sys.argv[1] if len(sys.argv) > 1 else "time"
B, L, H = int(sys.argv[2]) if len(sys.argv) > 2 else 16, 640, 576
torch.manual_seed(0)
head = load_head(Path("src/dynatree/drafts/smollm2-135m-eagle")).float().train()
V = len(head.vocab_ids)
embed = torch.nn.Embedding(49152, H)
out_rows = torch.randn(V, H) * 0.05
cfg = EagleConfig(unroll=3, seq_len=L)
batch = {"tokens": torch.randint(0, 49152, (B, L)), "features": torch.randn(B, L, H), "next_features": torch.randn(B, L, H),
         "labels": torch.randint(0, 49152, (B, L)), "sub_labels": torch.randint(0, V, (B, L)),
         "valid": torch.ones(B, L, dtype=torch.bool), "answer": torch.ones(B, L, dtype=torch.bool),
         "covered": torch.ones(B, L, dtype=torch.bool), "positions": torch.arange(L).repeat(B, 1),
         "head_vocab": head.vocab_ids,
         # one sequence per batch row (read by the code since 7cb54bd; ignored before)
         "segment": torch.arange(B)[:, None].expand(B, L).clone(), "local": torch.arange(L).repeat(B, 1)}
params = [p for p in head.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=1e-5)


def step():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = eagle_train.unrolled_loss(head, embed, out_rows, batch, cfg)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()


step()  # warm-up
if mode == "time":
    for _ in range(3):
        t = time.perf_counter()
        step()
        print(f"step {time.perf_counter() - t:.2f} s", flush=True)
else:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
