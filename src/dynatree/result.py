"""The typed result of one decode: what `api.run` and `api.generate` return.

A `Result` holds the new tokens, their text, the run's figures (`Summary`, defined in
stats.py) and the settings that produced them (`RunInfo`), as attributes with types instead
of a dict read back by string keys. `Result.to_json()` is the JSON record of
`dynatree generate --json`, of the server's `dynatree` field and of bench result files; its
keys are the field names below, in this order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """A run's figures; stats.py defines each one."""

    new_tokens: int  # tokens returned (a stop string's last token included, nothing decoded after it)
    iterations: int  # target forward passes, prefill included
    acceptance_rate: float | None  # drafted tokens committed / drafted (None: nothing drafted)
    tokens_per_iter: float | None  # L: new tokens per target pass
    mean_generated_len: float | None  # M: tokens committed per verification pass, prefill excluded
    accepted_len: float | None  # l: committed drafted tokens per target pass
    ttft_s: float  # call to first new token
    tpot_s: float | None  # (wall - ttft) / (new - 1)
    wall_s: float  # prefill included, model load excluded
    tokens_per_s: float | None  # new tokens / wall time
    peak_mem_mb: float | None  # process peak RSS (CPU) or peak allocated device memory (CUDA); None: not measured (server)
    drafted_tokens: int  # drafted tree nodes sent to verification
    accepted_tokens: int  # of those, committed
    compile_s: float | None  # compiling before the clock started (--compile; None without)
    graphs_compiled_while_timed: int | None  # graphs compiled inside the timings (0 expected)
    draft_ms: float | None  # per decode iteration: growing the tree (drafter + policy)
    verify_ms: float | None  # per decode iteration: the verification pass and acceptance
    commit_ms: float | None  # per decode iteration: committing caches and drafter state


@dataclass(frozen=True)
class RunInfo:
    """The settings a run was decoded with (what makes two runs comparable or not)."""

    max_new_tokens: int
    ignore_eos: bool
    chat: bool  # the prompt went through the chat template
    device: str
    dtype: str  # the target's compute dtype ("gguf": llama.cpp decoded the file as stored)
    weights: str  # the target's weight format (weights.py; for llama.cpp the GGUF file's storage types, `gguf_format`)
    weights_note: str | None  # what a low-bit format converted, or why it fell back to dense
    compile: bool  # decode steps through torch.compile
    engine: str  # who decoded: "dynatree", "transformers" or "llama.cpp"
    inexact_greedy: str | None  # why greedy output may differ from ar's here (dense 16-bit), else None
    linear: str  # the target's linear kernels ("stock" for transformers' generate(), "llama.cpp")
    linear_note: str | None  # why not oneDNN, if so
    draft_linear: str | None  # the draft's linear kernels (None: no draft model)
    draft_linear_note: str | None
    draft_weights: str | None  # the draft model's weight format ("q4": a feature head in 4 bits); None: no draft model
    seed: int
    hf_universal_assisted: bool  # transformers re-tokenizes text between draft and target
    ngram_max: int | None  # longest n-gram the copy drafter matches (None: no n-gram drafter)
    kv_window: str | None  # "SINK,RECENT" when the KV caches are bounded
    sampling: dict | None  # the sampling settings (None: greedy)
    lossy: bool  # the acceptance rule does not keep the target's distribution (sampling only)
    stop: list[str] | None  # the stop strings (None: none)


@dataclass(frozen=True)
class TokenLogprob:
    """One new token's log-probability under the target (`logprobs` of a request)."""

    token: int  # the token id
    logprob: float  # its natural log-probability in the target's distribution at its position (temperature 1)
    top: list[tuple[int, float]]  # the most likely tokens there with theirs, most likely first (`logprobs` of them)


@dataclass(frozen=True)
class Result:
    """One decode of one prompt by one method."""

    method: str
    target: str  # the target's name
    draft: str | None  # None (no drafter), "ngram", a model name, "ngram+NAME", "ngram+STORE" or "ngram+STORE+NAME"
    prompt_tokens: int
    new_token_ids: list[int]
    text: str  # the new tokens decoded, special tokens skipped (ending just before a stop string)
    finish_reason: str  # "stop": an end-of-sequence token or a stop string; "length": max_new_tokens;
    # "cancelled": the caller's `cancel()` ended the run (api.run; a server client gone)
    stats: Summary
    config: dict  # the method's config fields
    run: RunInfo
    env: dict  # the machine, library versions and threads (env.describe)
    policy_state: dict | None = None  # what an adaptive policy learnt (e.g. DynaTree's cost rule)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them

    def to_json(self) -> dict:
        """The JSON record (policy_state only where the policy has one, logprobs only when asked)."""
        record = dataclasses.asdict(self)
        for key in ("policy_state", "logprobs"):
            if record[key] is None:
                del record[key]
        for scored in record.get("logprobs", []):
            scored["top"] = [list(pair) for pair in scored["top"]]  # (JSON has no tuples)
        return record
