"""The hybrid's match orders fixed (`min_match=2`, as shipped) or learnt per run (`min_match=None`,
`MatchRouter`), beside both of its parts and a second n-gram run for the noise (issue 28; README.md here).

Per Spec-Bench question (first turns, chat, EOS respected, 256 new tokens, greedy; N per task, the first
question overall a warm-up): `ar`, cost-aware DynaTree with the n-gram drafter twice (`ngram`,
`ngram-again`), with the feature head alone (`eagle`), and with the hybrid `ngram+smollm2-135m-eagle`
routed by the fixed rule (`fixed`) and by the learnt one (`learnt`); interleaved per prompt in one
process, the order rotated from prompt to prompt.

  python docs/results/adaptive-route/ab.py q4|dense COMPILE(0|1) [N_PER_TASK=3] > OUT.json
"""
import functools
import json
import statistics
import sys
from unittest import mock

from dynatree import generate
from dynatree.draftload import load_draft
from dynatree.drafters import factory
from dynatree.drafters.hybrid import HybridDrafter
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize

HEAD = "smollm2-135m-eagle"
DRAFTS = {"ngram": "ngram", "ngram-again": "ngram", "eagle": HEAD, "fixed": f"ngram+{HEAD}", "learnt": f"ngram+{HEAD}"}
ROUTES = {"fixed": 2, "learnt": None}


def run(name, target, drafts, ids, compile, seen):
    if name == "ar":
        return generate(method="ar", target=target, prompt_ids=ids, max_new_tokens=256, compile=compile)
    routed = functools.partial(HybridDrafter, min_match=ROUTES.get(name, 2))

    def keep(*args, **kwargs):  # the run's drafter, to read what it learnt
        seen["drafter"] = routed(*args, **kwargs)
        return seen["drafter"]

    with mock.patch.object(factory, "HybridDrafter", keep):
        return generate(method="dynatree", target=target, draft=drafts[DRAFTS[name]], prompt_ids=ids,
                        max_new_tokens=256, cost_aware=True, compile=compile)


def quantiles(values):
    values = sorted(values)
    return {"min": round(values[0], 3), "median": round(statistics.median(values), 3), "max": round(values[-1], 3),
            "below_0.95": sum(v < 0.95 for v in values), "below_0.90": sum(v < 0.90 for v in values)}


def main(weights, compile, n):
    target = load_model("smollm2-135m", weights=weights)
    drafts = {spec: load_draft(spec, target) for spec in set(DRAFTS.values())}
    prompts = [p for p in load_texts("specbench", n + 1) if p.turn == 1]
    names = ["ar", "ngram", "ngram-again", "eagle", "fixed", "learnt"]
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenize(target.tokenizer, prompt, 4096, chat=True)
        row = {"id": prompt.id, "category": prompt.category, "warmup": index == 0, "prompt_tokens": len(ids)}
        tokens = {}
        for name in names[index % len(names):] + names[: index % len(names)]:
            seen = {}
            result = run(name, target, drafts, ids, compile, seen)
            tokens[name] = result.new_token_ids
            row[name] = {"tok_s": round(result.stats.tokens_per_s, 2), "M": round(result.stats.tokens_per_iter, 3),
                         "n_tokens": len(result.new_token_ids)}
            if name != "ar":
                row[name]["idle"] = result.policy_state.get("idle_iterations")
            if name == "learnt":
                row[name]["routing"] = seen["drafter"].routing_state()
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
        "over_ar_total": {k: round(sum(r[k]["n_tokens"] for r in measured) / sum(r[k]["n_tokens"] / r[k]["tok_s"] for r in measured)
                                   / (sum(r["ar"]["n_tokens"] for r in measured) / sum(r["ar"]["n_tokens"] / r["ar"]["tok_s"] for r in measured)), 3)
                          for k in names[1:]},
        "M_median": {k: round(statistics.median(r[k]["M"] for r in measured), 3) for k in names[1:]},
        "noise: ngram-again / ngram": quantiles(ratios("ngram-again", "ngram")),
        "learnt / fixed": quantiles(ratios("learnt", "fixed")),
        "fixed / max(ngram, eagle)": quantiles(ratios("fixed", ("ngram", "eagle"))),
        "learnt / max(ngram, eagle)": quantiles(ratios("learnt", ("ngram", "eagle"))),
        "noise-matched: ngram / max(ngram, ngram-again)": quantiles(ratios("ngram", ("ngram", "ngram-again"))),
        "all_same_as_ar": all(r[k]["same_as_ar"] for r in rows for k in names[1:]),
    }
    print(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], bool(int(sys.argv[2])), int(sys.argv[3]) if len(sys.argv) > 3 else 3)
