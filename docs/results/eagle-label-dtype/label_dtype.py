"""`distill --kind eagle --label-dtype`: the labelling pass in float32 and in bfloat16, on the embedded target's
committed answers (data/distill/smollm2-135m/answers-*.json.gz, the first chunks read in name order until
N conversations), through `eagle_data.label` as the build runs it (`--label-dtype target`, the float32 target as
loaded, and `--label-dtype bfloat16`) (batches of 4, right-padded).
Prints tokens per second of each pass (two rounds, interleaved), and how the bfloat16 pass's labels and
features compare with float32's, over all rows and over answer rows only.
  python docs/results/eagle-label-dtype/label_dtype.py [N=64]"""
import json
import sys
import time
from pathlib import Path

import torch

from dynatree.distill.eagle_data import EagleConfig, label, labelling_params, read_answers
from dynatree.env import describe
from dynatree.models import load_model

torch.set_num_threads(2)
n_conv = int(sys.argv[1]) if len(sys.argv) > 1 else 64
target = load_model("smollm2-135m")
seqs, starts = [], []
for path in sorted(Path("data/distill/smollm2-135m").glob("answers-*.json.gz")):
    s, a = read_answers(path, target)
    seqs += s
    starts += a
    if len(seqs) >= n_conv:
        break
seqs, starts = seqs[:n_conv], starts[:n_conv]
tokens = sum(map(len, seqs))
params = {"float32": None, "bfloat16": labelling_params(target, EagleConfig(label_dtype="bfloat16"))}
result = {"conversations": len(seqs), "tokens": tokens, "answer_tokens": sum(len(s) - a for s, a in zip(seqs, starts)),
          "machine": describe(), "tok_per_s": {"float32": [], "bfloat16": []}}
out = {}
for rnd in range(2):
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        out[dtype] = label(target, seqs, 4, params=params[dtype])
        result["tok_per_s"][dtype].append(round(tokens / (time.perf_counter() - t0)))
f32_feats, f32_labels = out["float32"]
b16_feats, b16_labels = out["bfloat16"]
for rows, name in ((slice(None), "all_rows"), ("answers", "answer_rows")):
    same = total = 0
    err_num = err_den = 0.0
    for i, start in enumerate(starts):
        cut = slice(None) if rows != "answers" else slice(start - 1, -1)  # the rows whose label is an answer token
        a, b = f32_labels[i][cut], b16_labels[i][cut]
        same += int((a == b).sum())
        total += len(a)
        fa, fb = f32_feats[i][cut].float(), b16_feats[i][cut].float()
        err_num += float((fa - fb).pow(2).sum())
        err_den += float(fa.pow(2).sum())
    result[name] = {"labels_equal": round(same / total, 4), "rows": total,
                    "feature_relative_error": round((err_num / err_den) ** 0.5, 4)}
print(json.dumps(result, indent=1))
