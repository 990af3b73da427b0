"""Is the hybrid drafter slower than the better of its parts by more than noise? (issue 28; README.md here)

Per Spec-Bench question (first turns, chat, EOS respected, 256 new tokens, greedy; 3 per task, the
first question overall a warm-up): `ar`, cost-aware DynaTree with the n-gram drafter **twice** (`ngram`,
`ngram-again`: the same configuration run twice gives the noise of a per-prompt ratio), with the
feature head alone (`eagle`) and with their hybrid (`hybrid`), plus llama.cpp greedy on the same GGUF
for the q4 setting; interleaved per prompt in one process, the order rotated from prompt to prompt.

  python docs/results/xeon-parts/parts.py q4|dense COMPILE(0|1) [N_PER_TASK=2] > OUT.json
"""
import json
import statistics
import sys

from dynatree import generate
from dynatree.draftload import load_draft
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize

HEAD = "smollm2-135m-eagle"
DRAFTS = {"ngram": "ngram", "ngram-again": "ngram", "eagle": HEAD, "hybrid": f"ngram+{HEAD}"}


def run(name, target, drafts, ids, compile):
    if name in ("ar", "llamacpp-ar"):
        options = {} if name == "llamacpp-ar" else {"compile": compile}
        return generate(method=name, target=target, prompt_ids=ids, max_new_tokens=256, **options)
    return generate(method="dynatree", target=target, draft=drafts[DRAFTS[name]], prompt_ids=ids, max_new_tokens=256,
                    cost_aware=True, compile=compile)


def quantiles(values):
    values = sorted(values)
    return {"min": round(values[0], 3), "median": round(statistics.median(values), 3), "max": round(values[-1], 3),
            "below_0.95": sum(v < 0.95 for v in values), "below_0.90": sum(v < 0.90 for v in values)}


def main(weights, compile, n):
    target = load_model("smollm2-135m", weights=weights)
    drafts = {spec: load_draft(spec, target) for spec in set(DRAFTS.values())}
    prompts = [p for p in load_texts("specbench", n + 1) if p.turn == 1]
    names = ["ar", "ngram", "ngram-again", "eagle", "hybrid"] + (["llamacpp-ar"] if weights == "q4" else [])
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenize(target.tokenizer, prompt, 4096, chat=True)
        row = {"id": prompt.id, "category": prompt.category, "warmup": index == 0, "prompt_tokens": len(ids)}
        tokens = {}
        for name in names[index % len(names):] + names[: index % len(names)]:
            result = run(name, target, drafts, ids, compile)
            tokens[name] = result.new_token_ids
            row[name] = {"tok_s": result.stats.tokens_per_s, "M": result.stats.tokens_per_iter,
                         "n_tokens": len(result.new_token_ids)}
            if name not in ("ar", "llamacpp-ar"):
                row[name]["idle"] = result.policy_state.get("idle_iterations")
        for name in names[1:]:
            row[name]["same_as_ar"] = tokens[name] == tokens["ar"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    measured = [r for r in rows if not r["warmup"]]

    def ratios(a, b):
        return [r[a]["tok_s"] / (max(r[x]["tok_s"] for x in b) if isinstance(b, tuple) else r[b]["tok_s"])
                for r in measured]

    summary = {
        "weights": weights, "compile": compile, "prompts_measured": len(measured),
        "over_ar_median": {k: round(statistics.median(ratios(k, "ar")), 3) for k in names[1:]},
        "M_median": {k: round(statistics.median(r[k]["M"] for r in measured), 3) for k in names[1:5]},
        "noise: ngram-again / ngram": quantiles(ratios("ngram-again", "ngram")),
        "hybrid / ngram": quantiles(ratios("hybrid", "ngram")),
        "hybrid / eagle": quantiles(ratios("hybrid", "eagle")),
        "hybrid / max(ngram, eagle)": quantiles(ratios("hybrid", ("ngram", "eagle"))),
        "noise-matched: max(ngram, ngram-again) / ngram": quantiles(ratios("ngram", ("ngram", "ngram-again"))),
        "all_same_as_ar": all(r[k]["same_as_ar"] for r in rows for k in names[1:5]),
    }
    if weights == "q4":
        summary["over_llamacpp_median"] = {k: round(statistics.median(ratios(k, "llamacpp-ar")), 3) for k in names[:5]}
    print(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], bool(int(sys.argv[2])), int(sys.argv[3]) if len(sys.argv) > 3 else 2)
