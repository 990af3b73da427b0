"""The checks a lent CUDA machine runs (README.md beside this file): nothing else tests the GPU path.

    python docs/results/gpu/run.py model DIR         # a GPU-sized random Llama (SmolLM2's tokenizer) saved to DIR
    python docs/results/gpu/run.py curve DIR OUT     # its verification cost curves, float32 and bfloat16 -> OUT.json
    python docs/results/gpu/run.py exact DIR OUT     # ar vs DynaTree (default drafter) on chat prompts -> OUT.json
    python docs/results/gpu/run.py compiled DIR OUT  # the same with --compile (CUDA's compiled path) -> OUT.json

The model is random (initialised as transformers does, seed 0): its text means nothing and its
acceptance rates say nothing about a trained model's; what it measures is the GPU itself (how a
forward's time grows with the number of tree tokens) and whether the engine stays exact and what
its own overhead costs at a size where the GPU, not Python, should set the pace.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
TOKENIZER = ROOT / "src/dynatree/drafts/smollm2-135m-draft"  # SmolLM2's tokenizer and chat template (49152 ids)
QUESTIONS = ROOT / "src/dynatree/data/spec_bench/question.jsonl"
TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")  # Spec-Bench's tasks besides MT-Bench
SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# DRY_RUN=1: a tiny model on the CPU, to check this script here before spending a GPU's minutes
DRY = os.environ.get("DRY_RUN") == "1"
DEVICE = "cpu" if DRY else "cuda"


def name() -> str:
    return "cpu (dry run)" if DRY else torch.cuda.get_device_name()


def build(directory: str) -> None:
    """A TinyLlama-shaped random model (1.1B parameters: 22 layers, hidden 2048, 32 query and 4 KV heads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if DRY else \
        dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22)
    config = LlamaConfig(**size, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=49152, max_position_embeddings=4096, rope_theta=10000.0,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(directory)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters to {directory}", flush=True)


def curves(directory: str, out: str) -> None:
    """The cost curve the cost-aware policy measures (costmeasure.measure), at two context lengths per dtype."""
    from dynatree import costmeasure
    from dynatree.models import load_model

    record = {"device": name(), "torch": torch.__version__, "sizes": list(SIZES), "curves": []}
    for dtype in ("float32", "bfloat16"):
        target = load_model(directory, device=DEVICE, dtype=dtype)
        for context in (256, 2048):
            t0 = time.perf_counter()
            curve = costmeasure.measure(target, list(range(100, 100 + context)), sizes=SIZES, rounds=7)
            ms = [round(s * 1e3, 3) for s in curve.seconds]
            record["curves"].append({"dtype": dtype, "context": context, "ms": ms})
            print(f"{dtype} context {context}: " + " ".join(f"{n}:{t}" for n, t in zip(SIZES, ms))
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
        del target
        if not DRY:
            torch.cuda.empty_cache()
    Path(out).write_text(json.dumps(record, indent=1))


def chat_prompts(per_task: int) -> list[tuple[str, str]]:
    """(task, first turn) of the first `per_task` Spec-Bench questions of each task."""
    from dynatree.prompts import questions

    seen: dict[str, int] = {}
    prompts = []
    for _, category, turns in questions(QUESTIONS):
        task = category if category in TASKS else "mt_bench"  # MT-Bench's eight categories are one task
        if seen.get(task, 0) < per_task:
            seen[task] = seen.get(task, 0) + 1
            prompts.append((task, turns[0]))
    return prompts


def exact(directory: str, out: str, per_category: int = 2, max_new: int = 128) -> None:
    """ar and DynaTree (its default drafter, eager, float32, greedy) on Spec-Bench chat prompts (`per_category`
    per task, first turns): the same tokens? and each run's speed, tokens per pass and step costs."""
    from dynatree import api
    from dynatree.models import load_model

    target = load_model(directory, device=DEVICE, dtype="float32")
    prompts = chat_prompts(per_category)
    api.generate(prompts[0][1], "ar", target=target, chat=True, max_new_tokens=8)  # CUDA's first-call set-up, untimed
    rows = []
    for category, text in prompts:
        runs = {}
        for method, options in (("ar", {}), ("dynatree", {}), ("dynatree", {"cost_aware": True})):
            label = method + (" +cost-aware" if options else "")
            runs[label] = api.generate(text, method, target=target, chat=True, max_new_tokens=max_new, **options)
        ar = runs["ar"]
        for label, result in runs.items():
            rows.append({"category": category, "method": label, "draft": result.draft,
                         "same_as_ar": result.new_token_ids == ar.new_token_ids, "new_tokens": result.stats.new_tokens,
                         "tokens_per_pass": result.stats.tokens_per_iter, "tokens_per_s": result.stats.tokens_per_s,
                         "draft_ms": result.stats.draft_ms, "verify_ms": result.stats.verify_ms,
                         "commit_ms": result.stats.commit_ms})
            r = rows[-1]
            print(f"{category:22} {label:20} same={r['same_as_ar']} n={r['new_tokens']} L={r['tokens_per_pass']} "
                  f"tok/s={r['tokens_per_s']:.1f}", flush=True)
    Path(out).write_text(json.dumps({"device": name(), "torch": torch.__version__,
                                     "max_new_tokens": max_new, "rows": rows}, indent=1))


def compiled(directory: str, out: str, max_new: int = 128) -> None:
    """`--compile` on CUDA: ar and DynaTree (default drafter, float32, greedy) eager and compiled, one Spec-Bench
    chat prompt per task, each prompt's four runs back to back; every run's tokens against eager `ar`'s. The first
    call of each compiled method builds its graphs (timed apart: that is what a user waits for once)."""
    from dynatree import api
    from dynatree.models import load_model

    target = load_model(directory, device=DEVICE, dtype="float32")
    prompts = chat_prompts(1)
    methods = (("ar", {}), ("ar +compile", {"compile": True}), ("dynatree", {}),
               ("dynatree +compile", {"compile": True}), ("dynatree +cost-aware +compile", {"compile": True, "cost_aware": True}))
    first = {}
    for label, options in methods:  # warm-up on a prompt that is not measured: CUDA set-up, graph building
        t0 = time.perf_counter()
        api.generate("Write a short poem about the sea.", label.split()[0], target=target, chat=True,
                     max_new_tokens=max_new, **options)
        first[label] = round(time.perf_counter() - t0, 1)
        print(f"first call {label}: {first[label]} s", flush=True)
    rows = []
    for category, text in prompts:
        runs = {label: api.generate(text, label.split()[0], target=target, chat=True, max_new_tokens=max_new, **options)
                for label, options in methods}
        ar = runs["ar"]
        for label, result in runs.items():
            rows.append({"category": category, "method": label, "same_as_ar": result.new_token_ids == ar.new_token_ids,
                         "new_tokens": result.stats.new_tokens, "tokens_per_pass": result.stats.tokens_per_iter,
                         "tokens_per_s": result.stats.tokens_per_s, "draft_ms": result.stats.draft_ms,
                         "verify_ms": result.stats.verify_ms, "commit_ms": result.stats.commit_ms})
            r = rows[-1]
            print(f"{category:14} {label:30} same={r['same_as_ar']} n={r['new_tokens']} L={r['tokens_per_pass']:.2f} "
                  f"tok/s={r['tokens_per_s']:.1f} verify={r['verify_ms']:.2f} ms", flush=True)
        Path(out).write_text(json.dumps({"device": name(), "torch": torch.__version__, "max_new_tokens": max_new,
                                         "first_call_s": first, "rows": rows}, indent=1))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"model": build, "curve": curves, "exact": exact, "compiled": compiled}[command](*args)
