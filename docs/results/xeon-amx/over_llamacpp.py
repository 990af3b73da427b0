"""Per-prompt speed of each variant of a `dynatree bench` run over llama.cpp's greedy decoding in the
same run (`llamacpp-ar`, same prompt): median, min-max, and the ratio of total throughputs.

  python docs/results/xeon-amx/over_llamacpp.py RESULTS.json [...]
"""
import json
import statistics
import sys


def main(paths):
    for path in paths:
        records = [r for r in json.load(open(path))["records"] if not r["warmup"]]
        base = {r["prompt_index"]: r["stats"] for r in records if r["method"] == "llamacpp-ar"}
        print(f"## {path}: {len(base)} measured prompts")
        for variant in dict.fromkeys(r["variant"] for r in records):
            rows = [r for r in records if r["variant"] == variant]
            ratios = [r["stats"]["tokens_per_s"] / base[r["prompt_index"]]["tokens_per_s"] for r in rows]
            total = (sum(r["stats"]["new_tokens"] for r in rows) / sum(r["stats"]["wall_s"] for r in rows)) / (
                sum(base[r["prompt_index"]]["new_tokens"] for r in rows) / sum(base[r["prompt_index"]]["wall_s"] for r in rows))
            print(f"{variant:50s} median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}), "
                  f"totals {total:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
