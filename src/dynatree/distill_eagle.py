"""`dynatree distill --kind eagle`: train a feature head (featurehead.py) for a target.

Data is on-policy chat: the target's own greedy answers (EOS respected), through its chat
template, to instruction prompts:
  specbench    Spec-Bench's questions, every turn (a second turn is asked with the target's
               own first answer in the history), except the first `holdout` questions of each
               task: those are what `dynatree bench --dataset specbench --n N` (N <= holdout)
               measures, so a benchmark never runs on training text
  self         questions the target writes itself from topic seeds (sampled), then answers
  FILE         prompts of a file (`--prompts`): Spec-Bench question .jsonl, one
               {"prompt": ...} per line, or plain text with blank-line-separated paragraphs
Answers are generated in batches; then one teacher-forced target pass over each whole
conversation gives both the features (last hidden states) and the labels (the target's argmax
next token at every position): the labels and the features come from the same forward.

Training (the idea of EAGLE-3's "training-time test"): pass 1 feeds every position with the
target's true feature of the position before; pass j feeds each position with pass j-1's
*predicted* feature of the position before and attends to pass-1 keys up to j-1 positions back
plus its own deeper chain, exactly what a tree node at depth j-1 sees when drafting. Loss:
cross-entropy against the target's next token (pass j weighted `decay`^(j-1)) plus
`feature_loss` x smooth-L1 of pass 1's predicted feature against the target's. The
decoder layer starts from the target's last layer when the shapes agree.

`out/` holds while training `data/` (the data in parts of `chunk` conversations, saved as each is
built: a stopped build resumes, and a larger one, e.g. more `--self-prompts` into the same `--out`
with `--resume`, reuses them; an older run's single `data.pt` is still read) and `checkpoint.pt`; at the end the head (`--draft out/` loads it), `distill.json` and a README.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import env
from .config import option, positive, require
from .draftspec import is_head_dir
from .distill import _lr, _save_atomic, batches
from .errors import DynaTreeError
from .featurehead import FeatureHead, HeadConfig, check_head, load_head, target_features, tokenizer_fingerprint
from .runtime import LoadedModel

TOPICS = (
    "cooking", "gardening", "personal finance", "the solar system", "ancient Rome", "climate change", "machine learning",
    "the human heart", "music theory", "chess", "marathon training", "photography", "volcanoes", "the French Revolution",
    "renewable energy", "sleep", "coffee", "job interviews", "electric cars", "the ocean", "birds", "poetry",
    "public speaking", "recycling", "the stock market", "vaccines", "the internet", "architecture", "friendship",
    "time management", "dinosaurs", "the Moon landing", "bread baking", "mountain climbing", "probability",
    "world geography", "learning a language", "painting", "football", "the immune system", "bees", "rainforests",
    "cybersecurity", "taxes", "the Renaissance", "meditation", "nutrition", "movies", "small businesses", "robots",
    "earthquakes", "the printing press", "philosophy", "traveling in Japan", "mathematics puzzles", "Python lists",
    "writing a resume", "dogs", "cats", "weather forecasts", "electricity", "the water cycle", "recipes with rice",
    "customer service", "online privacy", "video games", "economics", "the history of flight", "healthy habits",
)
ASKS = (
    "Write one question that a curious person might ask an AI assistant about {topic}. Reply with the question only.",
    "Write one short instruction asking an assistant to write something (a story, a poem, an email or a list) "
    "about {topic}. Reply with the instruction only.",
    "Write one question asking for a clear explanation of a concept related to {topic}. Reply with the question only.",
    "Write one short math word problem about {topic} that needs a few steps to solve. Reply with the problem only.",
)


@dataclass
class EagleConfig:
    prompts: str = option("specbench", "instruction prompts: 'specbench' (all but the held-out questions), a file, "
                          "or several joined by commas")
    holdout: int = option(10, "Spec-Bench questions per task left out of training (bench --n up to this stays unseen)")
    self_prompts: int = option(256, "extra questions the target writes itself from topic seeds, then answers")
    max_new_tokens: int = option(256, "longest answer per turn (EOS ends it sooner)")
    l_max: int = option(1024, "longest prompt (with history) in tokens; longer ones are left out")
    gen_batch: int = option(16, "conversations per batched target generation")
    chunk: int = option(64, "conversations answered and labelled per saved data part: a stopped build "
                        "resumes from its parts, a larger one reuses them")
    data_dir: str = option("", "directory of the data parts (default OUT/data); give one directory to several "
                           "runs to reuse what each built (parts are named by what determines them)")
    label_batch: int = option(4, "conversations per teacher-forced target pass")
    draft_vocab: int = option(8192, "most frequent target tokens of the data the head proposes from")
    ffn: int = option(0, "inner size of the head's MLP (0: the target's)")
    heads: int = option(0, "attention heads of the head (0: the target's)")
    kv_heads: int = option(0, "key/value heads of the head (0: the target's)")
    unroll: int = option(3, "training passes: pass j feeds the head its own features j-1 levels deep")
    decay: float = option(0.8, "loss weight factor per deeper pass")
    feature_loss: float = option(0.1, "weight of the smooth-L1 loss on pass 1's predicted features")
    seq_len: int = option(640, "rows per training sequence (the last ones of a conversation)")
    steps: int = option(600, "optimizer steps")
    batch_size: int = option(4, "conversations per optimizer step")
    lr: float = option(1e-3, "peak learning rate (AdamW, linear warm-up, cosine decay)")
    warmup: int = option(30, "warm-up steps")
    weight_decay: float = option(0.0, "AdamW weight decay")
    eval_fraction: float = option(0.05, "share of conversations held out to measure agreement")
    checkpoint_every: int = option(50, "steps between resumable checkpoints")
    seed: int = option(0, "seed of the self-written prompts, the split and the order")
    init_head: str = option("", "continue training this head directory (its sizes and sub-vocabulary are kept; "
                            "--ffn/--heads/--kv-heads/--draft-vocab are then ignored)")

    def validate(self) -> None:
        positive(self, "max_new_tokens", "l_max", "gen_batch", "chunk", "label_batch", "draft_vocab", "unroll", "seq_len",
                 "steps", "batch_size", "checkpoint_every")
        require(self.holdout >= 0 and self.self_prompts >= 0, "--holdout and --self-prompts must be at least 0")
        require(min(self.ffn, self.heads, self.kv_heads) >= 0, "--ffn, --heads and --kv-heads must be at least 0")
        require(0.0 < self.eval_fraction < 1.0, f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        require(self.lr > 0 and 0 < self.decay <= 1 and self.feature_loss >= 0,
                "--lr must be positive, --decay in (0, 1], --feature-loss at least 0")
        require(not self.data_dir or not Path(self.data_dir).expanduser().exists()
                or Path(self.data_dir).expanduser().is_dir(), f"--data-dir {self.data_dir!r} is not a directory")
        require(not self.init_head or is_head_dir(Path(self.init_head).expanduser()),
                f"--init-head {self.init_head!r} is not a feature-head directory (no feature_head.json)")

    def data_key(self) -> dict:
        return {k: getattr(self, k) for k in ("prompts", "holdout", "self_prompts", "max_new_tokens", "l_max", "seed")}


# ---------------------------------------------------------------- data


def instruction_prompts(spec: str, holdout: int) -> tuple[list[list[str]], dict]:
    """Conversations (lists of user turns) from `spec`, and counts per source."""
    from .bench.data import SPEC_BENCH, SPEC_BENCH_FILE, _file, _is_question_file, task_of

    convs, info = [], {}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == SPEC_BENCH or (Path(part).is_file() and _is_question_file(Path(part))):
            path = SPEC_BENCH_FILE if part == SPEC_BENCH else Path(part)
            seen: dict[str, int] = {}
            kept = 0
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                row = json.loads(line)
                task = task_of(row["category"])
                seen[task] = seen.get(task, 0) + 1
                if part == SPEC_BENCH and seen[task] <= holdout:
                    continue
                convs.append([t for t in row["turns"] if isinstance(t, str) and t.strip()])
                kept += 1
            info[part] = {"conversations": kept, "held_out_per_task": holdout if part == SPEC_BENCH else 0}
        elif Path(part).is_dir():
            raise DynaTreeError(f"--prompts {part!r} is a directory; give a prompts file")
        elif Path(part).is_file():
            found = [[p.text] for p in _file(Path(part), 0)]
            if not found:
                raise DynaTreeError(f"--prompts {part!r} holds no prompts")
            convs += found
            info[part] = {"conversations": len(found)}
        elif Path(part).exists():
            raise DynaTreeError(f"--prompts {part!r} is not a regular file; give a prompts file")
        else:
            raise DynaTreeError(f"--prompts {part!r}: neither 'specbench' nor an existing file")
    return convs, info


def _chat_ids(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    messages = []
    for user, answer in zip(turns, answers + [None]):
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


@torch.no_grad()
def generate_batched(target: LoadedModel, prompts: list[list[int]], max_new: int, batch: int, bar=None,
                     sample: bool = False, seed: int = 0) -> list[list[int]]:
    """The target's answer ids to each prompt (greedy unless `sample`), EOS included when reached;
    prompts batched by length (left-padded)."""
    pad = target.eos_ids[0] if target.eos_ids else 0
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(order), batch):
        rows = order[start: start + batch]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows],
                            device=target.device)
        if sample:
            torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        result = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=sample,
                                       temperature=0.9 if sample else None, top_p=0.95 if sample else None,
                                       top_k=None, eos_token_id=target.eos_ids or None, pad_token_id=pad)
        for row, i in enumerate(rows):
            answer = result[row, width:].tolist()
            for k, token in enumerate(answer):
                if token in target.eos_ids:
                    answer = answer[: k + 1]
                    break
            out[i] = answer
        if bar is not None:
            bar.update(len(rows))
    return out


def self_written(target: LoadedModel, n: int, cfg: EagleConfig, bar=None, parts: Path | None = None) -> list[list[str]]:
    """`n` questions the target writes from (topic, kind of request) seeds, sampled, in blocks of
    `gen_batch` seeds each sampled with its own seed: the first blocks of a larger `n` are those of a
    smaller one, so with `parts` (a directory of saved blocks) a build asked for more questions
    reuses the blocks written before and a stopped build resumes."""
    rng = random.Random(cfg.seed)
    seeds = [(t, a) for t in TOPICS for a in ASKS]
    rng.shuffle(seeds)
    seeds = (seeds * (n // len(seeds) + 1))[:n]
    out = []
    for block, start in enumerate(range(0, n, cfg.gen_batch)):
        asked = seeds[start: start + cfg.gen_batch]
        path = _part_path(parts, "questions", [target.name, asked, cfg.seed, block], ".json")
        if path is not None and path.exists():
            texts = json.loads(path.read_text())
            if bar is not None:
                bar.update(len(asked))
        else:
            prompts = [_chat_ids(target.tokenizer, [a.format(topic=t)], []) for t, a in asked]
            answers = generate_batched(target, prompts, 80, cfg.gen_batch, bar, sample=True,
                                       seed=cfg.seed * 1_000_003 + block)
            texts = [target.tokenizer.decode(ids, skip_special_tokens=True).strip().strip('"').strip()
                     for ids in answers]
            texts = [t for t in texts if 15 <= len(t) <= 600]
            if path is not None:
                _write_atomic(path, json.dumps(texts))
        out += [[t] for t in texts]
    return out


def _part_path(parts: Path | None, kind: str, key, suffix: str) -> Path | None:
    """Where a saved piece of data lives: named by a hash of everything that determines it."""
    if parts is None:
        return None
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return parts / f"{kind}-{digest}{suffix}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def answer_conversations(target: LoadedModel, convs: list[list[str]], cfg: EagleConfig, bar=None) -> list[list[int]]:
    """Token ids of every turn of every conversation asked in turn, with the target's own greedy
    answers in the history: one sequence per turn (its prompt with history, then its answer)."""
    tok = target.tokenizer
    answers: list[list[str]] = [[] for _ in convs]
    sequences = []
    for turn in range(max(len(c) for c in convs)):
        asked = [i for i, c in enumerate(convs) if len(c) > turn and len(answers[i]) == turn]
        prompts = {i: _chat_ids(tok, convs[i][: turn + 1], answers[i]) for i in asked}
        asked = [i for i in asked if len(prompts[i]) <= cfg.l_max]
        replies = generate_batched(target, [prompts[i] for i in asked], cfg.max_new_tokens, cfg.gen_batch, bar)
        for i, reply in zip(asked, replies):
            answers[i].append(tok.decode(reply, skip_special_tokens=True))
            sequences.append(prompts[i] + reply)
    return sequences


@torch.no_grad()
def label(target: LoadedModel, sequences: list[list[int]], batch: int, bar=None) -> tuple[list, list]:
    """For each sequence: the target's last hidden states (bfloat16, [n, hidden]) and argmax next
    tokens (int32, [n]), from one teacher-forced pass (right-padded batches: causal rows never see
    the padding)."""
    feats, labels = [None] * len(sequences), [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch):
        rows = order[start: start + batch]
        width = max(len(sequences[i]) for i in rows)
        ids = torch.tensor([sequences[i] + [0] * (width - len(sequences[i])) for i in rows], device=target.device)
        out = target.model(ids, use_cache=False, output_hidden_states=True)
        for row, i in enumerate(rows):
            n = len(sequences[i])
            feats[i] = out.hidden_states[-1][row, :n].to(torch.bfloat16).cpu()
            labels[i] = out.logits[row, :n].argmax(-1).int().cpu()
        if bar is not None:
            bar.update(sum(len(sequences[i]) for i in rows))
    return feats, labels


def build_data(target: LoadedModel, cfg: EagleConfig, progress: bool = True, parts: Path | None = None) -> dict:
    """Conversations, the target's answers, features and labels. Conversations are answered and
    labelled `chunk` at a time; with `parts` (a directory) each chunk is saved as it completes and
    found again by a hash of its conversations and options, so a stopped build resumes where it
    stopped and a larger build (more --self-prompts, another prompts file) reuses what was built."""
    from tqdm.auto import tqdm

    def bar(total, desc, unit):
        return tqdm(total=total, desc=desc, unit=unit, disable=not progress, file=sys.stderr, dynamic_ncols=True)

    if parts is not None:
        parts.mkdir(parents=True, exist_ok=True)
    convs, info = instruction_prompts(cfg.prompts, cfg.holdout)
    if cfg.self_prompts:
        b = bar(cfg.self_prompts, "target writes questions", "q")
        written = self_written(target, cfg.self_prompts, cfg, b, parts)
        b.close()
        info["self"] = {"conversations": len(written), "asked_for": cfg.self_prompts}
        convs += written
    if not convs:
        raise DynaTreeError("no instruction prompts: give --prompts or --self-prompts")
    data = {"key": cfg.data_key(), "info": info, "tokens": [], "features": [], "labels": []}
    b = bar(sum(len(c) for c in convs), "target answers and labels", "turn")
    reused = 0
    for start in range(0, len(convs), cfg.chunk):
        chunk = convs[start: start + cfg.chunk]
        path = _part_path(parts, "part", [target.name, chunk, cfg.max_new_tokens, cfg.l_max], ".pt")
        if path is not None and path.exists():
            part = torch.load(path, weights_only=True)
            b.update(sum(len(c) for c in chunk))
            reused += 1
        else:
            sequences = answer_conversations(target, chunk, cfg, b)
            feats, labels = label(target, sequences, cfg.label_batch)
            part = {"tokens": [torch.tensor(s, dtype=torch.int32) for s in sequences], "features": feats,
                    "labels": labels}
            if path is not None:
                _save_atomic(part, path)
        for name in ("tokens", "features", "labels"):
            data[name] += part[name]
    b.close()
    info["sequences"] = len(data["tokens"])
    info["tokens"] = sum(len(s) for s in data["tokens"])
    info["chunks"] = {"total": -(-len(convs) // cfg.chunk), "reused": reused}
    return data


# ---------------------------------------------------------------- head and training


def new_head(target: LoadedModel, cfg: EagleConfig, vocab_ids: torch.Tensor) -> FeatureHead:
    """A head shaped by the target (unless set), its decoder layer copied from the target's last
    layer when that is a Llama-shaped layer of the same sizes; fc starts as [0, I] (pass the feature)."""
    hidden, rows = target_features(target.model)
    tcfg = target.model.config
    config = HeadConfig(
        target=target.name, hidden_size=hidden, vocab_size=rows, tokenizer_sha1=tokenizer_fingerprint(target.tokenizer),
        draft_vocab=len(vocab_ids), heads=cfg.heads or getattr(tcfg, "num_attention_heads", 8),
        kv_heads=cfg.kv_heads or (cfg.heads if cfg.heads else getattr(tcfg, "num_key_value_heads", None)
                                  or tcfg.num_attention_heads),
        ffn=cfg.ffn or getattr(tcfg, "intermediate_size", 4 * hidden),
        context=target.context_length or 8192, rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-5),
    )
    torch.manual_seed(cfg.seed)
    head = FeatureHead(config, vocab_ids, name="feature-head")
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.weight[:, :hidden].normal_(0.0, 0.02)
        layers = getattr(getattr(target.model, "model", None), "layers", None)
        last = layers[-1] if layers is not None else None
        own = head.body.layers[0]
        if last is not None and type(last).__name__ == type(own).__name__:
            theirs = {k: v for k, v in last.state_dict().items()}
            mine = own.state_dict()
            if all(k in theirs and theirs[k].shape == v.shape for k, v in mine.items()):
                own.load_state_dict({k: theirs[k].float() for k in mine})
    return head.float()


def _pass_mask(rows: int, depth: int) -> torch.Tensor:
    """Additive mask [1, 1, rows, depth * rows] of pass `depth` (1-based) over the keys of passes
    1..depth: row r sees pass-1 keys r' <= r - (depth - 1) and pass-i key r - (depth - i)."""
    allowed = torch.zeros(rows, depth * rows, dtype=torch.bool)
    r = torch.arange(rows)
    allowed[:, :rows] = torch.ones(rows, rows, dtype=torch.bool).tril(-(depth - 1))
    for i in range(2, depth + 1):
        col = r - (depth - i)
        ok = col >= 0
        allowed[r[ok], (i - 1) * rows + col[ok]] = True
    mask = torch.zeros(rows, depth * rows)
    mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def unrolled_loss(head: FeatureHead, embed, out_rows, batch: dict, cfg: EagleConfig) -> tuple[torch.Tensor, list]:
    """Loss and per-pass top-1 agreement (count, total) for a batch of sequences (see module doc)."""
    from transformers import DynamicCache

    tokens, feats, labels, valid, positions = (batch[k] for k in ("tokens", "features", "labels", "valid", "positions"))
    B, L = tokens.shape
    with torch.no_grad():  # the target's embeddings stay frozen
        embeds = embed(tokens).float()
    cache = DynamicCache()
    total, stats = 0.0, []
    prev = None
    for depth in range(1, cfg.unroll + 1):
        # pass 1 reads the target's true feature of the position before each row; pass j the
        # previous pass's prediction at row r - 1
        feature_in = feats if depth == 1 else torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        out = head(embeds, feature_in, positions, _pass_mask(L, depth).expand(B, 1, L, depth * L), cache)
        logits = out @ out_rows.T
        rows = valid & (torch.arange(L) >= depth - 1)[None]  # rows that exist at this depth
        learn = rows & batch["covered"]  # ... and whose label the sub-vocabulary holds
        if bool(learn.any()):
            ce = F.cross_entropy(logits[learn], batch["sub_labels"][learn], reduction="mean")
            total = total + (cfg.decay ** (depth - 1)) * ce
            if depth == 1 and cfg.feature_loss:
                total = total + cfg.feature_loss * F.smooth_l1_loss(out[learn], batch["next_features"][learn])
        hit = (batch["head_vocab"][logits.argmax(-1)] == labels) & rows
        stats.append((int(hit.sum()), int(rows.sum())))
        prev = out
    return total, stats


def make_batch(data: dict, picked: list[int], seq_len: int, sub_index: torch.Tensor, head_vocab: torch.Tensor) -> dict:
    """Rows r of a sequence of n tokens (the last seq_len of 0..n-2): input token x_{r+1} at position
    r+1 with feature f_r; label the target's argmax at r+1 and feature f_{r+1}. Right-padded."""
    rows = [min(seq_len, len(data["tokens"][i]) - 1) for i in picked]
    L = max(rows)
    B = len(picked)
    H = data["features"][picked[0]].shape[1]
    tokens = torch.zeros(B, L, dtype=torch.long)
    feats = torch.zeros(B, L, H)
    nxt = torch.zeros(B, L, H)
    labels = torch.full((B, L), -1, dtype=torch.long)
    positions = torch.zeros(B, L, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    for b, (i, m) in enumerate(zip(picked, rows)):
        n = len(data["tokens"][i])
        start = n - 1 - m  # first row
        r = torch.arange(start, n - 1)
        tokens[b, :m] = data["tokens"][i][r + 1].long()
        feats[b, :m] = data["features"][i][r].float()
        nxt[b, :m] = data["features"][i][r + 1].float()
        labels[b, :m] = data["labels"][i][r + 1].long()
        positions[b, :m] = r + 1
        positions[b, m:] = n + torch.arange(L - m)
        valid[b, :m] = True
    sub = sub_index[labels.clamp(min=0)]
    return {"tokens": tokens, "features": feats, "next_features": nxt, "labels": labels, "sub_labels": sub.clamp(min=0),
            "valid": valid, "covered": sub >= 0,  # labels outside the sub-vocabulary: counted as misses, no loss
            "positions": positions, "head_vocab": head_vocab}


@torch.no_grad()
def evaluate(head, embed, out_rows, data, held, cfg, sub_index, head_vocab) -> dict:
    """Held-out top-1 agreement with the target per depth (pass), over all rows whose label the
    sub-vocabulary holds, and the share of labels it holds."""
    head.eval()
    hits = [[0, 0] for _ in range(cfg.unroll)]
    covered = total = 0
    for s in range(0, len(held), cfg.batch_size):
        batch = make_batch(data, held[s: s + cfg.batch_size], cfg.seq_len, sub_index, head_vocab)
        _, stats = unrolled_loss(head, embed, out_rows, batch, cfg)
        for d, (h, n) in enumerate(stats):
            hits[d][0] += h
            hits[d][1] += n
        real = batch["labels"] >= 0
        covered += int((sub_index[batch["labels"].clamp(min=0)] >= 0)[real].sum())
        total += int(real.sum())
    head.train()
    return {"agreement_by_depth": [h / max(n, 1) for h, n in hits], "vocab_coverage": covered / max(total, 1)}


def distill_eagle(target: LoadedModel, out: Path, cfg: EagleConfig, resume: bool = False, progress: bool = True,
                  command: list[str] | None = None) -> dict:
    """Train a feature head for `target` into `out`; return the summary written to out/distill.json."""
    from tqdm.auto import tqdm

    cfg.validate()
    target_features(target.model)  # a target whose last hidden state cannot be read fails here, before any work
    out = Path(out)
    ckpt_path, data_path = out / "checkpoint.pt", out / "data.pt"
    if not resume and ((out / "feature_head.json").exists() or ckpt_path.exists()):
        raise DynaTreeError(f"{out} already holds a head or a checkpoint; pass --resume to continue it, "
                            "or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    # data.pt: the whole data set of an earlier build (kept for the runs that have one); else the
    # parts in out/data/, built now where missing
    data = torch.load(data_path, weights_only=False) if data_path.exists() else None
    if data is not None and data["key"] != cfg.data_key():
        raise DynaTreeError(f"{data_path} was built with other data options ({data['key']}); "
                            "use the same options or another --out")
    if data is None:
        t0 = time.perf_counter()
        parts = Path(cfg.data_dir).expanduser() if cfg.data_dir else out / "data"
        data = build_data(target, cfg, progress, parts=parts)
        data["info"]["build_s"] = time.perf_counter() - t0  # this run's (reused parts cost nothing)
    n = len(data["tokens"])
    idx = list(range(n))
    random.Random(cfg.seed).shuffle(idx)
    n_held = max(1, round(n * cfg.eval_fraction))
    held, train = sorted(idx[:n_held]), idx[n_held:]
    if not train:
        raise DynaTreeError("the data gave too few conversations to train on")

    counts = torch.bincount(torch.cat([data["labels"][i].long() for i in train]), minlength=target.vocab_size)
    start_from = None
    if cfg.init_head:  # continue an existing head: its sub-vocabulary too
        start_from = load_head(Path(cfg.init_head).expanduser(), name=cfg.init_head)
        check_head(start_from, target)
        head_vocab = start_from.vocab_ids.cpu()
    else:
        head_vocab = counts.argsort(descending=True)[: min(cfg.draft_vocab, target.vocab_size)].sort().values
    sub_index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    sub_index[head_vocab] = torch.arange(len(head_vocab))
    train_coverage = float(counts[head_vocab].sum() / counts.sum())

    head = new_head(target, cfg, head_vocab) if start_from is None else start_from.float().train()
    embed = target.model.get_input_embeddings()
    out_rows = target.model.get_output_embeddings().weight.detach()[head_vocab].float()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    step, history, prior_s = 0, [], 0.0
    if resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        # --steps may change on resume (a run cut short or extended): the cosine decay follows the new
        # total from the checkpoint's step on, and the history records where it changed
        changed = sorted(k for k, v in dataclasses.asdict(cfg).items() if state["config"].get(k) != v and k != "steps")
        if changed:
            raise DynaTreeError(f"{ckpt_path} was trained with other options ({', '.join(changed)} differ); "
                                "resume with the same options (only --steps may change)")
        if cfg.steps < state["step"]:
            raise DynaTreeError(f"--steps {cfg.steps} is below the {state['step']} steps {ckpt_path} has already trained")
        head.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, history, prior_s = state["step"], state["history"], state["train_s"]
        if state["config"]["steps"] != cfg.steps:
            history.append({"step": step, "steps_changed": {"from": state["config"]["steps"], "to": cfg.steps}})
    head.train()
    feed = batches(train, cfg.batch_size, step, random.Random(cfg.seed + 1))
    bar = tqdm(total=cfg.steps, initial=step, desc="distill eagle", unit="step", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    avg = None
    while step < cfg.steps:
        batch = make_batch(data, next(feed), cfg.seq_len, sub_index, head_vocab)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg, floor=0.05)
        loss, stats = unrolled_loss(head, embed, out_rows, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        agree = [h / max(t, 1) for h, t in stats]
        avg = agree if avg is None else [0.95 * a + 0.05 * b for a, b in zip(avg, agree)]
        bar.set_postfix_str(f"step loss {loss.item():.3f} | moving avg agreement by depth "
                            + " ".join(f"{a:.0%}" for a in avg),
                            refresh=False)
        bar.update(1)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            # the step's own loss, and agreement as a moving average (weight 0.05 per step)
            history.append({"step": step, "train_step_loss": loss.item(), "train_agreement_moving_avg": avg,
                            "held_out": evaluate(head, embed, out_rows, data, held, cfg, sub_index, head_vocab)})
            _save_atomic({"model": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "history": history,
                          "config": dataclasses.asdict(cfg), "train_s": prior_s + time.perf_counter() - t0}, ckpt_path)
    bar.close()
    train_s = prior_s + time.perf_counter() - t0
    final = evaluate(head, embed, out_rows, data, held, cfg, sub_index, head_vocab)
    info = dict(data["info"], train_conversations=len(train), held_out_conversations=len(held),
                train_vocab_coverage=train_coverage)
    summary = {
        "command": command if command is not None else sys.argv,
        "kind": "eagle",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "target": target.name,
        "config": dataclasses.asdict(cfg),
        "parameters": sum(p.numel() for p in head.parameters()),
        "data": info,
        "held_out": final,
        "history": history,
        "timings": {"build_s": data["info"].get("build_s"), "train_s": train_s},
        "env": env.describe(target.device),
    }
    head.eval().save(out, extra={"trained": {"held_out": final, "steps": cfg.steps}})
    (out / "distill.json").write_text(json.dumps(summary, indent=2) + "\n")
    depth = " / ".join(f"{a:.1%}" for a in final["agreement_by_depth"])
    (out / "README.md").write_text(
        f"# Feature head for {target.name}\n\nTrained with `dynatree distill --kind eagle` "
        f"({summary['parameters'] / 1e6:.1f}M parameters: one decoder layer over the target's features, "
        f"proposing from the {len(head_vocab)} most frequent tokens, {final['vocab_coverage']:.1%} of held-out labels).\n"
        f"Held-out top-1 agreement with the target at draft depth 1 / 2 / ...: {depth}.\n"
        f"Use: `dynatree generate PROMPT --chat --target {target.name} --draft {out}`. Details in distill.json.\n"
    )
    return summary
