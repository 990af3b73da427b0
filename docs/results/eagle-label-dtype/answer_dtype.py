"""Batched answer generation (chat.generate_batched, HF generate; prompts under 256 tokens) of the embedded
target: float32 against a bfloat16 dense load, the same prompts (Spec-Bench training questions, first turns),
interleaved twice. `python docs/results/eagle-label-dtype/answer_dtype.py 32 64` (prompts, new tokens)."""
import json
import sys
import time

from dynatree.models import DEFAULT_TARGET, load_model
from dynatree.distill.chat import instruction_prompts, chat_ids, generate_batched
n, max_new = int(sys.argv[1]), int(sys.argv[2])
f32 = load_model(DEFAULT_TARGET, weights="dense")
b16 = load_model(DEFAULT_TARGET, weights="dense", dtype="bfloat16")
convs, _ = instruction_prompts("specbench", 10)
prompts = [chat_ids(f32.tokenizer, c[:1], []) for c in convs]
prompts = [p for p in prompts if len(p) < 256][:n]
print(len(prompts), "prompts, mean len", sum(map(len, prompts)) / len(prompts), file=sys.stderr)
res = {}
for rnd in range(2):
    for name, m in (("float32", f32), ("bfloat16", b16)):
        t = time.perf_counter()
        out = generate_batched(m, prompts, max_new, 16)
        dt = time.perf_counter() - t
        toks = sum(map(len, out))
        res.setdefault(name, []).append(round(toks / dt, 1))
        res[name + "_out"] = out
        print(name, rnd, round(toks / dt, 1), "tok/s", file=sys.stderr, flush=True)
a, b = res["float32_out"], res["bfloat16_out"]
same = sum(x == y for x, y in zip(a, b))
pref = [next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) for x, y in zip(a, b)]
print(json.dumps({"tok_s": {k: v for k, v in res.items() if not k.endswith("_out")}, "answers_equal": same,
                  "n": len(a), "common_prefix_median": sorted(pref)[len(pref)//2]}))
