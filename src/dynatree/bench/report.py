"""report.md from results.json alone: the papers' tables, mean +- std over measured prompts."""

from __future__ import annotations

import statistics
from pathlib import Path

from .. import cpu
from ..env import BUSY_CPUS
from ..draftspec import parse
from ..methods import get_method
from ..wording import counted
from .results import (at, by_category, datasets, limit_gaps, load, lossy, marked_lossy, ratios_to, round_noise,
                      settings, task_order)


def _pm(mean, std, scale=1.0, digits=1) -> str:
    if mean is None:
        return "-"
    if std is None:  # one measured prompt: no deviation to show
        return f"{mean * scale:.{digits}f}"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def quality_table(results: dict, t_new: int, l_max: int) -> str:
    """Paper 004's table: mean generated length M, speed and PPL per method and data set."""
    sets = datasets(results)
    variants = list(dict.fromkeys(a["variant"] for a in results["aggregates"]))
    marked = marked_lossy(results)
    rows = []
    for v in variants:
        row = [v + (" (lossy)" if v in marked else "")]
        for d in sets:
            a = next((a for a in at(results, t_new, l_max, d) if a["variant"] == v), None)
            row += ["-", "-", "-"] if a is None else [
                _pm(a["mean"]["mean_generated_len"], a["std"]["mean_generated_len"], digits=2),
                _pm(a["mean"]["tokens_per_s"], a["std"]["tokens_per_s"]),
                _pm(a["mean"]["ppl"], a["std"]["ppl"], digits=3)]
        rows.append(row)
    header = ["Method"] + [f"{col} ({d})" if len(sets) > 1 else col for d in sets for col in ("M", "Speed (tok/s)", "PPL")]
    return _table(header, rows)


def _ratio(r: dict | None) -> str:
    return "-" if r is None else (f"{r['median']:.2f}× ({r['min']:.2f}-{r['max']:.2f}; of means {r['of_means']:.2f}×, "
                                  f"of totals {r['of_totals']:.2f}×)")


def perf_section(results: dict, t_new: int, l_max: int) -> str:
    """Every method against transformers' greedy generate (hf-ar), and ours against each hf-*
    speculative method run (the best by mean throughput named as such: with several peers
    the best on the median prompt may be another one), per prompt (median, range) and as a
    ratio of means and of totals; plus the memory-bandwidth limit of plain decoding when it was measured."""
    aggs = at(results, t_new, l_max)
    dataset = aggs[0].get("dataset") if aggs else None
    setting = (dataset, t_new, l_max)
    records = results["records"]
    peers = [a for a in aggs if a["method"] in ("hf-lookup", "hf-assisted")]
    best_peer = max(peers, key=lambda a: a["mean"]["tokens_per_s"] or 0)["variant"] if peers else None
    peer_names = [p["variant"] for p in peers] or [None]
    compiled_hf = "hf-ar +compile" if any(a["variant"] == "hf-ar +compile" for a in aggs) else None
    rows = []
    for a in aggs:
        ours = not a["method"].startswith("hf-")
        rows.append([a["variant"], _pm(a["mean"]["tokens_per_s"], a["std"]["tokens_per_s"]),
                     _ratio(ratios_to(records, a["variant"], "hf-ar", setting))]
                    + ([_ratio(ratios_to(records, a["variant"], compiled_hf, setting))] if compiled_hf else [])
                    + [_ratio(ratios_to(records, a["variant"], p, setting)) if ours and p else "-" for p in peer_names])
    out = [_table(["Method", "Throughput (tok/s)", "vs hf-ar: per-prompt median (range; ratio of means, of totals)"]
                  + (["vs hf-ar +compile (transformers at its best: static cache, compiled)"] if compiled_hf else [])
                  + [f"vs best hf-* speculative ({p})" if p == best_peer else f"vs {p}" if p
                     else "vs best hf-* speculative (none run)" for p in peer_names], rows)]
    hw = results.get("hardware")
    if hw:
        limit = hw["limit_tokens_per_s"]
        line = (f"Bandwidth limit of plain decoding: {hw['weight_bytes'] / 1e6:.0f} MB of weights per forward / "
                f"{hw['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s measured read bandwidth = **{limit:.1f} tokens/s**.")
        for ar in (a for a in aggs if a["method"] == "ar" and a["mean"]["tokens_per_s"]):
            speed = ar["mean"]["tokens_per_s"]
            line += f" Our `{ar['variant']}` reaches {speed:.1f} tokens/s, {100 * speed / limit:.0f}% of it ({limit / speed:.2f}× from the limit)."
        out += ["", line]
        paired = [(ar["variant"], limit_gaps(records, ar["variant"], setting, hw["weight_bytes"]))
                  for ar in aggs if ar["method"] == "ar"]
        paired = [(name, g) for name, g in paired if g]
        if paired:
            out += ["", "Measured again beside each `ar` run (best of 5 reads just before and after it, the higher "
                        "kept; the machine's bandwidth drifts), per-prompt median (range): " + "; ".join(
                            f"`{name}` limit {g['limit']['median']:.1f} tokens/s ({g['limit']['min']:.1f}-"
                            f"{g['limit']['max']:.1f}), {g['gap']['median']:.2f}× from it "
                            f"({g['gap']['min']:.2f}-{g['gap']['max']:.2f})" for name, g in paired) + "."]
    return "\n".join(out)


def draft_section(results: dict, t_new: int, l_max: int) -> str:
    """Each draft LM's agreement and step cost, and the methods using it against the same
    method with the n-gram drafter and against hf-assisted with the same draft."""
    quality = [q for q in results.get("draft_quality", []) if not q["warmup"]
               and (q["max_new_tokens"], q["l_max"]) == (t_new, l_max)]
    aggs = at(results, t_new, l_max)
    setting = (aggs[0].get("dataset") if aggs else None, t_new, l_max)
    records = results["records"]
    spec = {v["label"]: v["draft"] for v in results["variants"]}  # the drafter each variant was given
    out = []
    for draft in dict.fromkeys(q["draft"] for q in quality):
        rows = [q for q in quality if q["draft"] == draft]
        med = lambda key: statistics.median(q[key] for q in rows)  # noqa: E731
        agree = [q["agreement"] for q in rows]
        out.append(f"Draft `{draft}` ({counted(len(rows), 'prompt')}): top-1 agreement with the target {100 * med('agreement'):.1f}% "
                   f"(median; {100 * min(agree):.1f}-{100 * max(agree):.1f}%); one draft step {med('draft_ms'):.1f} ms vs "
                   f"one target step {med('target_ms'):.1f} ms = **{med('cost_ratio'):.3f}** of a target forward "
                   f"(1/{1 / med('cost_ratio'):.1f}).")
        assisted = next((a["variant"] for a in aggs if a["method"] == "hf-assisted" and spec[a["variant"]] == draft), None)
        table = []
        for a in aggs:
            if parse(spec[a["variant"]] or "ngram").model != draft or a["method"].startswith("hf-"):
                continue
            ngram = _ngram_twin(a, aggs, spec)
            table.append([a["variant"], _speedup(a),
                          _ratio(ratios_to(records, a["variant"], ngram, setting)) if ngram else "-",
                          _ratio(ratios_to(records, a["variant"], assisted, setting)) if assisted else "-"])
        if table:
            out += ["", _table(["Method", "Speedup vs ar", "vs the same method with the n-gram drafter",
                                f"vs hf-assisted with this draft ({assisted or 'not run'})"], table), ""]
    return "\n".join(out).strip()


def _ngram_twin(a: dict, aggs: list[dict], spec: dict) -> str | None:
    """The variant that runs a's method and options with the n-gram drafter: the same label with
    the drafter's name replaced (so "+compile" pairs with "+compile"), else the first such variant."""
    same = [b["variant"] for b in aggs if b["method"] == a["method"] and spec[b["variant"]] == "ngram"]
    twin = a["variant"].replace(f"[{spec[a['variant']]}]", "[ngram]")
    return twin if twin in same else next(iter(same), None)


def _speedup(a: dict) -> str:
    """Per-prompt median (range; ratio of mean throughputs, ratio of total throughputs)."""
    if a["speedup"] is None or a["speedup_median"] is None:
        return "-"
    totals = "-" if a.get("speedup_totals") is None else f"{a['speedup_totals']:.2f}×"
    return (f"{a['speedup_median']:.2f}× ({a['speedup_min']:.2f}-{a['speedup_max']:.2f}; "
            f"of means {a['speedup']:.2f}×, of totals {totals})")


def main_tables(aggs: list[dict], lossy_variants=frozenset(), on_gpu: bool = False) -> str:
    """Throughput, latency, efficiency and memory tables; `lossy_variants` labelled "(lossy)"; `on_gpu`:
    the memory figures are the device's (stats.PeakMemory), and the table says so."""
    aggs = [{**a, "variant": a["variant"] + (" (lossy)" if a["variant"] in lossy_variants else "")
             + (f" ({a['weights']})" if a.get("weights") and a["method"].startswith("llamacpp") else "")}
            for a in aggs]  # llama.cpp rows name the quantized format they read
    ar = next((a for a in aggs if a["variant"] == "ar"), None)
    ar_mem = ar["mean"]["peak_mem_mb"] if ar else None
    out = ["**Throughput**", "", _table(
        ["Method", "Draft", "Throughput (tok/s)", "Speedup: per-prompt median (range; of means, of totals)", "over"],
        [[a["variant"], a["draft"] or "-", _pm(a["mean"]["tokens_per_s"], a["std"]["tokens_per_s"]), _speedup(a),
          a.get("reference", "ar")] for a in aggs]),
        "", "Speedups are over plain decoding in the same implementation and setting: our methods over our "
            "`ar` with the same compile setting and KV window (llama.cpp's rows too), hf-* over `hf-ar` (over `ar` in a "
            "run without `hf-ar`), `ar` and `hf-ar` variants over plain `ar`; the `over` column names each row's."]
    out += ["", "**Latency**", "", _table(
        ["Method", "TTFT (ms)", "TPOT (ms)"],
        [[a["variant"], _pm(a["mean"]["ttft_s"], a["std"]["ttft_s"], 1000), _pm(a["mean"]["tpot_s"], a["std"]["tpot_s"], 1000, 2)]
         for a in aggs])]
    out += ["", "**Verification efficiency**", "", _table(
        ["Method", "Accept.", "L (tokens/iter)", "l (accepted/iter)", "#Iter.", "drafted/iter",
         "ms/iter: draft", "verify", "commit"],
        [[a["variant"],
          "-" if a["mean"]["acceptance_rate"] is None else f"{100 * a['mean']['acceptance_rate']:.1f}%",
          _pm(a["mean"]["tokens_per_iter"], a["std"]["tokens_per_iter"], digits=2),
          _pm(a["mean"]["accepted_len"], a["std"]["accepted_len"], digits=2),
          f"{a['mean']['iterations']:.0f}",
          f"{a['mean']['drafted_tokens'] / max(a['mean']['iterations'] - 1, 1):.1f}",
          *(_pm(a["mean"].get(f"{phase}_ms"), a["std"].get(f"{phase}_ms"), digits=2) for phase in ("draft", "verify", "commit"))]
         for a in aggs])]
    memory = ("peak GPU memory allocated to tensors during each run (`torch.cuda.max_memory_allocated`: "
              "without the CUDA context and the allocator's cache; not comparable with a CPU run's resident memory)"
              if on_gpu else "the process's peak resident memory during each run: every variant runs in the "
              "one process, so every model loaded for the run counts in each figure")
    out += ["", f"**Peak memory** ({memory})", "", _table(
        ["Method", "Peak memory (MB)", "vs AR"],
        [[a["variant"], _pm(a["mean"]["peak_mem_mb"], a["std"]["peak_mem_mb"], digits=0),
          f"{100 * (a['mean']['peak_mem_mb'] / ar_mem - 1):+.1f}%" if ar_mem and a["mean"]["peak_mem_mb"] else "-"]
         for a in aggs])]
    return "\n".join(out)


def pivot_table(results: dict, axis: str, stat: str = "tokens_per_s") -> str:
    """Rows: variants; columns: values of `axis` (max_new_tokens or l_max)."""
    aggs = results["aggregates"]
    values = sorted({a[axis] for a in aggs})
    variants = list(dict.fromkeys(a["variant"] for a in aggs))
    label = {"max_new_tokens": "T", "l_max": "L_max"}[axis]

    def cell(v, x, key):
        a = next((a for a in aggs if a["variant"] == v and a[axis] == x), None)
        if a is None:
            return "-"
        if key == "speedup":  # per-prompt median (range; of means, of totals), as every speedup table
            return _speedup(a)
        return _pm(a["mean"][key], a["std"][key], digits=2 if key != "tokens_per_s" else 1)

    parts = []
    for key, title in [(stat, "Throughput (tok/s)"), ("speedup", "Speedup over its reference: per-prompt median (range; of means, of totals)"), ("tokens_per_iter", "L (tokens/iter)")]:
        parts += [f"**{title} by {label}**", "",
                  _table(["Method"] + [f"{label}={x}" for x in values], [[v] + [cell(v, x, key) for x in values] for v in variants]), ""]
    return "\n".join(parts)


def grid_best(results: dict) -> tuple[dict, list[str]]:
    """Best fixed-tree sweep variant by speedup, and the grid axes on whose edge it lies."""
    tagged = {v["label"]: v["tags"] for v in results["variants"] if {"depth", "branch", "tau"} <= set(v["tags"])}
    aggs = [a for a in results["aggregates"] if a["variant"] in tagged and a["speedup"] is not None]
    best = max(aggs, key=lambda a: a["speedup"])
    edges = []
    for axis in ("depth", "branch", "tau"):
        grid = sorted({t[axis] for t in tagged.values()})
        value = tagged[best["variant"]][axis]
        if len(grid) > 1 and value in (grid[0], grid[-1]):
            edges.append(f"{axis}={value} ({'lower' if value == grid[0] else 'upper'} edge of {grid})")
    return best, edges


def sweep_section(results: dict) -> str:
    best, edges = grid_best(results)
    aggs = sorted((a for a in results["aggregates"] if a["variant"] != "ar"), key=lambda a: -(a["speedup"] or 0))
    lines = [f"Best configuration of this sweep (picked after the run: a sweep's best, not a declared headline): "
             f"**{best['variant']}**, {_pm(best['mean']['tokens_per_s'], best['std']['tokens_per_s'])} tok/s, "
             f"speedup {_speedup(best)}.",
             "",
             ("It lies **on the edge** of the grid in " + "; ".join(edges) + ": extend the grid there before calling it tuned."
              if edges else "It lies inside the grid on every axis (not on an edge)."),
             "", "**All configurations, best first**", "",
             _table(["Configuration", "Throughput (tok/s)", "Speedup: per-prompt median (range; of means, of totals)",
                     "L", "drafted/iter"],
                    [[a["variant"], _pm(a["mean"]["tokens_per_s"], a["std"]["tokens_per_s"]),
                      _speedup(a), f"{a['mean']['tokens_per_iter']:.2f}",
                      f"{a['mean']['drafted_tokens'] / max(a['mean']['iterations'] - 1, 1):.1f}"] for a in aggs])]
    return "\n".join(lines)


def contention_line(results: dict) -> str | None:
    """What other processes used of the CPU while the measured runs decoded (`other_cpu`), and a warning
    when some runs shared the machine; None for results that did not record it."""
    busy = [(other, r["variant"], r["prompt_index"]) for r in results["records"] if not r["warmup"]
            for other in ([x.get("other_cpu") for x in r["rounds"]] if r.get("rounds") else [r.get("other_cpu")])
            if other is not None]  # every round of a record that ran several
    if not busy:
        return None
    values = sorted(b for b, _, _ in busy)
    line = (f"- other processes on the machine while runs decoded: median {values[len(values) // 2]:.2f}, at most "
            f"{values[-1]:.2f} CPUs' worth (of {results['env']['cpu_count']}), over {counted(len(values), 'run')}")
    flagged = [b for b in busy if b[0] > BUSY_CPUS]
    if flagged:
        worst = max(flagged)
        line += (f". **Warning: {len(flagged)} of {len(values)} runs shared the CPU with other processes (more than "
                 f"{BUSY_CPUS} CPUs' worth; the worst {worst[0]:.2f}, {worst[1]} on prompt {worst[2] + 1}): their timings are "
                 "not reliable**")
    return line


def rounds_line(results: dict) -> str | None:
    """How a record's figures were chosen when every prompt ran several rounds, and the spread between
    rounds (the run's own timing noise, what a per-prompt ratio must exceed to mean anything); None
    for a run of one round."""
    noise = round_noise(results["records"])
    if noise is None:
        return None
    repeats = results["protocol"]["repeats"]  # recorded by every run that can have rounds
    where = noise["max_setting"]
    setting = (f", T = {where['max_new_tokens']}, L_max = {where['l_max']}" if len(settings(results)) > 1 else "")
    per_variant = "; ".join(f"{v} {m:.1%}" for v, m in noise["per_variant"].items())
    return (f"- rounds: every variant ran every prompt {repeats} times, interleaved; each record is its median round "
            f"(of an even count, the slower middle one). Between rounds of one variant on one prompt the throughput "
            f"differed by a median {noise['median']:.1%} (fastest over slowest), at most {noise['max']:.1%} "
            f"({noise['max_variant']} on prompt {noise['max_prompt']}{setting}), over {counted(noise['n'], 'record')}: "
            f"the timing noise of this run. Median per variant: {per_variant}")


def header(results: dict) -> str:
    p, e = results["protocol"], results["env"]
    tasks = any(r.get("category") for r in results["records"])
    per_task = " (questions per Spec-Bench task)" if tasks else ""
    turns = ", every turn of multi-turn questions after each variant's own answers to the earlier ones" if p.get("turns") == "all" else ""
    versions = ", ".join(f"{k} {v}" for k, v in e["versions"].items() if v)
    lines = [f"# dynatree benchmark: {results['experiment']}", "",
             f"- command: `{' '.join(results['command'])}`",
             f"- date: {results['created']}{'' if results.get('complete') else ' (INCOMPLETE run)'}",
             f"- target: `{results['target']}` ({results['dtype']}, {results.get('weights', 'dense')} weights) on {e['device']}: {e['cpu']}"
             f"{', ' + e['gpu'] if e.get('gpu') else ''}, {e['cpu_count']} CPUs, {e['torch_threads']} torch threads",
             f"- CPU support: {cpu.summary(e['cpu_support']) if e.get('cpu_support') else 'not recorded'}",
             f"- versions: {versions}; Python {e['python']}",
             f"- protocol: data set `{p['dataset']}`, {counted(p['n'], 'prompt')}{per_task} of which the first {p['warmup']} are "
             f"warm-up (excluded){turns}, T = {', '.join(map(str, p['max_new_tokens']))} new tokens"
             f"{' (EOS ignored)' if p['ignore_eos'] else ''}, prompts cut to L_max = {', '.join(map(str, p['l_max']))} tokens"
             f"{', chat template' if p['chat'] else ''}",
             "- values: mean ± sample std over the measured prompts (the mean alone with one); speedup over the row's plain-decoding "
             "reference in this run (the `over` column: `ar` of the same compile setting and KV window): the per-prompt "
             "ratios' median first, then their range, the ratio of mean throughputs and the ratio of totals", ""]
    if p.get("sample"):
        lines.insert(-1, f"- sampling: temperature {p.get('temperature') or 1.0}, top-k {p.get('top_k') or 'off'}, "
                         f"top-p {p.get('top_p') or 'off'}; prompt i sampled with seed {p.get('seed', 0)} + i by every "
                         "variant; PPL = perplexity of each continuation under the target (the WETAP paper, eq. 11)")
    universal = [v["label"] for v in results["variants"] if v.get("hf_universal_assisted")]
    if universal:
        lines.insert(-1, f"- {', '.join(universal)}: the draft's vocabulary size differs from the target's, so "
                         "transformers ran universal assisted decoding (re-tokenizing the draft's text each "
                         "iteration; slower than plain assisted decoding)")
    lines.insert(-1, declared_line(results))
    for extra in (contention_line(results), rounds_line(results)):
        if extra:
            lines.insert(-1, extra)
    window = p.get("kv_window")
    lines += ["**Variants**", "", _table(["Label", "Method", "Draft", "KV window", "Config"],
              [[v["label"], v["method"], v["draft"] or "-", v.get("kv_window") or window or "-",
                ", ".join(f"{k}={val}" for k, val in v["config"].items()) or "-"]
               for v in results["variants"]])]
    return "\n".join(lines)


def declared_line(results: dict) -> str:
    """The configuration declared before the run and its figures, or that none was (a sweep)."""
    label = results.get("declared")
    if label is None:
        return ("- declared configuration: none (a sweep, or a custom method list without --headline): every row is one variant "
                "among others, none is a headline")
    mine = [a for a in results.get("aggregates", []) if a["variant"] == label]
    figures = "; ".join(f"{a['dataset']}, T = {a['max_new_tokens']}: {_speedup(a)} over `{a['reference']}`"
                        for a in mine)
    return (f"- declared configuration (before the run, the headline; every other row is for comparison): "
            f"`{label}`{': ' + figures if figures else ''}")


def _lossy_rules(results: dict, labels: list[str]) -> str:
    """The lossy rules the variants `labels` use, named once each, in the order they appear."""
    names = {"wetap": "WETAP's beam rule", "mtad": "MTAD's joint rule"}
    methods = [v["method"] for v in results["variants"] if v["label"] in labels]
    return ", ".join(dict.fromkeys(names.get(m, f"{m}'s rule") for m in methods))


def exactness(results: dict) -> str:
    """The report's exactness line: whether every run produced `ar`'s tokens (greedy), or what a sampling
    run compares instead; and any record whose rounds (`--repeats`) produced different tokens."""
    split = [r for r in results.get("records", []) if r.get("rounds_agree") is False]  # rounds of one record that differ
    rounds_note = (" **Rounds of one variant on one prompt produced different tokens** (nondeterministic decoding): "
                   + ", ".join(f"{r['variant']} on prompt {r.get('prompt_id') or r['prompt_index'] + 1}" for r in split)
                   + "." if split else "")
    return _exactness(results) + rounds_note


def _exactness(results: dict) -> str:
    if results["protocol"].get("sample"):
        marked = lossy(results)
        return ("Sampling run: tokens are not compared with `ar` (lossless methods reproduce the target's "
                "distribution, not ar's draws); compare PPL instead."
                + (f" Lossy verification ({_lossy_rules(results, marked)}): {', '.join(marked)}." if marked else ""))
    bad = [a for a in results["aggregates"] if a["mismatches"] and get_method(a["method"]).engine != "llama.cpp"]
    other = [a for a in results["aggregates"] if a["mismatches"] and get_method(a["method"]).engine == "llama.cpp"]
    unchecked = [a["variant"] for a in results["aggregates"] if a.get("unchecked")]
    note = (f" Not checked (no `ar` run under the same KV window): {', '.join(dict.fromkeys(unchecked))}."
            if unchecked else "")
    if other:  # another engine, with its own rounding (llama.cpp also quantizes activations): not a defect
        note += (" llama.cpp decodes with its own numerics, so its tokens may differ from `ar`'s: " + ", ".join(
            f"{a['variant']} {a['mismatches']}/{counted(a['n'], 'prompt')}" for a in other) + " differ.")
    if not bad:
        return (f"Exactness: every measured run{' (llama.cpp aside)' if other else ''} produced exactly the tokens "
                "of `ar` (in the same KV window and compile setting where run) on the same prompt." + note)
    rows = ", ".join(f"{a['variant']} ({a['mismatches']}/{counted(a['n'], 'prompt')}, T={a['max_new_tokens']})" for a in bad)
    if results.get("weights", "dense") == "dense" and results.get("dtype") in ("bfloat16", "float16"):
        return (f"Exactness: tokens differ from `ar` in {rows}: expected with dense {results['dtype']} weights (tree "
                "steps round some values otherwise than one-token steps; float32 and --weights q4/int8 are exact)."
                + note)
    return (f"Exactness: tokens differ from `ar` in {rows}. In float32 this can come from near-tied logits "
            "(the tests check exactness in float64); investigate if it persists." + note)


def category_table(results: dict, t_new: int, l_max: int) -> str:
    """Spec-Bench's table: per task and overall, each variant's speedup over `ar` (ratio of total
    throughputs) and M; `ar`'s own row gives its tokens/s. Empty when no record has a task."""
    rows = [c for c in by_category(results["records"]) if (c["max_new_tokens"], c["l_max"]) == (t_new, l_max)]
    if not rows:
        return ""
    parts, marked = [], marked_lossy(results)
    rank = {v["label"]: i for i, v in enumerate(results["variants"])}
    for dataset in dict.fromkeys(c["dataset"] for c in rows):
        mine = [c for c in rows if c["dataset"] == dataset]
        tasks = task_order(c["category"] for c in mine)
        cell = {(c["variant"], c["category"]): c for c in mine}
        table = []
        for variant in sorted(dict.fromkeys(c["variant"] for c in mine), key=lambda v: rank.get(v, len(rank))):
            label = variant + (" (lossy)" if variant in marked else "")
            if variant == "ar":
                table.append([label] + [f"{cell[('ar', t)]['tokens_per_s']:.1f} tok/s" if ("ar", t) in cell else "-"
                                        for t in tasks])
                continue
            table.append([label] + [_task_cell(cell[(variant, t)]) if (variant, t) in cell else "-" for t in tasks])
        n = {t: cell[("ar", t)]["n"] for t in tasks if ("ar", t) in cell}
        parts += [f"`{dataset}`: speedup over the same setting's `ar` (see Throughput) = ratio of total "
                  "throughputs (all tokens / all decode time, as Spec-Bench's speed.py) [per-prompt median, "
                  "min-max; ratio of mean throughputs]; M = tokens per verification pass "
                  f"over all passes; prompts per task: {', '.join(f'{t} {k}' for t, k in n.items())}", "",
                  _table(["Variant", *tasks], table), ""]
    return "\n".join(parts).rstrip()


def _task_cell(c: dict) -> str:
    return (f"{c['speedup']:.2f}× [{c['speedup_median']:.2f}, {c['speedup_min']:.2f}-{c['speedup_max']:.2f}; "
            f"means {c['speedup_of_means']:.2f}×] M {c['mean_generated_len'] or 0:.2f}")


def on_gpu(results: dict) -> bool:
    """Whether the run's models were on a CUDA device (its env record)."""
    return str(results.get("env", {}).get("device", "cpu")).startswith("cuda")


def render(results: dict) -> str:
    parts = [header(results), ""]
    s = settings(results)
    if len({t for t, _ in s}) > 1:
        parts += ["## Sequence-length scaling", "", pivot_table(results, "max_new_tokens")]
    if len({l for _, l in s}) > 1:
        parts += ["## Prompt-length sensitivity", "", pivot_table(results, "l_max")]
    if any({"depth", "branch", "tau"} <= set(v["tags"]) for v in results["variants"]):
        parts += ["## Fixed-tree sweep", "", sweep_section(results), ""]
    scored = any(a["mean"].get("ppl") is not None for a in results["aggregates"])
    sets = datasets(results)
    for t_new, l_max in s:
        title = f"## Results at T = {t_new}, L_max = {l_max}" if len(s) > 1 else "## Results"
        parts += [title, ""]
        if any(v["label"] == "hf-ar" for v in results["variants"]):
            parts += ["**Against transformers (hf-ar = `generate()` greedy, same dtype)**", "",
                      perf_section(results, t_new, l_max), ""]
        if results.get("draft_quality"):
            parts += ["**Draft models**", "", draft_section(results, t_new, l_max), ""]
        tasks = category_table(results, t_new, l_max)
        if tasks:
            parts += ["**Spec-Bench tasks**", "", tasks, ""]
        if scored or len(sets) > 1:
            parts += ["**M (tokens per verification), speed and PPL**", "", quality_table(results, t_new, l_max), ""]
        for d in sets:
            if len(sets) > 1:
                parts += [f"### {d}", ""]
            parts += [main_tables(at(results, t_new, l_max, d), marked_lossy(results), on_gpu(results)), ""]
    parts += [exactness(results), ""]
    return "\n".join(parts)


def write(results_dir: Path) -> list[Path]:
    """(Re)build report.md and the plots of a results directory from its results.json alone."""
    from . import plots

    results_dir = Path(results_dir)
    results = load(results_dir)
    report = results_dir / "report.md"
    written = plots.make_all(results, results_dir)
    figures = "".join(f"\n![{p.stem}]({p.name})\n" for p in written)
    report.write_text(render(results) + ("\n## Plots\n" + figures if written else ""))
    return [report, *written]
