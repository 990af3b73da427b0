"""Depth-1 agreement of the shipped head in bfloat16 and in int4 with the q4 target, on the 60 held-out
Spec-Bench answers of ../eagle-heldout/answers-q4 (the q4 target's own greedy answers, 10 per task, never
trained on): one teacher-forced q4 pass per conversation gives the features and the target's picks; each head
variant predicts from the same features through its own output rows (bfloat16 packed, or int4).

  python docs/results/head-lowbit/agreement.py > agreement.json
"""
import gzip
import json
from pathlib import Path

import torch

from dynatree.draftload import load_draft
from dynatree.draftspec import head_dir
from dynatree.drafters import FeatureDrafter
from dynatree.featurehead import load_head
from dynatree.models import load_model

HEAD = "smollm2-135m-eagle"
ANSWERS = Path(__file__).resolve().parent.parent / "eagle-heldout" / "answers-q4"
torch.set_grad_enabled(False)
target = load_model("smollm2-135m", weights="q4")
heads = {"bf16": load_head(head_dir(HEAD), name=HEAD, dtype=target.dtype, linear="auto"),
         "int4": load_draft(HEAD, target).model}
assert heads["int4"].weights == "q4"
drafters = {k: FeatureDrafter(h, target) for k, h in heads.items()}
hits = {k: {} for k in heads}
count = {}
for path in sorted(ANSWERS.glob("answers-*.json.gz")):
    data = json.load(gzip.open(path))
    for seq, start in zip(data["sequences"], data["answer_from"]):
        out = target.model(torch.tensor([seq]), use_cache=False, output_hidden_states=True)
        picks = out.logits[0, start - 1:-1].argmax(-1)  # the target's next token at each answer row
        feats = out.hidden_states[-1][:, :-1].to(torch.bfloat16)  # position p reads token p and feature p - 1
        task = path.name
        count[task] = count.get(task, 0) + len(picks)
        for k, d in drafters.items():
            pred = d.head(d.embed(torch.tensor([seq[1:]])).to(torch.bfloat16), feats, torch.arange(1, len(seq))[None])
            mine = d.head.vocab_ids[d.out(pred[0, start - 2:-1]).argmax(-1)]  # pred row p-1 predicts token p+1
            hits[k][task] = hits[k].get(task, 0) + int((mine == picks).sum())
result = {"answer_tokens": sum(count.values()), "per_file_tokens": count,
          "agreement": {k: sum(h.values()) / sum(count.values()) for k, h in hits.items()},
          "per_file": {k: {t: round(h[t] / count[t], 4) for t in count} for k, h in hits.items()}}
print(json.dumps(result, indent=1))
