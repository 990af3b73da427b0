"""`dynatree bench`, `dynatree sweep` and `dynatree report`."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

from ..draftspec import HYBRID, NGRAM, parse
from ..cli_args import given_method_options
from ..config import cli_flag
from .. import env
from ..errors import DynaTreeError, check_out_dir
from ..sampling import sampling_config
from ..methods import get_method, make_config
from ..prompts import DATASETS, L_MAX, SPEC_BENCH_TASKS
from .presets import PRESETS, dataset_default, declared, method_variants, protocol_defaults, sampling_defaults, variants
from .results import PLAIN_METHODS, at, datasets, load, marked_lossy, settings
from .plan import Protocol, Variant, check_declared, check_variants

DRAFT_HELP = ("comma-separated drafters: 'ngram', draft model specs sharing the target's tokenizer, feature heads "
              "(smollm2-135m-eagle, or a directory from distill --kind eagle), and/or 'ngram+DRAFT' (n-gram copying "
              "backed by the draft), 'ngram+STORE[+DRAFT]' (with a datastore: smollm2-135m-store, or a directory "
              "from distill --kind store) [ngram]")

SWEEP_DRAFT_HELP = ("the one drafter every combination drafts with: 'ngram', a draft model, a feature head, "
                    "'ngram+DRAFT' or 'ngram+STORE[+DRAFT]' (as in bench; one sweep per drafter) [ngram]")


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _protocol_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("protocol (defaults come from the preset and --scale)")
    g.add_argument("--scale", default="paper",
                   help="paper: the papers' protocol (N=10, W=2, T=1500 for the DynaTree presets; T=1024 for wetap-*; "
                        "N=22, T=256 for perf and draft; N=3, W=1 for streaming) or small: minutes on a CPU (N 2-6, "
                        "W 1, T 32-256; streaming up to 4096) [paper]")
    g.add_argument("--dataset",
                   help=f"{', '.join(DATASETS)}, specbench:TASK[,TASK] (tasks: {', '.join(SPEC_BENCH_TASKS)}), or a "
                        "prompts file (.jsonl of Spec-Bench questions or {\"prompt\": ...} rows, or plain text); "
                        "several comma-separated; Spec-Bench: --n questions per task "
                        "[wikitext2; humaneval for draft; mtbench,humaneval,gsm8k for the wetap-* presets]")
    g.add_argument("--n", type=int, help="prompts, warm-up included [from --preset and --scale]")
    g.add_argument("--warmup", type=int,
                   help="first prompts run but excluded from the aggregates [from --preset and --scale]")
    g.add_argument("--max-new-tokens", type=_ints, metavar="T[,T...]",
                   help="new tokens per run (several: length scaling) [from --preset and --scale]")
    g.add_argument("--l-max", type=_ints, metavar="L[,L...]",
                   help="prompt cap in tokens (several: prompt-length sensitivity) [800; 1000 for pg19; 4096 for specbench, "
                        "mtbench and gsm8k]")
    g.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="runs of every variant on every prompt, interleaved; a record keeps the median run (of an even "
                        "R the slower middle one) and every run's throughput, and the report gives their spread: the "
                        "timing noise of the run itself [1]")
    g.add_argument("--keep-eos", action="store_true", help="stop at EOS instead of forcing T tokens")
    g.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    g.add_argument("--turns", choices=("first", "all"), default="first",
                   help="multi-turn questions (Spec-Bench's MT-Bench rows): the first turn only, or every turn, "
                        "each asked after the earlier turns and the variant's own answers to them (needs --chat) [first]")
    g.add_argument("--min-chars", type=int, help="drop prompts shorter than this many characters [200 for prose sets]")
    g.add_argument("--kv-window", metavar="SINK,RECENT", help="attention-sink KV window for every variant [none]")
    s = p.add_argument_group("sampling (greedy unless --sample; the wetap-* presets sample at temperature 1, "
                             "top-k 10, top-p 0.9 unless --greedy)")
    mode = s.add_mutually_exclusive_group()
    mode.add_argument("--sample", action="store_true", default=None,
                      help="sample (lossless verification, except wetap --verify beam and mtad)")
    mode.add_argument("--greedy", action="store_true", help="greedy decoding even for a sampling preset")
    s.add_argument("--temperature", type=float, help="softmax temperature (> 0) [1.0]")
    s.add_argument("--top-k", type=int, help="keep the k most probable tokens (>= 1) [off]")
    s.add_argument("--top-p", type=float, help="nucleus: keep the most probable tokens up to mass top_p, in (0, 1] [off: 1.0]")
    s.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i by every variant [0]")
    g.add_argument("--no-ppl", action="store_true", help="do not score continuations' perplexity under the target")
    g.add_argument("--out", type=Path, help="results directory [runs/<experiment>-<time>]")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_bench_commands(sub) -> None:
    from ..cli_args import add_model_args, method_options

    bench = sub.add_parser("bench", help="run a benchmark preset or a list of methods",
                           description="Run the papers' experiments (presets) or any list of methods on a data set; "
                                       "writes results.json, report.md and plots.")
    bench.add_argument("--preset", default="main", help=f"{', '.join(PRESETS)} [main]")
    bench.add_argument("--methods", metavar="M1,M2", help="run these methods instead of the preset's variants ('ar' is added)")
    bench.add_argument("--headline", metavar="LABEL",
                       help="with --methods: the variant declared before the run, by its label as the report prints it "
                            "(e.g. 'dynatree +cost-aware'; with several drafters 'dynatree[ngram] +cost-aware'); "
                            "the report leads with it [none] (presets declare their own)")
    add_model_args(bench, DRAFT_HELP)
    _protocol_args(bench)
    bench.set_defaults(method_fields=method_options(bench), run=cmd_bench)

    sweep = sub.add_parser("sweep", help="run a grid over one method's options",
                           description="Every combination of the comma-separated option values, next to 'ar'. "
                                       "Example: dynatree sweep --method fixed-tree --depth 4,6,8 --branch 2,3 --tau 0.05,0.1 --dataset specbench")
    sweep.add_argument("--method", default="fixed-tree", help="the method whose options are swept [fixed-tree]")
    add_model_args(sweep, SWEEP_DRAFT_HELP)
    _protocol_args(sweep)
    sweep.set_defaults(method_fields=method_options(sweep, as_lists=True), run=cmd_sweep)

    report = sub.add_parser("report", help="rebuild report.md and plots from a results directory")
    report.add_argument("directory", type=Path, help="directory holding results.json")
    report.set_defaults(run=cmd_report)


def _protocol(args, preset: str) -> Protocol:
    n, warmup, t_values, l_values = protocol_defaults(preset, args.scale)
    dataset = args.dataset or dataset_default(preset) or "wikitext2"
    l_default = [max(L_MAX.get(d.strip().partition(":")[0], 800) for d in dataset.split(","))]
    defaults = sampling_defaults(preset) if not args.greedy else None
    sample = bool(args.sample) or defaults is not None
    if not sample:
        sampling_config(False, args.temperature, args.top_k, args.top_p)  # names the options given, if any
    defaults = defaults or {}
    n_prompts = args.n if args.n is not None else n
    return Protocol(
        dataset=dataset,
        n=n_prompts,
        warmup=args.warmup if args.warmup is not None else min(warmup, max(n_prompts - 1, 0)),
        max_new_tokens=args.max_new_tokens or t_values,
        l_max=args.l_max or l_values or l_default,
        ignore_eos=not args.keep_eos,
        chat=args.chat,
        turns=args.turns,
        min_chars=args.min_chars,
        kv_window=args.kv_window,
        sample=sample,
        temperature=args.temperature if args.temperature is not None else defaults.get("temperature"),
        top_k=args.top_k if args.top_k is not None else defaults.get("top_k"),
        top_p=args.top_p if args.top_p is not None else defaults.get("top_p"),
        seed=args.seed,
        repeats=args.repeats,
        ppl=not args.no_ppl,
        bandwidth_limit=preset == "perf",
    )


def _drafts(args) -> list[str]:
    preset = getattr(args, "preset", None)
    if args.draft is None and preset in ("draft", "perf") and not getattr(args, "methods", None):
        from ..embedded import DEFAULT_DRAFTS

        if args.target in DEFAULT_DRAFTS:
            shipped = DEFAULT_DRAFTS[args.target]
            return [NGRAM, shipped, HYBRID + shipped]  # each drafter alone, and the two together
        if preset == "draft":
            raise DynaTreeError(f"the draft preset needs a draft LM for {args.target!r}: pass --draft ngram,MODEL "
                                "(train one with `dynatree distill`)")
    if args.draft is None:
        return [NGRAM]
    items = [d.strip() for d in args.draft.split(",")]
    if not any(items) or not all(items):
        raise DynaTreeError(f"--draft takes comma-separated draft specs without empty items, got {args.draft!r}")
    return list(dict.fromkeys(parse(item).text for item in items))  # canonical ('auto' is 'ngram'); bad ones named now


def _check_drafts_used(args, drafts: list[str], variant_list: list[Variant]) -> None:
    """A --draft the user gave that no variant of the run drafts with is an error, never dropped."""
    if args.draft is None:
        return
    used = {v.draft for v in variant_list}
    unused = [d for d in drafts if d not in used]
    if unused:
        raise DynaTreeError(f"--draft {unused[0]!r} is used by no variant of this run (its methods "
                            f"{', '.join(dict.fromkeys(v.method for v in variant_list))} draft with "
                            f"{', '.join(sorted(filter(None, used))) or 'nothing'}); drop it or add a method that drafts")



def _execute(args, experiment: str, variant_list: list[Variant], protocol: Protocol,
             headline: str | None = None) -> int:
    from ..draftload import Draft, load_draft, load_store
    from ..models import check_findable, load_model
    from . import report, runner
    drafts = [parse(d) for d in _drafts(args)]  # a bad spec fails before any model loads
    check_variants(variant_list)
    protocol.validate()
    texts = runner.load_all(protocol)  # fail fast, before loading models
    out = args.out or Path("runs") / f"{experiment}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_out_dir(out)
    for spec in drafts:
        if spec.model is not None:
            check_findable(spec.model)  # a mistyped draft is named before the target loads
    target = load_model(args.target, device=args.device, dtype=args.dtype, linear=args.linear, weights=args.weights)
    loaded, models, stores = {}, {}, {}
    for spec in drafts:
        model = store = None
        if spec.model is not None:
            if spec.model not in models:  # one copy of a draft LM (or feature head) used alone and in ngram+
                models[spec.model] = load_draft(spec.model, target, args.linear).model
            model = models[spec.model]
        if spec.store is not None:
            if spec.store not in stores:  # one copy of a datastore used alone and beside a model
                stores[spec.store] = load_store(spec.store, target)
            store = stores[spec.store]
        loaded[spec.text] = Draft(ngram=spec.ngram, model=model, target=target, store=store)
    runner.run(experiment, variant_list, protocol, target, loaded, out_dir=out, progress=not args.no_progress,
               command=["dynatree", *args.argv], texts=texts, declared=headline)
    paths = report.write(out)
    results = load(out)
    setting = max(settings(results))
    if any(v["label"] == "hf-ar" for v in results["variants"]):
        print(report.perf_section(results, *setting) + "\n")
    if results.get("draft_quality"):
        print(report.draft_section(results, *setting) + "\n")
    tasks = report.category_table(results, *setting)
    if tasks:
        print(tasks + "\n")
    if results["protocol"].get("ppl") or len(datasets(results)) > 1:
        print(report.quality_table(results, *setting) + "\n")
    sets, marked = datasets(results), marked_lossy(results)
    for t_new, l_max in settings(results):  # every data set and setting, each labelled
        for dataset in sets:
            print(f"-- {dataset}, T = {t_new}, L_max = {l_max}")
            print(report.main_tables(at(results, t_new, l_max, dataset), marked, report.on_gpu(results))
                  .split("\n\n**Latency**")[0])
    print(report.declared_line(results).removeprefix("- "))
    busy = report.contention_line(results)
    if busy and "Warning" in busy:  # said where the figures are read, not only in the report
        print(busy.removeprefix("- ").replace("**", "") + f" ({env.contention_advice()})", file=sys.stderr)
    print(f"\nwrote {', '.join(str(p) for p in [out / 'results.json', *paths])}")
    return 0


def cmd_bench(args) -> int:
    drafts = _drafts(args)
    given = given_method_options(args)
    if args.methods is not None:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods:
            raise DynaTreeError(f"--methods needs a comma-separated list of methods, got {args.methods!r}")
        methods = methods if "ar" in methods else ["ar", *methods]
        per_method = {m: {k: v for k, v in given.items() if m in args.method_fields[k]} for m in methods}
        experiment, variant_list = "custom", method_variants(methods, drafts, per_method)
    else:
        experiment, variant_list = args.preset, variants(args.preset, args.scale, drafts)
        for v in variant_list:  # command-line options apply to every variant of a method the preset leaves them to
            mine = {k: val for k, val in given.items() if v.method in args.method_fields[k]}
            make_config(v.method, **mine)  # a bad value is reported as such, before any clash with the preset
            for k, val in mine.items():  # the preset varies k for this method: giving it would relabel nothing
                setters = [w for w in variant_list if w.method == v.method and k in w.options]
                if setters and (len(setters) < sum(w.method == v.method for w in variant_list)
                                or any(w.options[k] != val for w in setters)):
                    w = next((w for w in setters if w.options[k] != val), setters[0])
                    raise DynaTreeError(
                        f"{cli_flag(k)} {val} conflicts with preset {args.preset!r}: its variant "
                        f"{w.label!r} sets {k}={w.options[k]}; run your own set with --methods instead")
            v.options = {**v.options, **mine}
            if mine.get("cost_aware") and "+cost-aware" not in v.label.split():
                v.label += " +cost-aware"  # as the presets' own cost-aware rows are labelled
    if args.compile:  # every variant that can be compiled, under its own label
        compilable = [v for v in variant_list if get_method(v.method).compilable]
        if not compilable:
            m = get_method(variant_list[0].method)
            raise DynaTreeError(f"--compile applies to none of the methods in this run ({m.name}: {m.not_compilable})")
        for v in compilable:
            v.compile = True
            if v.method.startswith("hf-"):  # transformers compiled is another baseline than as shipped: say so
                v.label += " +compile"
    unused = [k for k in given if not any(v.method in args.method_fields[k] for v in variant_list)]
    if unused:
        raise DynaTreeError(f"option {cli_flag(unused[0])} applies to none of the methods in this run")
    _check_drafts_used(args, drafts, variant_list)
    headline = _headline(args, variant_list)
    return _execute(args, experiment, variant_list, _protocol(args, args.preset if not args.methods else "main"),
                    headline)


def _headline(args, variant_list: list[Variant]) -> str | None:
    """The configuration declared before the run: a preset's own (presets.declared), or with --methods the
    one --headline names (none if not given); a label not among the run's rows is a one-line error."""
    if args.methods is None:
        own = declared(args.preset, variant_list)
        if args.headline is not None:
            raise DynaTreeError(f"--headline applies to --methods runs: preset {args.preset!r} "
                                + ("declares its own headline" if own else "is a sweep and declares none"))
        return own
    check_declared(args.headline, variant_list, "--headline")
    if args.headline is not None and next(v for v in variant_list if v.label == args.headline).method in PLAIN_METHODS:
        raise DynaTreeError(f"--headline {args.headline!r} is a reference row (the speedups are over it): "
                            "declare a method that speeds it up")
    return args.headline


def cmd_sweep(args) -> int:
    get_method(args.method)  # an unknown method is named before its options are checked
    drafts = _drafts(args)
    if len(drafts) > 1:
        raise DynaTreeError(f"sweep takes one --draft, got {len(drafts)} ({', '.join(drafts)}): run one sweep per "
                            "drafter, or compare drafters in one run with bench --methods")
    grid = given_method_options(args)
    for name in grid:
        if args.method not in args.method_fields[name]:
            raise DynaTreeError(f"option {cli_flag(name)} does not apply to method {args.method!r}")
    if not grid:
        raise DynaTreeError(f"give at least one option of {args.method!r} as a comma-separated list to sweep")
    names = list(grid)
    variant_list = [Variant("ar", "ar", compile=args.compile)]
    for values in itertools.product(*(grid[n] for n in names)):
        options = dict(zip(names, values))
        label = " ".join(f"{n}={v}" for n, v in options.items())
        variant_list.append(Variant(label, args.method, options, drafts[0], dict(options), compile=args.compile))
    _check_drafts_used(args, drafts, variant_list)
    preset = "fixed-sweep" if args.method == "fixed-tree" else "dynatree-sensitivity"
    return _execute(args, f"sweep-{args.method}", variant_list, _protocol(args, preset))


def cmd_report(args) -> int:
    from . import report

    for path in report.write(args.directory):
        print(f"wrote {path}")
    return 0
