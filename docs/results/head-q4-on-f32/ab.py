"""(python docs/results/head-q4-on-f32/ab.py eager|compiled N_PER_TASK)
A/B: dynatree[ngram+eagle] +cost-aware on the float32 embedded target, head dense float32 vs int4 (bf16)."""
import sys, statistics as st, torch
from dynatree.api import generate
from dynatree.models import load_model
from dynatree.draftspec import Hybrid, head_dir
from dynatree.featurehead import load_head
from dynatree.prompts import load_texts, encode_prompt
comp = sys.argv[1] == "compiled"; n = int(sys.argv[2])
t = load_model("smollm2-135m", dtype="float32")
dense = load_head(head_dir("smollm2-135m-eagle"), name="dense", dtype=torch.float32, linear="auto")
q4 = load_head(head_dir("smollm2-135m-eagle"), name="q4", dtype=torch.bfloat16, weights="q4")
ps = load_texts("specbench", n)
rows = []
for i, p in enumerate(ps):
    ids = encode_prompt(t.tokenizer, p.text, chat=True)
    out = {}
    order = (("ar", None), ("dense", dense), ("q4", q4)) if i % 2 == 0 else (("q4", q4), ("dense", dense), ("ar", None))
    for name, h in order:
        r = generate(method="ar" if h is None else "dynatree", target=t, draft=None if h is None else Hybrid(h),
                     prompt_ids=ids, max_new_tokens=256, compile=comp, **({} if h is None else {"cost_aware": True}))
        out[name] = r
    same = all(out[k].new_token_ids == out["ar"].new_token_ids for k in ("dense", "q4"))
    s = {k: out[k].stats for k in out}
    row = dict(cat=p.category if hasattr(p, "category") else "", same=same,
               dense=s["ar"].wall_s / s["dense"].wall_s, q4=s["ar"].wall_s / s["q4"].wall_s,
               Md=s["dense"].tokens_per_iter, Mq=s["q4"].tokens_per_iter, dd=s["dense"].draft_ms, dq=s["q4"].draft_ms)
    rows.append(row); print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
if rows:
    print("median speedup over ar: dense %.3f q4 %.3f; q4/dense per prompt median %.3f" % (
        st.median(r["dense"] for r in rows), st.median(r["q4"] for r in rows), st.median(r["q4"] / r["dense"] for r in rows)))
