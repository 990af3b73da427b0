"""Where the time goes on the two prompts where the hybrid trails the n-gram drafter (README.md here):
each head forward's fed rows and time (compiled q4, after a short warm-up), the hybrid's and the n-gram
drafter's tokens per pass and speed. A diagnostic, not a benchmark.

    python docs/results/xeon-parts/lagging.py > lagging.txt
"""
import time, collections
from unittest.mock import patch
from dynatree import generate
from dynatree.draftload import load_draft
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize
from dynatree.drafters.feature import FeatureDrafter
target = load_model("smollm2-135m", weights="q4")
hyb = load_draft("ngram+smollm2-135m-eagle", target); ng = load_draft("ngram", target)
prompts = {p.id: p for p in load_texts("specbench", 3) if p.turn == 1}
calls = []
for spec in (hyb, ng):
    generate(method="dynatree", target=target, draft=spec, prompt="Hello there", max_new_tokens=64, cost_aware=True, compile=True)
orig = FeatureDrafter._run
def run(self, ids, features, positions, allowed):
    t = time.perf_counter(); out = orig(self, ids, features, positions, allowed); calls.append((len(ids), time.perf_counter() - t)); return out
for pid in ("specbench:163", "specbench:404"):
    p = prompts[pid]; ids = tokenize(target.tokenizer, p, 4096, chat=True)
    calls.clear()
    with patch.object(FeatureDrafter, "_run", run):
        r = generate(method="dynatree", target=target, draft=hyb, prompt_ids=ids, max_new_tokens=256, cost_aware=True, compile=True)
    g = generate(method="dynatree", target=target, draft=ng, prompt_ids=ids, max_new_tokens=256, cost_aware=True, compile=True)
    fed = collections.Counter(min(n, 9) for n, _ in calls[1:])
    print(pid, p.category, "hyb M %.2f it %d tok/s %.1f | ngram M %.2f it %d tok/s %.1f" % (r.stats.tokens_per_iter, r.stats.iterations, r.stats.tokens_per_s, g.stats.tokens_per_iter, g.stats.iterations, g.stats.tokens_per_s))
    print("  head calls", len(calls) - 1, "total ms %.1f" % (1e3 * sum(t for _, t in calls[1:])), "rows fed histogram", sorted(fed.items()), "idle", r.policy_state["idle_iterations"], "fwd ms", r.policy_state["draft_forward_ms"])
    big = [(n, round(t * 1e3, 2)) for n, t in calls[1:] if n >= 4]
    print("  calls feeding >=4 rows:", big[:20])
