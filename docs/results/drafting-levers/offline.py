"""Offline tokens per pass (M) of model-free chain drafters on held-out Spec-Bench answers (issue 28).

The target's greedy answers to the 60 held-out Spec-Bench questions (../eagle-heldout/answers)
are replayed: at each pass a chain of K tokens is drafted from the text so far, the longest
prefix equal to the target's next tokens is accepted, plus the target's own token (M counts
both). No model runs; this measures what a drafter could propose, not time.

  python docs/results/drafting-levers/offline.py orders   the n-gram drafter's longest order, 2..12
  python docs/results/drafting-levers/offline.py store [MAX]  plus a datastore of the target's own
                                                          training answers (data/distill/smollm2-135m), store
                                                          orders 2..MAX (default 6)
"""
import collections
import glob
import gzip
import json
import statistics
import sys
from pathlib import Path

K = 5
ROOT = Path(__file__).resolve().parents[3]


def sequences(pattern):
    for f in sorted(glob.glob(str(ROOT / pattern))):
        d = json.load(gzip.open(f))
        yield from zip(d["sequences"], d["answer_from"])


HELD = list(sequences("docs/results/eagle-heldout/answers/answers-*.json.gz"))


def build_store(orders):
    """n-gram -> counts of the next token over the answers of every training conversation."""
    store = {n: collections.defaultdict(collections.Counter) for n in orders}
    tokens = 0
    for s, a in sequences("data/distill/smollm2-135m/answers-*.json.gz"):
        seg = s[max(0, a - max(orders)):]
        tokens += len(s) - a
        for n in orders:
            for i in range(len(seg) - n):
                store[n][tuple(seg[i:i + n])][seg[i + n]] += 1
    return store, tokens


def lookup(index, ctx, orders):
    """(most frequent next token, order) of the longest of `orders` whose suffix of ctx is in index."""
    for n in orders:
        c = index[n].get(tuple(ctx[-n:])) if len(ctx) >= n else None
        if c:
            return c.most_common(1)[0][0], n
    return None, 0


def replay(s, a, max_n, store=None):
    """M for one answer: the live n-gram drafter (longest suffix of the text so far, orders max_n..1,
    most frequent next token), falling back to the store where the live match is shorter than 3
    tokens and the store's is longer."""
    live = {n: collections.defaultdict(collections.Counter) for n in range(1, max_n + 1)}
    indexed, t, passes = 0, a, 0
    while t < len(s):
        for i in range(indexed, t):
            for n in range(1, max_n + 1):
                if i >= n:
                    live[n][tuple(s[i - n:i])][s[i]] += 1
        indexed = t
        ctx, chain = list(s[:t]), []
        for _ in range(K):
            tok, n_live = lookup(live, ctx, range(max_n, 0, -1))
            if store is not None and n_live < 3:
                alt, n_store = lookup(store, ctx, sorted(store, reverse=True))
                if alt is not None and n_store > n_live:
                    tok = alt
            if tok is None:
                break
            chain.append(tok)
            ctx.append(tok)
        accepted = 0
        while accepted < len(chain) and t + accepted < len(s) and s[t + accepted] == chain[accepted]:
            accepted += 1
        t += accepted + 1
        passes += 1
    return (len(s) - a) / passes


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "orders"
    if mode == "orders":
        for max_n in (2, 3, 4, 6, 8, 12):
            m = [replay(s, a, max_n) for s, a in HELD]
            print(f"live n-gram, orders {max_n}..1: mean M {statistics.mean(m):.3f}")
    else:
        store, tokens = build_store(range(2, int(sys.argv[2]) + 1 if len(sys.argv) > 2 else 7))
        print(f"store: {tokens} answer tokens, {sum(len(v) for v in store.values())} n-grams of 2..{max(store)} tokens")
        for name, st in (("live n-gram (orders 4..1)", None), ("live n-gram + store", store)):
            m = [replay(s, a, 4, st) for s, a in HELD]
            print(f"{name}: mean M {statistics.mean(m):.3f}, median {statistics.median(m):.3f}")
