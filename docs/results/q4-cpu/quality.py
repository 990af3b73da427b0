"""Quality of each weight format against the float32 target (issue 32), on Spec-Bench questions.

For every question (the first turn, chat template): the float32 model's greedy answer (T
tokens, EOS respected) is the reference text. Each format then reads prompt + answer in one
teacher-forced pass, and we report
  * top-1 agreement: the share of answer positions where the format's most likely next token
    is the float32 model's (the answer's own token),
  * PPL of the question text (the prompt's tokens after the first), a neutral text none of them wrote,
  * PPL of the float32 answer.
Formats: ours (`dense` bfloat16, `q4`, `int8`, all from the embedded GGUF) and llama.cpp's own
decoding of the same GGUF file (logits of every position through llama-cpp-python).

    .venv/bin/python docs/results/q4-cpu/quality.py --per-task 2 --max-new-tokens 128 > quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from dynatree import generate
from dynatree.prompts import encode_prompt
from dynatree.prompts import load_texts
from dynatree.models import load_model


@torch.no_grad()
def logits_of(model, ids: list[int]) -> np.ndarray:
    out = model.model(torch.tensor([ids]), use_cache=False).logits[0].float()
    return out.numpy()


def llamacpp_logits(gguf, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = llamacpp_logits.cache.get(str(gguf))
    if llm is None:
        llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=torch.get_num_threads(), logits_all=True, verbose=False)
        llamacpp_logits.cache[str(gguf)] = llm
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


llamacpp_logits.cache = {}


def scores(logits: np.ndarray, ids: list[int], prompt_len: int) -> dict:
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]  # position i predicts token i + 1
    answer = slice(prompt_len - 1, len(ids) - 1)
    agree = (logits[answer].argmax(-1) == np.array(ids[prompt_len:]))
    return {"agree": int(agree.sum()), "answer_tokens": int(agree.size),
            "prompt_nll": float(nll[: prompt_len - 1].sum()), "prompt_tokens": prompt_len - 1,
            "answer_nll": float(nll[answer].sum())}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(2)
    reference = load_model("smollm2-135m")  # float32, the GGUF's values dequantized
    formats = {"bfloat16": load_model("smollm2-135m", dtype="bfloat16"),
               "q4": load_model("smollm2-135m", weights="q4"),
               "int8": load_model("smollm2-135m", weights="int8")}
    picked = load_texts("specbench", args.per_task)  # per_task questions of each Spec-Bench task
    totals = {name: {} for name in ["float32", *formats, "llama.cpp"]}
    start = time.time()
    for q in picked:
        prompt = encode_prompt(reference.tokenizer, q.text, chat=True)
        answer = generate(prompt_ids=prompt, method="ar", target=reference, max_new_tokens=args.max_new_tokens)
        ids = prompt + answer.new_token_ids
        rows = {"float32": logits_of(reference, ids), **{n: logits_of(m, ids) for n, m in formats.items()},
                "llama.cpp": llamacpp_logits(reference.gguf, ids)}
        for name, logits in rows.items():
            for key, value in scores(logits, ids, len(prompt)).items():
                totals[name][key] = totals[name].get(key, 0) + value
        print(f"{q.category}: {len(answer['new_token_ids'])} tokens ({time.time() - start:.0f} s)", file=sys.stderr)
    report = {name: {"top1_agreement_with_float32": t["agree"] / t["answer_tokens"],
                     "ppl_question": math.exp(t["prompt_nll"] / t["prompt_tokens"]),
                     "ppl_float32_answer": math.exp(t["answer_nll"] / t["answer_tokens"]),
                     "answer_tokens": t["answer_tokens"], "question_tokens": t["prompt_tokens"]}
              for name, t in totals.items()}
    print(json.dumps({"questions": len(picked), "per_task": args.per_task, "max_new_tokens": args.max_new_tokens,
                      "formats": report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
