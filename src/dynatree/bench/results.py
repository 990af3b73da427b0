"""results.json: saving, loading, and the aggregates every table and plot is drawn from.

Aggregates are per (variant, data set, T, L_max) over the measured prompts (warm-up
excluded): mean and sample standard deviation of every statistic and of the PPL of the
continuations (when scored), and the speedup against plain decoding in the same
implementation (`reference`): our methods against our `ar` run with the same compile setting
and KV window (so `dynatree +compile` against `ar +compile`), transformers' methods (hf-*)
against `hf-ar`, and `ar` and `hf-ar` variants against the plain `ar` (how much compiling, a
window or transformers' own loop changes plain decoding). Two ways:
  speedup            = mean throughput / mean reference throughput (the papers' definition)
  speedup_totals     = throughput over the totals (all tokens / all decode time) / the reference's,
                       on the prompts both ran (Spec-Bench's speed.py)
  speedup_median/min/max = over prompts, of throughput / reference throughput on the same prompt
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ..errors import DynaTreeError
from ..files import write_text_atomic

STATS = ["tokens_per_s", "ttft_s", "tpot_s", "acceptance_rate", "tokens_per_iter", "mean_generated_len", "accepted_len",
         "iterations", "new_tokens", "wall_s", "peak_mem_mb", "drafted_tokens", "accepted_tokens",
         "draft_ms", "verify_ms", "commit_ms"]


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation; the deviation of a single value is undefined (None)."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _setting(r: dict) -> tuple:
    return r.get("dataset"), r["max_new_tokens"], r["l_max"]


PLAIN_METHODS = ("ar", "hf-ar")  # plain decoding, ours and transformers': the references speedups are over


def references(records: list[dict]) -> dict[str, str]:
    """Each variant's plain-decoding reference in the same implementation (see the module docstring)."""
    variants = {r["variant"]: r for r in records}
    ours_ar: dict[tuple, str] = {}
    for v, r in sorted(variants.items(), key=lambda item: item[0] != "ar"):  # the variant labelled `ar` first
        if r["method"] == "ar":
            ours_ar.setdefault((r.get("compile", False), r.get("kv_window")), v)
    plain = ours_ar.get((False, None), "ar")
    hf_ar: dict[bool, str] = {}  # transformers' plain decoding per compile setting
    for v, r in variants.items():
        if r["method"] == "hf-ar":
            hf_ar.setdefault(r.get("compile", False), v)
    out = {}
    for v, r in variants.items():
        if r["method"] in PLAIN_METHODS:  # plain decoding itself: against ours, plain
            out[v] = plain
        elif r["method"].startswith("hf-"):
            out[v] = hf_ar.get(r.get("compile", False)) or hf_ar.get(False) or plain
        else:
            compiled = r.get("compile", False)
            out[v] = ours_ar.get((compiled, r.get("kv_window")), ours_ar.get((compiled, None), plain))
    return out


def aggregate(records: list[dict], order: list[str] | None = None) -> list[dict]:
    """Aggregates per (variant, setting), variants in `order` (the run's own; prompts run them rotated)."""
    measured = [r for r in records if not r["warmup"]]
    rank = {v: i for i, v in enumerate(order or [])}
    setting_rank = {s: i for i, s in enumerate(dict.fromkeys(_setting(r) for r in measured))}
    keys = sorted(dict.fromkeys((r["variant"], *_setting(r)) for r in measured),
                  key=lambda k: (setting_rank[tuple(k[1:])], rank.get(k[0], len(rank))))
    refs = references(records)
    tps = {(r["variant"], r["prompt_index"], *_setting(r)): r["stats"]["tokens_per_s"] for r in measured}
    out = []
    for variant, *setting in keys:
        setting = tuple(setting)
        rows = [r for r in measured if r["variant"] == variant and _setting(r) == setting]
        ref = refs[variant]
        agg = {"variant": variant, "method": rows[0]["method"], "draft": rows[0]["draft"], "dataset": setting[0],
               "max_new_tokens": setting[1], "l_max": setting[2], "n": len(rows), "reference": ref,
               "compile": rows[0].get("compile", False), "weights": rows[0].get("weights"), "mean": {}, "std": {}}
        for stat in STATS:
            agg["mean"][stat], agg["std"][stat] = mean_std([r["stats"].get(stat) for r in rows])
        agg["mean"]["prompt_tokens"], agg["std"]["prompt_tokens"] = mean_std([r["prompt_tokens"] for r in rows])
        agg["mean"]["ppl"], agg["std"]["ppl"] = mean_std([r.get("ppl") for r in rows])
        ratios = [r["stats"]["tokens_per_s"] / tps[(ref, r["prompt_index"], *setting)] for r in rows
                  if (ref, r["prompt_index"], *setting) in tps]
        ar_mean = mean_std([t for k, t in tps.items() if k[0] == ref and k[2:] == setting])[0]
        agg["speedup"] = agg["mean"]["tokens_per_s"] / ar_mean if ar_mean else None
        agg["speedup_median"] = statistics.median(ratios) if ratios else None
        agg["speedup_min"] = min(ratios) if ratios else None
        agg["speedup_max"] = max(ratios) if ratios else None
        agg["speedup_std"] = mean_std(ratios)[1]
        base = {r["prompt_index"]: r for r in measured if r["variant"] == ref and _setting(r) == setting}
        paired = [(r, base[r["prompt_index"]]) for r in rows if r["prompt_index"] in base]
        agg["speedup_totals"] = _rate([r for r, _ in paired]) / _rate([b for _, b in paired]) if paired else None
        agg["mismatches"] = sum(1 for r in rows if r.get("matches_ar") is False)
        agg["unchecked"] = sum(1 for r in rows if r.get("matches_ar") is None)
        out.append(agg)
    return out


def by_category(records: list[dict]) -> list[dict]:
    """Spec-Bench's per-task figures (as its speed.py computes them), per variant, setting and task
    (records with a `category`), and over all tasks ("overall"): speedup as the ratio of total
    throughputs (all tokens / all decode time, this variant over `ar` on the same prompts), the
    per-prompt ratio's median and range, and M over totals (tokens committed per verification
    pass, prefill excluded)."""
    measured = [r for r in records if not r["warmup"] and r.get("category") is not None]
    refs = references(records)
    by_key = {(r["variant"], r["prompt_index"], *_setting(r)): r for r in measured}
    groups: dict[tuple, list[dict]] = {}
    for r in measured:
        if (refs[r["variant"]], r["prompt_index"], *_setting(r)) in by_key:
            for category in (r["category"], "overall"):
                groups.setdefault((r["variant"], *_setting(r), category), []).append(r)
    out = []
    for (variant, dataset, t_new, l_max, category), rows in groups.items():
        base = [by_key[(refs[variant], r["prompt_index"], dataset, t_new, l_max)] for r in rows]
        rate, ar_rate = _rate(rows), _rate(base)
        passes = sum(r["stats"]["iterations"] - 1 for r in rows)
        out.append({"variant": variant, "dataset": dataset, "max_new_tokens": t_new, "l_max": l_max,
                    "category": category, "reference": refs[variant], "n": len(rows), "tokens_per_s": rate, "speedup": rate / ar_rate,
                    "speedup_of_means": statistics.fmean(r["stats"]["tokens_per_s"] for r in rows)
                    / statistics.fmean(b["stats"]["tokens_per_s"] for b in base),
                    **{f"speedup_{k}": v for k, v in _spread([r["stats"]["tokens_per_s"] / b["stats"]["tokens_per_s"]
                                                               for r, b in zip(rows, base)]).items()},
                    "mean_generated_len": sum(r["stats"]["new_tokens"] - 1 for r in rows) / passes if passes else None})
    return out


def _rate(rows: list[dict]) -> float:
    """Throughput over the totals of some runs: all their tokens / all their decode time."""
    return sum(r["stats"]["new_tokens"] for r in rows) / sum(r["stats"]["wall_s"] for r in rows)


def task_order(categories) -> list[str]:
    """Task names in Spec-Bench's order (then any others as met), "overall" last."""
    from ..prompts import SPEC_BENCH_TASKS

    known = [t for cats in ([task, *cats] for task, cats in SPEC_BENCH_TASKS.items()) for t in cats]
    names = [c for c in dict.fromkeys(categories) if c != "overall"]
    return sorted(names, key=lambda c: known.index(c) if c in known else len(known)) + ["overall"]


def ratios_to(records: list[dict], variant: str, reference: str, setting: tuple) -> dict | None:
    """Throughput of `variant` / throughput of `reference` on the same measured prompts:
    per-prompt median, min, max, the ratio of mean throughputs, and the ratio of throughputs over
    the totals (all tokens / all time: Spec-Bench's speedup). None if they share no prompt."""
    measured = [r for r in records if not r["warmup"] and _setting(r) == tuple(setting)]
    ref = {r["prompt_index"]: r["stats"] for r in measured if r["variant"] == reference}
    mine = {r["prompt_index"]: r["stats"] for r in measured if r["variant"] == variant}
    common = [i for i in mine if i in ref and ref[i]["tokens_per_s"]]
    if not common:
        return None
    per_prompt = [mine[i]["tokens_per_s"] / ref[i]["tokens_per_s"] for i in common]

    def over_totals(runs: dict) -> float:
        return sum(runs[i]["new_tokens"] for i in common) / sum(runs[i]["wall_s"] for i in common)

    return {**_spread(per_prompt),
            "of_means": statistics.fmean(mine[i]["tokens_per_s"] for i in common)
            / statistics.fmean(ref[i]["tokens_per_s"] for i in common),
            "of_totals": over_totals(mine) / over_totals(ref),
            "n": len(common)}


def limit_gaps(records: list[dict], variant: str, setting: tuple, weight_bytes: float) -> dict | None:
    """The bandwidth limit measured beside each measured run of `variant` (records with
    `bandwidth_bytes_per_s`) and how far the run's throughput is from it (limit / tokens/s):
    per-prompt median, min and max of both. None if no run has a paired measurement."""
    rows = [r for r in records if r["variant"] == variant and not r["warmup"] and _setting(r) == tuple(setting)
            and r.get("bandwidth_bytes_per_s") and r["stats"]["tokens_per_s"]]
    if not rows:
        return None
    limits = [r["bandwidth_bytes_per_s"] / weight_bytes for r in rows]
    gaps = [lim / r["stats"]["tokens_per_s"] for lim, r in zip(limits, rows)]
    return {"limit": _spread(limits), "gap": _spread(gaps), "n": len(rows)}


def round_noise(records: list[dict]) -> dict | None:
    """The run's own timing noise, from records that ran several rounds (`--repeats`): per record,
    how much its fastest round's throughput exceeds its slowest's (max / min - 1); their median and
    maximum over the measured records, with the variant, prompt (its id, else its 1-based number) and
    setting of the maximum, and the median per variant. None when no record has rounds."""
    spreads = []
    for r in records:
        speeds = [x["tokens_per_s"] for x in r.get("rounds") or [] if x.get("tokens_per_s")]
        if not r["warmup"] and len(speeds) > 1:
            spreads.append((max(speeds) / min(speeds) - 1.0, r["variant"], r.get("prompt_id") or r["prompt_index"] + 1,
                            r["max_new_tokens"], r["l_max"]))
    if not spreads:
        return None
    worst = max(spreads)
    per_variant: dict[str, list[float]] = {}
    for value, variant, *_ in spreads:
        per_variant.setdefault(variant, []).append(value)
    return {"median": statistics.median(v for v, *_ in spreads), "max": worst[0], "max_variant": worst[1],
            "max_prompt": worst[2], "max_setting": {"max_new_tokens": worst[3], "l_max": worst[4]}, "n": len(spreads),
            "per_variant": {v: statistics.median(vals) for v, vals in per_variant.items()}}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def save(results: dict, out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    write_text_atomic(path, json.dumps(results, indent=1))  # never a half-written results.json
    return path


def load(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        raise DynaTreeError(f"no results file at {path}") from None
    except json.JSONDecodeError as exc:
        raise DynaTreeError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(results, dict) or "records" not in results or "variants" not in results:
        raise DynaTreeError(f"{path} is not a dynatree results file")
    compiled = {v["label"]: v.get("compile", False) for v in results["variants"]}
    for r in results["records"]:  # older files: the compile setting is on the variant only
        r.setdefault("compile", compiled.get(r["variant"], False))
    if "aggregates" not in results:  # an interrupted run: aggregate what was measured
        results["aggregates"] = aggregate([r for r in results["records"] if "matches_ar" in r],
                                          [v["label"] for v in results["variants"]])
    return results


# ---------------------------------------------------------------- queries the tables and plots share


def settings(results: dict) -> list[tuple[int, int]]:
    return list(dict.fromkeys((a["max_new_tokens"], a["l_max"]) for a in results["aggregates"]))


def datasets(results: dict) -> list[str | None]:
    return list(dict.fromkeys(a.get("dataset") for a in results["aggregates"]))


def at(results: dict, t_new: int, l_max: int, dataset: str | None = None) -> list[dict]:
    """Aggregates of one setting on one data set (the run's first when not given)."""
    dataset = dataset if dataset is not None else datasets(results)[0]
    return [a for a in results["aggregates"]
            if (a["max_new_tokens"], a["l_max"], a.get("dataset")) == (t_new, l_max, dataset)]


def lossy(results: dict) -> list[str]:
    """Variants whose verification does not keep the target's distribution when sampling."""
    from ..methods import is_lossy, make_config

    return [v["label"] for v in results["variants"] if is_lossy(make_config(v["method"], **v["config"]))]


def marked_lossy(results: dict) -> set[str]:
    """The variants to label "(lossy)": lossy rules, in a sampling run (greedy, every rule is exact)."""
    return set(lossy(results)) if results["protocol"].get("sample") else set()
