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

Loss: cross-entropy of the draft against the target's top-k distribution, renormalised
over those k tokens. Agreement = how often the draft's argmax equals the target's.

`out/` holds, while training: `data.pt` (the labelled windows, reused on resume) and
`checkpoint.pt` (model, optimizer, step; written every `checkpoint_every` steps); at the
end: a transformers checkpoint (`--draft out/` loads it), the tokenizer, `distill.json`
(command, config, data, timings, machine, final metrics) and a README.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import math
import os
import random
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import env
from .config import option, positive
from .errors import DynaTreeError
from .models import resolve_dtype
from .runtime import LoadedModel


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
    warmup: int = option(60, "warm-up steps")
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
                          "questions), a prompts file, or several joined by commas; first turns, up to --gen-prompts; "
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


# ---------------------------------------------------------------- the draft model


def draft_config(target: LoadedModel, cfg: DistillConfig):
    """A Llama config sized by `cfg` that shares the target's vocabulary and special tokens."""
    from transformers import LlamaConfig

    tc = target.model.config
    rope = getattr(tc, "rope_parameters", None) or {}
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=target.context_length or 4096,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope.get("rope_theta", 10000.0))},
        tie_word_embeddings=True,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=getattr(tc, "eos_token_id", None),
        pad_token_id=getattr(tc, "pad_token_id", None),
    )


def init_draft(target: LoadedModel, cfg: DistillConfig):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    if cfg.init_draft:
        model = AutoModelForCausalLM.from_pretrained(Path(cfg.init_draft).expanduser(), dtype=torch.float32)
        if model.config.vocab_size != target.vocab_size:
            raise DynaTreeError(f"--init-draft {cfg.init_draft!r} has a vocabulary of {model.config.vocab_size} "
                                f"tokens, the target {target.vocab_size}; it must be a draft for this target")
        return model
    model = LlamaForCausalLM(draft_config(target, cfg))
    if cfg.init_from_target:
        with torch.no_grad():
            emb = target.model.get_input_embeddings().weight.float().cpu()
            emb = emb - emb.mean(0, keepdim=True)
            q = min(cfg.hidden, emb.shape[1])
            _, _, v = torch.pca_lowrank(emb, q=q, center=False, niter=4)
            proj = emb @ v  # [V, q]: the target's embeddings in their q main directions
            proj = proj / proj.std() * model.config.initializer_range
            model.get_input_embeddings().weight[:, :q] = proj
    return model


# ---------------------------------------------------------------- text sources


def humaneval_lines() -> set[str]:
    """Distinctive lines (>= 30 characters) of the HumanEval prompts: text that must not be trained on."""
    from .bench.data import _humaneval

    return {line.strip() for p in _humaneval() for line in p.text.splitlines() if len(line.strip()) >= 30}


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


# ---------------------------------------------------------------- labelling by the target


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

    from .distill_eagle import _chat_ids, generate_batched, instruction_prompts

    convs, sources = instruction_prompts(cfg.prompts, cfg.holdout)
    random.Random(cfg.seed).shuffle(convs)
    convs = convs[: cfg.gen_prompts]
    tok = target.tokenizer
    if cfg.chat and not getattr(tok, "chat_template", None):
        raise DynaTreeError("--chat needs a tokenizer with a chat template; the target's has none")
    prompts = [_chat_ids(tok, c[:1], []) if cfg.chat else tok(c[0], add_special_tokens=False).input_ids for c in convs]
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


def split(data: dict, eval_fraction: float) -> tuple[dict, dict]:
    """Per source: the last `eval_fraction` of windows (at least one, when there are two) are held out."""
    train, held = {}, {}
    for name, src in data["sources"].items():
        n = len(src["tokens"])
        k = _held_count(n, eval_fraction)
        train[name] = {key: v[: n - k] for key, v in src.items()}
        if k:
            held[name] = {key: v[n - k:] for key, v in src.items()}
    return train, held


# ---------------------------------------------------------------- training


def distill_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy against the target's renormalised top-k, and top-1 agreement.

    logits [B, T, V], top_ids [B, T, k], top_p [B, T, k] -> (loss, agreement) scalars.
    """
    logits = logits.float()
    logp = logits.gather(-1, top_ids.long()) - logits.logsumexp(-1, keepdim=True)  # no [B, T, V] log-softmax copy
    p = top_p.float()
    p = p / p.sum(-1, keepdim=True)
    loss = -(p * logp).sum(-1).mean()
    agree = (logits.argmax(-1) == top_ids[..., 0].long()).float().mean()
    return loss, agree


def _batch(train: dict, rows: list[tuple[str, int]], device) -> tuple[torch.Tensor, ...]:
    pick = lambda key: torch.stack([train[s][key][i] for s, i in rows]).to(device)  # noqa: E731
    return pick("tokens").long(), pick("top_ids"), pick("top_p")


@torch.no_grad()
def evaluate(model, held: dict, device, batch: int) -> dict:
    """Held-out loss and agreement per source (position-weighted)."""
    model.eval()
    out = {}
    for name, src in held.items():
        losses, agrees, n = 0.0, 0.0, 0
        for i in range(0, len(src["tokens"]), batch):
            rows = [(name, j) for j in range(i, min(i + batch, len(src["tokens"])))]
            ids, top_ids, top_p = _batch(held, rows, device)
            loss, agree = distill_loss(model(ids).logits, top_ids, top_p)
            losses += loss.item() * len(rows)
            agrees += agree.item() * len(rows)
            n += len(rows)
        out[name] = {"loss": losses / n, "agreement": agrees / n}
    model.train()
    return out


def _lr(step: int, cfg, floor: float = 0.1) -> float:
    """Linear warm-up over cfg.warmup steps to cfg.lr, then cosine decay to `floor` x cfg.lr at cfg.steps."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batches(items: list, batch_size: int, step: int, rng: random.Random):
    """Endless batches of `items`, reshuffled by `rng` at each pass, resuming where a run stopped at
    `step` would have left off (the shuffles it used are replayed, so a resumed run sees the same batches)."""
    order: list = []
    for _ in range(step * batch_size // len(items) + 1):
        order = items[:]
        rng.shuffle(order)
    cursor = step * batch_size % len(items)
    while True:
        picked = []
        while len(picked) < batch_size:
            if cursor == len(order):
                order = items[:]
                rng.shuffle(order)
                cursor = 0
            take = order[cursor: cursor + batch_size - len(picked)]
            picked += take
            cursor += len(take)
        yield picked


def _save_atomic(obj, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    tmp.replace(path)


def distill(target: LoadedModel, out: Path, cfg: DistillConfig, resume: bool = False, progress: bool = True,
            command: list[str] | None = None) -> dict:
    """Train a draft for `target` into `out`; return the summary written to out/distill.json."""
    from tqdm.auto import tqdm

    cfg.validate()
    out = Path(out)
    ckpt_path, data_path = out / "checkpoint.pt", out / "data.pt"
    if not resume and ((out / "config.json").exists() or ckpt_path.exists()):
        raise DynaTreeError(f"{out} already holds a draft or a checkpoint; pass --resume to continue it, "
                            "or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    timings = {}

    data = torch.load(data_path, weights_only=True) if data_path.exists() else None
    if data is not None and data["key"] != cfg.data_key():
        raise DynaTreeError(f"{data_path} was built with other data options ({data['key']}); "
                            "use the same options or another --out")
    if data is None:
        t0 = time.perf_counter()
        data = build_data(target, cfg, progress)
        data["info"]["build_s"] = time.perf_counter() - t0
        _save_atomic(data, data_path)
    train, held = split(data, cfg.eval_fraction)
    rows = [(name, i) for name, src in train.items() for i in range(len(src["tokens"]))]
    if not rows:
        raise DynaTreeError("the data gave no training windows; raise --corpus-tokens or lower --seq-len")

    device = target.device
    model = init_draft(target, cfg).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    step, history, prior_s = 0, [], 0.0
    if resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        if state["config"] != dataclasses.asdict(cfg):
            changed = sorted(k for k, v in dataclasses.asdict(cfg).items() if state["config"].get(k) != v)
            raise DynaTreeError(f"{ckpt_path} was trained with other options ({', '.join(changed)} differ); "
                                "resume with the same options")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history, prior_s = state["step"], state["history"], state["train_s"]

    feed = batches(rows, cfg.batch_size, step, random.Random(cfg.seed))
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    t0 = time.perf_counter()
    avg_loss = avg_agree = None
    while step < cfg.steps:
        ids, top_ids, top_p = _batch(train, next(feed), device)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        loss, agree = distill_loss(model(ids).logits, top_ids, top_p)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        avg_loss = loss.item() if avg_loss is None else 0.95 * avg_loss + 0.05 * loss.item()
        avg_agree = agree.item() if avg_agree is None else 0.95 * avg_agree + 0.05 * agree.item()
        bar.set_postfix_str(f"moving avg: loss {avg_loss:.3f} | agreement {avg_agree:.1%}", refresh=False)
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            # training figures are moving averages (weight 0.05 per step); held-out ones are exact
            history.append({"step": step, "train_loss_moving_avg": avg_loss, "train_agreement_moving_avg": avg_agree,
                            "held_out": evaluate(model, held, device, cfg.batch_size)})
            _save_atomic({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                          "history": history, "config": dataclasses.asdict(cfg),
                          "train_s": prior_s + time.perf_counter() - t0}, ckpt_path)
    bar.close()
    timings["train_s"] = prior_s + time.perf_counter() - t0
    final = evaluate(model, held, device, cfg.batch_size) if held else {}
    return _write_draft(model, target, out, cfg, data["info"], final, history, timings, command)


def _write_draft(model, target, out: Path, cfg, info, final, history, timings, command) -> dict:
    model.eval()
    model.to(resolve_dtype(cfg.save_dtype)).save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    summary = {
        "command": command if command is not None else sys.argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": target.name,
        "config": dataclasses.asdict(cfg),
        "parameters": params,
        "data": info,
        "held_out": final,
        "history": history,
        "timings": timings,
        "env": env.describe(target.device),
    }
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    agreement = ", ".join(f"{k} {v['agreement']:.1%}" for k, v in final.items()) or "n/a"
    (out / "README.md").write_text(
        f"# Draft model for {target.name}\n\nDistilled with `dynatree distill` "
        f"({params / 1e6:.1f}M parameters, {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}); "
        f"held-out top-1 agreement with the target: {agreement}.\n"
        f"Use: `dynatree generate PROMPT --target {target.name} --draft {out}`. Details in distill.json.\n"
    )
    return summary
