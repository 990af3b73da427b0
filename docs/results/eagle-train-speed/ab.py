"""A/B of the feature head's training step: `unrolled_loss` as it was before commit 0d92e77 (the output
layer on every row of the padded batch, F.cross_entropy, argmax; loaded from git) against today's
(`output_loss` on the real rows only), recording both ways' loss and statistics per batch. Real batches:
16 conversations drawn from the labelled parts of `data/distill/smollm2-135m` (the stage-10 data), the
shipped head, bfloat16 autocast, unroll 3, seq_len 640, as stage 10 trains. Forward, backward and the optimizer step, alternated per batch; medians.

    python docs/results/eagle-train-speed/ab.py [BATCHES] > ab.json     (from the repository root)
"""

import glob
import json
import random
import statistics
import subprocess
import sys
import types
import time
from pathlib import Path

import torch

from dynatree.distill import eagle_train
from dynatree.distill.eagle_data import EagleConfig
from dynatree.featurehead import load_head


def code_before(commit: str = "0d92e77^"):
    """eagle_train.py as it was before output_loss (`git show`), loaded as a module of the package."""
    source = subprocess.run(["git", "show", f"{commit}:src/dynatree/distill/eagle_train.py"], capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType("dynatree.distill._eagle_train_before")
    module.__package__ = "dynatree.distill"
    exec(compile(source, f"eagle_train.py@{commit}", "exec"), module.__dict__)
    return module


def main(n_batches: int) -> dict:
    torch.manual_seed(0)
    parts = sorted(glob.glob("data/distill/smollm2-135m/part-*.pt"))
    rng = random.Random(0)
    data = {"tokens": [], "features": [], "labels": [], "answer_from": []}
    for p in rng.sample(parts, 8):
        part = torch.load(p, weights_only=False)
        for k in data:
            data[k] += part[k]
    data["tokens"] = [t.long() for t in data["tokens"]]
    data["labels"] = [t.long() for t in data["labels"]]
    data["features"] = [f.float() for f in data["features"]]
    head = load_head(Path("src/dynatree/drafts/smollm2-135m-eagle")).float().train()
    from dynatree.models import load_model
    target = load_model("smollm2-135m")
    embed = target.model.get_input_embeddings()
    out_rows = target.model.get_output_embeddings().weight.detach()[head.vocab_ids].float()
    sub_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    sub_index[head.vocab_ids] = torch.arange(len(head.vocab_ids))
    cfg = EagleConfig(unroll=3, seq_len=640)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0)  # (the full step's cost, the weights unchanged: both ways see the same head)
    plain_loss = code_before().unrolled_loss
    times = {"plain": [], "output_loss": []}
    padding, seen = [], {}
    for b in range(n_batches + 1):  # the first batch warms up both
        batch = eagle_train.make_batch(data, rng.sample(range(len(data["tokens"])), 16), cfg.seq_len, sub_index, head.vocab_ids)
        padding.append(1 - float(batch["valid"].float().mean()))
        order = ["plain", "output_loss"] if b % 2 else ["output_loss", "plain"]
        for way in order:
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fn = plain_loss if way == "plain" else eagle_train.unrolled_loss
                loss, stats = fn(head, embed, out_rows, batch, cfg)
            seen.setdefault(b, []).append((round(float(loss), 4), stats))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if b:
                times[way].append(time.perf_counter() - t)
        print(f"batch {b}: " + " ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    same_stats = all(a[1] == b[1] for a, b in seen.values())
    return {"batches": n_batches, "padding_share_median": statistics.median(padding[1:]),
            "step_s": times, "median_s": med, "speedup": med["plain"] / med["output_loss"],
            "losses": {b: [x[0] for x in v] for b, v in seen.items()}, "same_statistics": same_stats,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6), indent=1))
