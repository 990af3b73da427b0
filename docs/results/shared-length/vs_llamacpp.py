"""Compiled q4 `ar` of the embedded target (as shipped) and llama.cpp greedy on the same GGUF file,
interleaved per prompt in one process (the order alternates): Spec-Bench questions (first turns,
N per task, the first overall a warm-up), chat template, EOS respected, 256 new tokens, 2 threads.

  python docs/results/shared-length/vs_llamacpp.py N_PER_TASK > vs_llamacpp.json
"""
import json
import statistics
import sys

import torch

from dynatree import generate
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize


def main(n):
    torch.manual_seed(0)
    target = load_model("smollm2-135m", weights="q4", compile=True)
    target.warm_up(["token"])
    prompts = [p for p in load_texts("specbench", n) if p.turn == 1]
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenize(target.tokenizer, prompt, 4096, chat=True)
        row = {"id": prompt.id, "category": prompt.category, "warmup": index == 0, "prompt_tokens": len(ids)}
        for run in (("ar", "llamacpp") if index % 2 == 0 else ("llamacpp", "ar")):
            out = generate(method="llamacpp-ar" if run == "llamacpp" else "ar", target=target, prompt_ids=ids,
                           max_new_tokens=256, compile=run == "ar")
            row[run] = {"tok_s": out.stats.tokens_per_s, "tpot_ms": out.stats.tpot_s * 1e3, "tokens": out.new_token_ids}
        row["same_tokens"] = row["ar"]["tokens"] == row["llamacpp"]["tokens"]
        for run in ("ar", "llamacpp"):
            row[run].pop("tokens")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    measured = [r for r in rows if not r["warmup"]]
    ratios = [r["ar"]["tok_s"] / r["llamacpp"]["tok_s"] for r in measured]
    summary = {"prompts": len(measured),
               "ar_over_llamacpp": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                    "max": round(max(ratios), 3)},
               "tpot_ms_median": {run: round(statistics.median(r[run]["tpot_ms"] for r in measured), 2)
                                  for run in ("ar", "llamacpp")},
               "same_tokens_as_llamacpp": f"{sum(r['same_tokens'] for r in rows)}/{len(rows)}"}
    print(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main(int(sys.argv[1]))
