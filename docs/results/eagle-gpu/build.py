"""Build more of the feature head's chat data on a lent GPU (issue 28): the same files
`dynatree distill --data-dir data/distill/smollm2-135m` reads and writes, many times faster.

On the CPU the distiller writes questions in blocks of `--gen-batch` (16) and answers a chunk (64
conversations) at a time: about 25 questions a minute and 1.7 s per answer on 2 cores. A GPU runs
hundreds of rows in one generation for about the cost of one, so this script
  1. writes every missing question block of `--self-prompts N`, `--batch` rows per generation (the
     blocks keep their names: a block is still the same 16 seeds; their sampling differs from the
     CPU's one-block-at-a-time draw, and the saved file is what every later build reads), then
  2. answers every chunk without an answers file, single-turn conversations of many chunks in one
     greedy batched generation (multi-turn chunks one at a time, as the distiller does), writing each
     chunk's answers file under its own name,
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
from dynatree.distill.common import write_atomic
from dynatree.distill.eagle_data import (ChatDataConfig, _chunk_key, _part_path, answer_conversations, chat_chunks,
                                         question_blocks, question_path, question_texts, write_answers)
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


def write_questions(target, cfg: ChatDataConfig, parts: Path, batch: int, deadline: float) -> tuple[int, bool]:
    """The missing question blocks of `cfg.self_prompts`, `batch` rows per generation; returns how many
    blocks were written and whether none is missing now. The library's blocks, seeds, file names and
    text filter (eagle_data.question_blocks, question_path, question_texts)."""
    missing = [(block, asked, question_path(parts, target, asked, block, cfg))
               for block, asked in enumerate(question_blocks(cfg.self_prompts, cfg))]
    missing = [m for m in missing if not m[2].exists()]
    per_call = max(1, batch // cfg.gen_batch)
    written = 0
    for g in range(0, len(missing), per_call):
        if time.perf_counter() > deadline:
            break
        group = missing[g: g + per_call]
        prompts = [chat_ids(target.tokenizer, [a.format(topic=t)], []) for _, asked, _ in group for t, a in asked]
        answers = generate_batched(target, prompts, 80, len(prompts), sample=True,
                                   seed=cfg.seed * 1_000_003 + group[0][0])
        k = 0
        for _, asked, path in group:
            write_atomic(path, json.dumps(question_texts(target, answers[k: k + len(asked)])))
            k += len(asked)
            written += 1
        print(f"questions: {written}/{len(missing)} blocks written, {time.perf_counter() - T0:.0f} s", flush=True)
    return written, written == len(missing)


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
    multi = [(c, p) for c, p in todo if any(len(conv) > 1 for conv in c)]
    single = [(c, p) for c, p in todo if all(len(conv) == 1 for conv in c)]
    for chunk, path in multi:  # as the distiller does it (later turns need the earlier answers)
        if time.perf_counter() > deadline:
            return done, turns, False
        sequences, starts = answer_conversations(target, chunk, cfg)
        write_answers(path, target, sequences, starts)
        done, turns = done + 1, turns + len(sequences)
    g = 0
    while g < len(single) and time.perf_counter() < deadline:
        group, n = [], 0
        while g < len(single) and n < batch:
            group.append(single[g])
            n += len(single[g][0])
            g += 1
        prompts = [[chat_ids(target.tokenizer, conv[:1], []) for conv in chunk] for chunk, _ in group]
        flat = [p for ps in prompts for p in ps if len(p) <= cfg.l_max]
        replies = iter(generate_batched(target, flat, cfg.max_new_tokens, len(flat)))
        for (chunk, path), ps in zip(group, prompts):
            kept = [p for p in ps if len(p) <= cfg.l_max]  # answer_conversations' order: asked, then l_max
            sequences, starts = [], []
            for p in kept:
                sequences.append(p + next(replies))
                starts.append(len(p))
            write_answers(path, target, sequences, starts)
            done, turns = done + 1, turns + len(sequences)
        print(f"answers: {done}/{len(todo)} chunks, {turns} turns, {time.perf_counter() - T0:.0f} s", flush=True)
    return done, turns, done == len(todo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--self-prompts", type=int, required=True)
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
    cfg = ChatDataConfig(prompts=args.prompts, self_prompts=args.self_prompts, data_dir=args.data_dir)
    cfg.validate()
    parts = Path(args.data_dir)
    deadline = T0 + args.deadline
    with torch.no_grad():
        blocks, complete = write_questions(target, cfg, parts, args.batch, deadline)
        # (with blocks missing, chat_chunks would write them itself, one block at a time)
        chunks, turns, complete = (write_missing_answers(target, cfg, parts, args.batch, deadline) if complete
                                   else (0, 0, False))
    print(json.dumps({"question_blocks_written": blocks, "answer_chunks_written": chunks, "turns_answered": turns,
                      "complete": complete,
                      "seconds": round(time.perf_counter() - T0, 1), "device": str(target.device),
                      "torch": torch.__version__}), flush=True)


T0 = time.perf_counter()
if __name__ == "__main__":
    main()
