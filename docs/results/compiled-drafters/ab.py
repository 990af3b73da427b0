"""The drafter's model steps (by default the feature head's) compiled or eager in one `--compile` run of
the embedded target (2026-11-27).

  python docs/results/compiled-drafters/ab.py WEIGHTS [N [DRAFT]]   WEIGHTS: dense (float32) or q4; N questions
                                                                   per task; DRAFT (default ngram+smollm2-135m-eagle)

Same process, same compiled target: each Spec-Bench question (chat template, EOS respected, 256 new
tokens) is decoded by `dynatree[DRAFT] +cost-aware` with the draft model eager and with it compiled, in turn (order alternating per prompt), after one warm-up prompt. Prints per prompt the
two throughputs, the drafting seconds per head forward (a feature head's; 0 forwards counted for a draft LM) and whether the tokens are
equal (they must be: greedy output never depends on the draft), then the per-prompt median ratio.
"""
import statistics
import sys
import time

import torch

from dynatree import Decoder, make_config
from dynatree.draftload import load_draft
from dynatree.drafters.factory import make_drafter
from dynatree.methods import METHODS
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize

WEIGHTS = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1
torch.manual_seed(0)
target = load_model("smollm2-135m", weights=WEIGHTS, compile=True)
DRAFT = sys.argv[3] if len(sys.argv) > 3 else "ngram+smollm2-135m-eagle"
draft = load_draft(DRAFT, target)
config = make_config("dynatree", cost_aware=True)
prompts = [tokenize(target.tokenizer, p, 4096, chat=True) for p in load_texts("specbench", N)]


def decode(ids, compiled: bool):
    drafter = make_drafter(draft, target, ngram_max=4, compile=compiled)  # the CLI's default --ngram-max
    feature = drafter.lm if hasattr(drafter, "lm") else drafter  # the model's drafter (inside a hybrid or alone)
    decoder = Decoder(target, METHODS["dynatree"].policy_cls(config), drafter, compile=True)
    decoder.prepare(ids, 256)
    start = time.perf_counter()
    run = decoder.generate(ids, 256)
    wall = time.perf_counter() - start
    return run, wall, getattr(feature, "calls", 0)  # (an LM drafter does not count its forwards)


decode(prompts[0], True), decode(prompts[0], False)  # graphs, cost curve, caches
ratios = []
for i, ids in enumerate(prompts):
    res = {}
    for compiled in ((True, False) if i % 2 else (False, True)):
        res[compiled] = decode(ids, compiled)
    (r_e, w_e, c_e), (r_c, w_c, c_c) = res[False], res[True]
    tps_e, tps_c = len(r_e.new_tokens) / w_e, len(r_c.new_tokens) / w_c
    ratios.append(tps_c / tps_e)
    print(f"prompt {i:2d} ({len(ids)} tokens): eager draft {tps_e:6.1f} tok/s ({r_e.stats.draft_s / max(c_e, 1) * 1e3:.2f} ms "
          f"drafting per head call, {c_e} calls), compiled draft {tps_c:6.1f} tok/s ({r_c.stats.draft_s / max(c_c, 1) * 1e3:.2f} ms, "
          f"{c_c} calls), ratio {tps_c / tps_e:.3f}, same tokens {r_e.new_tokens == r_c.new_tokens}", flush=True)
print(f"{WEIGHTS}, {DRAFT}: compiled draft over eager draft, per-prompt median {statistics.median(ratios):.3f} "
      f"({min(ratios):.3f}-{max(ratios):.3f}) over {len(ratios)} prompts")
