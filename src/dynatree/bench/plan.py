"""What a benchmark run is: its variants (method, options, draft) and its protocol (data, lengths,
sampling), validated before any model loads. `runner.py` executes a plan; `presets.py` builds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..draftspec import parse
from ..errors import DynaTreeError
from ..methods import get_method, make_config
from ..sampling import sampling_config
from ..window import KVWindow
from ..prompts import SPEC_BENCH, spec_bench_tasks


@dataclass
class Variant:
    label: str  # unique name in tables and plots
    method: str
    options: dict = field(default_factory=dict)  # method config fields
    draft: str | None = None  # "ngram", a draft model spec, or None (methods without a draft)
    tags: dict = field(default_factory=dict)  # what the variant varies, for plots (e.g. {"depth": 8})
    kv_window: str | None = None  # "SINK,RECENT" attention-sink KV window (overrides the protocol's)
    compile: bool = False  # run the target's decode steps through torch.compile (methods.Method.compilable)


@dataclass
class Protocol:
    dataset: str  # data set name or prompts file
    n: int = 10  # prompts, warm-up included
    warmup: int = 2  # first prompts run but left out of the aggregates
    max_new_tokens: list[int] = field(default_factory=lambda: [1500])  # T; several for length scaling
    l_max: list[int] = field(default_factory=lambda: [800])  # prompt cap in tokens; several for sensitivity
    ignore_eos: bool = True  # force T tokens, as the papers do
    chat: bool = False  # wrap prompts in the tokenizer's chat template
    turns: str = "first"  # multi-turn questions: ask the first turn only, or "all" (one record per turn)
    min_chars: int | None = None  # paragraph filter override (None: the data set's own)
    kv_window: str | None = None  # "SINK,RECENT" KV window for every variant without its own
    sample: bool = False  # sampling mode (lossless verification; WETAP's beam rule and MTAD are lossy)
    temperature: float | None = None  # sampling settings (None: off / 1.0), as `dynatree generate`
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0  # prompt i is sampled with seed + i by every variant
    repeats: int = 1  # rounds of every variant on every prompt, interleaved; a record keeps the median round
    ppl: bool = True  # score every continuation's perplexity under the target (one extra pass, untimed)
    # measure the memory-bandwidth limit of plain decoding (hardware.py): at the start and beside every ar run
    bandwidth_limit: bool = False

    @property
    def datasets(self) -> list[str]:
        """The data sets, comma-separated; Spec-Bench task names after `specbench:TASK` are more tasks
        of it (`specbench:qa,rag,humaneval` is Spec-Bench's qa and rag, then HumanEval; a file
        named like a task: ./rag)."""
        out: list[str] = []
        for item in (d.strip() for d in self.dataset.split(",")):
            if not item:
                continue
            if out and out[-1].startswith(SPEC_BENCH + ":") and _is_task(item):
                out[-1] += "," + item
            else:
                out.append(item)
        return out

    def sampling(self):
        return sampling_config(self.sample, self.temperature, self.top_k, self.top_p)

    def validate(self) -> None:
        if not self.datasets:
            raise DynaTreeError("--dataset is empty")
        self.sampling()
        if self.n < 1:
            raise DynaTreeError(f"--n must be at least 1, got {self.n}")
        if self.repeats < 1:
            raise DynaTreeError(f"--repeats must be at least 1, got {self.repeats}")
        if self.warmup < 0 or self.warmup >= self.n:
            raise DynaTreeError(f"need 0 <= --warmup < --n, got n={self.n}, warmup={self.warmup}")
        if any(t < 1 for t in self.max_new_tokens) or any(l < 1 for l in self.l_max):
            raise DynaTreeError("--max-new-tokens and --l-max values must be positive")
        self.kv_window = canonical_window(self.kv_window)
        if self.turns not in ("first", "all"):
            raise DynaTreeError(f"--turns must be first or all, got {self.turns!r}")
        if self.turns == "all" and not self.chat:
            raise DynaTreeError("--turns all asks later turns with the earlier ones as chat history: add --chat")


def canonical_window(text: str | None) -> str | None:
    """A KV window as the runs record it ('SINK,RECENT', no spaces; None for none), so the protocol, its
    variants and their records name one window one way (' 4, 60' and '4,60' are one window): checked here."""
    window = KVWindow.parse(text)
    return None if window is None else str(window)


def _is_task(name: str) -> bool:
    try:
        spec_bench_tasks(name)
    except DynaTreeError:
        return False
    return True


def check_declared(label: str | None, variants: list[Variant], what: str = "the declared configuration") -> None:
    """A declared headline (`label`, None for none) must be one of the run's rows: else a one-line error
    naming them; `what` names where the label came from (the CLI says --headline)."""
    labels = [v.label for v in variants]
    if label is not None and label not in labels:
        raise DynaTreeError(f"{what} {label!r} is not a variant of this run; its rows: "
                            + ", ".join(repr(known) for known in labels))


def check_variants(variants: list[Variant]) -> None:
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise DynaTreeError(f"variant labels must be unique, got {labels}")
    if "ar" not in labels:
        raise DynaTreeError("a benchmark needs the 'ar' variant: speedups are measured against it in the same run")
    for v in variants:
        make_config(v.method, **v.options)  # fails early on a bad option
        v.kv_window = canonical_window(v.kv_window)
        need = get_method(v.method).draft
        if need == "lm" and not parse(v.draft).model_alone:
            raise DynaTreeError(f"variant {v.label!r}: method {v.method!r} needs a draft language model alone")
        if v.compile and not get_method(v.method).compilable:
            raise DynaTreeError(f"variant {v.label!r}: --compile does not apply to {v.method!r}: "
                                f"{get_method(v.method).not_compilable}")
