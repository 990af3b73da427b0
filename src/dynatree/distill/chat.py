"""Instruction prompts and batched chat generation, for both kinds of distillation: Spec-Bench's
questions (all turns; the first `holdout` per task left out, since benchmarks run on those),
prompt files, the target's chat template, and the target's greedy answers in batches."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import DynaTreeError
from ..runtime import LoadedModel


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


def instruction_prompts(spec: str, holdout: int) -> tuple[list[list[str]], dict]:
    """Conversations (lists of user turns) from `spec`, and counts per source."""
    from ..prompts import SPEC_BENCH, SPEC_BENCH_FILE, is_question_file, prompt_file, task_of

    convs, info = [], {}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == SPEC_BENCH or (Path(part).is_file() and is_question_file(Path(part))):
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
            found = [[p.text] for p in prompt_file(Path(part), 0)]
            if not found:
                raise DynaTreeError(f"--prompts {part!r} holds no prompts")
            convs += found
            info[part] = {"conversations": len(found)}
        elif Path(part).exists():
            raise DynaTreeError(f"--prompts {part!r} is not a regular file; give a prompts file")
        else:
            raise DynaTreeError(f"--prompts {part!r}: neither 'specbench' nor an existing file")
    return convs, info


def chat_ids(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
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
