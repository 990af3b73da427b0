"""Head step cost on a q4 target: as shipped (bfloat16, oneDNN-packed) vs its linears as int4 (groups of 32,
min/max per group, the int4 kernel the q4 target uses) and vs int8 per channel; eager and compiled; plus
teacher-forced agreement of each on Spec-Bench answers. Usage: python cost.py [questions] [compile 0/1]
(Runs at commit f85893e or before: it reads `FeatureDrafter.out_rows`, which later commits removed.)"""
import statistics, sys, time, json
import torch
from dynatree import generate
from dynatree.models import load_model
from dynatree.draftload import load_draft
from dynatree.prompts import load_texts, tokenize
from dynatree.drafters import FeatureDrafter
from dynatree.featurehead import load_head
from dynatree.draftspec import head_dir
from dynatree.weights import Int4Linear, Int8Linear
from dynatree.tree import TreeBuilder
from dynatree import cache as kv


@torch.no_grad()
def agreement(target, d, prompt_ids, new_ids):
    """As bench.draftcheck.head_agreement, through this drafter's own (maybe low-bit) output layer."""
    n, seq = len(new_ids), prompt_ids + new_ids[:-1]
    out = target.model(torch.tensor([seq]), use_cache=False, output_hidden_states=True)
    picks = out.logits[0, -n:].argmax(-1)
    feats = out.hidden_states[-1][:, :-1].to(torch.bfloat16)
    pred = d.head(d.embed(torch.tensor([seq[1:]])).to(feats.dtype), feats, torch.arange(1, len(seq))[None])
    mine = d.head.vocab_ids[d.out(pred[0, -n:]).argmax(-1)]
    return float((mine == picks).float().mean())

torch.manual_seed(0)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 6
COMPILE = bool(int(sys.argv[2])) if len(sys.argv) > 2 else False


def int4_of(linear):
    w = linear.weight.detach().float()
    out, inp = w.shape
    g = w.reshape(out, inp // 32, 32)
    mn, mx = g.amin(-1), g.amax(-1)
    scale = ((mx - mn) / 15).clamp_min(1e-8).to(torch.bfloat16).float()
    q = torch.round((g - mn[..., None]) / scale[..., None]).clamp(0, 15)
    zero = mn + 8 * scale
    return Int4Linear(q.reshape(out, inp).to(torch.int32), scale, zero, None)


def swap(module, make):
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear) or type(child).__name__ == "PackedLinear":
            lin = child if isinstance(child, torch.nn.Linear) else child.linear
            setattr(module, name, make(lin))
        else:
            swap(child, make)


target = load_model("smollm2-135m", weights="q4")
variants = {}
for kind in ("bf16", "int4", "int8"):
    head = load_head(head_dir("smollm2-135m-eagle"), name="smollm2-135m-eagle", dtype=target.dtype,
                     linear="stock" if kind != "bf16" else "auto")
    d = FeatureDrafter(head, target, compile=COMPILE)
    if kind != "bf16":
        make = int4_of if kind == "int4" else (lambda lin: Int8Linear(lin.weight, None))
        head.compiled()  # the compile wrapper reads the dtype from head.fc.weight, which int layers lack
        swap(head, make)
        lin = torch.nn.Linear(d.out_rows.shape[1], d.out_rows.shape[0], bias=False, dtype=torch.bfloat16)
        lin.weight = torch.nn.Parameter(d.out_rows.clone(), requires_grad=False)
        d.out = make(lin)
    variants[kind] = d
print({k: type(v.out).__name__ for k, v in variants.items()}, file=sys.stderr)

qs = load_texts("specbench", 2)[1:][: N]
res = {k: {"ms": [], "agree": []} for k in variants}
res["target"] = {"ms": []}
for d in variants.values():
    d.warm_up()
for qi, prompt in enumerate(qs):
    ids = tokenize(target.tokenizer, prompt, 4096, chat=True)
    r = generate(method="ar", target=target, prompt_ids=ids, max_new_tokens=64)
    new = r.new_token_ids
    for k, d in variants.items():
        res[k]["agree"].append(agreement(target, d, ids, list(new)))
    seq = ids + list(new)
    start = len(seq) - 24
    cache = kv.new_cache(target.model)
    hidden = target.forward(cache, seq[:start], list(range(start)), None, last_only=True, hidden=True)[1]
    for d in variants.values():
        d.reset(seq[:start], hidden)
        d.propose(TreeBuilder(seq[start - 1]), [0], k=8)
    for i in range(start, len(seq)):
        t0 = time.perf_counter(); target.forward(cache, [seq[i]], [i], None, last_only=True)
        res["target"]["ms"].append(1e3 * (time.perf_counter() - t0))
        for k, d in variants.items():
            t0 = time.perf_counter()
            d.commit(seq[: i + 1], [], hidden[-1:])
            tree = TreeBuilder(seq[i])
            p = d.propose(tree, [0], k=8)
            res[k]["ms"].append(1e3 * (time.perf_counter() - t0))
    print(qi, len(ids), {k: round(statistics.median(v["ms"]), 2) for k, v in res.items()}, file=sys.stderr)
summary = {k: {"step_ms_median": round(statistics.median(v["ms"]), 3),
               **({"agreement_mean": round(statistics.mean(v["agree"]), 4)} if "agree" in v else {})}
           for k, v in res.items()}
print(json.dumps({"compile": COMPILE, "questions": len(qs), "summary": summary,
                  "agree": {k: v.get("agree") for k, v in res.items()}}, indent=1))
