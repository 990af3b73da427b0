"""Section 5 of README.md: would dense bfloat16 with float64 attention pay on an AMX CPU? The embedded
target as q4 (the CLI's default) and as dense bfloat16 with float64 attention (what the low-bit formats
get), eager; per Spec-Bench question (first turn, chat, EOS respected, 256 tokens): `ar` and DynaTree
with the hybrid drafter (cost-aware) in each format, interleaved per prompt; tokens compared with the
same format's `ar`. Not a benchmark of record: a probe of a lead (eager, a few prompts).

  python docs/results/xeon-amx/bf16_trees.py N_PER_TASK > bf16_trees.json
"""
import json
import statistics
import sys

from dynatree import generate
from dynatree.attention import use_exact_attention
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize


def main(n):
    q4 = load_model("smollm2-135m", weights="q4")
    bf16 = load_model("smollm2-135m", dtype="bfloat16", weights="dense")
    assert use_exact_attention(bf16.model), "float64 attention refused"
    prompts = load_texts("specbench", n + 1)
    prompts = [p for p in prompts if p.turn == 1]
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenize(q4.tokenizer, prompt, 4096, chat=True)
        row = {"id": prompt.id, "category": prompt.category, "warmup": index == 0}
        for name, target in (("q4", q4), ("bf16", bf16)):
            ar = generate(method="ar", target=target, prompt_ids=ids, max_new_tokens=256)
            tree = generate(method="dynatree", target=target, draft="ngram+smollm2-135m-eagle", prompt_ids=ids,
                            max_new_tokens=256, cost_aware=True)
            row[name] = {"ar_tok_s": ar.stats.tokens_per_s, "tree_tok_s": tree.stats.tokens_per_s,
                         "tree_M": tree.stats.tokens_per_iter, "same": tree.new_token_ids == ar.new_token_ids,
                         "tokens": len(ar.new_token_ids)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    measured = [r for r in rows if not r["warmup"]]
    summary = {f"{f}_{k}": statistics.median(r[f][k] for r in measured) for f in ("q4", "bf16")
               for k in ("ar_tok_s", "tree_tok_s", "tree_M")}
    summary["bf16_tree_over_q4_tree"] = statistics.median(r["bf16"]["tree_tok_s"] / r["q4"]["tree_tok_s"] for r in measured)
    summary["bf16_tree_over_q4_ar"] = statistics.median(r["bf16"]["tree_tok_s"] / r["q4"]["ar_tok_s"] for r in measured)
    summary["bf16_same_as_ar"] = f"{sum(r['bf16']['same'] for r in rows)}/{len(rows)}"
    summary["q4_same_as_ar"] = f"{sum(r['q4']['same'] for r in rows)}/{len(rows)}"
    print(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]))
