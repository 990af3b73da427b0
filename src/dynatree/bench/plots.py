"""PNG plots from results.json alone; which ones depends on what the run varied."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .results import at, by_category, datasets, marked_lossy, settings, task_order  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _variant_tags(results: dict) -> dict[str, dict]:
    return {v["label"]: v["tags"] for v in results["variants"]}


def _main_setting(results: dict) -> tuple[int, int]:
    return max(settings(results))  # the longest generation, then the longest prompt cap


def throughput_bars(results: dict, out: Path) -> Path:
    """Throughput and speedup per variant: one row of panels per data set (lossy rules labelled)."""
    sets = datasets(results)
    marked = marked_lossy(results)
    width = max(8, 1.3 * len(results["variants"]) + 4)
    fig, axes = plt.subplots(len(sets), 2, figsize=(width, 4 * len(sets)), squeeze=False)
    for (ax1, ax2), dataset in zip(axes, sets):
        aggs = at(results, *_main_setting(results), dataset)
        labels = [a["variant"] + (" (lossy)" if a["variant"] in marked else "") for a in aggs]
        ax1.bar(labels, [a["mean"]["tokens_per_s"] for a in aggs], yerr=[a["std"]["tokens_per_s"] or 0 for a in aggs],
                capsize=3, color="tab:blue")
        ax1.set_ylabel("throughput (tokens/s)")
        ax1.set_title(str(dataset))
        ax2.bar(labels, [a["speedup"] or 0 for a in aggs], color="tab:orange")
        ax2.axhline(1.0, color="gray", lw=1, ls="--")
        ax2.set_ylabel("speedup over plain decoding (same setting)")
        ax2.set_title(str(dataset))
        for ax in (ax1, ax2):
            ax.tick_params(axis="x", rotation=30)
            for tick in ax.get_xticklabels():
                tick.set_ha("right")
    fig.suptitle(f"{results['target']}, T={_main_setting(results)[0]}")
    return _save(fig, out / "throughput.png")


def memory_bars(results: dict, out: Path) -> Path | None:
    """Peak memory per variant; None (no plot) where no run's peak could be measured (stats.PeakMemory)."""
    aggs = [a for a in at(results, *_main_setting(results)) if a["mean"]["peak_mem_mb"] is not None]
    if not aggs:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(aggs) + 2), 3.5))
    ax.bar([a["variant"] for a in aggs], [a["mean"]["peak_mem_mb"] for a in aggs], color="tab:gray")
    ax.set_ylabel("peak memory (MB)")
    ax.tick_params(axis="x", rotation=30)
    return _save(fig, out / "memory.png")


def _lines(results: dict, axis: str, out: Path, name: str, panels: list[tuple[str, str]]) -> Path:
    aggs = [a for a in results["aggregates"] if a.get("dataset") == datasets(results)[0]]
    variants = list(dict.fromkeys(a["variant"] for a in aggs))
    color = {v: f"C{i % 10}" for i, v in enumerate(variants)}  # one color per variant in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    for ax, (key, ylabel) in zip(axes, panels):
        for v in variants:
            rows = sorted((a for a in aggs if a["variant"] == v), key=lambda a: a[axis])
            ys = [a["speedup"] if key == "speedup" else a["mean"][key] for a in rows]
            if any(y is None for y in ys):
                continue
            ax.plot([a[axis] for a in rows], ys, marker="o", label=v, color=color[v])
        ax.set_xlabel({"max_new_tokens": "new tokens T", "l_max": "prompt cap L_max (tokens)"}[axis])
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, out / name)


def length_scaling(results: dict, out: Path) -> Path:
    return _lines(results, "max_new_tokens", out, "length_scaling.png", [
        ("tokens_per_s", "throughput (tokens/s)"), ("tokens_per_iter", "L (tokens/iter)"),
        ("accepted_len", "l (accepted drafts/iter)"), ("acceptance_rate", "acceptance rate")])


def memory_scaling(results: dict, out: Path) -> Path:
    return _lines(results, "max_new_tokens", out, "memory_scaling.png", [
        ("peak_mem_mb", "peak memory (MB)"), ("tokens_per_s", "throughput (tokens/s)"), ("tpot_s", "TPOT (s)")])


def prompt_length(results: dict, out: Path) -> Path:
    return _lines(results, "l_max", out, "prompt_length.png", [
        ("tokens_per_s", "throughput (tokens/s)"), ("speedup", "speedup vs AR")])


def ablation(results: dict, out: Path) -> Path:
    tags = _variant_tags(results)
    aggs = sorted((a for a in at(results, *_main_setting(results)) if "stage" in tags[a["variant"]]),
                  key=lambda a: tags[a["variant"]]["stage"])
    labels = [a["variant"] for a in aggs]
    fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(labels, [a["mean"]["tokens_per_s"] for a in aggs], yerr=[a["std"]["tokens_per_s"] or 0 for a in aggs],
            capsize=3, color="tab:blue")
    ax1.set_ylabel("throughput (tokens/s)")
    ax2 = ax1.twinx()
    ax2.plot(labels, [a["mean"]["iterations"] for a in aggs], color="tab:red", marker="o")
    ax2.set_ylabel("#iterations", color="tab:red")
    ax3.bar(labels, [a["mean"]["tokens_per_iter"] for a in aggs], color="tab:green")
    ax3.set_ylabel("L (tokens/iter)")
    ax4 = ax3.twinx()
    ax4.plot(labels, [a["mean"]["acceptance_rate"] or 0 for a in aggs], color="tab:purple", marker="s")
    ax4.set_ylabel("acceptance rate", color="tab:purple")
    for ax in (ax1, ax3):
        ax.tick_params(axis="x", rotation=15)
    return _save(fig, out / "ablation.png")


def fixed_sweep(results: dict, out: Path) -> Path:
    tags = _variant_tags(results)
    aggs = [a for a in at(results, *_main_setting(results))
            if {"depth", "branch", "tau"} <= set(tags[a["variant"]]) and a["speedup"] is not None]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, axis in zip(axes, ("depth", "branch", "tau")):
        values = sorted({tags[a["variant"]][axis] for a in aggs})
        best = [max(a["speedup"] for a in aggs if tags[a["variant"]][axis] == x) for x in values]
        mean = [sum(a["speedup"] for a in aggs if tags[a["variant"]][axis] == x)
                / sum(1 for a in aggs if tags[a["variant"]][axis] == x) for x in values]
        ax.plot(values, best, marker="o", label="best over the other axes")
        ax.plot(values, mean, marker=".", ls="--", label="mean over the other axes")
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xlabel({"depth": "depth D", "branch": "branch B", "tau": "pruning threshold tau"}[axis])
        ax.set_ylabel("speedup vs AR")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("fixed-tree sweep")
    return _save(fig, out / "fixed_sweep.png")


def sensitivity(results: dict, out: Path) -> Path:
    tags = _variant_tags(results)
    aggs = at(results, *_main_setting(results))
    by_group = lambda g: [a for a in aggs if tags[a["variant"]].get("group") == g]  # noqa: E731
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ths = by_group("thresholds")
    if ths:
        sc = axes[0].scatter([tags[a["variant"]]["tau_h"] for a in ths], [tags[a["variant"]]["tau_l"] for a in ths],
                             c=[a["mean"]["tokens_per_s"] for a in ths], cmap="viridis", s=80)
        fig.colorbar(sc, ax=axes[0], label="tokens/s")
    axes[0].set_xlabel("tau_h")
    axes[0].set_ylabel("tau_l")
    axes[0].set_title("(a) confidence thresholds")
    for ax, group, title in ((axes[1], "breadth", "(b) breadth (b_min, b_mid, b_max)"),
                             (axes[2], "depth", "(c) depth (D0, D_max)")):
        rows = by_group(group)
        ax.errorbar(range(len(rows)), [a["mean"]["tokens_per_s"] for a in rows],
                    yerr=[a["std"]["tokens_per_s"] or 0 for a in rows], fmt="o", capsize=3)
        ax.set_xticks(range(len(rows)), [tags[a["variant"]]["value"] for a in rows], rotation=30)
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
    for a in aggs:  # reference lines: AR and the fixed tree of the same run
        if a["variant"] == "ar" or tags[a["variant"]].get("baseline"):
            for ax in axes[1:]:
                ax.axhline(a["mean"]["tokens_per_s"], ls="--", lw=1, color="gray" if a["variant"] == "ar" else "tab:red")
                ax.annotate(a["variant"], (0, a["mean"]["tokens_per_s"]), fontsize=7)
    return _save(fig, out / "sensitivity.png")


def quality_bars(results: dict, out: Path) -> Path:
    """Paper 004's three metrics side by side: M, speed and PPL per variant (and data set)."""
    setting = _main_setting(results)
    sets = datasets(results)
    variants = list(dict.fromkeys(a["variant"] for a in results["aggregates"]))
    marked = marked_lossy(results)
    labels = [v + (" (lossy)" if v in marked else "") for v in variants]
    fig, axes = plt.subplots(1, 3, figsize=(max(12, 1.2 * len(variants) * len(sets) + 6), 4))
    width = 0.8 / len(sets)
    for j, d in enumerate(sets):
        aggs = {a["variant"]: a for a in at(results, *setting, d)}
        for ax, key in zip(axes, ("mean_generated_len", "tokens_per_s", "ppl")):
            xs = [i + j * width for i in range(len(variants))]
            ax.bar(xs, [aggs[v]["mean"][key] or 0 if v in aggs else 0 for v in variants], width,
                   yerr=[aggs[v]["std"][key] or 0 if v in aggs else 0 for v in variants], capsize=2, label=d)
    for ax, title in zip(axes, ("M (tokens per verification)", "speed (tokens/s)", "PPL under the target")):
        ax.set_title(title)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(variants))], labels, rotation=30, ha="right")
    if len(sets) > 1:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{results['target']} on {', '.join(map(str, sets))}, T={setting[0]}")
    return _save(fig, out / "quality.png")


def wetap_sensitivity(results: dict, out: Path) -> Path:
    """Speed, M and PPL against the one WETAP parameter a sensitivity preset varies."""
    tags = _variant_tags(results)
    aggs = [a for a in at(results, *_main_setting(results)) if tags[a["variant"]].get("wetap")]
    groups = list(dict.fromkeys(tags[a["variant"]]["group"] for a in aggs))
    ref = {a["variant"]: a for a in at(results, *_main_setting(results))}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, ylabel) in zip(axes, (("tokens_per_s", "speed (tokens/s)"), ("mean_generated_len", "M"),
                                        ("ppl", "PPL"))):
        for group in groups:
            rows = [a for a in aggs if tags[a["variant"]]["group"] == group]
            ax.errorbar([str(tags[a["variant"]]["value"]) for a in rows], [a["mean"][key] or 0 for a in rows],
                        yerr=[a["std"][key] or 0 for a in rows], marker="o", capsize=3, label=group)
        for name, style in (("ar", "gray"), ("wetap", "tab:red")):
            if name in ref and ref[name]["mean"][key] is not None:
                ax.axhline(ref[name]["mean"][key], ls="--", lw=1, color=style, label=f"{name} (defaults)")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(fig, out / "wetap_sensitivity.png")


def task_bars(results: dict, out: Path) -> Path:
    """Spec-Bench's figure: each variant's speedup over ar (ratio of total throughputs) per task and
    overall, one panel per data set with tasks, at the main setting."""
    t_new, l_max = _main_setting(results)
    rows = [c for c in by_category(results["records"]) if (c["max_new_tokens"], c["l_max"]) == (t_new, l_max)
            and c["variant"] != "ar"]
    sets = list(dict.fromkeys(c["dataset"] for c in rows))
    marked = marked_lossy(results)
    fig, axes = plt.subplots(1, len(sets), figsize=(8 * len(sets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], sets):
        mine = [c for c in rows if c["dataset"] == dataset]
        tasks = task_order(c["category"] for c in mine)
        variants = list(dict.fromkeys(c["variant"] for c in mine))
        cell = {(c["variant"], c["category"]): c["speedup"] for c in mine}
        width = 0.8 / max(len(variants), 1)
        for j, v in enumerate(variants):
            ax.bar([i + j * width for i in range(len(tasks))], [cell.get((v, t), 0) for t in tasks], width,
                   label=v + (" (lossy)" if v in marked else ""))
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks, rotation=30, ha="right")
        ax.set_ylabel("speedup over same-setting ar (total throughput)")
        ax.set_title(dataset)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['target']}, T={t_new}")
    return _save(fig, out / "tasks.png")


def make_all(results: dict, out: Path) -> list[Path]:
    out = Path(out)
    tags = [v["tags"] for v in results["variants"]]
    s = settings(results)
    made = [throughput_bars(results, out), *filter(None, [memory_bars(results, out)])]
    if len({t for t, _ in s}) > 1:
        made += [length_scaling(results, out), memory_scaling(results, out)]
    if len({l for _, l in s}) > 1:
        made.append(prompt_length(results, out))
    if any("stage" in t for t in tags):
        made.append(ablation(results, out))
    if any({"depth", "branch", "tau"} <= set(t) for t in tags):
        made.append(fixed_sweep(results, out))
    if any("group" in t and not t.get("wetap") for t in tags):
        made.append(sensitivity(results, out))
    if any(t.get("wetap") for t in tags):
        made.append(wetap_sensitivity(results, out))
    if any(a["mean"].get("ppl") is not None for a in results["aggregates"]):
        made.append(quality_bars(results, out))
    if any(c["variant"] != "ar" for c in by_category(results["records"])):
        made.append(task_bars(results, out))
    return made
