"""Mixing the datastore into the feature head's rows of the hybrid (issue 28): tokens per pass (M).

`ngram+smollm2-135m-store+smollm2-135m-eagle`, `dynatree` with its default (not cost-aware: M is
then deterministic, no timing enters), the first turns of Spec-Bench questions 4-10 of each task
(held out from training, not among the bench's first 3), chat, EOS respected, T new tokens. Variants:
the hybrid as shipped (the store answers only nodes the n-gram part drafts) and, where the head
drafts a node and the store matches at least `min_order` tokens, the head's distribution mixed with
the store's counts, (1 - lam) q_head + lam q_store, its top-k proposed. Every variant's tokens are
checked equal. No timing: run on a quiet or busy CPU alike.

  python docs/results/drafting-levers/store_mix.py 128
"""
import statistics
import sys

from dynatree import Decoder, make_config
from dynatree.methods import METHODS
from dynatree.models import load_model
from dynatree.draftload import load_draft
from dynatree.drafters import make_drafter
from dynatree.drafters.base import Proposal
from dynatree.prompts import load_texts, encode_prompt

class StoreMixed:
    """The head's drafter with the store's counts mixed into each row the store matches."""

    def __init__(self, lm, ngram, lam, min_order):
        self.lm, self.ngram, self.lam, self.min_order = lm, ngram, lam, min_order
        self.name, self.uses_target_hidden = lm.name, lm.uses_target_hidden
    def reset(self, tokens, hidden=None): self.lm.reset(tokens, hidden)
    def commit(self, tokens, path, hidden=None): self.lm.commit(tokens, path, hidden)
    def without_model(self): return None
    def warm_up(self): return self.lm.warm_up()
    def propose(self, tree, nodes, k, full=False):
        ans = self.lm.propose(tree, nodes, k, full=True)
        ids, probs = ans.ids.clone(), ans.probs.clone()
        for i, node in enumerate(nodes):
            n, found = self.ngram._stored(self.ngram.context(tree, node))
            if n >= self.min_order:
                q = ans.dist[i] * (1 - self.lam)
                tot = sum(c for _, c in found)
                for t, c in found:
                    q[t] += self.lam * c / tot
                top = q.topk(ids.shape[1])
                ids[i], probs[i] = top.indices, top.values
        return Proposal(ids, probs, ans.dist if full else None, forwards=ans.forwards)

target = load_model("smollm2-135m", device="cpu", dtype="float32", weights="dense")
draft = load_draft("ngram+smollm2-135m-store+smollm2-135m-eagle", target)
by = {}
for p in load_texts("specbench", 10):
    by.setdefault(p.category, []).append(p)
prompts = [p for c in by.values() for p in c[3:]]  # not the bench's first 3 per task
T = int(sys.argv[1]) if len(sys.argv) > 1 else 128
variants = [("base", None, None), ("mix0.3/3", 0.3, 3), ("mix0.5/3", 0.5, 3), ("mix0.3/2", 0.3, 2)]
res = {v[0]: [] for v in variants}
for p in prompts:
    ids = encode_prompt(target.tokenizer, p.text, chat=True)
    ref = None
    for name, lam, mo in variants:
        d = make_drafter(draft, target, 4)
        if lam is not None:
            d.lm = StoreMixed(d.lm, d.ngram, lam, mo)
        policy = METHODS["dynatree"].policy_cls(make_config("dynatree"))
        run = Decoder(target, policy, d).generate(ids, T)
        if ref is None: ref = run.new_tokens
        assert run.new_tokens == ref, name
        res[name].append(len(run.new_tokens) / run.stats.iterations)
    print(p.category, {k: round(v[-1], 2) for k, v in res.items()}, flush=True)
for k, v in res.items():
    print(k, "mean M", round(statistics.mean(v), 3), "median", round(statistics.median(v), 3))
