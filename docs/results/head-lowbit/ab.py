"""Does a low-bit feature head pay on a q4 target? (issues 28 and 32; README.md here)

Per Spec-Bench question (first turns, chat, EOS respected, 256 new tokens, greedy; N per task plus one, the
first question overall a warm-up): `ar`, cost-aware DynaTree with the n-gram drafter (twice: `ngram`,
`ngram-again`, the noise of a per-prompt ratio), with the head in bfloat16 on oneDNN-packed linears (`eagle`:
what a q4 target drafted with before commit "feature heads draft in int4 on q4 targets"), with the head in
int4 (`eagle-int4`), and their hybrids with the n-gram drafter; interleaved per prompt in one process, the
order rotated from prompt to prompt.

  python docs/results/head-lowbit/ab.py COMPILE(0|1) [N_PER_TASK=3] [shipped] > OUT.json

`shipped`: the int4 head as dynatree loads it now (`load_draft`, featurehead.to_q4 / weights.int4_linear);
without it, this script's own prototype of the same quantization (the first run, before the change shipped).
"""
import json
import statistics
import sys
import weakref

import torch

from dynatree import generate
from dynatree.draftload import load_draft
from dynatree.draftspec import Hybrid, head_dir
from dynatree.drafters import feature
from dynatree.featurehead import load_head
from dynatree.kernels import linear_kernel
from dynatree.models import load_model
from dynatree.prompts import load_texts, tokenize
from dynatree.weights import Int4Linear

HEAD = "smollm2-135m-eagle"


def int4_of(weight):
    """Int4Linear of a dense (out, in) weight: groups of 32 along `in`, codes 0..15 between the group's min and max."""
    w = weight.detach().float()
    out, inp = w.shape
    g = w.reshape(out, inp // 32, 32)
    mn, mx = g.amin(-1), g.amax(-1)
    scale = ((mx - mn) / 15).clamp_min(1e-8).to(torch.bfloat16).float()
    q = torch.round((g - mn[..., None]) / scale[..., None]).clamp(0, 15)
    return Int4Linear(q.reshape(out, inp).to(torch.int32), scale, mn + 8 * scale, None)


def int4_head(target):
    head = load_head(head_dir(HEAD), name=HEAD + "-int4", dtype=target.dtype, linear="stock")
    for layer in head.body.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, int4_of(child.weight))
    weight = target.model.get_output_embeddings().weight  # the sub-vocabulary's rows, int4 too (feature._output_layer's cache)
    rows = weight.detach()[head.vocab_ids].to(head.fc.weight.dtype)
    key = (weight.data_ptr(), weight.dtype, linear_kernel(head) == "onednn", head.fc.weight.dtype)
    feature._OUTPUTS[head] = (key, rows, int4_of(rows), weakref.ref(weight))
    # (at 84680c3, where this ran; since d54b004 `_output_layer` keys on head.weights too and would rebuild this
    # entry as dense rows: rerun with `shipped`, which builds the same int4 rows through dynatree itself)
    return head


def quantiles(values):
    values = sorted(values)
    return {"min": round(values[0], 3), "median": round(statistics.median(values), 3), "max": round(values[-1], 3),
            "below_0.95": sum(v < 0.95 for v in values)}


def main(compile, n, shipped):
    target = load_model("smollm2-135m", weights="q4")
    dense = load_head(head_dir(HEAD), name=HEAD, dtype=target.dtype, linear="auto")  # bfloat16, packed, as before
    low = load_draft(HEAD, target).model if shipped else int4_head(target)
    assert dense.weights == "dense" and (low.weights == "q4" or not shipped)
    drafts = {"ngram": load_draft("ngram", target), "ngram-again": load_draft("ngram", target),
              "eagle": load_draft(dense, target), "eagle-int4": load_draft(low, target),
              "hybrid": load_draft(Hybrid(dense), target), "hybrid-int4": load_draft(Hybrid(low), target)}
    prompts = [p for p in load_texts("specbench", n + 1) if p.turn == 1]
    names = ["ar", *drafts]
    rows = []
    for index, prompt in enumerate(prompts):
        ids = tokenize(target.tokenizer, prompt, 4096, chat=True)
        row = {"id": prompt.id, "category": prompt.category, "warmup": index == 0, "prompt_tokens": len(ids)}
        tokens = {}
        for name in names[index % len(names):] + names[: index % len(names)]:
            if name == "ar":
                result = generate(method="ar", target=target, prompt_ids=ids, max_new_tokens=256, compile=compile)
            else:
                result = generate(method="dynatree", target=target, draft=drafts[name], prompt_ids=ids,
                                  max_new_tokens=256, cost_aware=True, compile=compile)
            tokens[name] = result.new_token_ids
            s = result.stats
            row[name] = {"tok_s": s.tokens_per_s, "M": s.tokens_per_iter, "n_tokens": len(result.new_token_ids),
                         "draft_ms": s.draft_ms, "verify_ms": s.verify_ms}
            if name != "ar":
                state = result.policy_state
                row[name].update(idle=state.get("idle_iterations"), forward_ms=state.get("draft_forward_ms"))
        for name in names[1:]:
            row[name]["same_as_ar"] = tokens[name] == tokens["ar"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    measured = [r for r in rows if not r["warmup"]]
    med = lambda xs: round(statistics.median(xs), 3)
    summary = {name: {"over_ar_median": med([r[name]["tok_s"] / r["ar"]["tok_s"] for r in measured]),
                      "M_mean": round(statistics.mean(r[name]["M"] for r in measured), 3),
                      "forward_ms_median": med([r[name]["forward_ms"] or 0 for r in measured]),
                      "draft_ms_mean": round(statistics.mean(r[name]["draft_ms"] for r in measured), 3),
                      "verify_ms_mean": round(statistics.mean(r[name]["verify_ms"] for r in measured), 3),
                      "all_same_as_ar": all(r[name]["same_as_ar"] for r in rows)}
               for name in names[1:]}
    summary["int4_over_bf16"] = {pair: med([r[pair + "-int4"]["tok_s"] / r[pair]["tok_s"] for r in measured])
                                 for pair in ("eagle", "hybrid")}
    summary["noise_ngram_again_over_ngram"] = quantiles([r["ngram-again"]["tok_s"] / r["ngram"]["tok_s"] for r in measured])
    for pair in ("", "-int4"):
        summary[f"hybrid{pair}_over_better_part"] = quantiles(
            [r[f"hybrid{pair}"]["tok_s"] / max(r["ngram"]["tok_s"], r[f"eagle{pair}"]["tok_s"]) for r in measured])
    summary["ar_tok_s_mean"] = round(statistics.mean(r["ar"]["tok_s"] for r in measured), 2)
    print(json.dumps({"compile": compile, "per_task": n, "measured": len(measured), "summary": summary,
                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main(bool(int(sys.argv[1])), int(sys.argv[2]) if len(sys.argv) > 2 else 3, "shipped" in sys.argv[3:])
