"""Compiled q4 `ar` of the embedded target with the Python wrapper and with the C++ wrapper (shipped),
and llama.cpp greedy on the same GGUF file, interleaved per prompt in one process (the order rotates
from prompt to prompt): Spec-Bench questions (first turns, N per task, the first overall a warm-up),
chat template, EOS respected, 256 new tokens, 2 threads. Per-prompt tok/s ratios, medians.

  python docs/results/cpp-wrapper/ab.py N_PER_TASK > ab.json
"""
import json
import statistics
import sys

import torch

from dynatree import generate, runtime
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize

SHIPPED = runtime.wrapper_options


def compiled_target(wrapper: str):
    """The embedded target in q4, its one-token graph built with the Python or the C++ wrapper."""
    target = load_model("smollm2-135m", weights="q4", compile=True)
    runtime.wrapper_options = SHIPPED if wrapper == "cpp" else (lambda device: {})
    assert target.warm_up(["token"]) > 0, "no graph built: the other target's was reused"  # built now, this wrapper
    runtime.wrapper_options = SHIPPED
    return target


def main(n):
    torch.manual_seed(0)
    targets = {"python": compiled_target("python"), "cpp": compiled_target("cpp")}
    prompts = [p for p in load_texts("specbench", n) if p.turn == 1]
    runs = ("python", "cpp", "llamacpp")
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenize(targets["cpp"].tokenizer, prompt, 4096, chat=True)
        row = {"id": prompt.id, "category": prompt.category, "warmup": index == 0, "prompt_tokens": len(ids)}
        for run in runs[index % 3:] + runs[: index % 3]:
            if run == "llamacpp":
                out = generate(method="llamacpp-ar", target=targets["cpp"], prompt_ids=ids, max_new_tokens=256)
            else:
                out = generate(method="ar", target=targets[run], prompt_ids=ids, max_new_tokens=256, compile=True)
            row[run] = {"tok_s": out.stats.tokens_per_s, "tpot_ms": out.stats.tpot_s * 1e3,
                        "tokens": out.new_token_ids}
        row["same_tokens"] = row["python"]["tokens"] == row["cpp"]["tokens"]
        for run in runs:
            row[run].pop("tokens")
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    measured = [r for r in rows if not r["warmup"]]

    def ratio(a, b):
        values = [r[a]["tok_s"] / r[b]["tok_s"] for r in measured]
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}

    summary = {"prompts": len(measured), "cpp_over_python": ratio("cpp", "python"),
               "python_over_llamacpp": ratio("python", "llamacpp"), "cpp_over_llamacpp": ratio("cpp", "llamacpp"),
               "tpot_ms_median": {run: round(statistics.median(r[run]["tpot_ms"] for r in measured), 2) for run in runs},
               "same_tokens": f"{sum(r['same_tokens'] for r in rows)}/{len(rows)}"}
    print(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    with torch.no_grad():
        main(int(sys.argv[1]))
