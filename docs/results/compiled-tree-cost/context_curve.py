"""Verification cost curve at two context lengths (is the per-row cost context-dependent?).
The cost-aware policy times its curve once, on the first prompt, and learns one offset for trees online.
    python docs/results/compiled-tree-cost/context_curve.py eager|compiled"""
import sys, torch
from dynatree.models import load_model
from dynatree.costmeasure import measure
torch.manual_seed(0)
compiled = sys.argv[1] == "compiled"
t = load_model("smollm2-135m", dtype="float32", weights="dense")
ids = t.tokenizer("The quick brown fox jumps over the lazy dog. " * 200)["input_ids"]
sizes = (1, 2, 3, 4, 6, 8, 12, 16)
for L in (100, 1200, 100, 1200):
    c = measure(t, ids[:L], sizes=sizes, rounds=5, compiled=compiled)
    print(L, " ".join(f"{n}:{s*1e3:.2f}" for n, s in zip(c.sizes, c.seconds)), flush=True)
