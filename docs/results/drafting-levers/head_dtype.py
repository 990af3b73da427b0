"""A/B: the shipped head in float32 vs bfloat16 (packed kernels) drafting for the float32 target,
dynatree[ngram+head] +cost-aware, eager, Spec-Bench held-out questions (chat), interleaved."""
import sys, time, statistics, torch, pathlib, dynatree
from dynatree.models import load_model
from dynatree.featurehead import load_head
from dynatree.draftspec import Hybrid
from dynatree.prompts import load_texts, tokenize
from dynatree.api import generate
n = int(sys.argv[1]) if len(sys.argv) > 1 else 6
T = int(sys.argv[2]) if len(sys.argv) > 2 else 128
mode = sys.argv[3] if len(sys.argv) > 3 else "hybrid"
target = load_model("smollm2-135m", device="cpu", dtype="float32", weights="dense")
p = pathlib.Path(dynatree.__file__).parent / "drafts/smollm2-135m-eagle"
heads = {"f32": load_head(p, name="smollm2-135m-eagle", dtype=torch.float32, linear="auto"),
         "bf16": load_head(p, name="smollm2-135m-eagle", dtype=torch.bfloat16, linear="auto")}
prompts = load_texts("specbench", n)
ids = [tokenize(target.tokenizer, pr, 4096, chat=True) for pr in prompts]
res = {k: [] for k in heads}; ref = {}
for i, pid in enumerate(ids):
    for k, h in heads.items():
        d = Hybrid(h) if mode == "hybrid" else h
        r = generate(prompt_ids=pid, method="dynatree", target=target, draft=d, max_new_tokens=T, cost_aware=True)
        s = r.stats
        res[k].append((s.tokens_per_s, s.mean_generated_len, s.draft_ms, s.verify_ms))
        ref.setdefault(i, r.new_token_ids); assert ref[i] == r.new_token_ids
    print(i, {k: tuple(round(x, 2) for x in v[-1]) for k, v in res.items()}, flush=True)
ratio = [b[0] / a[0] for a, b in zip(res["f32"], res["bf16"])]
print("median speed ratio bf16/f32", round(statistics.median(ratio), 3), "M", [round(statistics.mean(x[1] for x in v), 2) for v in res.values()])
