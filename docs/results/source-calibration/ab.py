"""A/Bs of changes to cost-aware DynaTree with the hybrid drafter `ngram+smollm2-135m-eagle` (README.md
here), each emulating another behaviour in this process. Variants:
  * `hybrid`: the policy of the commit the script runs at;
  * `hybrid-shared`: one calibration table for model and lookup nodes (every node reported as a
    lookup's, `Proposal.by_model` -> False, the only thing the tables are keyed by);
  * `hybrid-no-lookups`: no lookup nodes beside a model's tree, the model judged against plain steps
    only (`DynaTreePolicy._add_lookups` returns the tree as it is; needs a commit that has it);
  * `ar`, `ngram` and `ngram-again` (the n-gram drafter alone, twice: the second gives the noise).
Set `lookups` (section 2, ran at 8fba883): ar, ngram, hybrid, hybrid-shared, hybrid-no-lookups; set
`orders` (section 3, at b0c4624): ar, ngram, ngram-again, hybrid, hybrid-no-lookups. Interleaved per
prompt in one process, the order rotated from prompt to prompt. Spec-Bench questions (first turns,
chat, EOS respected, 256 new tokens, greedy), the first a warm-up. (`q4-compiled-calibration.json`,
section 1, came from the first version of this script at c9e6b1c: variants ar, ngram, `hybrid-split`
(= `hybrid`) and hybrid-shared.)

  python docs/results/source-calibration/ab.py lookups|orders N_PER_TASK q4|dense COMPILE(0|1) > OUT.json
"""
import json
import statistics
import sys
from contextlib import nullcontext
from unittest.mock import patch

from dynatree import generate
from dynatree.draftload import load_draft
from dynatree.drafters import Proposal
from dynatree.models import load_model
from dynatree.policies.dynatree import DynaTreePolicy
from dynatree.prompts import load_texts, tokenize

HYBRID = "ngram+smollm2-135m-eagle"


def no_lookups(policy, grown, *args):
    policy._free = None
    return grown
    yield  # a generator, as the method it stands in for


PATCHES = {
    "hybrid-shared": lambda: patch.object(Proposal, "by_model", lambda self, row: False),
    "hybrid-no-lookups": lambda: patch.object(DynaTreePolicy, "_add_lookups", no_lookups),
}


def run(name, target, drafts, ids, compile):
    if name == "ar":
        return generate(method="ar", target=target, prompt_ids=ids, max_new_tokens=256, compile=compile)
    draft = drafts["ngram" if name.startswith("ngram") else HYBRID]
    with PATCHES[name]() if name in PATCHES else nullcontext():
        return generate(method="dynatree", target=target, draft=draft, prompt_ids=ids, max_new_tokens=256,
                        cost_aware=True, compile=compile)


SETS = {"lookups": ["ar", "ngram", "hybrid", "hybrid-shared", "hybrid-no-lookups"],
        "orders": ["ar", "ngram", "ngram-again", "hybrid", "hybrid-no-lookups"]}


def main(variants, n, weights, compile):
    target = load_model("smollm2-135m", weights=weights)
    drafts = {"ngram": load_draft("ngram", target), HYBRID: load_draft(HYBRID, target)}
    prompts = [p for p in load_texts("specbench", n + 1) if p.turn == 1]
    names = SETS[variants]
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenize(target.tokenizer, prompt, 4096, chat=True)
        row = {"id": prompt.id, "category": prompt.category, "warmup": index == 0, "prompt_tokens": len(ids)}
        order = names[index % len(names):] + names[: index % len(names)]
        for name in order:
            result = run(name, target, drafts, ids, compile)
            row[name] = {"tok_s": result.stats.tokens_per_s, "M": result.stats.tokens_per_iter,
                         "tokens": result.new_token_ids, "idle": (result.policy_state or {}).get("idle_iterations")}
        for name in names[1:]:
            row[name]["same_as_ar"] = row[name]["tokens"] == row["ar"]["tokens"]
        for name in names:
            row[name]["n_tokens"] = len(row[name].pop("tokens"))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    measured = [r for r in rows if not r["warmup"]]

    def med(f):
        return round(statistics.median(f(r) for r in measured), 4)

    summary = {
        "weights": weights, "compile": compile, "prompts_measured": len(measured),
        **{f"{k}_over_ar": med(lambda r, k=k: r[k]["tok_s"] / r["ar"]["tok_s"]) for k in names[1:]},
        **{f"{k}_M": med(lambda r, k=k: r[k]["M"]) for k in names[1:]},
        **{f"hybrid_over_{k}": med(lambda r, k=k: r["hybrid"]["tok_s"] / r[k]["tok_s"])
           for k in names if k.startswith("hybrid-")},
        **{f"{k}_over_ngram": med(lambda r, k=k: r[k]["tok_s"] / r["ngram"]["tok_s"]) for k in names[2:]},
        **{f"{k}_slower_than_ngram_by_5pct": sum(r[k]["tok_s"] < 0.95 * r["ngram"]["tok_s"] for r in measured)
           for k in names[2:]},
        "all_same_as_ar": all(r[k]["same_as_ar"] for r in rows for k in names[1:]),
    }
    print(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], bool(int(sys.argv[4])))
