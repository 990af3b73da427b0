"""Do the target's lower layers tell a draft head more than its last one? (issue 28)

EAGLE-3 feeds its head a fusion of low, middle and high layer features instead of the last
hidden state alone. Before changing the head, this probe asks whether that carries information
for the embedded target: small MLPs predict the target's next-next choice (what a head's first
tree level predicts: the target's argmax after token x_{t+1}, from position t's features and
x_{t+1}'s embedding) on answer rows of the committed distillation data, trained identically
with the last layer's feature only vs the last plus lower layers. No attention (the head has
it): the probe measures what one position's features hold, not what a head can reach.

    python docs/results/eagle-layers/probe.py > docs/results/eagle-layers/result.json
"""

import gzip
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from dynatree.embedded import EMBEDDED_DRAFTS
from dynatree.featurehead import load_head
from dynatree.models import DEFAULT_TARGET, load_model

DATA = Path(__file__).resolve().parents[3] / "data" / "distill" / "smollm2-135m"
SEQUENCES, EVAL_SHARE, STEPS, BATCH, LR, SEED = 480, 0.2, 1500, 1024, 1e-3, 0
VARIANTS = {"last": [-1], "last+15+3": [-1, 15, 3], "last+24+15+8+3": [-1, 24, 15, 8, 3]}

torch.manual_seed(SEED)
target = load_model(DEFAULT_TARGET, weights="dense")
seqs = []
for path in sorted(DATA.glob("answers-*.json.gz")):
    record = json.loads(gzip.decompress(path.read_bytes()))
    seqs += list(zip(record["sequences"], record["answer_from"]))
random.Random(SEED).shuffle(seqs)
seqs = [s for s in seqs if len(s[0]) <= 1280][:SEQUENCES]
layers = sorted({i for v in VARIANTS.values() for i in v})
t0 = time.perf_counter()
rows = {i: [] for i in layers}
inputs, labels, groups = [], [], []
with torch.no_grad():
    for k, (ids, start) in enumerate(seqs):
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
        argmax = out.logits[0].argmax(-1)
        n = len(ids)
        r = torch.arange(max(0, start - 2), n - 2)  # answer rows: label argmax at r+1 chooses token r+2 >= start
        for i in layers:
            rows[i].append(out.hidden_states[i][0, r].to(torch.bfloat16))
        inputs.append(torch.tensor(ids)[r + 1])
        labels.append(argmax[r + 1])
        groups.append(torch.full((len(r),), k))
extract_s = time.perf_counter() - t0
feats = {i: torch.cat(v) for i, v in rows.items()}
tokens, labels, groups = torch.cat(inputs), torch.cat(labels), torch.cat(groups)
held = groups >= int(len(seqs) * (1 - EVAL_SHARE))  # split by sequence
vocab = load_head(EMBEDDED_DRAFTS["smollm2-135m-eagle"]).vocab_ids  # the shipped head's sub-vocabulary
sub = torch.full((target.vocab_size,), -1, dtype=torch.long)
sub[vocab] = torch.arange(len(vocab))
sub_labels = sub[labels]
out_rows = target.model.get_output_embeddings().weight.detach()[vocab].float()
embed = target.model.get_input_embeddings().weight.detach().float()
H = out_rows.shape[1]


class Probe(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.inp = torch.nn.Linear((k + 1) * H, 2 * H)
        self.out = torch.nn.Linear(2 * H, H)
        self.norm = torch.nn.RMSNorm(H)

    def forward(self, x):
        return self.norm(self.out(F.silu(self.inp(x)))) @ out_rows.T


def batch_inputs(variant, idx):
    # the lower layers' residual streams are not normalized (the last is): scale each to unit RMS
    return torch.cat([F.rms_norm(feats[i][idx].float(), (H,)) for i in VARIANTS[variant]] + [embed[tokens[idx]]], dim=1)


result = {"target": DEFAULT_TARGET, "sequences": len(seqs), "train_rows": int((~held).sum()), "eval_rows": int(held.sum()),
          "eval_rows_in_sub_vocab": float((sub_labels[held] >= 0).float().mean()), "extract_s": extract_s,
          "steps": STEPS, "batch_rows": BATCH, "lr": LR, "variants": {}}
train_idx = torch.nonzero(~held & (sub_labels >= 0))[:, 0]
eval_idx = torch.nonzero(held)[:, 0]
for variant, picked in VARIANTS.items():
    torch.manual_seed(SEED)
    probe = Probe(len(picked))
    opt = torch.optim.AdamW(probe.parameters(), lr=LR)
    t0 = time.perf_counter()
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = LR * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(step / STEPS * 3.14159))))
        idx = train_idx[torch.randint(0, len(train_idx), (BATCH,))]
        loss = F.cross_entropy(probe(batch_inputs(variant, idx)), sub_labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        hits = 0
        for s in range(0, len(eval_idx), 4096):
            idx = eval_idx[s: s + 4096]
            pred = vocab[probe(batch_inputs(variant, idx)).argmax(-1)]
            hits += int((pred == labels[idx]).sum())
    result["variants"][variant] = {"layers": picked, "eval_top1": hits / len(eval_idx), "final_train_loss": float(loss),
                                   "train_s": time.perf_counter() - t0}
    print(variant, result["variants"][variant], file=sys.stderr, flush=True)
json.dump(result, sys.stdout, indent=1)
print()
