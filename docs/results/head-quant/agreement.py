"""Depth-1 agreement with the q4 target of the shipped head in bfloat16, in int4 as commit f85893e quantized it
(Q4_1's min-max levels, from the head cast to bfloat16 first; codes chosen against the unrounded zero), and in int4
as dynatree loads it now (`weights.int4_linear`: min-max start, least-squares refit per group, from the saved
float32 weights, codes against the bfloat16-rounded scale and zero), on the 60 held-out Spec-Bench answers of
../eagle-heldout/answers-q4 (10 per task, never trained on). The steps of ../head-lowbit/agreement.py.

  python docs/results/head-quant/agreement.py > agreement.json
"""
import gzip
import json
from pathlib import Path

import torch

from dynatree import weights as W
from dynatree.draftload import load_draft
from dynatree.draftspec import head_dir
from dynatree.drafters import FeatureDrafter
from dynatree.drafters import feature as F
from dynatree.featurehead import FeatureHead, load_head
from dynatree.models import load_model

HEAD = "smollm2-135m-eagle"
ANSWERS = Path(__file__).resolve().parent.parent / "eagle-heldout" / "answers-q4"


def min_max_int4(weight):  # int4_linear at f85893e
    out, inp = weight.shape
    groups = weight.detach().float().reshape(out, inp // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16).float()
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return W.Int4Linear(codes.reshape(out, inp).to(torch.int32), scale, low + 8 * scale, None)


def old_q4_head(target):
    head = load_head(head_dir(HEAD), name=HEAD + "-old", dtype=torch.bfloat16)
    for parent in list(head.body.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, min_max_int4(child.weight))
    head.weights = "q4"
    return head


torch.set_grad_enabled(False)
target = load_model("smollm2-135m", weights="q4")
heads = {"bf16": load_head(head_dir(HEAD), name=HEAD, dtype=target.dtype, linear="auto"),
         "int4-minmax-f85893e": old_q4_head(target), "int4-refit": load_draft(HEAD, target).model}
drafters = {}
for k, h in heads.items():
    d = FeatureDrafter(h, target)
    if k.startswith("int4-minmax"):  # its output rows the old way too: cast to the head's dtype, then min-max
        rows = target.model.get_output_embeddings().weight.detach()[h.vocab_ids].to(torch.bfloat16)
        d.out = min_max_int4(rows)
    drafters[k] = d
err = {}
for k in ("int4-minmax-f85893e", "int4-refit"):  # relative squared error of the output rows' weights
    rows = target.model.get_output_embeddings().weight.detach()[heads[k].vocab_ids].float()
    err[k] = float(((drafters[k].out.dequantized() - rows) ** 2).sum() / (rows ** 2).sum())
hits = {k: {} for k in heads}
count = {}
for path in sorted(ANSWERS.glob("answers-*.json.gz")):
    data = json.load(gzip.open(path))
    for seq, start in zip(data["sequences"], data["answer_from"]):
        out = target.model(torch.tensor([seq]), use_cache=False, output_hidden_states=True)
        picks = out.logits[0, start - 1:-1].argmax(-1)
        feats = out.hidden_states[-1][:, :-1].to(torch.bfloat16)
        task = path.name
        count[task] = count.get(task, 0) + len(picks)
        for k, d in drafters.items():
            pred = d.head(d.embed(torch.tensor([seq[1:]])).to(torch.bfloat16), feats, torch.arange(1, len(seq))[None])
            mine = d.head.vocab_ids[d.out(pred[0, start - 2:-1]).argmax(-1)]
            hits[k][task] = hits[k].get(task, 0) + int((mine == picks).sum())
result = {"answer_tokens": sum(count.values()), "output_rows_relative_squared_error": err,
          "agreement": {k: sum(h.values()) / sum(count.values()) for k, h in hits.items()},
          "per_file": {k: {t: round(h[t] / count[t], 4) for t in count} for k, h in hits.items()}}
print(json.dumps(result, indent=1))
