"""The benchmark protocol: every variant on every prompt, in one run, with one timer.

For each setting (T new tokens, prompt cap L_max) and each prompt, all variants run one
after the other (interleaved, so slow drifts of the machine hit every method alike), in an
order rotated by one variant per prompt. With `repeats` R > 1 every variant runs every prompt R
times, the rounds interleaved the same way (rotated by one per round): a record keeps its median
round's statistics and every round's throughput (`rounds`), whose spread is the run's own timing
noise (`results.round_noise`), and each round's tokens are checked against ar's. The
first `warmup` prompts are run (in the first setting only: warming up once is enough) and
recorded but flagged, and left out of the aggregates.
EOS is ignored by default (the papers force T tokens). Every record keeps the engine's
full statistics and the perplexity of its continuation under the target (`quality.py`).
Greedy, each variant's tokens are compared with those of an `ar` variant run under the
same KV window (if any) on the same prompt. Sampling (`sample`), every variant on a prompt
gets the same seed (protocol seed + prompt index); tokens are not compared (lossless
methods match the target's distribution, not ar's draws) and PPL is the quality measure.
Several data sets (comma-separated) run one after the other, like settings.
With draft LMs, each one's top-1 agreement with the target and the cost of one draft step
(`draftcheck.py`) are measured on ar's continuation of every prompt (`draft_quality`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

from .. import env
from ..api import prepare, run as run_one
from ..request import Request
from ..result import Result
from ..draftload import Draft, load_draft
from ..draftspec import Hybrid, parse
from ..errors import DynaTreeError
from ..hardware import decode_limit, read_bandwidth
from ..llamacpp import ready_for as llamacpp_ready
from ..methods import get_method, make_config
from ..featurehead import FeatureHead
from ..runtime import LoadedModel
from ..peers import check_assisted, universal_assisted
from ..quality import teacher_forced
from . import draftcheck
from ..prompts import Prompt, load_texts, tokenize
from .plan import Protocol, Variant, check_declared, check_variants  # noqa: F401 (re-exported)
from .results import aggregate, save

SCHEMA = 1


def run(
    experiment: str,
    variants: list[Variant],
    protocol: Protocol,
    target: LoadedModel,
    drafts: dict[str, Draft | LoadedModel | FeatureHead],
    out_dir: Path | None = None,
    progress: bool = True,
    command: list[str] | None = None,
    texts: dict[str, list[Prompt]] | None = None,
    declared: str | None = None,
) -> dict:
    """Run the protocol; write `out_dir/results.json` after every prompt; return the results.

    `drafts` maps --draft specs (canonical text) to a `Draft`, or to the loaded model the spec names
    (checked against the target here); a spec not in it ('ngram') is loaded by each request.
    `texts` maps each data set to its prompts when already loaded (else loaded here).
    `declared` is the label of the configuration declared before the run (presets.declared), the
    report's headline; None: none (a sweep, or a custom method list without --headline).
    """
    drafts = {spec: _draft_for(spec, d, target) for spec, d in drafts.items()}
    protocol.validate()
    check_variants(variants)
    check_declared(declared, variants)
    texts = texts if texts is not None else load_all(protocol)
    results = {
        "schema": SCHEMA,
        "experiment": experiment,
        "declared": declared,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command if command is not None else sys.argv,
        "complete": False,
        "protocol": dataclasses.asdict(protocol),
        "target": target.name,
        "dtype": str(target.dtype).removeprefix("torch."),
        "weights": target.weights,  # the target's weight format (weights.py)
        "weights_note": target.weights_note,
        "linear": target.linear,  # our methods' linear kernels; the hf-* baselines run stock (peers.py)
        "env": env.describe(target.device),
        "variants": [
            {**dataclasses.asdict(v), "config": dataclasses.asdict(make_config(v.method, **v.options))}
            for v in variants
        ],
        "records": [],
    }
    if protocol.bandwidth_limit:
        results["hardware"] = decode_limit(target.model, target.device)
    settings = [(d, t, l) for d in protocol.datasets for l in protocol.l_max for t in protocol.max_new_tokens]
    runs = sum(len(texts[d]) - (number > 0) * len(_warmup_indices(texts[d], protocol.warmup))
               for number, (d, _, _) in enumerate(settings))
    bar = _Progress(runs * len(variants) * protocol.repeats, enabled=progress)
    sampling = protocol.sampling()
    for v, row in zip(variants, results["variants"]):  # checked before any run, not in the middle of one
        if v.method == "hf-assisted":
            model = drafts[v.draft].model if v.draft in drafts else None
            check_assisted(target, model, sampling)
            row["hf_universal_assisted"] = isinstance(model, LoadedModel) and universal_assisted(target, model)
        if get_method(v.method).engine == "llama.cpp":  # a binding that crashes would end the whole run
            llamacpp_ready(target)
    scored: dict[str, tuple] = {}  # sha1 of prompt + tokens -> (PPL, target argmaxes); greedy runs repeat sequences
    answers: dict[tuple, list[str]] = {}  # (setting, question, variant) -> its answer to each turn so far
    try:
        for number, (dataset, t_new, l_max) in enumerate(settings):
            warm = _warmup_indices(texts[dataset], protocol.warmup)  # run in the first setting, skipped after
            for index, prompt in enumerate(texts[dataset]):
                if number > 0 and index in warm:
                    continue
                reference = {}  # (KV window, compiled) -> (prompt, tokens) of plain decoding (ar) in that setting
                by_label: dict[str, list[dict]] = {}  # variant label -> its rounds on this prompt, in the order run
                for round_ in range(protocol.repeats):
                    for v in rotated(variants, index * protocol.repeats + round_):
                        # a later turn is asked after the earlier ones and this variant's own answers to
                        # them (Spec-Bench's protocol; greedy exact methods get ar's history, as answers)
                        history = answers.setdefault((dataset, t_new, l_max, prompt.question, v.label), [])
                        ids = tokenize(target.tokenizer, prompt, l_max, protocol.chat, tuple(history[:len(prompt.earlier)]))
                        _check_length(target, drafts, ids, t_new)
                        bar.start(f"{dataset} {index + 1}/{len(texts[dataset])}", v.label, t_new)
                        paired = protocol.bandwidth_limit  # around every variant, so none runs in a different pause
                        bandwidth = read_bandwidth(target.device) if paired else None
                        watch = env.OtherCpu(bar.tokens)
                        rec = run_one(prepare(Request(
                            method=v.method, options=v.options, target=target, draft=drafts.get(v.draft, v.draft),
                            prompt_ids=ids, max_new_tokens=t_new, ignore_eos=protocol.ignore_eos,
                            kv_window=v.kv_window or protocol.kv_window, seed=protocol.seed + index,
                            sample=sampling is not None, temperature=protocol.temperature, top_k=protocol.top_k,
                            top_p=protocol.top_p, compile=v.compile)), on_tokens=watch)
                        bar.done(rec.stats.tokens_per_s)
                        if v.method == "ar":  # plain decoding in this setting, whatever runs first
                            reference.setdefault((rec.run.kv_window, v.compile), (ids, rec.new_token_ids))
                        by_label.setdefault(v.label, []).append({
                            "variant": v, "ids": ids, "rec": rec, "other_cpu": watch.result(),  # CPUs' worth others used
                            # the machine's bandwidth drifts: measured beside each run, the higher kept
                            "bandwidth": max(bandwidth, read_bandwidth(target.device)) if paired else None})
                for label, rounds in by_label.items():  # the first round's order
                    kept = _median_round(rounds)
                    chosen = rounds[kept]
                    v, ids, rec = chosen["variant"], chosen["ids"], chosen["rec"]
                    if prompt.question is not None:  # the history of the question's next turn
                        history = answers[(dataset, t_new, l_max, prompt.question, v.label)]
                        history[len(prompt.earlier):] = [_answer(target, rec.new_token_ids)]
                    r = _record(v, prompt, dataset, index, index in warm, t_new, l_max, rec)
                    r["_rounds"] = [(x["ids"], x["rec"].new_token_ids) for x in rounds]
                    r["other_cpu"] = chosen["other_cpu"]
                    r["prompt_sha1"] = _sha1(ids)  # what was asked
                    if chosen["bandwidth"] is not None:
                        r["bandwidth_bytes_per_s"] = chosen["bandwidth"]
                    if len(rounds) > 1:  # every round's timing: the spread between them is the run's noise
                        r["round"] = kept
                        r["rounds"] = [{"tokens_per_s": x["rec"].stats.tokens_per_s, "wall_s": x["rec"].stats.wall_s,
                                        "ttft_s": x["rec"].stats.ttft_s, "other_cpu": x["other_cpu"],
                                        "graphs_compiled_while_timed": x["rec"].stats.graphs_compiled_while_timed,
                                        "tokens_sha1": _sha1(x["rec"].new_token_ids)}
                                       for x in rounds]
                        # a round that compiled while timed, or used other tokens, is not hidden behind the kept one
                        compiled_timed = [x["graphs_compiled_while_timed"] for x in r["rounds"]
                                          if x["graphs_compiled_while_timed"] is not None]
                        if compiled_timed:
                            r["stats"]["graphs_compiled_while_timed"] = max(compiled_timed)
                        r["rounds_agree"] = len({x["tokens_sha1"] for x in r["rounds"]}) == 1
                    if protocol.ppl:
                        key = _key(ids, rec.new_token_ids)
                        if key not in scored:  # (ppl, the target's argmax per position)
                            scored[key] = teacher_forced(target, ids, rec.new_token_ids)
                        r["ppl"] = scored[key][0]
                    results["records"].append(r)
                for r in results["records"][-len(variants):]:  # ar may not run first: compare afterwards
                    rounds = r.pop("_rounds")  # every round's (prompt, tokens): each must be ar's
                    key = _reference_key(reference, r["kv_window"], r.get("compile", False),
                                         get_method(r["method"]).engine == "dynatree")
                    # None: sampling, or no ar run here; a later turn asked after another history than ar's
                    # (the conversation had diverged) is not ar's either
                    r["matches_ar"] = (all(x == reference[key] for x in rounds)
                                       if sampling is None and key is not None else None)
                plain = _reference_key(reference, None, False, False)
                if plain is not None:  # the draft LMs' agreement and step cost on ar's continuation
                    ids, continuation = reference[plain]
                    picks = scored.get(_key(ids, continuation), (None, None))[1]  # known when ppl is on
                    for spec, lm in draft_lms(drafts).items():
                        results.setdefault("draft_quality", []).append({
                            "draft": spec, "dataset": dataset, "prompt_index": index, "warmup": index in warm,
                            "max_new_tokens": t_new, "l_max": l_max,
                            **draftcheck.measure(target, lm, ids, continuation, picks),
                        })
                if out_dir is not None:
                    save(results, out_dir)
    finally:
        bar.close()
    results["complete"] = True
    results["aggregates"] = aggregate(results["records"], [v.label for v in variants])
    if out_dir is not None:
        save(results, out_dir)
    return results


def _median_round(rounds: list[dict]) -> int:
    """The index of the round a record keeps: the median by throughput (of an even count, the slower
    of the two middle rounds), so one slow or fast round (a pause, a warm cache) moves no figure."""
    by_speed = sorted(range(len(rounds)), key=lambda i: rounds[i]["rec"].stats.tokens_per_s or 0.0)
    return by_speed[(len(by_speed) - 1) // 2]


def rotated(variants: list, index: int) -> list:
    """The variants in the order prompt `index` runs them: rotated by one per prompt, so no
    variant always runs first (after a pause) or right after a particular other one. With several
    rounds (`Protocol.repeats`) `index` counts rounds (prompt * repeats + round): the order turns by one
    each round, so the variant that ended a round sometimes also starts the next."""
    k = index % len(variants)
    return variants[k:] + variants[:k]


def _answer(target: LoadedModel, new_ids: list[int]) -> str:
    """The text of an answer, up to its first EOS (a run that ignores EOS goes on past it), as the
    history of a question's next turn."""
    stop = next((i for i, t in enumerate(new_ids) if t in target.eos_ids), len(new_ids))
    return target.tokenizer.decode(new_ids[:stop], skip_special_tokens=True)


def _warmup_indices(prompts: list[Prompt], warmup: int) -> set[int]:
    """The warm-up prompts: the first `warmup`, and every other turn of their questions (flagged
    in the first setting, skipped in later ones)."""
    questions = {p.question for p in prompts[:warmup] if p.question is not None}
    return {i for i, p in enumerate(prompts) if i < warmup or (p.question is not None and p.question in questions)}


def _key(prompt_ids: list[int], new_ids: list[int]) -> str:
    return _sha1([prompt_ids, new_ids])


def _sha1(value) -> str:
    """The SHA-1 of a JSON-able value's JSON text: how records name prompts and token sequences."""
    return hashlib.sha1(json.dumps(value).encode()).hexdigest()


def load_all(protocol: Protocol) -> dict[str, list[Prompt]]:
    """The prompts of every data set of the protocol (any that cannot be loaded is an error)."""
    return {d: load_texts(d, protocol.n, protocol.min_chars, protocol.turns) for d in protocol.datasets}


def _record(v: Variant, prompt: Prompt, dataset: str, index: int, warmup: bool, t_new: int, l_max: int,
            rec: Result) -> dict:
    return {
        "variant": v.label,
        "method": v.method,
        "draft": rec.draft,
        "dataset": dataset,
        "prompt_id": prompt.id,
        "prompt_index": index,
        "category": prompt.category,  # Spec-Bench task, None for other data sets
        "turn": prompt.turn,
        "warmup": warmup,
        "max_new_tokens": t_new,
        "l_max": l_max,
        "prompt_tokens": rec.prompt_tokens,
        "kv_window": rec.run.kv_window,
        "compile": rec.run.compile,
        "weights": rec.run.weights,  # the weight format read (llama.cpp: the GGUF file's storage types)
        "draft_weights": rec.run.draft_weights,  # the draft model's format ("q4": a feature head in 4 bits; None: none)
        "stats": dataclasses.asdict(rec.stats),
        "policy_state": rec.policy_state,
        "seed": rec.run.seed,
        "tokens_sha1": _sha1(rec.new_token_ids),
    }


def _draft_for(spec: str, value, target: LoadedModel) -> Draft:
    """The `Draft` a run's `drafts[spec]` gives (a Draft, the loaded model the spec names, or a
    Hybrid for 'ngram+SPEC', 'ngram+STORE' or 'ngram+STORE+SPEC'), checked against the target; a value that is not what its spec
    says is a one-line error, never relabelled."""
    parsed = parse(spec)
    if isinstance(value, (LoadedModel, FeatureHead)) and parsed.model is not None:
        value = Hybrid(value) if parsed.ngram else value
    elif isinstance(value, Hybrid) and parsed.ngram:  # Hybrid(model), Hybrid(model, store=...), Hybrid(None, store=...)
        pass
    elif not isinstance(value, Draft):
        raise DynaTreeError(f"drafts[{spec!r}] must be a Draft or the draft model that spec names, "
                            f"got {type(value).__name__}")
    draft = load_draft(value, target)
    if ((draft.ngram, draft.model is None, None if draft.store is None else draft.store.name)
            != (parsed.ngram, parsed.model is None, parsed.store)):
        raise DynaTreeError(f"drafts[{spec!r}] drafts as {draft.name!r}, not as that spec says")
    return draft


def draft_lms(drafts: dict[str, Draft]) -> dict[str, LoadedModel | FeatureHead]:
    """The distinct draft LMs (and feature heads) of a run by spec; 'ngram+SPEC' drafters count under SPEC."""
    out = {}
    for spec, d in drafts.items():
        if d.model is not None:
            out.setdefault(parse(spec).model, d.model)
    return out


def _check_length(target: LoadedModel, drafts: dict, ids: list[int], t_new: int) -> None:
    for model in [target, *draft_lms(drafts).values()]:
        limit = model.context_length
        if limit is not None and len(ids) + t_new > limit:
            raise DynaTreeError(
                f"a prompt of {len(ids)} tokens + {t_new} new tokens exceeds the context length {limit} of "
                f"{model.name!r}; lower --l-max or --max-new-tokens"
            )


class _Progress:
    """One tqdm bar over all runs, showing prompt, method and live tokens/s."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="bench", unit="run", dynamic_ncols=True, file=sys.stderr)

    def start(self, prompt: str, method: str, t_new: int) -> None:
        self.prompt, self.method, self.t_new = prompt, method, t_new
        self.count, self.t0, self.shown = 0, time.perf_counter(), 0.0

    def tokens(self, new: list[int]) -> None:
        self.count += len(new)
        now = time.perf_counter()
        if self.bar is not None and now - self.shown > 0.5:
            self.shown = now
            self._show(self.count / max(now - self.t0, 1e-9), f"{self.count}/{self.t_new}")

    def done(self, tokens_per_s: float | None) -> None:
        if self.bar is not None:
            self._show(tokens_per_s or 0.0, f"{self.count}/{self.t_new}")
            self.bar.update(1)

    def _show(self, rate: float, tokens: str) -> None:
        self.bar.set_postfix_str(f"prompt {self.prompt} | {self.method} | {tokens} tok | {rate:.1f} tok/s", refresh=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _reference_key(reference: dict, window, compiled: bool, ours: bool):
    """Which `ar` run a record's tokens are compared with: `ar` in the same KV window and compile
    setting; for a baseline (eager, another implementation) also `ar` of the other setting; else None
    (unchecked: in 16-bit formats a compiled and an eager `ar` may legitimately differ)."""
    keys = ((window, compiled),) if ours else ((window, compiled), (window, not compiled))
    return next((k for k in keys if k in reference), None)
