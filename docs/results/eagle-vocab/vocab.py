"""How much the feature head's sub-vocabulary limits it on Spec-Bench answers (issue 28; README.md here).

The shipped head proposes from 8192 rows of the target's (frozen) output layer. For each of the first 3
Spec-Bench questions per task (turn 1, chat, EOS respected, the float32 target's greedy answer of at most
256 tokens): the share of answer tokens inside the sub-vocabulary, and the head's teacher-forced top-1
agreement (`bench.draftcheck.head_agreement`, as the bench measures it) with its own rows, with them
extended by the tokens most frequent in the committed training answers (data/distill/smollm2-135m) to
12288 / 16384 / 24576 rows and to the whole vocabulary (rows the head was never trained against), and
with the 8192 rows most frequent in those answers instead of its own; then one head step (a root
expansion) against one target step for each size, twice.

  python docs/results/eagle-vocab/vocab.py > vocab.txt
"""
import copy
import gzip
import json
import os
import statistics

import torch

from dynatree import generate
from dynatree.bench.draftcheck import head_agreement, step_costs
from dynatree.draftload import load_draft
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize

DATA = "data/distill/smollm2-135m"


def main():
    target = load_model("smollm2-135m", weights="dense")
    head = load_draft("smollm2-135m-eagle", target).model
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    for name in os.listdir(DATA):
        if name.startswith("answers"):
            for seq in json.load(gzip.open(f"{DATA}/{name}"))["sequences"]:
                counts += torch.bincount(torch.tensor(seq[1:]), minlength=target.vocab_size)
    order = counts.argsort(descending=True).tolist()
    own = set(head.vocab_ids.tolist())
    print(f"own rows among the 8192 most frequent tokens of the training answers: {len(own & set(order[:8192]))}")
    print("training answers' tokens covered: own %.4f, their top 8192 %.4f, top 16384 %.4f" % (
        counts[list(own)].sum() / counts.sum(), counts[order[:8192]].sum() / counts.sum(), counts[order[:16384]].sum() / counts.sum()))
    answers = []
    for prompt in [p for p in load_texts("specbench", 3) if p.turn == 1]:
        ids = tokenize(target.tokenizer, prompt, 4096, chat=True)
        new = generate(method="ar", target=target, prompt_ids=ids, max_new_tokens=256).new_token_ids
        answers.append((prompt, ids, new))
    vocabs = {str(n): own | set([t for t in order if t not in own][: max(0, n - len(own))])
              for n in (8192, 12288, 16384, 24576, target.vocab_size)}
    vocabs["top-8192 of the training answers"] = set(order[:8192])
    heads = {}
    for name, rows in vocabs.items():
        heads[name] = copy.deepcopy(head)
        heads[name].vocab_ids = torch.tensor(sorted(rows))
    results = {name: {"coverage": [], "agreement": []} for name in vocabs}
    for prompt, ids, new in answers:
        line = [prompt.id, prompt.category, len(new)]
        for name, rows in vocabs.items():
            results[name]["coverage"].append(sum(t in rows for t in new) / len(new))
            results[name]["agreement"].append(head_agreement(target, heads[name], ids, new))
            line.append("%s: %.3f/%.3f" % (name, results[name]["coverage"][-1], results[name]["agreement"][-1]))
        print(*line, flush=True)
    for name, r in results.items():
        print("%s rows: coverage mean %.3f, agreement mean %.4f, median %.4f" % (
            name, statistics.mean(r["coverage"]), statistics.mean(r["agreement"]), statistics.median(r["agreement"])))
    _, ids, new = answers[0]
    for _ in range(2):
        for name in list(vocabs)[:5]:
            cost = step_costs(target, heads[name], ids + new, steps=40)
            print("step %s rows: head %.2f ms, target %.2f ms, ratio %.3f" % (name, cost["draft_ms"], cost["target_ms"], cost["cost_ratio"]))


if __name__ == "__main__":
    main()
