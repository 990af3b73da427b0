"""`dynatree distill --kind eagle`: train a feature head (featurehead.py) for a target.

Data is on-policy chat: the target's own greedy answers (EOS respected), through its chat
template, to instruction prompts:
  specbench    Spec-Bench's questions, every turn (a second turn is asked with the target's
               own first answer in the history), except the first `holdout` questions of each
               task: those are what `dynatree bench --dataset specbench --n N` (N <= holdout)
               measures, so a benchmark never runs on training text
  specbench-asks  other requests over the same training questions' articles, passages, sentences
               and problems (chat.other_asks): summaries, facts, quotes, follow-up turns
  self         questions the target writes itself from topic seeds (sampled), then answers
  documents    articles and encyclopedia text the target writes itself from topic seeds (sampled),
               each given back to it to summarize or quote (chat.DOCUMENT_KINDS): long inputs
               like Spec-Bench's summarization and RAG prompts, none of them benchmark text
  FILE         prompts of a file (`--prompts`): Spec-Bench question .jsonl, one
               {"prompt": ...} per line, or plain text with blank-line-separated paragraphs
Answers are generated in batches; then one teacher-forced target pass over each whole
conversation gives both the features (last hidden states) and the labels (the target's argmax
next token at every position): the labels and the features come from the same forward.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.func import functional_call

from ..config import option, positive, require
from ..draftspec import is_head_dir
from ..errors import DynaTreeError
from ..files import write_bytes_atomic, write_text_atomic
from ..runtime import LoadedModel
from .chat import ASKS, DOCUMENT_KINDS, SPECULATE_FROM, TOPICS, chat_ids, generate_batched, instruction_sources
from .common import save_atomic


@dataclass
class ChatDataConfig:
    """What the on-policy chat data is (the target's answers to which prompts): shared by the kinds
    built from it (`--kind eagle`, `--kind store`), whose parts each other's runs reuse."""

    prompts: str = option("specbench", "instruction prompts: 'specbench' (all but the held-out questions), "
                          "'specbench-asks' (other requests over their material), a file, or several joined by commas")
    holdout: int = option(10, "Spec-Bench questions per task left out of training (bench --n up to this stays unseen)")
    self_prompts: int = option(256, "extra questions the target writes itself from topic seeds, then answers")
    self_documents: int = option(0, "documents (articles, encyclopedia text) the target writes itself from topic "
                                 "seeds, each then given back to it to summarize or quote")
    max_new_tokens: int = option(256, "longest answer per turn (EOS ends it sooner)")
    l_max: int = option(1024, "longest prompt (with history) in tokens; longer ones are left out")
    gen_batch: int = option(16, "conversations per batched target generation")
    chunk: int = option(64, "conversations answered and labelled per saved data part: a stopped build "
                        "resumes from its parts, a larger one reuses them")
    data_dir: str = option("", "directory of the data parts (default OUT/data); give one directory to several "
                           "runs to reuse what each built (parts are named by what determines them)")
    seed: int = option(0, "seed of the self-written prompts, the new head's initialisation, the split and the order")

    def validate(self) -> None:
        positive(self, "max_new_tokens", "l_max", "gen_batch", "chunk")
        require(min(self.holdout, self.self_prompts, self.self_documents) >= 0,
                "--holdout, --self-prompts and --self-documents must be at least 0")
        require(not self.data_dir or not Path(self.data_dir).expanduser().exists()
                or Path(self.data_dir).expanduser().is_dir(), f"--data-dir {self.data_dir!r} is not a directory")

    def data_key(self) -> dict:
        key = {k: getattr(self, k) for k in ("prompts", "holdout", "self_prompts", "max_new_tokens", "l_max", "seed")}
        if self.self_documents:  # (absent when 0: the key of data built before the option existed)
            key["self_documents"] = self.self_documents
        return key


# --label-dtype's choices: the dtype the labelling pass's parameters take (None: the target's as loaded)
LABEL_DTYPES = {"target": None, "bfloat16": torch.bfloat16}


@dataclass
class EagleConfig(ChatDataConfig):
    label_batch: int = option(4, "conversations per teacher-forced target pass")
    loss_rows: str = option("all", "rows the loss is taken on: 'all' (prompt and answer tokens) or 'answers' (the "
                            "target's answers only: what drafting meets)")
    draft_vocab: int = option(8192, "most frequent target tokens of the data the head proposes from")
    ffn: int = option(0, "inner size of the head's MLP (0: the target's)")
    heads: int = option(0, "attention heads of the head (0: the target's)")
    kv_heads: int = option(0, "key/value heads of the head (0: the target's)")
    unroll: int = option(3, "training passes: pass j feeds the head its own features j-1 levels deep")
    decay: float = option(0.8, "loss weight factor per deeper pass")
    feature_loss: float = option(0.1, "weight of the smooth-L1 loss on pass 1's predicted features")
    feature_noise: float = option(0.0, "training only: uniform noise on the target's features that pass 1 reads, as a "
                                  "share of each feature's RMS (f + a * rms(f) * U(-1, 1); EAGLE adds noise of a "
                                  "fixed size instead): a regulariser for a head that memorizes its data; 0: none")
    label_loss: str = option("hard", "what each row's token loss is taken against: 'hard', the target's argmax "
                             "next token; 'soft', the target's distribution over the head's sub-vocabulary "
                             "(softmax of its output rows at the target's next feature, as EAGLE trains; "
                             "costs one more output-layer product per row)")
    seq_len: int = option(640, "rows per training sequence (the last ones of a conversation)")
    steps: int = option(600, "optimizer steps")
    batch_size: int = option(4, "conversations per optimizer step")
    lr: float = option(1e-3, "peak learning rate (AdamW, linear warm-up, cosine decay)")
    warmup: int = option(30, "warm-up steps (cut to --steps when longer)")
    weight_decay: float = option(0.0, "AdamW weight decay")
    eval_fraction: float = option(0.05, "share of conversations held out to measure agreement")
    checkpoint_every: int = option(50, "steps between resumable checkpoints")
    train_dtype: str = option("float32", "dtype of the head's products while training: 'bfloat16' runs them under "
                              "autocast (weights, optimizer and held-out evaluation stay float32); about twice as "
                              "fast where the hardware has native bfloat16 (AVX-512 bf16 or AMX CPUs, GPUs); emulated, "
                              "about 80x slower, on an AVX2-only CPU (distill warns)")
    label_dtype: str = option("target", "the teacher-forced pass that computes the features and labels: 'target' "
                              "runs the target as loaded (float32 from the CLI); 'bfloat16' runs it on bfloat16 "
                              "copies of a dense float32 target's weights, about 2.6x faster on a CPU with AMX "
                              "(docs/results/eagle-label-dtype: 98.9% of answer labels equal float32's), likely "
                              "slower on an AVX2-only CPU; the answers stay the target's own, and its parts are "
                              "kept apart")
    init_head: str = option("", "continue training this head directory (its sizes and sub-vocabulary are kept; "
                            "--ffn/--heads/--kv-heads/--draft-vocab are then ignored)")

    def validate(self) -> None:
        super().validate()
        positive(self, "label_batch", "draft_vocab", "unroll", "seq_len", "steps", "batch_size", "checkpoint_every")
        require(self.train_dtype in ("float32", "bfloat16"),
                f"--train-dtype must be float32 or bfloat16, got {self.train_dtype!r}")
        require(self.label_dtype in LABEL_DTYPES,
                f"--label-dtype must be {' or '.join(LABEL_DTYPES)}, got {self.label_dtype!r}")
        require(min(self.ffn, self.heads, self.kv_heads) >= 0, "--ffn, --heads and --kv-heads must be at least 0")
        require(0.0 < self.eval_fraction < 1.0, f"--eval-fraction must be in (0, 1), got {self.eval_fraction}")
        require(self.loss_rows in ("all", "answers"), f"--loss-rows must be all or answers, got {self.loss_rows!r}")
        require(self.label_loss in ("hard", "soft"), f"--label-loss must be hard or soft, got {self.label_loss!r}")
        require(self.lr > 0 and 0 < self.decay <= 1 and self.feature_loss >= 0 and self.feature_noise >= 0,
                "--lr must be positive, --decay in (0, 1], --feature-loss and --feature-noise at least 0")
        require(self.warmup >= 0 and self.weight_decay >= 0, "--warmup and --weight-decay must be at least 0")
        require(not self.init_head or is_head_dir(Path(self.init_head).expanduser()),
                f"--init-head {self.init_head!r} is not a feature-head directory (no feature_head.json)")

    def data_key(self) -> dict:
        """What the whole data set (an earlier build's data.pt) depends on: the chat data's key, and the
        labelling pass unless the target's own (absent then: the key of data built before the option)."""
        key = super().data_key()
        if self.label_dtype != "target":
            key["label_dtype"] = self.label_dtype
        return key


def question_blocks(n: int, cfg: ChatDataConfig) -> list[list[tuple[str, str]]]:
    """The (topic, kind of request) seeds of `n` self-written questions, in blocks of `gen_batch`:
    the first blocks of a larger `n` are those of a smaller one (a saved block is named by its seeds)."""
    return _seed_blocks([(t, a) for t in TOPICS for a in ASKS], n, random.Random(cfg.seed), cfg.gen_batch)


def _seed_blocks(seeds: list, n: int, rng: random.Random, batch: int) -> list[list]:
    """`n` of `seeds` shuffled by `rng` (repeated in the same order when `n` is larger), in blocks of
    `batch`: the first blocks of a larger `n` are those of a smaller one."""
    rng.shuffle(seeds)
    seeds = (seeds * (n // len(seeds) + 1))[:n]
    return [seeds[start: start + batch] for start in range(0, n, batch)]


def question_path(parts: Path | None, target: LoadedModel, asked, block: int, cfg: ChatDataConfig) -> Path | None:
    """Where block `block` of self-written questions (seeds `asked`) is saved."""
    return _part_path(parts, "questions", [_target_key(target), asked, cfg.seed, block], ".json")


def question_texts(target: LoadedModel, answers: list[list[int]]) -> list[str]:
    """The questions in the target's sampled answers to the seeds' requests: decoded, quotes
    stripped, kept at 15 to 600 characters."""
    texts = [target.tokenizer.decode(ids, skip_special_tokens=True).strip().strip('"').strip() for ids in answers]
    return [t for t in texts if 15 <= len(t) <= 600]


def sampled_blocks(target: LoadedModel, blocks, requests, path_of, seed_of, max_new: int, texts_of,
                   cfg: ChatDataConfig, bar=None) -> list[list]:
    """The texts the target writes, sampled, for each block of seeds: `requests(seeds)` are the
    block's requests, `seed_of(block)` its sampling seed, `texts_of(target, answers)` what is kept of
    its answers (aligned with the seeds or filtered), `path_of(block, seeds)` where it is saved (None:
    not saved). A saved block is read back instead of written: a build asked for more reuses the
    blocks written before, and a stopped build resumes."""
    out = []
    for block, asked in enumerate(blocks):
        path = path_of(block, asked)
        if path is not None and path.exists():
            texts = json.loads(path.read_text())
            if bar is not None:
                bar.update(len(asked))
        else:
            prompts = [chat_ids(target.tokenizer, [r], []) for r in requests(asked)]
            texts = texts_of(target, generate_batched(target, prompts, max_new, cfg.gen_batch, bar, sample=True,
                                                      seed=seed_of(block)))
            if path is not None:
                write_text_atomic(path, json.dumps(texts))
        out.append(texts)
    return out


# Longest question the target is asked to write, in tokens.
QUESTION_TOKENS = 80


def question_seed(cfg: ChatDataConfig, block: int) -> int:
    """The sampling seed of question block `block`."""
    return cfg.seed * 1_000_003 + block


def question_requests(asked) -> list[str]:
    """The requests that write a block of questions (seeds: (topic, kind of request))."""
    return [a.format(topic=t) for t, a in asked]


def self_written(target: LoadedModel, n: int, cfg: ChatDataConfig, bar=None, parts: Path | None = None) -> list[list[str]]:
    """`n` questions the target writes from (topic, kind of request) seeds, sampled, in blocks of
    `gen_batch` seeds each sampled with its own seed (`question_blocks`, `sampled_blocks`): with
    `parts` (a directory of saved blocks) a build asked for more questions reuses the blocks written
    before and a stopped build resumes."""
    texts = sampled_blocks(target, question_blocks(n, cfg), question_requests,
                           lambda block, asked: question_path(parts, target, asked, block, cfg),
                           lambda block: question_seed(cfg, block), QUESTION_TOKENS, question_texts, cfg, bar)
    return [[t] for block in texts for t in block]


# Longest document the target is asked to write, in tokens (a 200-word article is about 260).
DOCUMENT_TOKENS = 320
# Kept documents, in characters: shorter ones are refusals or fragments.
DOCUMENT_CHARS = (40, 4000)


def document_blocks(n: int, cfg: ChatDataConfig) -> list[list[tuple[str, int, int]]]:
    """The (topic, kind of document, use) seeds of `n` self-written documents (indexes into
    chat.DOCUMENT_KINDS), in blocks of `gen_batch`: the first blocks of a larger `n` are those of a
    smaller one (a saved block is named by its seeds)."""
    seeds = [(t, k, u) for t in TOPICS for k, (_, uses) in enumerate(DOCUMENT_KINDS) for u in range(len(uses))]
    return _seed_blocks(seeds, n, random.Random(f"documents-{cfg.seed}"), cfg.gen_batch)


def document_path(parts: Path | None, target: LoadedModel, asked, block: int, cfg: ChatDataConfig) -> Path | None:
    """Where block `block` of self-written documents (seeds `asked`) is saved: named by the topics, the
    requests that wrote the documents and the conversations that use them (their texts, not their
    indexes in DOCUMENT_KINDS: a reworded or inserted kind never reuses another's documents)."""
    seeds = [(t, DOCUMENT_KINDS[k][0], DOCUMENT_KINDS[k][1][u]) for t, k, u in asked]
    return _part_path(parts, "documents", [_target_key(target), seeds, cfg.seed, block], ".json")


def document_texts(target: LoadedModel, answers: list[list[int]]) -> list[str | None]:
    """The documents in the target's sampled answers: decoded and stripped; None where outside
    DOCUMENT_CHARS (saved as None, so that saved texts stay aligned with their seeds)."""
    texts = [target.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in answers]
    return [t if DOCUMENT_CHARS[0] <= len(t) <= DOCUMENT_CHARS[1] else None for t in texts]


def document_conversations(asked, texts: list[str | None]) -> list[list[str]]:
    """The conversation of each seed's use (chat.DOCUMENT_KINDS) around its kept document."""
    return [[turn.replace("{doc}", text) for turn in DOCUMENT_KINDS[k][1][u]]
            for (_, k, u), text in zip(asked, texts) if text is not None]


def document_requests(asked) -> list[str]:
    """The requests that write a block of documents (seeds: (topic, kind, use))."""
    return [DOCUMENT_KINDS[k][0].format(topic=t) for t, k, _ in asked]


def self_documents(target: LoadedModel, n: int, cfg: ChatDataConfig, bar=None, parts: Path | None = None) -> list[list[str]]:
    """Conversations over `n` documents the target writes from (topic, kind, use) seeds, sampled, in
    blocks of `gen_batch` seeds each sampled with its own seed (`document_blocks`, `sampled_blocks`:
    saved and reused like the questions); a document outside DOCUMENT_CHARS is left out."""
    blocks = document_blocks(n, cfg)
    texts = sampled_blocks(target, blocks, document_requests,
                           lambda block, asked: document_path(parts, target, asked, block, cfg),
                           lambda block: document_seed(cfg, block), DOCUMENT_TOKENS, document_texts, cfg, bar)
    return [conv for asked, written in zip(blocks, texts) for conv in document_conversations(asked, written)]


def document_seed(cfg: ChatDataConfig, block: int) -> int:
    """The sampling seed of document block `block` (the question blocks' are seed * 1_000_003 + block)."""
    return cfg.seed * 1_000_003 + 500_009 + block


def _part_path(parts: Path | None, kind: str, key, suffix: str) -> Path | None:
    """Where a saved piece of data lives: named by a hash of everything that determines it."""
    if parts is None:
        return None
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return parts / f"{kind}-{digest}{suffix}"


def write_answers(path: Path, target: LoadedModel, sequences: list[list[int]], starts: list[int]) -> None:
    """Save a chunk's token ids (prompts with history, then the target's answers) and where each
    answer starts: the part of the data that costs generation time, small enough (gzip JSON, a few
    bytes per token) to commit, so builds accumulate across machines; features and labels are one
    teacher-forced pass over these ids and are recomputed (`label`) where only this file exists.
    The record says where the answers were generated (dtype, device, library versions, CPU): another
    machine's kernels may round differently, so a regenerated chunk can differ in a few tokens."""
    from ..env import describe

    machine = describe(target.device)
    record = {"target": target.name, "weights": target.weights, "dtype": _dtype_name(target),
              "device": str(target.device), "versions": machine["versions"], "cpu": machine["cpu"],
              "answers": f"greedy; on a CPU prompts of {SPECULATE_FROM}+ tokens by exact linear n-gram speculation",
              "sequences": sequences, "answer_from": starts}
    write_bytes_atomic(path, gzip.compress(json.dumps(record, separators=(",", ":")).encode(), mtime=0))


def read_answers(path: Path, target: LoadedModel) -> tuple[list[list[int]], list[int]]:
    """A saved chunk's (sequences, answer starts), checked against `target` (its name, weight format
    and dtype, as recorded), or a one-line error."""
    try:
        record = json.loads(gzip.decompress(path.read_bytes()))
        sequences, starts = record["sequences"], record["answer_from"]
        ok = (len(sequences) == len(starts) and all(isinstance(n, int) and 0 < n <= len(seq)
                                                    and all(isinstance(t, int) for t in seq)
                                                    for seq, n in zip(sequences, starts)))
    except (OSError, EOFError, zlib.error, ValueError, KeyError, TypeError) as e:
        raise DynaTreeError(f"{path} is not a saved chunk of answers ({e}); delete it to generate it again") from e
    if not ok:
        raise DynaTreeError(f"{path} is not a saved chunk of answers (sequences and answer starts do not match); "
                            "delete it to generate it again")
    if record.get("target") != target.name:  # the name is in the file's hash too: this is a renamed file
        raise DynaTreeError(f"{path} holds answers of {record.get('target')!r}, not of {target.name!r}")
    # (files written before the format was recorded say only their dtype; `_target_key` names both apart now)
    for what, saved, here in (("weights", record.get("weights", target.weights), target.weights),
                              ("dtype", record.get("dtype", _dtype_name(target)), _dtype_name(target))):
        if saved != here:
            raise DynaTreeError(f"{path} holds answers of {target.name} in {what} {saved}, not {here} as loaded "
                                f"(another {what} writes other answers); move it away to generate them again")
    return sequences, starts


def answered_turns(target: LoadedModel, convs: list[list[str]], cfg: ChatDataConfig, batch: int,
                   bar=None) -> list[tuple[int, list[int], int]]:
    """Every turn of every conversation asked in turn, with the target's own greedy answers in the
    history, `batch` prompts per generation: (conversation index, its prompt with history then its
    answer, where the answer starts), turn by turn, conversations in order. A prompt over `l_max`
    tokens is left out, with its conversation's later turns."""
    tok = target.tokenizer
    answers: list[list[str]] = [[] for _ in convs]
    out = []
    for turn in range(max(len(c) for c in convs)):
        asked = [i for i, c in enumerate(convs) if len(c) > turn and len(answers[i]) == turn]
        prompts = {i: chat_ids(tok, convs[i][: turn + 1], answers[i]) for i in asked}
        asked = [i for i in asked if len(prompts[i]) <= cfg.l_max]
        replies = generate_batched(target, [prompts[i] for i in asked], cfg.max_new_tokens, batch, bar)
        for i, reply in zip(asked, replies):
            answers[i].append(tok.decode(reply, skip_special_tokens=True))
            out.append((i, prompts[i] + reply, len(prompts[i])))
    return out


def answer_conversations(target: LoadedModel, convs: list[list[str]], cfg: ChatDataConfig,
                         bar=None) -> tuple[list[list[int]], list[int]]:
    """Token ids of every turn of every conversation (`answered_turns`, `gen_batch` at a time): one
    sequence per turn (its prompt with history, then its answer), and where each answer starts."""
    turns = answered_turns(target, convs, cfg, cfg.gen_batch, bar)
    return [sequence for _, sequence, _ in turns], [start for _, _, start in turns]


@torch.no_grad()
def label(target: LoadedModel, sequences: list[list[int]], batch: int, bar=None,
          params: dict | None = None) -> tuple[list, list]:
    """For each sequence: the target's last hidden states (bfloat16, [n, hidden]) and argmax next
    tokens (int32, [n]), from one teacher-forced pass (right-padded batches: causal rows never see
    the padding). `params` (from `labelling_params`): run the target's modules on these parameters
    instead of its own (`torch.func.functional_call`)."""
    feats, labels = [None] * len(sequences), [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    for start in range(0, len(order), batch):
        rows = order[start: start + batch]
        width = max(len(sequences[i]) for i in rows)
        ids = torch.tensor([sequences[i] + [0] * (width - len(sequences[i])) for i in rows], device=target.device)
        kwargs = {"use_cache": False, "output_hidden_states": True}
        out = target.model(ids, **kwargs) if params is None else functional_call(target.model, params, (ids,), kwargs)
        for row, i in enumerate(rows):
            n = len(sequences[i])
            feats[i] = out.hidden_states[-1][row, :n].to(torch.bfloat16).cpu()
            labels[i] = out.logits[row, :n].argmax(-1).int().cpu()
        if bar is not None:
            bar.update(sum(len(sequences[i]) for i in rows))
    return feats, labels


def turn_digest(tokens) -> bytes:
    """Identity of one turn (its token ids), to keep a turn asked by two sources once."""
    return hashlib.sha1(torch.as_tensor(tokens, dtype=torch.int32).numpy().tobytes()).digest()


def _bar(progress: bool):
    from tqdm.auto import tqdm

    def bar(total, desc, unit):
        return tqdm(total=total, desc=desc, unit=unit, disable=not progress, file=sys.stderr, dynamic_ncols=True)

    return bar


def chat_chunks(target: LoadedModel, cfg: ChatDataConfig, progress: bool = True,
                parts: Path | None = None) -> tuple[list[list[list[str]]], dict]:
    """The conversations of the data (instruction sources, then the self-written questions, then the
    conversations over self-written documents), cut
    into chunks of `cfg.chunk` per source (adding, dropping or reordering sources keeps the others'
    parts), and what they came from."""
    bar = _bar(progress)
    if parts is not None:
        parts.mkdir(parents=True, exist_ok=True)
    groups, info = instruction_sources(cfg.prompts, cfg.holdout)
    for n, write, name, what, unit in ((cfg.self_prompts, self_written, "self", "questions", "q"),
                                       (cfg.self_documents, self_documents, "documents", "documents", "doc")):
        if n:  # the target's self-written sources, after the instruction sources
            b = bar(n, f"target writes {what}", unit)
            convs = write(target, n, cfg, b, parts)
            b.close()
            info[name] = {"conversations": len(convs), "asked_for": n}
            groups.append(convs)
    if not any(groups):
        raise DynaTreeError("no instruction prompts: give --prompts, --self-prompts or --self-documents")
    return [group[start: start + cfg.chunk] for group in groups for start in range(0, len(group), cfg.chunk)], info


def _target_key(target: LoadedModel) -> str:
    """The target as saved pieces name it: its name, and its weight format unless dense, or its dtype
    when dense and not float32 (a q4 or bfloat16 target writes other answers than the float32 one of the
    same name; dense float32 keeps the keys of the data already saved)."""
    if target.weights != "dense":
        return f"{target.name}@{target.weights}"
    dtype = _dtype_name(target)
    return target.name if dtype == "float32" else f"{target.name}@{dtype}"


def _dtype_name(target: LoadedModel) -> str:
    return str(target.dtype).removeprefix("torch.")


def _chunk_key(target: LoadedModel, chunk, cfg: ChatDataConfig) -> list:
    return [_target_key(target), chunk, cfg.max_new_tokens, cfg.l_max]


def check_labelling(target: LoadedModel, cfg: EagleConfig) -> None:
    """`cfg.label_dtype` is a choice, and a copy in another dtype is asked of a dense float32 target only
    (any other is already in a reduced format): else a one-line error."""
    if cfg.label_dtype not in LABEL_DTYPES:
        raise DynaTreeError(f"--label-dtype must be {' or '.join(LABEL_DTYPES)}, got {cfg.label_dtype!r}")
    if LABEL_DTYPES[cfg.label_dtype] is None:
        return
    if target.weights != "dense" or target.dtype != torch.float32:
        form = target.weights if target.weights != "dense" else _dtype_name(target)
        raise DynaTreeError(f"--label-dtype {cfg.label_dtype} copies a dense float32 target's weights; "
                            f"{target.name} is loaded as {form} (leave --label-dtype out: its pass already runs so)")


def labelling_params(target: LoadedModel, cfg: EagleConfig) -> dict | None:
    """The parameters `label` runs the target on for `cfg.label_dtype`: None for the target's own, else
    a copy of each in that dtype (buffers, such as rotary frequencies, stay as they are)."""
    check_labelling(target, cfg)
    dtype = LABEL_DTYPES[cfg.label_dtype]
    return None if dtype is None else {name: p.detach().to(dtype) for name, p in target.model.named_parameters()}


def _label_key(key: list, cfg: EagleConfig) -> list:
    """A part's key: its chunk's, and the labelling pass unless the target's own (whose parts keep the
    names they had before the option existed)."""
    return key if cfg.label_dtype == "target" else [*key, f"labels@{cfg.label_dtype}"]


def _answers_from_part(answers_path: Path, target: LoadedModel, part: dict) -> None:
    """Write the answers file of a part built before answers were kept apart (when it knows where
    its answers start)."""
    if part.get("answer_from"):
        write_answers(answers_path, target, [t.tolist() for t in part["tokens"]], part["answer_from"])


def chunk_answers(target: LoadedModel, chunk, cfg: ChatDataConfig, parts: Path | None,
                  bar=None) -> tuple[list[list[int]], list[int], bool]:
    """A chunk's (sequences, answer starts, whether they were read from a saved answers file): read
    when saved, else generated (and saved when `parts` is given)."""
    answers_path = _part_path(parts, "answers", _chunk_key(target, chunk, cfg), ".json.gz")
    part_path = _part_path(parts, "part", _chunk_key(target, chunk, cfg), ".pt")
    if answers_path is not None and not answers_path.exists() and part_path.exists():
        _answers_from_part(answers_path, target, torch.load(part_path, weights_only=True))
    if answers_path is not None and answers_path.exists():
        sequences, starts = read_answers(answers_path, target)
        if bar is not None:
            bar.update(sum(len(c) for c in chunk))
        return sequences, starts, True
    sequences, starts = answer_conversations(target, chunk, cfg, bar)
    if answers_path is not None:
        write_answers(answers_path, target, sequences, starts)
    return sequences, starts, False


def answers_only(target: LoadedModel, cfg: ChatDataConfig, progress: bool = True,
                 parts: Path | None = None) -> tuple[list[tuple[list[int], int]], dict]:
    """The target's answers alone ((sequence, answer start) per turn, each distinct turn once), no
    features: what a datastore is built from. Reuses (and writes) the same answers files as
    `build_data`, so one data directory serves both kinds."""
    chunks, info = chat_chunks(target, cfg, progress, parts)
    b = _bar(progress)(sum(len(c) for chunk in chunks for c in chunk), "target answers", "turn")
    out, seen, reused, duplicates = [], set(), 0, 0
    for chunk in chunks:
        sequences, starts, was_saved = chunk_answers(target, chunk, cfg, parts, b)
        reused += was_saved
        for seq, start in zip(sequences, starts):
            turn = turn_digest(seq)
            if turn in seen:  # the same turn from two sources: kept once
                duplicates += 1
                continue
            seen.add(turn)
            out.append((seq, start))
    b.close()
    info["sequences"] = len(out)
    info["duplicates_dropped"] = duplicates
    info["tokens"] = sum(len(s) for s, _ in out)
    info["answer_tokens"] = sum(len(s) - a for s, a in out)
    info["chunks"] = {"total": len(chunks), "answers_reused": reused}
    return out, info


def build_data(target: LoadedModel, cfg: ChatDataConfig, progress: bool = True, parts: Path | None = None) -> dict:
    """Conversations, the target's answers, features and labels. Conversations are answered and
    labelled `chunk` at a time; with `parts` (a directory) each chunk is saved as it completes and
    found again by a hash of its conversations and options, so a stopped build resumes where it
    stopped and a larger build (more --self-prompts or --self-documents, another prompts file) reuses
    what was built.
    Each chunk is two files: `answers-*.json.gz`, the token ids (what generation costs, small: commit
    it to share a build), and `part-*.pt`, their features and labels (large, recomputed from the
    answers in one teacher-forced pass when missing)."""
    check_labelling(target, cfg)  # before any answer is generated
    params = None  # the labelling pass's parameters (None: the target's own), copied when a part first needs them
    chunks, info = chat_chunks(target, cfg, progress, parts)
    data = {"key": cfg.data_key(), "info": info, "tokens": [], "features": [], "labels": [], "answer_from": []}
    b = _bar(progress)(sum(len(c) for chunk in chunks for c in chunk), "target answers and labels", "turn")
    reused = answers_reused = duplicates = 0
    seen: set[bytes] = set()
    for chunk in chunks:
        key = _chunk_key(target, chunk, cfg)
        path = _part_path(parts, "part", _label_key(key, cfg), ".pt")
        answers_path = _part_path(parts, "answers", key, ".json.gz")
        if path is not None and path.exists():
            part = torch.load(path, weights_only=True)
            if part.get("label_dtype", "target") != cfg.label_dtype:  # (parts before the option: the target's)
                raise DynaTreeError(f"{path} holds features and labels of a {part['label_dtype']!r} pass, not "
                                    f"{cfg.label_dtype!r} as asked (a part renamed or copied: remove it)")
            b.update(sum(len(c) for c in chunk))
            reused += 1
            if not answers_path.exists():
                _answers_from_part(answers_path, target, part)
        else:
            sequences, starts, was_saved = chunk_answers(target, chunk, cfg, parts, b)
            answers_reused += was_saved
            if params is None:
                params = labelling_params(target, cfg)
            feats, labels = label(target, sequences, cfg.label_batch, params=params)
            part = {"tokens": [torch.tensor(s, dtype=torch.int32) for s in sequences], "features": feats,
                    "labels": labels, "answer_from": starts, "label_dtype": cfg.label_dtype}
            if path is not None:
                save_atomic(part, path)
        starts = part.get("answer_from") or [None] * len(part["tokens"])  # older parts: unknown
        for i, tokens in enumerate(part["tokens"]):
            turn = turn_digest(tokens)
            if turn in seen:  # the same turn from two sources (or a source given twice): kept once
                duplicates += 1
                continue
            seen.add(turn)
            for name in ("tokens", "features", "labels"):
                data[name].append(part[name][i])
            data["answer_from"].append(starts[i])
    b.close()
    info["sequences"] = len(data["tokens"])
    info["duplicates_dropped"] = duplicates
    info["tokens"] = sum(len(s) for s in data["tokens"])
    info["chunks"] = {"total": len(chunks), "reused": reused, "answers_reused": answers_reused}
    return data
