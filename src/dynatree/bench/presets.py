"""The papers' experiments as named presets, each at two scales.

  main        AR, linear, fixed tree, DynaTree, hf-lookup (+ hf-assisted with a draft LM):
              the main, latency, verification-efficiency and memory tables (one run makes all
              four; `latency`, `efficiency` and `memory` are its aliases)
  ablation    fixed tree (D=5, B=2) -> + dynamic breadth & depth -> + history adaptation
  length      sequence-length scaling over T
  prompt-length  prompt-length sensitivity over L_max
  fixed-sweep the fixed tree's (D, B, tau) grid
  dynatree-sensitivity  DynaTree's thresholds, breadth and depth, one group at a time
  streaming   AR and DynaTree with and without an attention-sink KV window (paper 003's
              StreamingLLM + speculative baseline): peak memory and throughput over T
  perf        the speed table: transformers' greedy generate (hf-ar), hf-lookup,
              hf-assisted (with a draft LM), and our ar, linear, fixed tree, DynaTree with every
              drafter, DynaTree with `cost_aware` ("+cost-aware"), plus ar and cost-aware
              DynaTree with torch.compile ("+compile"), and hf-ar compiled (transformers at its
              best: a static cache and its compiled forward); ratios to hf-ar, hf-ar +compile, the best hf-*
              speculative method, and the memory-bandwidth limit of plain decoding. Default
              drafters as for `draft`
  draft       a draft LM against the n-gram drafter and against transformers' assisted
              generation with the same draft: ar, linear and DynaTree with each
              drafter, DynaTree with `cost_aware` ("+cost-aware"), hf-lookup, hf-assisted;
              plus each draft's top-1 agreement with the target and its step cost relative
              to a target forward. Default drafters: `ngram`, the embedded target's shipped
              draft, and the two together (`ngram+DRAFT`)
  wetap-main  paper 004, Table 1: AR, SpecInfer, DSBD, SpecExec, MTAD (lossy), OPT-Tree, WETAP
              (its lossy beam verification, and our lossless verifier on its tree), DynaTree; M, speed, PPL;
              sampling at temperature 1, top-k 10, top-p 0.9; MT-Bench, HumanEval, GSM8K
  wetap-ablation  Table 2: WETAP, w/o dynamic width (every layer W_max), w/o prob+len
              pruning (alpha = 1: probability alone); DSBD and MTAD beside it for scale
  wetap-width Fig. 4 / C.2: fixed widths 16..128 and width ranges
  wetap-gamma, wetap-alpha, wetap-length  Table 3, Fig. 5, Table 5: one WETAP parameter each

`paper` scale follows the papers (N=10 prompts, W=2 warm-up, T=1500); `small` runs in
minutes on a 2-core CPU. Every value can still be overridden on the command line.
"""

from __future__ import annotations

import dataclasses
import itertools

from ..draftspec import head_dir, parse
from ..errors import DynaTreeError
from ..methods import get_method
from .plan import Variant

ALIASES = {"latency": "main", "efficiency": "main", "memory": "main"}
PRESETS = ["main", "perf", "draft", "latency", "efficiency", "memory", "ablation", "length", "prompt-length", "fixed-sweep",
           "dynatree-sensitivity", "streaming", "wetap-main", "wetap-ablation", "wetap-width", "wetap-gamma",
           "wetap-alpha", "wetap-length"]
STREAMING_WINDOW = {"paper": "4,1020", "small": "4,508"}  # paper 003 used a 1024-token cache

# protocol per preset and scale: n prompts, warm-up, T values, L_max values (None: the data set's cap)
SCALES = {
    "paper": {
        "main": (10, 2, [1500], None),
        "ablation": (10, 2, [1500], None),
        "length": (10, 2, [100, 200, 300, 500, 1000, 1500], None),
        "prompt-length": (10, 2, [1500], [100, 200, 400, 600, 800, 1000]),
        "fixed-sweep": (10, 2, [1500], None),
        "dynatree-sensitivity": (10, 2, [1500], None),
        "streaming": (3, 1, [500, 1000, 2000, 4000], None),
        "perf": (22, 2, [256], None),
        "draft": (22, 2, [256], None),
        **{p: (10, 2, [1024], None) for p in ("wetap-main", "wetap-ablation")},
        **{p: (10, 2, [1024], None) for p in ("wetap-width", "wetap-gamma", "wetap-alpha", "wetap-length")},
    },
    "small": {
        "main": (6, 1, [128], None),
        "ablation": (6, 1, [128], None),
        "length": (4, 1, [32, 64, 128, 256], None),
        "prompt-length": (4, 1, [64], [32, 64, 128, 256]),
        "fixed-sweep": (3, 1, [64], None),
        "dynatree-sensitivity": (3, 1, [64], None),
        "streaming": (2, 1, [512, 1024, 2048, 4096], None),
        "perf": (6, 1, [128], None),
        "draft": (6, 1, [128], None),
        **{p: (6, 1, [128], None) for p in ("wetap-main", "wetap-ablation")},
        **{p: (3, 1, [64], None) for p in ("wetap-width", "wetap-gamma", "wetap-alpha", "wetap-length")},
    },
}

FIXED_GRID = {
    "paper": {"depth": [4, 6, 8, 10], "branch": [2, 3, 4], "tau": [0.01, 0.05, 0.1, 0.2]},
    "small": {"depth": [2, 4, 6, 8], "branch": [1, 2, 3], "tau": [0.02, 0.1, 0.3]},
}
SENSITIVITY = {
    "thresholds": [(0.95, 0.5), (0.9, 0.4), (0.8, 0.4), (0.8, 0.2), (0.7, 0.3), (0.6, 0.2)],  # (tau_h, tau_l)
    "breadth": [(1, 1, 1), (1, 1, 2), (1, 2, 2), (1, 2, 3), (1, 2, 4), (2, 3, 4)],  # (b_min, b_mid, b_max)
    "depth": [(2, 4), (3, 6), (4, 8), (5, 8), (6, 10), (8, 12)],  # (d0, d_max)
}

# paper 004 (WETAP): sampling settings, data sets, and its sensitivity grids
WETAP_SAMPLING = {"temperature": 1.0, "top_k": 10, "top_p": 0.9}
WETAP_DATASETS = "mtbench,humaneval,gsm8k"
WETAP_GRIDS = {
    "wetap-width": [("fixed", w, w) for w in (16, 32, 64, 128)]
    + [("range", lo, hi) for lo, hi in ((16, 64), (32, 64), (16, 128), (32, 128), (16, 256), (32, 256))],
    "wetap-gamma": [0.2, 0.5, 1.0, 1.2, 2.0, 4.0, 8.0],
    "wetap-alpha": [round(0.1 * i, 1) for i in range(11)],
    "wetap-length": [4, 5, 6, 7, 8, 9, 10],
}


def sampling_defaults(preset: str) -> dict | None:
    """The sampling settings a preset runs with by default (None: greedy)."""
    return dict(WETAP_SAMPLING) if preset.startswith("wetap-") else None


def dataset_default(preset: str) -> str | None:
    if preset == "draft":
        return "humaneval"
    return WETAP_DATASETS if preset.startswith("wetap-") else None


def _wetap_variants(preset: str, first: str) -> list[Variant]:
    out = [Variant("ar", "ar"), Variant("wetap", "wetap", {}, first, {"baseline": True})]
    for value in WETAP_GRIDS[preset]:
        if preset == "wetap-width":
            kind, lo, hi = value
            options = {"w_min": lo, "w_max": hi}  # a fixed width is the range [w, w]
            label = f"width [{lo}, {hi}]" if kind == "range" else f"fixed width {lo}"
            group_value = f"[{lo},{hi}]" if kind == "range" else str(lo)
            out.append(Variant(label, "wetap", options, first, {"group": kind, "value": group_value, "wetap": True}))
        else:
            name = {"wetap-gamma": "gamma", "wetap-alpha": "alpha", "wetap-length": "depth"}[preset]
            out.append(Variant(f"{name}={value}", "wetap", {name: value}, first,
                               {"group": name, "value": value, "wetap": True}))
    return out


def _labelled(method: str, draft: str | None, drafts: list[str], options: dict | None = None) -> str:
    """The method, its drafter when several are compared, and "+cost-aware" when that option is on."""
    label = method if draft is None or len(drafts) == 1 else f"{method}[{draft}]"
    return label + (" +cost-aware" if (options or {}).get("cost_aware") else "")


def method_variants(methods: list[str], drafts: list[str], options: dict[str, dict] | None = None,
                    strict: bool = True) -> list[Variant]:
    """One variant per method, and per drafter for methods that take one.

    A method that needs a draft LM when only the n-gram drafter is given is an error when
    `strict` (the user asked for it), and skipped otherwise (a preset's "where it applies").
    """
    options = options or {}
    lms = [d for d in drafts if parse(d).model_alone]  # draft models alone (for hf-assisted)
    out = []
    for method in methods:
        need = get_method(method).draft
        if need == "none":
            out.append(Variant(_labelled(method, None, drafts, options.get(method)), method, options.get(method, {})))
        else:
            usable = lms if need == "lm" else drafts
            if get_method(method).policy_cls is None:  # transformers' generate() takes draft LMs, not feature heads
                heads = [d for d in usable if head_dir(d) is not None]
                usable = [d for d in usable if d not in heads]
                if heads and not usable and strict:
                    raise DynaTreeError(f"{method!r} runs transformers' generate(), which takes a draft LM; feature "
                                        f"head {heads[0]!r} drafts in dynatree's own methods only")
            if not usable and strict:
                raise DynaTreeError(f"method {method!r} needs a draft language model: pass --draft MODEL")
            out += [Variant(_labelled(method, d, drafts if need == "any" else lms, options.get(method)), method,
                            options.get(method, {}), d) for d in usable]
    return out


def _cost_aware(variants: list[Variant]) -> list[Variant]:
    """The same variants with `cost_aware` on, labelled "+cost-aware"."""
    return [dataclasses.replace(v, label=f"{v.label} +cost-aware", options={**v.options, "cost_aware": True})
            for v in variants]


def variants(preset: str, scale: str, drafts: list[str]) -> list[Variant]:
    preset = ALIASES.get(preset, preset)
    first = drafts[0]
    if preset in ("main",):
        return method_variants(["ar", "linear", "fixed-tree", "dynatree", "hf-lookup", "hf-assisted"], drafts,
                               strict=False)
    if preset in ("length", "prompt-length"):
        return method_variants(["ar", "linear", "fixed-tree", "dynatree"], drafts)
    if preset == "ablation":
        return [
            Variant("ar", "ar"),
            Variant("fixed tree (D=5, B=2)", "fixed-tree", {"depth": 5, "branch": 2}, first, {"stage": 0}),
            Variant("+ dynamic breadth & depth", "dynatree", {"history": False}, first, {"stage": 1}),
            Variant("+ history adaptation", "dynatree", {"history": True}, first, {"stage": 2}),
        ]
    if preset == "fixed-sweep":
        grid = FIXED_GRID[scale]
        return [Variant("ar", "ar")] + [
            Variant(f"D={d} B={b} tau={t}", "fixed-tree", {"depth": d, "branch": b, "tau": t}, first,
                    {"depth": d, "branch": b, "tau": t})
            for d, b, t in itertools.product(grid["depth"], grid["branch"], grid["tau"])
        ]
    if preset == "dynatree-sensitivity":
        out = [Variant("ar", "ar"), Variant("fixed-tree", "fixed-tree", {}, first, {"baseline": True})]
        for th, tl in SENSITIVITY["thresholds"]:
            out.append(Variant(f"tau_h={th} tau_l={tl}", "dynatree", {"tau_h": th, "tau_l": tl}, first,
                               {"group": "thresholds", "tau_h": th, "tau_l": tl, "value": f"{th}/{tl}"}))
        for b in SENSITIVITY["breadth"]:
            out.append(Variant(f"B={b[0]},{b[1]},{b[2]}", "dynatree", dict(zip(("b_min", "b_mid", "b_max"), b)), first,
                               {"group": "breadth", "value": f"{b[0]},{b[1]},{b[2]}"}))
        for d0, dm in SENSITIVITY["depth"]:
            out.append(Variant(f"D0={d0} D_max={dm}", "dynatree", {"d0": d0, "d_max": dm}, first,
                               {"group": "depth", "value": f"{d0}/{dm}"}))
        return out
    if preset == "perf":
        eager = method_variants(["hf-ar", "hf-lookup", "hf-assisted", "ar", "linear", "fixed-tree", "dynatree"], drafts,
                                strict=False)
        cost_aware = _cost_aware(method_variants(["dynatree"], drafts))
        compiled = [dataclasses.replace(v, label=f"{v.label} +compile", compile=True)
                    for v in method_variants(["hf-ar", "hf-assisted", "ar"], drafts, strict=False) + cost_aware]
        return eager + cost_aware + compiled
    if preset == "draft":
        if not [d for d in drafts if parse(d).model_alone]:
            raise DynaTreeError("--preset draft needs a draft language model (or feature head): pass --draft MODEL")
        return method_variants(["ar", "linear", "dynatree", "hf-lookup"], drafts) + \
            method_variants(["hf-assisted"], drafts, strict=False) + _cost_aware(method_variants(["dynatree"], drafts))
    if preset == "wetap-main":
        return [Variant("ar", "ar")] + method_variants(["specinfer", "dsbd", "specexec", "mtad", "opt-tree"], drafts) + [
            Variant(_labelled("wetap", d, drafts), "wetap", {"verify": "beam"}, d) for d in drafts] + [
            Variant(_labelled("wetap (exact verify)", d, drafts), "wetap", {"verify": "exact"}, d) for d in drafts
        ] + method_variants(["dynatree"], drafts)
    if preset == "wetap-ablation":
        return [
            Variant("ar", "ar"),
            Variant("WETAP w/o dynamic width tree", "wetap", {"dynamic_width": False}, first, {"stage": 0}),
            Variant("WETAP w/o prob+len pruning", "wetap", {"alpha": 1.0}, first, {"stage": 1}),
            Variant("WETAP", "wetap", {}, first, {"stage": 2}),
        ] + method_variants(["dsbd", "mtad"], [first])  # Table 1's beam baselines beside the ablation, for scale
    if preset in WETAP_GRIDS:
        return _wetap_variants(preset, first)
    if preset == "streaming":
        window = STREAMING_WINDOW[scale]
        return [Variant("ar", "ar"), Variant("dynatree", "dynatree", {}, first),
                Variant(f"ar + window {window}", "ar", {}, None, {"window": window}, window),
                Variant(f"dynatree + window {window}", "dynatree", {}, first, {"window": window}, window)]
    raise DynaTreeError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")


SWEEPS = {"fixed-sweep", "dynatree-sensitivity", *WETAP_GRIDS}  # presets that vary one method: no headline row


def declared(preset: str, variant_list: list[Variant]) -> str | None:
    """The configuration a preset declares before it runs (the label of the row its report and the
    README lead with, never the best row picked afterwards), or None for a sweep.

      main, length, prompt-length, streaming  DynaTree (the papers' method), first drafter
      ablation        the whole DynaTree (its last stage); wetap-ablation the whole WETAP
      wetap-main      WETAP with its own (beam) verification, first drafter
      perf, draft     eager cost-aware DynaTree (compiled under --compile) with the last drafter given: with the default
                      drafters, the n-gram drafter backed by the shipped draft
    """
    preset = ALIASES.get(preset, preset)
    if preset in SWEEPS:
        return None
    rules = {
        "ablation": lambda v: v.tags.get("stage") == 2,
        "wetap-ablation": lambda v: v.tags.get("stage") == 2,
        "wetap-main": lambda v: v.method == "wetap" and v.options.get("verify") == "beam",
        "perf": lambda v: v.method == "dynatree" and v.options.get("cost_aware"),
        "draft": lambda v: v.method == "dynatree" and v.options.get("cost_aware"),
    }
    rule = rules.get(preset, lambda v: v.method == "dynatree" and v.kv_window is None)
    found = [v for v in variant_list if rule(v)]
    if preset in ("perf", "draft"):
        found = ([v for v in found if not v.compile] or found)[-1:]  # eager, unless --compile made every row compiled
    return found[0].label if found else None


def protocol_defaults(preset: str, scale: str) -> tuple[int, int, list[int], list[int] | None]:
    if scale not in SCALES:
        raise DynaTreeError(f"unknown scale {scale!r}; choose small or paper")
    preset = ALIASES.get(preset, preset)
    if preset not in SCALES[scale]:
        raise DynaTreeError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return SCALES[scale][preset]
