"""Benchmark harness: data loading, aggregation arithmetic, reports/plots, end-to-end runs."""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics

import pytest
import torch

from helpers import tiny, tokenizer
from dynatree import DynaTreeError, api
from dynatree import prompts as data
from dynatree.bench import commands, plots, presets, report, results, runner
from dynatree.cli import main
from dynatree.quality import perplexity, teacher_forced


# ---------------------------------------------------------------- data sets
def test_plain_text_paragraphs_and_min_chars(tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("first paragraph\nstill first\n\n  \n" + "x" * 30 + "\n\n\nshort\n")
    assert data.paragraphs(f.read_text()) == ["first paragraph\nstill first", "x" * 30, "short"]
    assert [p.text for p in data.load_texts(str(f), 2)] == ["first paragraph\nstill first", "x" * 30]
    assert [p.text for p in data.load_texts(str(f), 1, min_chars=28)] == ["x" * 30]


def test_jsonl_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "w5 w6 w7", "id": "a"}\n\n{"prompt": "w8 w9"}\n')
    prompts = data.load_texts(str(f), 2)
    assert [(p.id, p.text) for p in prompts] == [("a", "w5 w6 w7"), ("p.jsonl:3", "w8 w9")]
    f.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(DynaTreeError, match=r'p.jsonl:1: expected a JSON object with a "prompt" field'):
        data.load_texts(str(f), 1)
    j = tmp_path / "p.json"  # read as text, its JSON would become one prompt: refused instead
    j.write_text('[{"prompt": "What is the capital of France?"}]')
    with pytest.raises(DynaTreeError, match=r'p\.json: a \.json file is not a prompts file; .* name it \.jsonl'):
        data.load_texts(str(j), 1)


def test_too_few_prompts_and_unknown_source(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("one\n\ntwo\n")
    with pytest.raises(DynaTreeError, match="has 2 usable prompts, fewer than the 3"):
        data.load_texts(str(f), 3)
    with pytest.raises(DynaTreeError, match="unknown data set 'nope'"):
        data.load_texts("nope", 1)


def test_truncation_is_in_tokens():
    tok = tokenizer()
    prompt = data.Prompt("x", " ".join(f"w{i}" for i in range(3, 40)))
    assert data.tokenize(tok, prompt, l_max=10) == list(range(3, 13))
    assert data.tokenize(tok, prompt, l_max=1000) == list(range(3, 40))


def test_humaneval_ships_offline():
    prompts = data.load_texts("humaneval", 164)
    assert prompts[0].id == "HumanEval/0" and prompts[0].text.startswith("from typing import List")


def test_hub_data_set_unreachable_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(DynaTreeError, match=r"cannot load data set 'wikitext2'.*unreachable.*--dataset FILE.*"
                                            r"ships with dynatree \(specbench, humaneval, mtbench, gsm8k\)"):
        data.load_texts("wikitext2", 3)


def test_wikitext_rows_filtered_like_the_papers(monkeypatch):
    """Headings and paragraphs under 200 characters are dropped (fake `datasets` rows)."""
    rows = [{"text": " = Title = "}, {"text": "short line"}, {"text": "a" * 199}, {"text": " " + "b" * 200 + " "},
            {"text": ""}, {"text": "c" * 500}]

    class FakeDatasets:
        class config:
            HF_HUB_OFFLINE = HF_DATASETS_OFFLINE = False

        @staticmethod
        def load_dataset(path, name, split):
            assert (path, name, split) == ("wikitext", "wikitext-2-raw-v1", "test")
            return rows

    monkeypatch.setitem(__import__("sys").modules, "datasets", FakeDatasets)
    monkeypatch.setattr("dynatree.models.hub_reachable", lambda timeout=3.0: True)
    prompts = data.load_texts("wikitext2", 2)
    assert [p.text for p in prompts] == ["b" * 200, "c" * 500]
    assert [p.id for p in prompts] == ["wikitext2:3", "wikitext2:5"]


# ---------------------------------------------------------------- aggregation
def rec(variant, index, tps, warmup=False, t=8, acc=None, matches=True):
    stats = {k: 1.0 for k in results.STATS}
    stats.update(tokens_per_s=tps, acceptance_rate=acc, new_tokens=t, wall_s=t / tps)
    return {"variant": variant, "method": variant, "draft": None, "prompt_index": index, "warmup": warmup,
            "max_new_tokens": t, "l_max": 800, "prompt_tokens": 10 + index, "stats": stats, "matches_ar": matches}


def test_every_speedup_table_gives_the_median_the_ratio_of_means_and_the_ratio_of_totals():
    """Issue 27: three figures that differ when prompts differ in length and speed: `x` doubles a
    long slow prompt and ties a short fast one: per-prompt median 1.5, ratio of mean throughputs
    60/55, ratio of total throughputs (110 tokens in 5.1 s vs 10.1 s) 1.98; both tables show all three."""
    def run(variant, long_s):
        out = [rec(variant, 0, 100 / long_s, t=100), rec(variant, 1, 100.0, t=10)]
        for r in out:
            r.update(dataset="specbench", category="qa", max_new_tokens=100)  # one setting; the short one hit EOS
        return out

    records = run("ar", 10.0) + run("x", 5.0)
    x = next(a for a in results.aggregate(records) if a["variant"] == "x")
    assert x["speedup_median"] == pytest.approx(1.5) and x["speedup"] == pytest.approx(60 / 55)
    assert x["speedup_totals"] == pytest.approx(10.1 / 5.1)
    assert "| x | - | 60.0 ± 56.6 | 1.50× (1.00-2.00; of means 1.09×, of totals 1.98×) | ar |" in report.main_tables(
        results.aggregate(records))
    overall = next(c for c in results.by_category(records) if c["variant"] == "x" and c["category"] == "overall")
    assert overall["speedup"] == pytest.approx(10.1 / 5.1) and overall["speedup_of_means"] == pytest.approx(60 / 55)
    table = report.category_table({"records": records, "variants": [{"label": "ar"}, {"label": "x"}], "protocol": {}},
                                  100, 800)
    assert "| x | 1.98× [1.50, 1.00-2.00; means 1.09×] M " in table


def test_speedups_are_over_plain_decoding_in_the_same_implementation_and_setting():
    """Issue 27: a compiled method over compiled ar, a windowed one over windowed ar, hf-* over hf-ar,
    ar variants over plain ar; never over another implementation's or setting's plain decoding."""
    def run(variant, method, tps, compile=False, kv_window=None):
        return [{**rec(variant, i, tps * (1 + i)), "method": method, "compile": compile, "kv_window": kv_window}
                for i in range(2)]

    records = (run("ar", "ar", 10.0) + run("ar +compile", "ar", 20.0, compile=True)
               + run("ar + window", "ar", 8.0, kv_window="4,28") + run("dynatree", "dynatree", 15.0)
               + run("dynatree +compile", "dynatree", 30.0, compile=True)
               + run("dynatree + window", "dynatree", 12.0, kv_window="4,28")
               + run("hf-ar", "hf-ar", 5.0) + run("hf-lookup", "hf-lookup", 7.5)
               + run("hf-ar +compile", "hf-ar", 10.0, compile=True)
               + run("hf-assisted +compile", "hf-assisted", 12.0, compile=True))
    aggs = {a["variant"]: a for a in results.aggregate(records)}
    expected = {"ar": ("ar", 1.0), "ar +compile": ("ar", 2.0), "ar + window": ("ar", 0.8),
                "dynatree": ("ar", 1.5), "dynatree +compile": ("ar +compile", 1.5),
                "dynatree + window": ("ar + window", 1.5), "hf-ar": ("ar", 0.5), "hf-lookup": ("hf-ar", 1.5),
                "hf-ar +compile": ("ar", 1.0),  # plain decoding itself: against our plain ar
                "hf-assisted +compile": ("hf-ar +compile", 1.2)}  # transformers compiled over transformers compiled
    assert {v: (a["reference"], round(a["speedup"], 6)) for v, a in aggs.items()} == expected
    assert all(a["speedup_median"] == pytest.approx(a["speedup"]) for a in aggs.values())  # same ratio per prompt
    table = report.main_tables(list(aggs.values()))
    assert "| dynatree +compile | - | 45.0 ± 21.2 | 1.50× (1.50-1.50; of means 1.50×, of totals 1.50×) | ar +compile |" in table
    assert all(a["speedup_totals"] == pytest.approx(a["speedup"]) for a in aggs.values())


def test_bench_summary_shows_every_data_set_and_setting_labelled(capsys, saved_tiny, prompt_file, tmp_path):
    """Issue 37: one labelled table per data set and T on stdout; throughput.png has a row per data set."""
    other = tmp_path / "b.txt"
    other.write_text("w20 w21 w22\n\nw30 w31 w32\n\nw40 w41")
    out = tmp_path / "run"
    assert main(["bench", "--target", str(saved_tiny), "--methods", "ar,dynatree", "--dataset",
                 f"{prompt_file},{other}", "--n", "2", "--warmup", "0", "--max-new-tokens", "4,6", "--no-ppl",
                 "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for dataset in (str(prompt_file), str(other)):
        for t in (4, 6):
            assert f"-- {dataset}, T = {t}, L_max = 800" in printed
    import matplotlib.image

    assert matplotlib.image.imread(out / "throughput.png").shape[0] > 700  # two rows of panels


@pytest.mark.parametrize("command", [["bench", "--methods", "ar", "--dataset", "humaneval", "--n", "2"],
                                     ["distill"]])
def test_out_naming_a_file_is_a_one_line_error_before_any_loading(capsys, tmp_path, command):
    """Issue 37: --out naming an existing file (or a path under one) was a traceback after the load."""
    taken = tmp_path / "taken"
    taken.write_text("x")
    for out in (taken, taken / "inside"):
        assert main([*command, "--target", "/nonexistent/model", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dynatree: error: --out ") and ("is a file" in err or "existing file" in err)
        assert "does not exist" not in err  # refused before the (missing) target was looked up


def test_older_records_without_compile_still_reference_plain_ar_and_rows_keep_the_run_s_order():
    records = [{**rec(v, i, 10.0 * (1 + i)), "method": m} for i in range(2)
               for v, m in (("dynatree", "dynatree"), ("ar +compile", "ar"), ("ar", "ar"))]  # no "compile" field
    assert results.references(records) == {"dynatree": "ar", "ar +compile": "ar", "ar": "ar"}
    assert [a["variant"] for a in results.aggregate(records, ["ar", "dynatree", "ar +compile"])] == [
        "ar", "dynatree", "ar +compile"]


def test_aggregate_excludes_warmup_and_computes_speedups():
    records = [rec("ar", 0, 100.0, warmup=True), rec("x", 0, 1.0, warmup=True),
               rec("ar", 1, 10.0), rec("x", 1, 20.0, acc=0.5),
               rec("ar", 2, 20.0), rec("x", 2, 30.0, acc=None, matches=False)]
    ar, x = results.aggregate(records)
    assert ar["n"] == x["n"] == 2
    assert ar["mean"]["tokens_per_s"] == 15.0 and ar["std"]["tokens_per_s"] == pytest.approx(7.0710678)
    assert x["mean"]["tokens_per_s"] == 25.0
    assert x["speedup"] == pytest.approx(25 / 15)  # ratio of means (the papers' definition)
    assert x["speedup_median"] == pytest.approx(1.75)  # per-prompt ratios 2.0 and 1.5
    assert (x["speedup_min"], x["speedup_max"]) == (1.5, 2.0)
    assert x["mean"]["acceptance_rate"] == 0.5  # None values are skipped, not counted as 0
    assert x["mismatches"] == 1 and ar["speedup"] == 1.0
    assert x["mean"]["prompt_tokens"] == 11.5


def test_aggregate_per_setting():
    records = [rec("ar", 0, 10.0, t=8), rec("x", 0, 20.0, t=8), rec("ar", 0, 5.0, t=16), rec("x", 0, 20.0, t=16)]
    aggs = {(a["variant"], a["max_new_tokens"]): a for a in results.aggregate(records)}
    assert aggs[("x", 8)]["speedup"] == 2.0 and aggs[("x", 16)]["speedup"] == 4.0


# ---------------------------------------------------------------- reports and plots
def fixed_results(kind: str, drafts: tuple[str, ...] = ("ngram",)) -> dict:
    """A small results dict shaped like the runner's, for report and plot tests."""
    variants = presets.variants(kind, "small", list(drafts))
    t_values = [8, 16] if kind in ("length", "streaming") else [8]
    sets = ["humaneval", "gsm8k"] if kind == "wetap-main" else ["fixture"]
    records = []
    for t in t_values:
        for d in sets:
            for i in range(3):
                for j, v in enumerate(variants):
                    r = rec(v.label, i, 10.0 + j + i, warmup=i == 0, t=t, acc=None if v.method == "ar" else 0.3)
                    r["method"], r["draft"], r["dataset"] = v.method, v.draft, d
                    if kind.startswith("wetap"):
                        r["ppl"] = 2.0 + j / 10
                    records.append(r)
    res = {"schema": 1, "experiment": kind, "created": "2026-11-22T00:00:00", "command": ["dynatree", "bench"],
           "complete": True, "target": "tiny", "dtype": "float32",
           "protocol": {"dataset": ",".join(sets), "n": 3, "warmup": 1, "max_new_tokens": t_values, "l_max": [800],
                        "ignore_eos": True, "chat": False, "min_chars": None, "sample": kind.startswith("wetap"),
                        "temperature": 1.0, "top_k": 10, "top_p": 0.9, "seed": 0, "ppl": kind.startswith("wetap")},
           "env": {"versions": {"torch": "x"}, "python": "3", "cpu": "cpu", "cpu_count": 2, "torch_threads": 2,
                   "device": "cpu"},
           "variants": [{"label": v.label, "method": v.method, "options": v.options, "draft": v.draft, "tags": v.tags,
                         "kv_window": v.kv_window, "config": v.options} for v in variants],
           "records": records}
    res["aggregates"] = results.aggregate(records)
    res["declared"] = presets.declared(kind, variants)
    return res


@pytest.mark.parametrize("kind, plot", [("main", "throughput.png"), ("ablation", "ablation.png"),
                                        ("length", "length_scaling.png"), ("fixed-sweep", "fixed_sweep.png"),
                                        ("dynatree-sensitivity", "sensitivity.png"),
                                        ("streaming", "memory_scaling.png"), ("wetap-main", "quality.png"),
                                        ("wetap-ablation", "ablation.png"), ("wetap-gamma", "wetap_sensitivity.png"),
                                        ("wetap-width", "wetap_sensitivity.png"), ("wetap-alpha", "quality.png"),
                                        ("perf", "throughput.png")])
def test_report_and_plots_from_results_json_alone(tmp_path, kind, plot):
    results.save(fixed_results(kind), tmp_path)
    written = report.write(tmp_path)
    names = {p.name for p in written}
    assert {"report.md", "throughput.png", "memory.png", plot} <= names
    for p in written:
        assert p.stat().st_size > 1000
    md = (tmp_path / "report.md").read_text()
    assert "**Throughput**" in md and "**Latency**" in md and "**Verification efficiency**" in md
    assert "**Peak memory**" in md and f"![{plot[:-4]}]({plot})" in md
    if kind == "length":
        assert "Throughput (tok/s) by T" in md and "T=16" in md


def test_wetap_report_has_m_speed_ppl_per_data_set_and_marks_the_lossy_rule():
    md = report.render(fixed_results("wetap-main"))
    assert "| Method | M (humaneval) | Speed (tok/s) (humaneval) | PPL (humaneval) | M (gsm8k) |" in md
    assert "| wetap (lossy) |" in md and "| wetap (exact verify) |" in md  # WETAP: only the beam rule is lossy
    assert "| mtad (lossy) |" in md and "| dsbd |" in md  # Table 1's beam baselines: MTAD's joint rule is lossy
    assert "### humaneval" in md and "### gsm8k" in md
    assert "Lossy verification (MTAD's joint rule, WETAP's beam rule): mtad, wetap." in md  # the rules present, once
    assert "sampling: temperature 1.0, top-k 10, top-p 0.9" in md
    throughput = md[md.index("**Throughput**"):md.index("**Latency**")]  # labelled in every table (issue 37)
    assert "| wetap (lossy) |" in throughput and "| wetap (exact verify) |" in throughput


def test_each_preset_declares_its_headline_before_it_runs_and_the_report_leads_with_it(prompt_file):
    """Issue 27: the configuration a preset declares is fixed by its rules before any run (never the
    best row afterwards); a sweep declares none; the report and the CLI say which it is."""
    shipped = ["ngram", "tiny-draft", "ngram+tiny-draft"]
    expect = {"main": "dynatree", "ablation": "+ history adaptation", "length": "dynatree",
              "streaming": "dynatree", "wetap-main": "wetap", "wetap-ablation": "WETAP",
              "fixed-sweep": None, "dynatree-sensitivity": None, "wetap-gamma": None}
    for preset, label in expect.items():
        assert presets.declared(preset, presets.variants(preset, "small", ["ngram"])) == label, preset
    for preset in ("perf", "draft"):  # eager cost-aware DynaTree, the n-gram drafter backed by the draft
        assert presets.declared(preset, presets.variants(preset, "small", shipped)) == \
            "dynatree[ngram+tiny-draft] +cost-aware"
    compiled = [dataclasses.replace(v, compile=True) for v in presets.variants("perf", "small", shipped)]
    assert presets.declared("perf", compiled) == "dynatree[ngram+tiny-draft] +cost-aware +compile"  # --compile
    md = report.render(fixed_results("main"))
    assert "- declared configuration (before the run, the headline; every other row is for comparison): " \
           "`dynatree`: fixture, T = 8: " in md
    assert "- declared configuration: none (a sweep" in report.render(fixed_results("fixed-sweep"))
    variants = presets.method_variants(["ar", "linear"], ["ngram"])
    proto = runner.Protocol(dataset=str(prompt_file), n=1, warmup=0, max_new_tokens=[4])
    with pytest.raises(DynaTreeError, match="declared configuration 'dynatree' is not a variant"):
        runner.run("main", variants, proto, tiny("llama", eos_ids=[]), {}, progress=False, declared="dynatree")


def test_wetap_presets_hold_every_row_of_the_papers_tables():
    """Table 1's methods in the paper's order (plus WETAP's tree verified exactly, and DynaTree);
    the ablation's three stages with DSBD and MTAD beside them."""
    main = [(v.method, v.options) for v in presets.variants("wetap-main", "small", ["ngram"])]
    assert [m for m, _ in main] == ["ar", "specinfer", "dsbd", "specexec", "mtad", "opt-tree", "wetap", "wetap",
                                    "dynatree"]
    ablation = presets.variants("wetap-ablation", "small", ["ngram"])
    assert [v.method for v in ablation] == ["ar", "wetap", "wetap", "wetap", "dsbd", "mtad"]
    assert [v.tags.get("stage") for v in ablation] == [None, 0, 1, 2, None, None]


def test_quality_plot_is_titled_with_its_data_sets(tmp_path, monkeypatch):
    """Issue 37: quality.png's title named the target and T only."""
    titles = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: titles.append(fig._suptitle.get_text()) or path)
    plots.quality_bars(fixed_results("wetap-main"), tmp_path)
    assert titles == ["tiny on humaneval, gsm8k, T=8"], titles


def test_perf_table_ratios_and_bandwidth_limit():
    res = fixed_results("perf")
    assert [v["label"] for v in res["variants"]] == ["hf-ar", "hf-lookup", "ar", "linear", "fixed-tree", "dynatree",
                                                     "dynatree +cost-aware", "hf-ar +compile", "ar +compile",
                                                     "dynatree +cost-aware +compile"]
    perf = presets.variants("perf", "small", ["ngram"])
    assert [v.compile for v in perf] == [False] * 7 + [True] * 3  # hf-ar +compile: transformers at its best
    assert [v.options.get("cost_aware", False) for v in perf] == [False] * 6 + [True, False, False, True]
    res["hardware"] = {"weight_bytes": 500e6, "bandwidth_bytes_per_s": 10e9, "limit_tokens_per_s": 20.0}
    md = report.render(res)
    # tokens/s = 10 + variant index + prompt index; measured prompts 1 and 2
    # linear (3) / hf-ar (0): 14/11, 15/12 -> median 1.26, range 1.25-1.27; vs hf-ar +compile (7): 14/18, 15/19;
    # vs hf-lookup (1): 14/12, 15/13
    assert ("| linear | 14.5 ± 0.7 | 1.26× (1.25-1.27; of means 1.26×, of totals 1.26×) | 0.78× (0.78-0.79; of means "
            "0.78×, of totals 0.78×) | 1.16× (1.15-1.17; of means 1.16×, of totals 1.16×) |") in md
    assert "| hf-lookup | 12.5 ± 0.7 | 1.09× (1.08-1.09; of means 1.09×, of totals 1.09×) | 0.68× (" in md
    # dynatree (5) / hf-ar: 16/11, 17/12; of means 16.5/11.5 = 1.435, of totals 2/(1/16+1/17) / 2/(1/11+1/12) = 1.437
    assert "| dynatree | 16.5 ± 0.7 | 1.44× (1.42-1.45; of means 1.43×, of totals 1.44×) |" in md
    assert "vs hf-ar +compile (transformers at its best: static cache, compiled)" in md
    assert "vs best hf-* speculative (hf-lookup)" in md
    assert "500 MB of weights per forward / 10.0 GB/s measured read bandwidth = **20.0 tokens/s**" in md
    assert "Our `ar` reaches 13.5 tokens/s, 68% of it (1.48× from the limit)" in md
    assert "Our `ar +compile` reaches 19.5 tokens/s, 98% of it (1.03× from the limit)" in md
    assert "Measured again beside" not in md  # no run had a paired measurement
    for r in res["records"]:  # bandwidth measured beside each ar run: 1e12 on the warm-up prompt 0 (ignored)
        if r["variant"] == "ar":
            r["bandwidth_bytes_per_s"] = 1e12 if r["warmup"] else (20 + r["prompt_index"]) * 1e9
    md = report.render(res)
    # limits 21e9 / 500e6 = 42, 44 tokens/s; ar 13, 14 tokens/s -> 3.23x, 3.14x
    assert ("per-prompt median (range): `ar` limit 43.0 tokens/s (42.0-44.0), 3.19× from it (3.14-3.23).") in md


def test_perf_table_has_a_column_per_hf_speculative_peer_and_names_the_best_by_mean():
    res = fixed_results("perf", ("ngram", "d"))
    labels = [v["label"] for v in res["variants"]]
    assert labels[:4] == ["hf-ar", "hf-lookup", "hf-assisted", "ar"]
    md = report.render(res)
    # tokens/s = 10 + variant index + prompt index, measured prompts 1 and 2: hf-ar 11, 12; hf-lookup 12, 13;
    # hf-assisted 13, 14; hf-assisted +compile (13) 23, 24, the fastest peer, so "best"; ar 14, 15
    assert labels[12:14] == ["hf-ar +compile", "hf-assisted +compile"]  # transformers at its best, where it compiles
    assert "| vs hf-lookup | vs hf-assisted | vs best hf-* speculative (hf-assisted +compile) |" in md
    assert ("| ar | 14.5 ± 0.7 | 1.26× (1.25-1.27; of means 1.26×, of totals 1.26×) | 0.62× (0.61-0.62; of means 0.62×, "
            "of totals 0.62×) | 1.16× (1.15-1.17; of means 1.16×, of totals 1.16×) | 1.07× (1.07-1.08; of means 1.07×, "
            "of totals 1.07×) | 0.59× (0.58-0.60; of means 0.59×, of totals 0.59×) |") in md
    assert "| hf-assisted | 13.5 ± 0.7 | 1.17× (1.17-1.18; of means 1.17×, of totals 1.17×) | 0.57× (" in md


def test_weight_bytes_and_bandwidth():
    from dynatree.hardware import decode_limit, weight_bytes

    model = tiny("gpt2").model  # tied input/output embeddings: counted once
    assert weight_bytes(model) == sum(p.numel() * p.element_size() for p in set(model.parameters()))
    assert weight_bytes(model) < sum(p.numel() * p.element_size() for p in model.state_dict().values())
    limit = decode_limit(model)
    assert limit["bandwidth_bytes_per_s"] > 1e8 and limit["limit_tokens_per_s"] > 0


def test_report_numbers(tmp_path):
    res = fixed_results("main")
    md = report.render(res)
    # linear is variant 1: tokens/s 10+1+i for measured prompts i=1,2 (ratios 12/11, 13/12) vs ar 11+i
    assert "| linear | ngram | 12.5 ± 0.7 | 1.09× (1.08-1.09; of means 1.09×, of totals 1.09×) |" in md
    assert "Exactness: every measured run" in md


def test_fixed_sweep_best_and_grid_edge():
    res = fixed_results("fixed-sweep")
    best, edges = report.grid_best(res)
    assert best["variant"] == "D=8 B=3 tau=0.3"  # the last variant is the fastest in the fixture
    assert len(edges) == 3 and "upper edge" in edges[0]
    # make an interior point the best: no edge
    inner = "D=4 B=2 tau=0.1"
    for a in res["aggregates"]:
        if a["variant"] == inner:
            a["speedup"] = 99.0
    best, edges = report.grid_best(res)
    assert best["variant"] == inner and edges == []
    assert "inside the grid on every axis" in report.sweep_section(res)


def test_interrupted_results_are_still_reportable(tmp_path):
    res = fixed_results("main")
    del res["aggregates"]
    res["complete"] = False
    results.save(res, tmp_path)
    report.write(tmp_path)
    assert "INCOMPLETE run" in (tmp_path / "report.md").read_text()


def test_results_file_errors(tmp_path):
    with pytest.raises(DynaTreeError, match="no results file"):
        results.load(tmp_path)
    (tmp_path / "results.json").write_text("{not json")
    with pytest.raises(DynaTreeError, match="not valid JSON"):
        results.load(tmp_path)


# ---------------------------------------------------------------- end to end

def test_runner_end_to_end_on_tiny_models(tmp_path, prompt_file):
    target = tiny("llama", eos_ids=[])
    draft = copy.copy(tiny("gpt2", seed=4))
    variants = presets.method_variants(["ar", "linear", "fixed-tree", "dynatree", "hf-lookup", "hf-ar", "hf-assisted"],
                                       ["ngram", "tiny-draft"])
    proto = runner.Protocol(dataset=str(prompt_file), n=3, warmup=1, max_new_tokens=[6, 12], l_max=[4, 800])
    res = runner.run("e2e", variants, proto, target, {"tiny-draft": draft}, out_dir=tmp_path, progress=False)
    labels = {v.label for v in variants}
    assert {"dynatree[ngram]", "dynatree[tiny-draft]", "hf-assisted"} <= labels
    assert len(res["records"]) == len(variants) * (3 + 3 * 2)  # the warm-up prompt runs in the first setting only
    for r in res["records"]:
        assert r["matches_ar"], r["variant"]
        assert set(results.STATS) <= set(r["stats"])
        assert r["stats"]["new_tokens"] == r["max_new_tokens"]
        assert r["prompt_tokens"] <= r["l_max"]
    assert {a["n"] for a in res["aggregates"]} == {2}
    on_disk = results.load(tmp_path)
    assert on_disk["complete"] and on_disk["env"]["versions"]["torch"] and len(on_disk["variants"]) == len(variants)
    assert on_disk["env"]["cpu_support"]["capability"] == torch.backends.cpu.get_cpu_capability()
    assert f"- CPU support: {on_disk['env']['cpu_support']['capability']}, oneDNN linear in float32" in report.header(on_disk)
    assert on_disk["variants"][1]["config"]["k"] == 5  # resolved config of every variant


def test_runner_measures_bandwidth_beside_every_run_in_rotated_order(monkeypatch, prompt_file):
    reads = iter([5e9, 7e9, 1e9, 2e9, 3e9, 2e9, 4e9, 6e9])  # before/after each run, in the order they run
    monkeypatch.setattr(runner, "read_bandwidth", lambda device: next(reads))
    monkeypatch.setattr(runner, "decode_limit", lambda model, device: {
        "weight_bytes": 1e8, "bandwidth_bytes_per_s": 9e9, "limit_tokens_per_s": 90.0})
    variants = presets.method_variants(["ar", "linear"], ["ngram"])
    proto = runner.Protocol(dataset=str(prompt_file), n=2, warmup=0, max_new_tokens=[4], bandwidth_limit=True)
    res = runner.run("perf", variants, proto, tiny("llama", eos_ids=[]), {}, progress=False)
    assert res["hardware"]["limit_tokens_per_s"] == 90.0
    order = [(r["prompt_index"], r["variant"]) for r in res["records"]]
    assert order == [(0, "ar"), (0, "linear"), (1, "linear"), (1, "ar")]  # rotated by one per prompt
    assert not any({"round", "rounds", "rounds_agree"} & set(r) for r in res["records"])  # one round: records as before
    assert [r["bandwidth_bytes_per_s"] for r in res["records"]] == [7e9, 2e9, 3e9, 6e9]  # the higher of each pair
    gaps = results.limit_gaps(res["records"], "ar", (str(prompt_file), 4, 800), 1e8)
    assert gaps["limit"] == {"median": 65.0, "min": 60.0, "max": 70.0} and gaps["n"] == 2
    speeds = [r["stats"]["tokens_per_s"] for r in res["records"] if r["variant"] == "ar"]
    assert gaps["gap"]["max"] == pytest.approx(max(70 / speeds[0], 60 / speeds[1]))  # limit / tok/s per run


def test_repeats_run_every_round_interleaved_and_keep_the_median_round(monkeypatch, tmp_path, prompt_file):
    """--repeats 3: each variant runs each prompt three times, rounds rotated like prompts; a record keeps
    its median round's statistics and every round's throughput, each round's tokens are checked against
    ar's, and the report states the spread between rounds (the run's own noise)."""
    order = []
    real = runner.run_one

    def spy(req, on_tokens=None):
        out = real(req, on_tokens=on_tokens)
        order.append(req.method)
        # a throughput that says in which run it came; the first run claims to have compiled while timed
        return dataclasses.replace(out, stats=dataclasses.replace(
            out.stats, tokens_per_s=float(len(order)), graphs_compiled_while_timed=2 if len(order) == 1 else 0))

    monkeypatch.setattr(runner, "run_one", spy)
    variants = presets.method_variants(["ar", "linear"], ["ngram"])
    proto = runner.Protocol(dataset=str(prompt_file), n=2, warmup=0, max_new_tokens=[6], repeats=3)
    res = runner.run("custom", variants, proto, tiny("llama", eos_ids=[]), {}, out_dir=tmp_path, progress=False)
    # prompt 0: rounds rotated by one each (ar first, then linear first, then ar); prompt 1 goes on from there
    assert order == ["ar", "linear", "linear", "ar", "ar", "linear", "linear", "ar", "ar", "linear", "linear", "ar"]
    assert len(res["records"]) == 4  # one record per variant and prompt, not per round
    by = {(r["variant"], r["prompt_index"]): r for r in res["records"]}
    ar0, lin0 = by[("ar", 0)], by[("linear", 0)]
    assert [x["tokens_per_s"] for x in ar0["rounds"]] == [1.0, 4.0, 5.0] and ar0["stats"]["tokens_per_s"] == 4.0
    assert ar0["stats"]["graphs_compiled_while_timed"] == 2  # its slow first round compiled: not hidden
    assert lin0["stats"]["graphs_compiled_while_timed"] == 0 and all(r["rounds_agree"] for r in res["records"])
    assert [x["tokens_per_s"] for x in lin0["rounds"]] == [2.0, 3.0, 6.0] and lin0["round"] == 1
    assert all(r["matches_ar"] for r in res["records"])
    assert len({x["tokens_sha1"] for x in ar0["rounds"]}) == 1
    noise = results.round_noise(res["records"])
    assert noise["n"] == 4 and res["protocol"]["repeats"] == 3
    assert noise["max"] == pytest.approx(max(5.0 / 1.0, 6.0 / 2.0, 11.0 / 7.0, 12.0 / 8.0) - 1)
    assert (noise["max_variant"], noise["max_prompt"]) == ("ar", ar0["prompt_id"])
    assert noise["per_variant"]["linear"] == pytest.approx(statistics.median([6.0 / 2.0 - 1, 11.0 / 7.0 - 1]))
    line = report.rounds_line(res)
    assert "every variant ran every prompt 3 times" in line and f"at most 400.0% (ar on prompt {ar0['prompt_id']})" in line
    assert "Median per variant: ar " in line
    assert line in report.render(results.load(tmp_path))


def test_a_round_that_leaves_ar_s_tokens_fails_the_record(monkeypatch, prompt_file):
    """Exactness is checked on every round, not only the one a record keeps."""
    real = runner.run_one
    calls = []

    def spy(req, on_tokens=None):
        out = real(req, on_tokens=on_tokens)
        calls.append(req.method)
        # throughputs fixed so that the astray round is the fastest: never the one the record keeps
        out = dataclasses.replace(out, stats=dataclasses.replace(out.stats, tokens_per_s=float(len(calls))))
        if req.method == "linear" and calls.count("linear") == 3:  # its last round (the fastest) goes astray
            return dataclasses.replace(out, new_token_ids=[*out.new_token_ids[:-1], (out.new_token_ids[-1] + 1) % 50])
        return out

    monkeypatch.setattr(runner, "run_one", spy)
    variants = presets.method_variants(["ar", "linear"], ["ngram"])
    proto = runner.Protocol(dataset=str(prompt_file), n=1, warmup=0, max_new_tokens=[6], repeats=3)
    res = runner.run("custom", variants, proto, tiny("llama", eos_ids=[]), {}, progress=False)
    by = {r["variant"]: r for r in res["records"]}
    assert by["ar"]["matches_ar"] and by["linear"]["matches_ar"] is False
    assert by["linear"]["round"] == 1 and by["linear"]["rounds_agree"] is False and by["ar"]["rounds_agree"]
    assert len({x["tokens_sha1"] for x in by["linear"]["rounds"]}) == 2
    line = report.exactness({**res, "aggregates": results.aggregate(res["records"])})
    assert "tokens differ from `ar` in linear" in line and "produced different tokens" in line and "linear on prompt" in line


def test_contention_in_any_round_is_reported():
    quiet, busy = rec("ar", 0, 10.0), rec("ar", 1, 10.0)
    quiet["other_cpu"] = busy["other_cpu"] = 0.01
    busy["rounds"] = [{"tokens_per_s": 10.0, "other_cpu": 0.01}, {"tokens_per_s": 8.0, "other_cpu": 1.5}]
    line = report.contention_line({"records": [quiet, busy], "env": {"cpu_count": 2}})
    assert "Warning: 1 of 3 runs shared the CPU" in line and "the worst 1.50, ar on prompt 2" in line


def test_one_round_records_are_as_before():
    assert results.round_noise([rec("ar", 0, 10.0)]) is None
    assert report.rounds_line({"records": [rec("ar", 0, 10.0)]}) is None


def test_sampling_runner_scores_ppl_per_data_set_reproducibly(tmp_path, prompt_file):
    """Sampling protocol on two data sets: same seed for every variant on a prompt, PPL scored,
    tokens not compared with ar, and a rerun reproduces every token."""
    other = tmp_path / "other.txt"
    other.write_text("w3 w4 w3 w4 w3\n\nw20 w21 w22 w20 w21 w22\n\nw7 w7 w8 w7 w7 w8")
    target = tiny("llama", eos_ids=[])
    variants = [v for v in presets.variants("wetap-main", "small", ["ngram"])]
    proto = runner.Protocol(dataset=f"{prompt_file},{other}", n=3, warmup=1, max_new_tokens=[10], sample=True,
                            temperature=1.0, top_k=10, top_p=0.9, seed=5)
    res = runner.run("wetap-main", variants, proto, target, {}, progress=False)
    assert {r["dataset"] for r in res["records"]} == {str(prompt_file), str(other)}
    assert len(res["records"]) == len(variants) * (3 + 2)  # warm-up in the first data set only
    for r in res["records"]:
        assert r["matches_ar"] is None and r["ppl"] > 1.0 and r["seed"] == 5 + r["prompt_index"]
        st = r["stats"]
        assert st["mean_generated_len"] == pytest.approx((st["new_tokens"] - 1) / (st["iterations"] - 1))
    assert {(a["variant"], a["dataset"]) for a in res["aggregates"]} == {
        (v.label, d) for v in variants for d in (str(prompt_file), str(other))}
    again = runner.run("wetap-main", variants, proto, target, {}, progress=False)
    assert [r["tokens_sha1"] for r in again["records"]] == [r["tokens_sha1"] for r in res["records"]]


def test_perplexity_is_the_targets_teacher_forced_loss():
    target = tiny("gpt2")
    prompt, new = [5, 6, 7, 8], [9, 10, 11]
    ids = torch.tensor([prompt + new], device=target.device)
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    with torch.no_grad():
        loss = target.model(input_ids=ids, labels=labels).loss  # transformers scores in float32
        nll = [-torch.log_softmax(target.model(torch.tensor([prompt + new[:i]], device=target.device)).logits[0, -1].double(), -1)[tok]
               for i, tok in enumerate(new)]  # one prefix at a time, float64
    assert perplexity(target, prompt, new) == pytest.approx(math.exp(float(sum(nll)) / len(new)), rel=1e-9)
    assert perplexity(target, prompt, new) == pytest.approx(math.exp(float(loss)), rel=1e-5)
    assert perplexity(target, prompt, []) is None


def test_bench_sweep_report_commands(tmp_path, prompt_file, saved_tiny, capsys):
    out = tmp_path / "main"
    code = main(["bench", "--preset", "main", "--scale", "small", "--target", str(saved_tiny), "--dataset",
                 str(prompt_file), "--n", "2", "--warmup", "1", "--max-new-tokens", "6", "--out", str(out),
                 "--no-progress", "--k", "3"])
    stdout = capsys.readouterr().out
    assert code == 0 and "| dynatree | ngram |" in stdout
    res = results.load(out)
    assert next(v for v in res["variants"] if v["label"] == "linear")["config"]["k"] == 3
    (out / "report.md").unlink()
    assert main(["report", str(out)]) == 0 and (out / "report.md").exists()

    sweep_out = tmp_path / "sweep"
    code = main(["sweep", "--method", "fixed-tree", "--depth", "1,2", "--branch", "1,2", "--tau", "0.1",
                 "--target", str(saved_tiny), "--dataset", str(prompt_file), "--n", "2", "--warmup", "0",
                 "--max-new-tokens", "5", "--out", str(sweep_out), "--no-progress"])
    assert code == 0
    res = results.load(sweep_out)
    assert [v["label"] for v in res["variants"]][1:] == ["depth=1 branch=1 tau=0.1", "depth=1 branch=2 tau=0.1",
                                                         "depth=2 branch=1 tau=0.1", "depth=2 branch=2 tau=0.1"]
    assert (sweep_out / "fixed_sweep.png").exists()
    assert "Best configuration" in (sweep_out / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["bench", "--preset", "nope"], "unknown preset 'nope'"),
    (["bench", "--scale", "huge"], "unknown scale 'huge'"),
    (["bench", "--n", "2", "--warmup", "2"], "need 0 <= --warmup < --n, got n=2, warmup=2"),
    (["bench", "--n", "0"], "--n must be at least 1, got 0"),
    (["bench", "--methods", "ar,hf-assisted"], "needs a draft language model"),
    (["bench", "--methods", "ar,linear", "--d0", "3"], "--d0 applies to none of the methods"),
    (["sweep", "--method", "fixed-tree", "--d0", "1,2"], "--d0 does not apply to method 'fixed-tree'"),
    (["sweep", "--method", "fixed-tree"], "give at least one option"),
    (["sweep", "--method", "nope", "--depth", "1"], "unknown method 'nope'"),
    (["bench", "--methods", "ar", "--dataset", "/nonexistent/q.jsonl"], "data set file '/nonexistent/q.jsonl' does not exist"),
    (["bench", "--methods", "ar,dynatree", "--draft", "ngram+"], "needs a draft model after 'ngram+'"),
    (["bench", "--methods", "ar,dynatree", "--draft", ","], "--draft takes comma-separated draft specs without empty"),
    (["bench", "--methods", "ar,dynatree", "--draft", ""], "--draft takes comma-separated draft specs without empty"),
    (["bench", "--methods", "ar,dynatree", "--draft", "ngram,,x"], "without empty items"),
    (["sweep", "--method", "fixed-tree", "--depth", "1", "--draft", ","], "without empty items"),
    (["bench", "--methods", "ar", "--dataset", "/dev/null"], "data set '/dev/null' is not a regular file"),
    (["bench", "--methods", ""], "--methods needs a comma-separated list of methods"),
    (["bench", "--methods", " , "], "--methods needs a comma-separated list of methods"),
    (["bench", "--methods", "ar,hf-lookup", "--draft", "x"], "--draft 'x' is used by no variant of this run"),
    (["bench", "--preset", "ablation", "--draft", "ngram,x"], "--draft 'x' is used by no variant"),
    (["sweep", "--method", "fixed-tree", "--depth", "1", "--draft", "ngram,x"], "sweep takes one --draft, got 2"),
    (["sweep", "--depth", "1,x"], "invalid int value 'x'"),
    (["report", "/nonexistent/dir"], "no results file"),
    (["bench", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["bench", "--temperature", "0.5"], "temperature (--temperature) applies only with sample=True (--sample)"),
    (["bench", "--preset", "wetap-main", "--top-p", "1.5"], "top_p (--top-p) must be in (0, 1]"),
    (["bench", "--preset", "wetap-main", "--temperature", "0"], "temperature (--temperature) must be > 0"),
    (["bench", "--preset", "wetap-main", "--top-k", "0"], "top_k (--top-k) must be at least 1"),
    (["bench", "--preset", "wetap-main", "--alpha", "2"], "--alpha must be in [0, 1]"),
    (["bench", "--preset", "wetap-main", "--w-min", "64", "--w-max", "16"], "--w-min must not exceed --w-max"),
    (["bench", "--preset", "wetap-gamma", "--gamma", "-1"], "--gamma must be > 0"),
    (["bench", "--preset", "perf", "--cost-aware"],  # the preset has plain and +cost-aware dynatree rows
     "--cost-aware True conflicts with preset 'perf': its variant 'dynatree[ngram] +cost-aware' sets cost_aware=True"),
    (["bench", "--preset", "fixed-sweep", "--depth", "3"],  # never silently overridden by the preset
     "--depth 3 conflicts with preset 'fixed-sweep': its variant 'D=4 B=2 tau=0.01' sets depth=4"),
    (["bench", "--sample", "--greedy"], "not allowed with argument"),
    (["bench", "--preset", "draft", "--target", "EleutherAI/pythia-2.8b"], "the draft preset needs a draft LM"),
    (["bench", "--methods", "ar,dynatree", "--draft", "ngram,x", "--headline", "dynatree"],
     "--headline 'dynatree' is not a variant of this run; its rows: 'ar', 'dynatree[ngram]', 'dynatree[x]'"),
    (["bench", "--preset", "main", "--headline", "dynatree"],
     "--headline applies to --methods runs: preset 'main' declares its own headline"),
    (["bench", "--preset", "fixed-sweep", "--headline", "x"],
     "--headline applies to --methods runs: preset 'fixed-sweep' is a sweep and declares none"),
    (["bench", "--methods", "ar,dynatree", "--headline", "ar"], "--headline 'ar' is a reference row"),
    (["bench", "--methods", "hf-ar,hf-lookup", "--compile", "--headline", "hf-ar"],  # labelled as the report prints it
     "--headline 'hf-ar' is not a variant of this run; its rows: 'ar', 'hf-ar +compile', 'hf-lookup'"),
    (["bench", "--methods", "hf-ar,hf-lookup", "--compile", "--headline", "hf-ar +compile"],
     "--headline 'hf-ar +compile' is a reference row"),
])
def test_bench_bad_input(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_cost_aware_given_to_a_preset_relabels_its_rows(monkeypatch):
    """Issue 37 item 7: `bench --preset main --cost-aware` rows are 'dynatree +cost-aware', not plain 'dynatree'."""
    seen = {}
    monkeypatch.setattr(commands, "_execute", lambda args, experiment, variants, protocol, headline: seen.update(
        {v.label: v.options for v in variants}, headline=headline) or 0)
    assert main(["bench", "--preset", "main", "--cost-aware", "--draft", "ngram"]) == 0
    assert seen["dynatree +cost-aware"] == {"cost_aware": True} and "dynatree" not in seen
    assert seen["headline"] == "dynatree +cost-aware"  # declared from the rows as they will run
    seen.clear()  # the perf preset's own compiled cost-aware rows keep their one suffix
    assert main(["bench", "--preset", "perf", "--draft", "ngram"]) == 0
    assert "dynatree +cost-aware +compile" in seen and not [k for k in seen if k.count("+cost-aware") > 1]


def test_a_custom_method_list_declares_its_headline_before_the_run(monkeypatch, saved_tiny, prompt_file, tmp_path):
    """`--methods ... --headline LABEL`: the row declared before the run is recorded (results.json's
    `declared`) and the report leads with it; without --headline a custom list declares none."""
    seen = {}
    monkeypatch.setattr(commands, "_execute", lambda args, experiment, variants, protocol, headline: seen.update(
        headline=headline) or 0)
    assert main(["bench", "--methods", "ar,dynatree", "--draft", "ngram", "--cost-aware", "--compile",
                 "--headline", "dynatree +cost-aware"]) == 0
    assert seen["headline"] == "dynatree +cost-aware"
    assert main(["bench", "--methods", "hf-ar,hf-lookup", "--compile", "--headline", "hf-lookup"]) == 0
    assert seen["headline"] == "hf-lookup"
    assert main(["bench", "--methods", "ar,dynatree"]) == 0 and seen["headline"] is None
    monkeypatch.undo()
    out = tmp_path / "run"
    assert main(["bench", "--target", str(saved_tiny), "--methods", "ar,linear,dynatree", "--headline", "linear",
                 "--dataset", str(prompt_file), "--n", "2", "--warmup", "0", "--max-new-tokens", "4", "--no-ppl",
                 "--no-progress", "--out", str(out)]) == 0
    assert results.load(out)["declared"] == "linear"
    assert ("- declared configuration (before the run, the headline; every other row is for comparison): `linear`"
            in (out / "report.md").read_text())


def test_method_variants_label_cost_aware_rows_as_presets_do():
    """Issue 37 item 7: `bench --methods dynatree --cost-aware` rows say +cost-aware, like the presets' rows."""
    labels = [v.label for v in presets.method_variants(["ar", "dynatree", "linear"], ["ngram", "x"],
                                                       {"dynatree": {"cost_aware": True}})]
    assert labels == ["ar", "dynatree[ngram] +cost-aware", "dynatree[x] +cost-aware", "linear[ngram]", "linear[x]"]


def test_windowed_variants_are_checked_against_windowed_ar(tmp_path, prompt_file):
    target = tiny("gpt_neox", eos_ids=[])
    variants = presets.variants("streaming", "small", ["ngram"])
    variants = [runner.Variant(v.label, v.method, v.options, v.draft, v.tags,
                               (" 2, 6" if v.method == "ar" else "2,6") if v.kv_window else None) for v in variants]
    variants.append(runner.Variant("linear + window 1,4", "linear", {}, "ngram", {}, "1,4"))  # no ar under 1,4
    proto = runner.Protocol(dataset=str(prompt_file), n=2, warmup=0, max_new_tokens=[20], l_max=[800])
    res = runner.run("streaming", variants, proto, target, {}, progress=False)
    # one window written two ways is recorded one way, in the variants' list and in their records
    assert {v["label"]: v["kv_window"] for v in res["variants"]}["ar + window 4,508"] == "2,6"
    by_variant = {r["variant"]: r for r in res["records"] if r["prompt_index"] == 0}
    assert by_variant["dynatree + window 4,508"]["matches_ar"] is True  # compared with "ar + window"
    assert by_variant["dynatree"]["matches_ar"] is True
    assert by_variant["linear + window 1,4"]["matches_ar"] is None
    assert by_variant["ar + window 4,508"]["kv_window"] == "2,6"
    assert "Not checked (no `ar` run under the same KV window): linear + window 1,4" in report.exactness(res)


# ---------------------------------------------------------------- draft models (issue 6)
def test_draft_agreement_and_step_cost():
    from dynatree.bench import draftcheck

    target = tiny("llama", seed=2, dtype=torch.float32)
    prompt, new = [5, 6, 7, 8], [9, 10, 11, 12, 13, 14]
    assert draftcheck.agreement(target, target, prompt, new) == 1.0
    other = tiny("gpt2", seed=7, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([prompt + new[:-1]], device=target.device)
        t = target.model(ids).logits[0, -6:].argmax(-1).cpu()
        o = other.model(ids).logits[0, -6:].argmax(-1).cpu()
    assert draftcheck.agreement(target, other, prompt, new) == pytest.approx((t == o).float().mean().item())
    ppl, picks = teacher_forced(target, prompt, new)  # the bench's ppl pass gives the target's picks too
    assert picks == t.tolist() and ppl == perplexity(target, prompt, new)
    assert draftcheck.agreement(target, other, prompt, new, picks) == draftcheck.agreement(target, other, prompt, new)
    assert draftcheck.agreement(target, other, prompt, new, o.tolist()) == 1.0  # picks are used as given
    cost = draftcheck.step_costs(target, other, prompt + new, steps=4)
    assert cost["target_ms"] > 0 and cost["draft_ms"] > 0
    assert cost["cost_ratio"] == pytest.approx(cost["draft_ms"] / cost["target_ms"])


def test_draft_preset_measures_each_draft_and_compares_with_ngram_and_assisted(tmp_path, prompt_file, monkeypatch):
    from dynatree.bench import draftcheck

    given = []  # the target's picks come from the ppl pass: no second teacher-forced target pass
    measure = draftcheck.measure
    monkeypatch.setattr(draftcheck, "measure", lambda t, d, p, n, picks=None: given.append(picks) or measure(t, d, p, n, picks))
    target = tiny("llama", eos_ids=[])
    variants = presets.variants("draft", "small", ["ngram", "tiny-draft"])
    assert {v.label for v in variants} == {"ar", "linear[ngram]", "linear[tiny-draft]", "dynatree[ngram]",
                                           "dynatree[tiny-draft]", "hf-lookup", "hf-assisted",
                                           "dynatree[ngram] +cost-aware", "dynatree[tiny-draft] +cost-aware"}
    assert [v.options for v in variants if v.label.endswith("+cost-aware")] == [{"cost_aware": True}] * 2
    proto = runner.Protocol(dataset=str(prompt_file), n=3, warmup=1, max_new_tokens=[8])
    res = runner.run("draft", variants, proto, target, {"tiny-draft": target}, out_dir=tmp_path, progress=False)
    quality = res["draft_quality"]
    assert [(q["draft"], q["prompt_index"], q["warmup"]) for q in quality] == [
        ("tiny-draft", 0, True), ("tiny-draft", 1, False), ("tiny-draft", 2, False)]
    assert all(q["agreement"] == 1.0 and q["cost_ratio"] > 0 for q in quality)  # the target drafting for itself
    assert len(given) == 3 and all(len(picks) == 8 for picks in given)
    assert all(r["matches_ar"] for r in res["records"])
    assert {(r["method"], r["draft_weights"]) for r in res["records"] if r["draft"] == target.name} == {
        ("dynatree", "dense"), ("linear", "dense"), ("hf-assisted", None)}  # the draft model's format (ours only)
    assert {r["draft_weights"] for r in res["records"] if r["draft"] in (None, "ngram")} == {None}
    section = report.draft_section(res, 8, 800)
    assert "Draft `tiny-draft` (2 prompts): top-1 agreement with the target 100.0%" in section
    assert "| dynatree[tiny-draft] |" in section and "| linear[tiny-draft] |" in section
    assert "vs hf-assisted with this draft (hf-assisted)" in section
    aggs = {a["variant"]: a for a in results.at(res, 8, 800)}
    spec = {v["label"]: v["draft"] for v in res["variants"]}
    pairs = {a: report._ngram_twin(aggs[a], list(aggs.values()), spec)
             for a in ("dynatree[tiny-draft]", "dynatree[tiny-draft] +cost-aware")}
    assert pairs == {"dynatree[tiny-draft]": "dynatree[ngram]",  # each against its own config
                     "dynatree[tiny-draft] +cost-aware": "dynatree[ngram] +cost-aware"}
    assert "**Draft models**" in report.render(results.load(tmp_path))
    with pytest.raises(DynaTreeError, match="needs a draft language model"):
        presets.variants("draft", "small", ["ngram"])


@pytest.mark.parametrize("preset", ["draft", "perf"])
def test_draft_and_perf_presets_default_to_ngram_the_shipped_draft_and_both_together(preset, saved_tiny):
    """`bench --preset draft|perf` on the embedded target, no --draft: each drafter alone and the hybrid."""
    from dynatree.bench.commands import _drafts
    from dynatree.cli import build_parser

    args = build_parser().parse_args(["bench", "--preset", preset])
    assert _drafts(args) == ["ngram", "smollm2-135m-draft", "ngram+smollm2-135m-draft"]
    args = build_parser().parse_args(["bench", "--preset", preset, "--draft", "ngram,x"])
    assert _drafts(args) == ["ngram", "x"]  # an explicit --draft list is taken as given
    args = build_parser().parse_args(["bench", "--preset", "main"])
    assert _drafts(args) == ["ngram"]
    if preset == "perf":  # a target without a shipped draft: the n-gram drafter alone (draft: an error, below)
        args = build_parser().parse_args(["bench", "--preset", preset, "--target", str(saved_tiny)])
        assert _drafts(args) == ["ngram"]


def test_phase_times_per_iteration_add_up_to_at_most_the_decode_time():
    target = tiny("llama", seed=4)
    out = api.generate(method="dynatree", target=target, draft="ngram", prompt_ids=[5, 9, 14, 9, 5, 9, 14, 30],
                       max_new_tokens=30, ignore_eos=True)
    s = out.stats
    phases = [s.draft_ms, s.verify_ms, s.commit_ms]
    assert all(p > 0 for p in phases)
    assert sum(phases) * (s.iterations - 1) <= 1e3 * (s.wall_s - s.ttft_s)
    hf = api.generate(method="hf-ar", target=target, prompt_ids=[5, 9], max_new_tokens=3, ignore_eos=True).stats
    assert hf.draft_ms is None and hf.verify_ms is None
    md = report.main_tables([{**agg, "mean": {**agg["mean"], "draft_ms": 0.25, "verify_ms": 60.0, "commit_ms": 1.5},
                              "std": {**agg["std"], "draft_ms": 0.05, "verify_ms": 2.0, "commit_ms": 0.5}}
                             for agg in results.aggregate([rec("ar", 0, 10.0)])])
    assert "| ms/iter: draft | verify | commit |" in md and "| 0.25 ± 0.05 | 60.00 ± 2.00 | 1.50 ± 0.50 |" in md


def test_the_exactness_line_sets_other_engines_and_dense_16_bit_apart():
    """llama.cpp's tokens may differ (another engine); dense 16-bit mismatches are expected and
    named as such; anything else is flagged for investigation."""
    agg = [{"variant": "dynatree[ngram]", "method": "dynatree", "mismatches": 2, "n": 3, "max_new_tokens": 64},
           {"variant": "llamacpp-ar", "method": "llamacpp-ar", "mismatches": 3, "n": 3, "max_new_tokens": 64}]
    res = {"protocol": {}, "aggregates": agg, "weights": "dense", "dtype": "float32"}
    line = report.exactness(res)
    assert line.startswith("Exactness: tokens differ from `ar` in dynatree[ngram] (2/3 prompts, T=64). In float32")
    assert "llama.cpp decodes with its own numerics, so its tokens may differ from `ar`'s: llamacpp-ar 3/3 prompts" in line
    assert "expected with dense bfloat16 weights" in report.exactness({**res, "dtype": "bfloat16"})
    agg[0]["mismatches"] = 0
    assert report.exactness(res).startswith("Exactness: every measured run (llama.cpp aside) produced exactly")


def test_a_compiled_only_run_checks_exactness_against_compiled_ar(tmp_path, prompt_file):
    """With --compile every variant of ours is compiled: each is compared with `ar +compile`
    (before, nothing was compared when no eager `ar` ran)."""
    target = tiny("llama", eos_ids=[])
    variants = [runner.Variant("ar", "ar", compile=True),
                runner.Variant("dynatree[ngram]", "dynatree", {}, "ngram", {}, compile=True),
                runner.Variant("hf-ar", "hf-ar")]
    proto = runner.Protocol(dataset=str(prompt_file), n=2, warmup=0, max_new_tokens=[12], l_max=[800])
    res = runner.run("custom", variants, proto, target, {}, progress=False)
    assert {r["variant"]: r["matches_ar"] for r in res["records"] if r["prompt_index"] == 0} == {
        "ar": True, "dynatree[ngram]": True, "hf-ar": True}


def test_other_processes_cpu_is_read_from_the_first_tokens_to_the_end(monkeypatch):
    """`other_cpu`: the machine's CPU time minus this process's, per second of decoding, from the run's
    first streamed tokens (compiling, before the clock, may use worker processes) to its end; None for
    windows too short for /proc/stat's ticks. On a scripted clock and scripted readings."""
    from types import SimpleNamespace

    from dynatree import env

    real = env.cpu_seconds
    now, readings = [100.0], iter([(50.0, 10.0), (54.0, 12.5), (60.0, 13.0)])  # machine +4 CPU-s, this process +2.5
    monkeypatch.setattr(env, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(env, "cpu_seconds", lambda: next(readings))
    seen = []
    watch = env.OtherCpu(seen.extend)
    assert watch.result() is None  # no tokens yet: nothing decoded
    watch([5, 6])
    now[0] += 2.0
    watch([7])
    assert seen == [5, 6, 7] and watch.result() == pytest.approx(0.75)  # (4 - 2.5) / 2
    short = env.OtherCpu(seen.extend)
    short([8])
    now[0] += 0.5
    assert short.result() is None  # under a second: ticks of 10 ms would make it noise
    assert env.other_cpu((1.0, 1.0), (2.0, 2.5), 1.0) == 0.0  # never negative (readings race)
    assert env.other_cpu(None, (2.0, 2.5), 1.0) is None
    first, second = real(), real()  # this machine's readings (Linux)
    assert first is not None and second[0] >= first[0] and second[1] >= first[1]


def test_contention_advice_names_the_autogroup_where_the_kernel_groups_sessions(tmp_path, monkeypatch):
    """Where each session is scheduled as one group, `nice` in another terminal does not lower a job:
    the advice says how to (the group's niceness); elsewhere it does not mention it."""
    from dynatree import env

    flag = tmp_path / "sched_autogroup_enabled"
    monkeypatch.setattr(env, "AUTOGROUP", str(flag))
    assert env.contention_advice() == "stop them or measure when the machine is idle"  # no such file: not Linux
    flag.write_text("1\n")
    assert "echo 19 > /proc/PID/autogroup" in env.contention_advice()
    flag.write_text("0\n")
    assert "autogroup" not in env.contention_advice()


def test_the_report_warns_when_runs_shared_the_cpu():
    records = [{"warmup": False, "variant": v, "prompt_index": i, "other_cpu": busy}
               for i, (v, busy) in enumerate([("ar", 0.02), ("dynatree", 0.05), ("ar", 0.9), ("dynatree", 0.04)])]
    records.append({"warmup": True, "variant": "ar", "prompt_index": 9, "other_cpu": 1.5})  # warm-ups not counted
    line = report.contention_line({"records": records, "env": {"cpu_count": 2}})
    assert line.startswith("- other processes on the machine while runs decoded: median 0.05, at most 0.90 "
                           "CPUs' worth (of 2), over 4 runs")
    assert "**Warning: 1 of 4 runs shared the CPU with other processes" in line and "ar on prompt 3" in line
    quiet = [dict(r, other_cpu=0.01) for r in records[:4]]
    assert "Warning" not in report.contention_line({"records": quiet, "env": {"cpu_count": 2}})
    assert report.contention_line({"records": [dict(r, other_cpu=None) for r in records], "env": {}}) is None


def test_peak_memory_is_none_where_the_peak_cannot_be_reset(monkeypatch):
    """A process-lifetime peak would count earlier runs' and model loads' memory as this run's."""
    from dynatree import stats

    assert stats.PeakMemory(torch.device("cpu")).peak_mb() > 0  # Linux: the kernel's high-water mark, reset
    monkeypatch.setattr(stats, "_reset_rss_peak", lambda: False)
    assert stats.PeakMemory(torch.device("cpu")).peak_mb() is None


def test_a_run_without_memory_figures_reports_and_plots_the_rest(tmp_path):
    """Where the peak could not be measured (no resettable high-water mark: peak_mem_mb None), the
    report and plots are made without the memory plot instead of failing."""
    fixed = fixed_results("length")
    for r in fixed["records"]:
        r["stats"]["peak_mem_mb"] = None
    fixed["aggregates"] = results.aggregate(fixed["records"])
    results.save(fixed, tmp_path)
    names = {p.name for p in report.write(tmp_path)}
    assert "throughput.png" in names and "memory.png" not in names and "report.md" in names
