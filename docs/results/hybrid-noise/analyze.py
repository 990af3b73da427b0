"""Per prompt, is the hybrid slower than each of its parts by more than the run's own noise?

    python docs/results/hybrid-noise/analyze.py results.json   (a bench run with --repeats 3 or more)

For a prompt and two variants A and B, each with R rounds: A is *slower beyond noise* when every round of A is
slower than every round of B (complete separation; for R = 3 against 3 with no real difference this happens with
probability 1 / C(6, 3) = 5% each way, so over 17 prompts about one such prompt is expected by chance, and the
count the other way round is printed beside it as the chance rate's check). Also printed: the per-prompt ratio
of median rounds, and the spread between rounds (fastest over slowest) of each variant.
"""

import json
import statistics
import sys

HYBRID = "dynatree[ngram+smollm2-135m-eagle] +cost-aware"  # every row compiled: no "+compile" in the labels
PARTS = ("dynatree[ngram] +cost-aware", "dynatree[smollm2-135m-eagle] +cost-aware")


def main(path: str) -> None:
    res = json.load(open(path))
    recs = [r for r in res["records"] if not r["warmup"]]
    by = {(r["variant"], r["prompt_index"]): r for r in recs}
    prompts = sorted({r["prompt_index"] for r in recs})
    labels = sorted({r["variant"] for r in recs})
    if HYBRID not in labels or any(p not in labels for p in PARTS):
        sys.exit(f"{path}: expected the variants {HYBRID!r} and {PARTS!r}, found {labels}")
    rounds = {k: [x["tokens_per_s"] for x in r.get("rounds") or []] for k, r in by.items()}
    if min(len(v) for v in rounds.values()) < 3:
        sys.exit(f"{path}: every record needs 3 or more rounds (--repeats 3)")
    spread = {k: max(v) / min(v) - 1 for k, v in rounds.items()}
    print(f"# {path}: {len(prompts)} measured prompts, {min(len(v) for v in rounds.values())} rounds each\n")
    print("Spread between rounds (fastest over slowest), median [max] over prompts:\n")
    for label in labels:
        vals = [spread[(label, p)] for p in prompts]
        print(f"- {label}: {statistics.median(vals):.1%} [{max(vals):.1%}]")
    print()
    for part in PARTS:
        ratios, slower, faster = [], [], []
        rows = []
        for p in prompts:
            h, o = rounds[(HYBRID, p)], rounds[(part, p)]
            ratio = statistics.median(h) / statistics.median(o)
            ratios.append(ratio)
            if max(h) < min(o):
                slower.append(p)
            if min(h) > max(o):
                faster.append(p)
            r = by[(HYBRID, p)]
            rows.append(f"| {p + 1} | {r.get('category')} | {ratio:.3f} | {min(h) / max(o):.3f}-{max(h) / min(o):.3f} | "
                        f"{'slower' if p in slower else 'faster' if p in faster else '-'} |")
        print(f"## {HYBRID} against {part}\n")
        print(f"Per-prompt ratio of median rounds: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}; ratio of totals (median rounds) "
              f"{_totals(by, HYBRID, prompts) / _totals(by, part, prompts):.3f}")
        print(f"Prompts where the hybrid is slower beyond noise (every round below every round of the part): "
              f"**{len(slower)}** of {len(prompts)} {[p + 1 for p in slower]}; faster beyond noise: {len(faster)} "
              f"{[p + 1 for p in faster]}\n")
        print("| prompt | task | ratio of medians | range over rounds | beyond noise |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))
        print()


def _totals(by, label, prompts):
    return sum(by[(label, p)]["stats"]["new_tokens"] for p in prompts) / sum(by[(label, p)]["stats"]["wall_s"]
                                                                             for p in prompts)


if __name__ == "__main__":
    main(sys.argv[1])
