"""`dynatree distill`: train a small draft LM for a target that has none, by distillation.

The draft is a Llama-style causal LM with the target's tokenizer and vocabulary (tied
embeddings, so its size is mostly vocab x hidden). Training data, labelled by the target:

  corpus     windows of text (default: this Python's standard library sources, site-packages
             excluded), each position labelled with the target's top-k next-token probabilities
  on-policy  the target's own greedy continuations of function headers + docstrings taken
             from the same corpus (what the draft will be asked to predict when decoding
             code), labelled the same way
  copy       windows in which spans of the corpus and on-policy text (some of them with their
             tokens shuffled) come back verbatim later in the same window, labelled the same
             way: the target copies from its context (an induction ability) and a draft trained
             on text alone does not learn to (0% on repeated random tokens, against the target's
             65-92%), which costs it most where the target repeats its prompt or loops

Nothing from HumanEval enters the data: corpus files and prompts that contain a line of a
HumanEval prompt are dropped (and counted in distill.json).
"""

from __future__ import annotations

import ast
import copy
import random
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import option, positive
from ..errors import DynaTreeError
from ..models import resolve_dtype
from ..runtime import LoadedModel
from .chat import chat_ids, generate_batched, instruction_prompts


@dataclass
class DistillConfig:
    layers: int = option(4, "decoder layers of the draft")
    hidden: int = option(160, "hidden size of the draft (embeddings are tied: vocab x hidden dominates its size)")
    heads: int = option(5, "attention heads (must divide --hidden)")
    ffn: int = option(640, "inner size of the draft's MLP")
    corpus: str = option("stdlib", "training text: 'stdlib' (this Python's standard library), a directory or a file")
    corpus_tokens: int = option(150_000, "tokens of corpus text labelled by the target")
    gen_prompts: int = option(384, "on-policy data: function headers from the corpus the target continues greedily")
    gen_tokens: int = option(192, "tokens the target generates per on-policy prompt (EOS ignored)")
    copy_tokens: int = option(0, "tokens of copy windows: corpus and on-policy spans repeated later in the same "
                              "window, labelled by the target (teaches the draft to copy from its context)")
    seq_len: int = option(256, "training window in tokens")
    top_k: int = option(8, "target probabilities kept per position (the distillation targets)")
    steps: int = option(1200, "optimizer steps")
    batch_size: int = option(8, "windows per optimizer step")
    lr: float = option(3e-3, "peak learning rate (AdamW, linear warm-up, cosine decay)")
    warmup: int = option(60, "warm-up steps (cut to --steps when longer)")
    weight_decay: float = option(0.01, "AdamW weight decay")
    eval_fraction: float = option(0.05, "share of windows held out to measure loss and agreement")
    checkpoint_every: int = option(100, "steps between resumable checkpoints")
    label_batch: int = option(4, "windows per target forward when labelling")
    gen_batch: int = option(32, "prompts per batched target generation")
    init_from_target: bool = option(True, "start the embeddings from the target's, projected on their top principal axes")
    init_draft: str = option("", "start from this draft directory instead of a new model (its own sizes are kept; "
                             "--layers/--hidden/--heads/--ffn/--init-from-target are then ignored)")
    gen_dtype: str = option("", "dtype the target generates the on-policy text in (e.g. bfloat16: about 2x faster "
                            "on CPUs with bf16); labels always come from the target as loaded. Empty: as loaded")
    save_dtype: str = option("float16", "dtype of the saved draft weights")
    seed: int = option(0, "seed for data order, initialisation and batches")
    prompts: str = option("", "on-policy prompts instead of function headers: 'specbench' (all but the held-out "
                          "questions), 'specbench-asks' (other requests over their material), a prompts file, or several "
                          "joined by commas; first turns, up to --gen-prompts; "
                          "answers end at EOS (or --gen-tokens)")
    chat: bool = option(False, "ask --prompts through the target's chat template")
    holdout: int = option(10, "Spec-Bench questions per task left out of --prompts specbench (bench --n up to this "
                          "stays unseen)")

    def validate(self) -> None:
        positive(self, "layers", "hidden", "heads", "ffn", "seq_len", "top_k", "steps", "batch_size",
                 "checkpoint_every", "label_batch", "gen_batch")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise DynaTreeError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads} with an even head size")
        if min(self.corpus_tokens, self.gen_prompts, self.gen_tokens, self.copy_tokens) < 0:
            raise DynaTreeError("--corpus-tokens, --gen-prompts, --gen-tokens and --copy-tokens cannot be negative")
        if self.corpus_tokens == 0 and (self.gen_prompts == 0 or self.gen_tokens == 0):
            raise DynaTreeError("no training data: give --corpus-tokens or --gen-prompts and --gen-tokens")
        if 0 < self.copy_tokens < self.seq_len:
            raise DynaTreeError(f"--copy-tokens must be 0 or at least --seq-len ({self.seq_len}), got {self.copy_tokens}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise DynaTreeError(f"--eval-fraction must be in (0, 0.5), got {self.eval_fraction}")
        if self.lr <= 0 or self.warmup < 0 or self.weight_decay < 0:
            raise DynaTreeError("--lr must be positive, --warmup and --weight-decay non-negative")
        resolve_dtype(self.save_dtype)
        if self.gen_dtype:
            resolve_dtype(self.gen_dtype)
        if self.chat and not self.prompts:
            raise DynaTreeError("--chat applies to --prompts (instruction prompts for the on-policy data)")
        if self.holdout < 0:
            raise DynaTreeError(f"--holdout must be at least 0, got {self.holdout}")
        if self.init_draft and not (Path(self.init_draft).expanduser() / "config.json").is_file():
            raise DynaTreeError(f"--init-draft {self.init_draft!r} is not a draft directory (no config.json)")

    def data_key(self) -> dict:
        """The fields that decide the labelled data (a resumed run must not mix data sets)."""
        keys = ("corpus", "corpus_tokens", "gen_prompts", "gen_tokens", "copy_tokens", "gen_dtype", "seq_len", "top_k",
                "seed", "prompts", "chat", "holdout")
        return {k: getattr(self, k) for k in keys}


def humaneval_lines() -> set[str]:
    """Distinctive lines (>= 30 characters) of the HumanEval prompts: text that must not be trained on."""
    from ..prompts import humaneval_prompts

    return {line.strip() for p in humaneval_prompts() for line in p.text.splitlines() if len(line.strip()) >= 30}


def corpus_files(spec: str) -> list[Path]:
    if spec == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [p for p in root.rglob("*.py") if not {"site-packages", "dist-packages"} & set(p.parts)]
    else:
        path = Path(spec).expanduser()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file() and p.suffix in (".py", ".txt", ".md", ".rst")]
        else:
            raise DynaTreeError(f"corpus {spec!r} is neither 'stdlib' nor an existing file or directory")
    files = sorted(files)
    if not files:
        raise DynaTreeError(f"corpus {spec!r} has no .py/.txt/.md/.rst files")
    return files


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _clean(text: str, banned: set[str]) -> bool:
    return not any(line.strip() in banned for line in text.splitlines())


def function_prompts(texts: list[str], n: int, seed: int, banned: set[str]) -> list[str]:
    """Up to `n` prompts `def f(...):\\n    \"\"\"docstring\"\"\"\\n` from Python sources, HumanEval-like in form."""
    found = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
                continue
            if len(doc.value.value.strip()) < 40 or len(node.body) < 2:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            prompt = textwrap.dedent("\n".join(lines[start: doc.end_lineno])) + "\n"
            if len(prompt) <= 1500 and _clean(prompt, banned):
                found.append(prompt)
    random.Random(seed).shuffle(found)
    return found[:n]


@torch.no_grad()
def label(target: LoadedModel, windows: torch.Tensor, top_k: int, batch: int, bar=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k next-token ids [N, T, k] (int32) and probabilities (float16) for each window [N, T]."""
    ids, probs = [], []
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch].to(target.device)
        logits = target.model(chunk, use_cache=False).logits[..., : target.vocab_size].float()
        top = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
        ids.append(top.indices.int().cpu())
        probs.append(top.values.half().cpu())
        if bar is not None:
            bar.update(chunk.numel())
    return torch.cat(ids), torch.cat(probs)


@torch.no_grad()
def generate_on_policy(target: LoadedModel, prompts: list[str], n_tokens: int, batch: int, bar=None,
                       dtype: str = "") -> list[list[int]]:
    """The target's greedy continuation (EOS ignored) of each prompt, as prompt + continuation ids;
    with `dtype`, generated by a copy of the target in that dtype."""
    model = target.model
    if dtype and resolve_dtype(dtype) != model.dtype:
        model = copy.deepcopy(model).to(resolve_dtype(dtype))
    tok = target.tokenizer
    pad = target.eos_ids[0] if target.eos_ids else 0
    out = []
    for i in range(0, len(prompts), batch):
        encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts[i: i + batch]]
        width = max(len(e) for e in encoded)
        ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded], device=target.device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=target.device)
        gen = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=pad,
        )
        for row, e in enumerate(encoded):
            out.append(e + gen[row, width:].tolist())
        if bar is not None:
            bar.update(len(encoded) * n_tokens)
    return out


def windows_of(docs: list[list[int]], seq_len: int, sep: int | None, limit: int | None = None) -> torch.Tensor:
    """Pack documents (separated by `sep`) into consecutive windows of seq_len tokens [N, seq_len]."""
    stream: list[int] = []
    for d in docs:
        stream.extend(d)
        if sep is not None:
            stream.append(sep)
        if limit is not None and len(stream) >= limit:
            break
    if limit is not None:
        stream = stream[:limit]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def copy_windows(pool: list[int], n_windows: int, seq_len: int, seed: int) -> torch.Tensor:
    """[n_windows, seq_len] windows of spans from `pool` (8 to seq_len/4 tokens; a quarter of them
    with their tokens shuffled, so copying cannot lean on grammar), where each next piece is, with
    probability 1/2, an earlier span of the same window again."""
    if len(pool) < 2 * seq_len:
        raise DynaTreeError(f"--copy-tokens needs at least {2 * seq_len} tokens of corpus or on-policy text to copy from")
    rng = random.Random(seed)
    rows = []
    for _ in range(n_windows):
        row: list[int] = []
        spans: list[list[int]] = []
        while len(row) < seq_len:
            if spans and rng.random() < 0.5:
                span = rng.choice(spans)
            else:
                m = rng.randint(8, max(8, seq_len // 4))
                start = rng.randrange(len(pool) - m)
                span = pool[start: start + m]
                if rng.random() < 0.25:
                    span = rng.sample(span, len(span))
                spans.append(span)
            row += span
        rows.append(row[:seq_len])
    return torch.tensor(rows, dtype=torch.long).view(n_windows, seq_len)


def build_data(target: LoadedModel, cfg: DistillConfig, progress: bool = True) -> dict:
    """Corpus and on-policy windows with the target's top-k labels, and what went into them."""
    from tqdm.auto import tqdm

    tok = target.tokenizer
    sep = target.eos_ids[0] if target.eos_ids else None
    banned = humaneval_lines()
    files = corpus_files(cfg.corpus)
    random.Random(cfg.seed).shuffle(files)
    texts, dropped, docs, n_tok = [], 0, [], 0
    need_prompts = cfg.gen_prompts > 0 and cfg.gen_tokens > 0 and not cfg.prompts
    for path in files:  # enough files for the corpus tokens, and a pool for prompts
        text = _read(path)
        if not text or not text.strip():
            continue
        if not _clean(text, banned):
            dropped += 1
            continue
        texts.append(text)
        if n_tok < cfg.corpus_tokens:
            docs.append(tok(text, add_special_tokens=False)["input_ids"])
            n_tok += len(docs[-1])
        elif not need_prompts or len(texts) >= 400:
            break
    info = {"corpus_files": len(docs), "corpus_files_dropped_for_humaneval": dropped}
    parts = []
    if cfg.corpus_tokens > 0:
        corpus = windows_of(docs, cfg.seq_len, sep, cfg.corpus_tokens)
        if len(corpus) == 0:
            raise DynaTreeError(f"corpus {cfg.corpus!r} holds fewer than --seq-len {cfg.seq_len} tokens")
        parts.append(("corpus", corpus))
    if need_prompts:
        prompts = function_prompts(texts, cfg.gen_prompts, cfg.seed, banned)
        if not prompts:
            raise DynaTreeError(f"corpus {cfg.corpus!r} has no documented Python functions to use as prompts; "
                                "pass --gen-prompts 0")
        bar = tqdm(total=len(prompts) * cfg.gen_tokens, desc="target generates", unit="tok", disable=not progress,
                   file=sys.stderr, dynamic_ncols=True)
        gen = generate_on_policy(target, prompts, cfg.gen_tokens, cfg.gen_batch, bar, cfg.gen_dtype)
        bar.close()
        on_policy = windows_of(gen, cfg.seq_len, sep)
        info["on_policy_prompts"] = len(prompts)
        if len(on_policy):
            parts.append(("on_policy", on_policy))
    if cfg.prompts and cfg.gen_prompts > 0 and cfg.gen_tokens > 0:
        parts.append(("on_policy", instruction_windows(target, cfg, info, progress)))
    if cfg.copy_tokens:  # spans from the training windows only, so held-out text stays unseen
        pool = [t for _, w in parts for t in w[: len(w) - _held_count(len(w), cfg.eval_fraction)].flatten().tolist()]
        parts.append(("copy", copy_windows(pool, cfg.copy_tokens // cfg.seq_len, cfg.seq_len, cfg.seed)))
    data = {"key": cfg.data_key(), "info": info, "sources": {}}
    total = sum(w.numel() for _, w in parts)
    bar = tqdm(total=total, desc="target labels", unit="tok", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    for name, w in parts:
        top_ids, top_p = label(target, w, cfg.top_k, cfg.label_batch, bar)
        data["sources"][name] = {"tokens": w.int(), "top_ids": top_ids, "top_p": top_p}
        info[f"{name}_tokens"] = w.numel()
    bar.close()
    return data


def instruction_windows(target: LoadedModel, cfg: DistillConfig, info: dict, progress: bool) -> torch.Tensor:
    """The target's greedy answers (EOS respected) to the first turns of --prompts (through its chat
    template with --chat), prompt + answer, packed into windows."""
    from tqdm.auto import tqdm


    convs, sources = instruction_prompts(cfg.prompts, cfg.holdout)
    random.Random(cfg.seed).shuffle(convs)
    convs = convs[: cfg.gen_prompts]
    tok = target.tokenizer
    if cfg.chat and not getattr(tok, "chat_template", None):
        raise DynaTreeError("--chat needs a tokenizer with a chat template; the target's has none")
    prompts = [chat_ids(tok, c[:1], []) if cfg.chat else tok(c[0], add_special_tokens=False).input_ids for c in convs]
    bar = tqdm(total=len(prompts), desc="target answers", unit="q", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    answers = generate_batched(target, prompts, cfg.gen_tokens, cfg.gen_batch, bar)
    bar.close()
    info["instruction_prompts"] = {"sources": sources, "used": len(prompts), "chat": cfg.chat}
    sep = target.eos_ids[0] if target.eos_ids else None
    windows = windows_of([p + a for p, a in zip(prompts, answers)], cfg.seq_len, sep)
    if len(windows) == 0:
        raise DynaTreeError(f"--prompts gave fewer than --seq-len {cfg.seq_len} tokens of prompts and answers")
    return windows


def _held_count(n: int, eval_fraction: float) -> int:
    return min(max(1, round(n * eval_fraction)), n - 1) if n > 1 else 0
