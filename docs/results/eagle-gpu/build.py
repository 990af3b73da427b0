"""Build more of the feature head's chat data on a lent GPU (issue 28): the same files
`dynatree distill --data-dir data/distill/smollm2-135m` reads and writes, many times faster.

On the CPU the distiller writes questions in blocks of `--gen-batch` (16) and answers a chunk (64
conversations) at a time: about 25 questions a minute and 1.7 s per answer on 2 cores. A GPU runs
hundreds of rows in one generation for about the cost of one, so this script
  1. writes every missing question block of `--self-prompts N`, `--batch` rows per generation (the
     blocks keep their names: a block is still the same 16 seeds; their sampling differs from the
     CPU's one-block-at-a-time draw, and the saved file is what every later build reads), then
     and likewise every missing document block of `--self-documents N` (articles and German
     sentences the target writes, each then given back to summarize, quote or translate), then
  2. answers every chunk without an answers file, the conversations of many chunks in one greedy
     batched generation per turn (a later turn asked with the earlier answers in its history, as the
     distiller does), writing each chunk's answers file under its own name,
until `--deadline` seconds have passed (a chunk is only ever written whole). The answers record says
where they came from (device cuda, float32; greedy, left-padded batches).
`--check FILE` first compares the loaded target's weights with this machine's conversion of the same
GGUF (weights_sums.py) and stops on any difference: answers of another model would not be on-policy.

    python docs/results/eagle-gpu/build.py --self-prompts 16384 --device cuda --batch 512 \
        --data-dir data/distill/smollm2-135m --check docs/results/eagle-gpu/weights_sums.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dynatree.distill.chat import chat_ids, generate_batched
from dynatree.files import write_text_atomic
from dynatree.distill.eagle_data import (DOCUMENT_TOKENS, QUESTION_TOKENS, ChatDataConfig, _chunk_key, _part_path,
                                         answered_turns, chat_chunks, document_blocks, document_path, document_requests,
                                         document_seed, document_texts, question_blocks, question_path,
                                         question_requests, question_seed, question_texts, write_answers)
from weights_sums import weight_sums
from dynatree.models import load_model


def check_weights(target, path: Path) -> None:
    want = json.loads(path.read_text())
    have = weight_sums(target.model.state_dict())
    bad = [k for k in want if k not in have or any(abs(a - b) > 1e-6 * max(1.0, abs(b)) for a, b in zip(have[k], want[k]))]
    missing = [k for k in want if k not in have]
    print(f"weights: {len(want)} tensors compared, {len(bad)} differ ({len(missing)} missing)", flush=True)
    if bad:
        sys.exit(f"the target's weights differ from {path}: {bad[:5]}")


def write_blocks(what: str, target, blocks, requests, path_of, seed_of, max_new: int, texts_of, cfg: ChatDataConfig,
                 batch: int, deadline: float) -> tuple[int, bool]:
    """The missing blocks of sampled `what` (questions or documents), `batch` rows per generation;
    returns how many blocks were written and whether none is missing now. The library's blocks,
    requests, seeds, file names and text filters (eagle_data.sampled_blocks' arguments), one
    generation for many blocks (seeded by the first block's seed, so the sampling differs from the
    CPU's one block at a time: the saved file is what every later build reads)."""
    missing = [(block, asked, path_of(block, asked)) for block, asked in enumerate(blocks)]
    missing = [m for m in missing if not m[2].exists()]
    per_call = max(1, batch // cfg.gen_batch)
    written = 0
    for g in range(0, len(missing), per_call):
        if time.perf_counter() > deadline:
            break
        group = missing[g: g + per_call]
        prompts = [chat_ids(target.tokenizer, [r], []) for _, asked, _ in group for r in requests(asked)]
        answers = generate_batched(target, prompts, max_new, len(prompts), sample=True, seed=seed_of(group[0][0]))
        k = 0
        for _, asked, path in group:
            write_text_atomic(path, json.dumps(texts_of(target, answers[k: k + len(asked)])))
            k += len(asked)
            written += 1
        print(f"{what}: {written}/{len(missing)} blocks written, {time.perf_counter() - T0:.0f} s", flush=True)
    return written, written == len(missing)


def write_questions(target, cfg: ChatDataConfig, parts: Path, batch: int, deadline: float) -> tuple[int, bool]:
    """The missing question blocks of `cfg.self_prompts` (`write_blocks`)."""
    return write_blocks("questions", target, question_blocks(cfg.self_prompts, cfg), question_requests,
                        lambda block, asked: question_path(parts, target, asked, block, cfg),
                        lambda block: question_seed(cfg, block), QUESTION_TOKENS, question_texts, cfg, batch, deadline)


def write_documents(target, cfg: ChatDataConfig, parts: Path, batch: int, deadline: float) -> tuple[int, bool]:
    """The missing document blocks of `cfg.self_documents` (`write_blocks`)."""
    return write_blocks("documents", target, document_blocks(cfg.self_documents, cfg), document_requests,
                        lambda block, asked: document_path(parts, target, asked, block, cfg),
                        lambda block: document_seed(cfg, block), DOCUMENT_TOKENS, document_texts, cfg, batch, deadline)


def answer_chunks(target, chunks: list, cfg: ChatDataConfig) -> list[tuple[list, list]]:
    """(sequences, answer starts) of each chunk, as eagle_data.answer_conversations gives them for the
    chunk alone, but every chunk's conversations asked in one batched generation per turn
    (eagle_data.answered_turns over all of them: turn by turn, so each chunk's share keeps its order)."""
    owner = [c for c, chunk in enumerate(chunks) for _ in chunk]
    flat = [conv for chunk in chunks for conv in chunk]
    out = [([], []) for _ in chunks]
    for i, sequence, start in answered_turns(target, flat, cfg, len(flat)):
        out[owner[i]][0].append(sequence)
        out[owner[i]][1].append(start)
    return out


def write_missing_answers(target, cfg: ChatDataConfig, parts: Path, batch: int, deadline: float) -> tuple[int, int, bool]:
    """Answers files for every chunk that has none; returns (chunks written, turns answered, whether
    every chunk has its answers now)."""
    chunks, _ = chat_chunks(target, cfg, progress=False, parts=parts)
    todo = [(c, _part_path(parts, "answers", _chunk_key(target, c, cfg), ".json.gz")) for c in chunks]
    # (a chunk with a features-and-labels part but no answers file is not missing: the distiller
    # writes its answers file from the part)
    todo = [(c, p) for c, p in todo
            if not p.exists() and not _part_path(parts, "part", _chunk_key(target, c, cfg), ".pt").exists()]
    print(f"answers: {len(todo)} of {len(chunks)} chunks missing "
          f"({sum(len(c) for c, _ in todo)} conversations)", flush=True)
    done = turns = 0
    g = 0
    while g < len(todo) and time.perf_counter() < deadline:
        group, n = [], 0
        while g < len(todo) and n < batch:
            group.append(todo[g])
            n += len(todo[g][0])
            g += 1
        for (chunk, path), (sequences, starts) in zip(group, answer_chunks(target, [c for c, _ in group], cfg)):
            write_answers(path, target, sequences, starts)
            done, turns = done + 1, turns + len(sequences)
        print(f"answers: {done}/{len(todo)} chunks, {turns} turns, {time.perf_counter() - T0:.0f} s", flush=True)
    return done, turns, done == len(todo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--self-prompts", type=int, required=True)
    ap.add_argument("--self-documents", type=int, default=0)
    ap.add_argument("--prompts", default="specbench,specbench-asks")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=512, help="rows per generation")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which no new generation starts")
    ap.add_argument("--check", default="", help="weights_sums.json to compare the target's weights with")
    args = ap.parse_args()
    target = load_model("smollm2-135m", device=args.device, dtype="float32")
    if args.check:
        check_weights(target, Path(args.check))
    cfg = ChatDataConfig(prompts=args.prompts, self_prompts=args.self_prompts, self_documents=args.self_documents,
                         data_dir=args.data_dir)
    cfg.validate()
    parts = Path(args.data_dir)
    deadline = T0 + args.deadline
    with torch.no_grad():
        blocks, complete = write_questions(target, cfg, parts, args.batch, deadline)
        documents = 0
        if complete:
            documents, complete = write_documents(target, cfg, parts, args.batch, deadline)
        # (with blocks missing, chat_chunks would write them itself, one block at a time)
        chunks, turns, complete = (write_missing_answers(target, cfg, parts, args.batch, deadline) if complete
                                   else (0, 0, False))
    print(json.dumps({"question_blocks_written": blocks, "document_blocks_written": documents,
                      "answer_chunks_written": chunks, "turns_answered": turns,
                      "complete": complete,
                      "seconds": round(time.perf_counter() - T0, 1), "device": str(target.device),
                      "torch": torch.__version__}), flush=True)


T0 = time.perf_counter()
if __name__ == "__main__":
    main()
