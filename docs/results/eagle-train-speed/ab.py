"""A/B of the feature head's training step: the output layer's loss the plain way (logits of every
row of the padded batch, F.cross_entropy, argmax; the code before commit 'output_loss') against
`output_loss` on the real rows only. Real batches: 16 conversations drawn from the labelled parts of
`data/distill/smollm2-135m` (the stage-10 data), the shipped head, bfloat16 autocast, unroll 3, seq_len
640, as stage 10 trains. Forward, backward and the optimizer step, alternated per batch; medians.

    python docs/results/eagle-train-speed/ab.py [BATCHES] > ab.json     (from the repository root)
"""

import glob
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dynatree.distill import eagle_train
from dynatree.distill.eagle_data import EagleConfig
from dynatree.featurehead import load_head


def plain_loss(head, embed, out_rows, batch, cfg):
    """unrolled_loss as it was: the output layer on every row of the padded batch."""
    from transformers import DynamicCache
    tokens, feats, labels, valid, positions = (batch[k] for k in ("tokens", "features", "labels", "valid", "positions"))
    B, L = tokens.shape
    with torch.no_grad():
        embeds = embed(tokens).float()
    cache, total, stats, prev = DynamicCache(), 0.0, [], None
    for depth in range(1, cfg.unroll + 1):
        feature_in = feats if depth == 1 else torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        mask = eagle_train.pass_mask_for(L, depth, max(L, cfg.seq_len), "cpu")
        out = head(embeds, feature_in, positions, mask.expand(B, 1, L, depth * L), cache)
        logits = out @ out_rows.T
        rows = valid & (torch.arange(L) >= depth - 1)[None]
        learn = rows & batch["covered"]
        ce = F.cross_entropy(logits[learn], batch["sub_labels"][learn], reduction="mean")
        total = total + (cfg.decay ** (depth - 1)) * ce
        if depth == 1:
            total = total + cfg.feature_loss * F.smooth_l1_loss(out[learn], batch["next_features"][learn])
        hit = (batch["head_vocab"][logits.argmax(-1)] == labels) & rows
        stats.append((int(hit.sum()), int(rows.sum())))
        prev = out
    return total, stats


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
    opt = torch.optim.AdamW(params, lr=1e-6)
    times = {"plain": [], "output_loss": []}
    padding = []
    for b in range(n_batches + 1):  # the first batch warms up both
        batch = eagle_train.make_batch(data, rng.sample(range(len(data["tokens"])), 16), cfg.seq_len, sub_index, head.vocab_ids)
        padding.append(1 - float(batch["valid"].float().mean()))
        order = ["plain", "output_loss"] if b % 2 else ["output_loss", "plain"]
        for way in order:
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fn = plain_loss if way == "plain" else eagle_train.unrolled_loss
                loss, _ = fn(head, embed, out_rows, batch, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if b:
                times[way].append(time.perf_counter() - t)
        print(f"batch {b}: " + " ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items() if v), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batches": n_batches, "padding_share_median": statistics.median(padding[1:]),
            "step_s": times, "median_s": med, "speedup": med["plain"] / med["output_loss"],
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 6), indent=1))
