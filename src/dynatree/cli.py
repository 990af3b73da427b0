"""Command line: `dynatree generate "PROMPT" [--method NAME] [options]`.

Method options are generated from the config dataclasses (one flag per field, e.g.
`n_max` -> `--n-max`), so the CLI and the configs cannot drift apart. Any user error
prints `dynatree: error: <one line>` and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys

from .cli_args import Parser, add_model_args, add_sampling_args, given_method_options, method_options
from .errors import DynaTreeError
from .methods import METHODS, get_method, lossy_reason
from .result import Result, Summary

EXIT_USAGE = 2


def sampling_kwargs(args) -> dict:
    return {"sample": args.sample, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}


def build_parser() -> argparse.ArgumentParser:
    from .bench.commands import add_bench_commands
    from .distill_cli import add_distill_command
    from .serve.command import add_serve_command
    from .serve.loadtest import add_bench_serve_command

    parser = Parser(prog="dynatree", description="Exact tree-based speculative decoding for HuggingFace causal LMs.")
    parser.add_argument("--version", action="version", version=f"dynatree {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    width = max(len(name) for name in METHODS)
    methods = "\n".join(f"  {m.name:{width}s}  {m.summary}" for m in METHODS.values())
    gen = sub.add_parser(
        "generate",
        help="decode one prompt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"Decode one prompt and print the text and its statistics.\n\nmethods:\n{methods}",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt text (or use --prompt-file)")
    gen.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE ('-' for stdin); one final "
                     "line end (an editor's or echo's) is dropped")
    gen.add_argument("--method", default="dynatree", help="decoding method [dynatree]")
    add_model_args(gen, "draft: 'ngram', the shipped feature head 'smollm2-135m-eagle' or draft LM "
                        "'smollm2-135m-draft' (for the default target), a draft model spec sharing the target's "
                        "tokenizer, a feature-head directory (dynatree distill --kind eagle), 'ngram+DRAFT' "
                        "(n-gram copying where the text repeats itself, the draft elsewhere), or 'ngram+STORE' / "
                        "'ngram+STORE+DRAFT' (the n-gram drafter also reading a datastore of the target's own answers, "
                        "'smollm2-135m-store' or a directory from distill --kind store) [ngram]")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most [128]")
    gen.add_argument("--ignore-eos", action="store_true", help="treat EOS as an ordinary token and generate exactly N tokens")
    gen.add_argument("--stop", action="append", metavar="TEXT", help="end at this text, printed up to just before it "
                     "(repeat for several; OpenAI's stop rule)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON record instead of the streamed text")
    gen.add_argument("--logprobs", type=int, metavar="N", help="record each new token's log-probability under the "
                     "target and the N most likely alternatives (0-20) in the JSON record (with --json)")
    gen.add_argument("--compare", metavar="M1,M2", help="also run these methods on the same prompt (each after a short untimed run of every method) and print a table")
    gen.add_argument("--seed", type=int, default=0, help="random seed [0]")
    gen.add_argument("--ngram-max", type=int, default=None, help="longest context the n-gram drafter matches [4]")
    add_sampling_args(gen)
    gen.add_argument("--kv-window", metavar="SINK,RECENT",
                     help="attention-sink KV window: keep the first SINK and the last RECENT tokens (bounded memory)")
    gen.set_defaults(method_fields=method_options(gen), run=cmd_generate)
    add_bench_commands(sub)
    add_distill_command(sub)
    add_serve_command(sub)
    add_bench_serve_command(sub)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("dynatree")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _without_final_newline(text: str) -> str:
    """A file's text without its last line end (editors and `echo` add one the user did not type)."""
    return text.removesuffix("\n")


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise DynaTreeError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt_file is None:
        if args.prompt is None:
            raise DynaTreeError("no prompt given (pass it as an argument or with --prompt-file)")
        return args.prompt
    if args.prompt_file == "-":
        try:  # the bytes, decoded strictly (the text layer may let undecodable bytes through as surrogates)
            return _without_final_newline(sys.stdin.buffer.read().decode("utf-8").replace("\r\n", "\n"))
        except UnicodeDecodeError as exc:
            raise DynaTreeError(f"the prompt on stdin is not UTF-8 text (byte {exc.start})") from None
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return _without_final_newline(f.read())
    except UnicodeDecodeError as exc:
        raise DynaTreeError(f"prompt file {args.prompt_file!r} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise DynaTreeError(f"cannot read prompt file {args.prompt_file!r}: {exc.strerror}") from None


class _Printer:
    """Prints the text a run streams (`api.run`'s `on_text`: incomplete characters and what may
    begin a stop string held back, nothing from a stop string on) as it arrives."""

    def __init__(self, out):
        self.out = out

    def __call__(self, delta: str) -> None:
        self.out.write(delta)
        self.out.flush()


def stats_line(result: Result) -> str:
    s = result.stats
    acc = "-" if s.acceptance_rate is None else f"{100 * s.acceptance_rate:.1f}%"
    tpot = "-" if s.tpot_s is None else f"{1000 * s.tpot_s:.1f} ms"
    line = (
        f"[{result.method}] {s.new_tokens} tokens in {s.wall_s:.2f} s ({s.tokens_per_s:.1f} tok/s) | "
        f"iterations {s.iterations}, L {s.tokens_per_iter:.2f}, l {s.accepted_len:.2f}, acceptance {acc} | "
        f"TTFT {1000 * s.ttft_s:.0f} ms, TPOT {tpot}"
        + ("" if s.peak_mem_mb is None else f" | peak {s.peak_mem_mb:.0f} MB")
    )
    return line + compile_note(s)


def compile_note(stats: Summary) -> str:
    """How long --compile compiled (before the clock started), and any graph compiled inside the timings."""
    if stats.compile_s is None:
        return ""
    note = f" | compiled {stats.compile_s:.1f} s before timing"
    if stats.graphs_compiled_while_timed:
        note += f" | {stats.graphs_compiled_while_timed} graph(s) compiled while timed: the figures include compiling"
    return note


def result_label(result: Result) -> str:
    """A run's method with what changes it: "+cost-aware", "+compile", "(lossy)"."""
    return (result.method + (" +cost-aware" if result.config.get("cost_aware") else "")
            + (" +compile" if result.run.compile else "") + (" (lossy)" if result.run.lossy else ""))


def comparison_table(results: list[Result]) -> str:
    """One row per method; speedup over `ar` (over the first method when ar is not compared, said in the
    header). Sampled runs are not comparable token by token: no token column, lossy rules labelled."""
    base = next((r for r in results if r.method == "ar"), results[0])
    sampled = base.run.sampling is not None
    same = "same tokens as " + result_label(base) if not sampled else "tokens (sampled)"
    rows = [("method", "draft", "tok/s", f"speedup over {result_label(base)}", "L", "accept", "TTFT ms", "TPOT ms", same)]
    for r in results:
        s = r.stats
        rows.append((
            result_label(r), r.draft or "-", f"{s.tokens_per_s:.1f}",
            f"{s.tokens_per_s / base.stats.tokens_per_s:.2f}x", f"{s.tokens_per_iter:.2f}",
            "-" if s.acceptance_rate is None else f"{100 * s.acceptance_rate:.1f}%",
            f"{1000 * s.ttft_s:.0f}", "-" if s.tpot_s is None else f"{1000 * s.tpot_s:.1f}",
            "n/a" if sampled else "yes" if r.new_token_ids == base.new_token_ids else "NO",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_generate(args) -> int:
    import dataclasses

    from . import api, env
    from .prompts import encode_prompt
    from .draftspec import parse as parse_draft
    from .draftload import load_draft
    from .peers import universal_note
    from .methods import make_config
    from .models import check_findable, load_model
    from .weights import inexact_greedy
    from .request import Request

    prompt = _read_prompt(args)
    compared = [m.strip() for m in args.compare.split(",") if m.strip()] if args.compare is not None else []
    if args.compare is not None and not compared:
        raise DynaTreeError("--compare needs a comma-separated list of methods, got an empty one")
    methods = [args.method] + compared
    repeated = sorted({m for m in methods if methods.count(m) > 1})
    if repeated:  # (one run per method: a repeat would be dropped, and with it the table)
        already = f" (--method {args.method} runs already)" if args.method in repeated else ""
        raise DynaTreeError(f"--compare repeats {', '.join(repeated)}{already}; name each method once")
    given = given_method_options(args)
    for method in methods:
        get_method(method)  # an unknown method fails before the checks below name it
    drafting = [m for m in methods if METHODS[m].draft != "none"]
    draft_spec = parse_draft(args.draft)  # a bad spec is named before any model loads
    if args.draft is not None and not drafting:
        raise DynaTreeError(f"--draft does not apply to {', '.join(methods)}: no drafter runs (drop it, or compare "
                            "with a method that drafts)")
    uses_ngram = [m for m in methods if METHODS[m].draft == "any" and METHODS[m].policy_cls is not None
                  and draft_spec.ngram]
    if args.ngram_max is not None and not uses_ngram:
        raise DynaTreeError(f"--ngram-max does not apply here: no method runs dynatree's n-gram drafter "
                            f"({', '.join(methods)}{' with --draft ' + args.draft if args.draft else ''})")

    def options_for(method: str) -> dict:
        return {k: v for k, v in given.items() if method in args.method_fields[k]}

    for name in given:
        if not any(m in args.method_fields[name] for m in methods):
            make_config(args.method, **{name: given[name]})  # raises "does not apply to method ..."
    if args.logprobs is not None and not args.json:
        raise DynaTreeError("--logprobs are written into the JSON record: add --json")
    compilable = [m for m in methods if METHODS[m].compilable]  # the others run uncompiled, labelled so
    if args.compile and not compilable:
        raise DynaTreeError(f"--compile does not apply to {methods[0]!r}: {METHODS[methods[0]].not_compilable}")
    requests = {method: Request(  # one per method, every value checked before any model loads
        prompt=prompt, method=method, options=options_for(method), target=args.target,
        draft=args.draft if method in drafting else None, max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos, stop=args.stop, logprobs=args.logprobs, chat=args.chat, device=args.device, dtype=args.dtype, weights=args.weights, seed=args.seed,
        ngram_max=args.ngram_max if method in uses_ngram else None, kv_window=args.kv_window, compile=args.compile and method in compilable, linear=args.linear,
        **sampling_kwargs(args)) for method in methods}
    checked = {method: request.check() for method, request in requests.items()}  # the one check of each
    for method in methods:
        reason = lossy_reason(checked[method].config) if args.sample else None
        if reason:
            print(f"note: {method}: {reason}", file=sys.stderr)
    if drafting and draft_spec.model is not None:
        check_findable(draft_spec.model)  # a mistyped --draft is named before the target loads, not after
    target = load_model(args.target, device=args.device, dtype=args.dtype, linear=args.linear, weights=args.weights)
    if not args.sample and any(METHODS[m].policy_cls is not None and METHODS[m].draft != "none" for m in methods):
        reason = inexact_greedy(target.dtype, target.weights, target.row_dependent)
        if reason:
            print(f"note: {reason}", file=sys.stderr)
    if target.linear_note:
        print(f"note: linear layers on stock kernels: {target.linear_note}", file=sys.stderr)
    draft = load_draft(args.draft, target, args.linear) if drafting else None  # loaded once for every method
    prompt_ids = encode_prompt(target.tokenizer, prompt, args.chat)
    jobs = {method: api.prepare(checked[method].bind(  # the loaded models and the encoded prompt
        target, draft if method in drafting else None, prompt_ids)) for method in methods}

    warm_compile: dict[str, float] = {}  # compiling done in a method's warm-up: reported with its result
    if len(methods) > 1:  # a short discarded run of each, so no measured method pays a cold start
        for method, job in jobs.items():
            warm = api.run(dataclasses.replace(job, max_new_tokens=8, ignore_eos=True))
            warm_compile[method] = warm.stats.compile_s or 0.0
    results, shared = [], []
    for i, (method, job) in enumerate(jobs.items()):
        printer = None if args.json or i > 0 else _Printer(sys.stdout)
        watch = env.OtherCpu()  # other processes slow a run of few cores without a sign in its figures
        result = api.run(job, on_tokens=watch, on_text=printer)
        busy = watch.result()
        if busy is not None and busy > env.BUSY_CPUS:
            shared.append(f"{method} ({busy:.2f})")
        if result.stats.compile_s is not None:  # compiled before the clock, in the warm-up or the run
            compiled = result.stats.compile_s + warm_compile.get(method, 0.0)
            result = dataclasses.replace(result, stats=dataclasses.replace(result.stats, compile_s=compiled))
        results.append(result)
        if printer:
            print(flush=True)
    if args.json:
        records = [r.to_json() for r in results]
        print(json.dumps(records[0] if len(records) == 1 else records, indent=None))
    elif len(results) == 1:
        print(stats_line(results[0]), file=sys.stderr)
    else:
        print(file=sys.stderr)
        print(comparison_table(results), file=sys.stderr)
    if shared:
        print(f"note: other processes used the CPU while these runs decoded (CPUs' worth of {os.cpu_count()}): "
              f"{', '.join(shared)}; their timings are not reliable ({env.contention_advice()})", file=sys.stderr)
    if any(r.run.hf_universal_assisted for r in results):
        print(f"note: {universal_note(target, draft.model)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        args = build_parser().parse_args(argv)
        args.argv = list(argv) if argv is not None else sys.argv[1:]  # recorded in result files
        return args.run(args)
    except DynaTreeError as exc:
        print(f"dynatree: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dynatree: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
