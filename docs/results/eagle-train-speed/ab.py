"""The feature head's training step three ways (`WAYS`: eagle_train.py loaded from git at each commit):
before commit 0d92e77 (the output layer on every row of the padded batch, F.cross_entropy, argmax),
`output_loss` on the real rows only, and sequences packed into rows; every way's loss and statistics
per batch recorded. Real batches:
16 conversations drawn from the labelled parts of `data/distill/smollm2-135m` (the stage-10 data), the
shipped head, bfloat16 autocast, unroll 3, seq_len 640, as stage 10 trains. Building the batch, forward, backward and the optimizer step, each way first in turn; medians.

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


WAYS = {"before (0d92e77^)": "0d92e77^",  # the output layer on every padded row, F.cross_entropy
        "output_loss (ad11a39)": "ad11a39",  # output_loss on the real rows, one sequence per batch row
        "packed (this tree)": None}  # output_loss, sequences packed into rows


def code_at(commit: str | None):
    """eagle_train.py at `commit` (`git show`; None: as imported), loaded as a module of the package."""
    if commit is None:
        return eagle_train
    source = subprocess.run(["git", "show", f"{commit}:src/dynatree/distill/eagle_train.py"], capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType(f"dynatree.distill._eagle_train_{commit.strip('^')}")
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
    opt = torch.optim.AdamW(params, lr=0.0)  # (the full step's cost, the weights unchanged: every way sees the same head)
    modules = {way: code_at(commit) for way, commit in WAYS.items()}
    times = {way: [] for way in WAYS}
    padding, batch_rows, seen = [], [], {}
    for b in range(n_batches + 1):  # the first batch warms every way up
        picked = rng.sample(range(len(data["tokens"])), 16)
        order = list(WAYS)[b % len(WAYS):] + list(WAYS)[:b % len(WAYS)]  # each way first in turn
        for way in order:
            t = time.perf_counter()
            batch = modules[way].make_batch(data, picked, cfg.seq_len, sub_index, head.vocab_ids)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, stats = modules[way].unrolled_loss(head, embed, out_rows, batch, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if b:
                times[way].append(time.perf_counter() - t)
            seen.setdefault(b, {})[way] = (round(float(loss.detach()), 4), stats)
            if way == "before (0d92e77^)":
                padding.append(1 - float(batch["valid"].float().mean()))
            if way == "packed (this tree)":
                batch_rows.append(batch["tokens"].shape[0])
        print(f"batch {b}: " + " ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    first = list(WAYS)[0]
    return {"batches": n_batches, "padding_share_median": statistics.median(padding[1:]),
            "packed_batch_rows": batch_rows[1:], "step_s": times, "median_s": med,
            "speedup_over_before": {k: med[first] / v for k, v in med.items()},
            "losses": {b: {k: v[0] for k, v in ways.items()} for b, ways in seen.items()},
            "same_statistics": all(len({str(v[1]) for v in ways.values()}) == 1 for ways in seen.values()),
            # (hits, rows, answer hits, answer rows) per depth: under bfloat16 autocast a product blocked
            # otherwise can round a near-tie the other way
            "statistics": {b: {k: v[1] for k, v in ways.items()} for b, ways in seen.items()},
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6), indent=1))
