"""Instruction prompts and batched chat generation, for both kinds of distillation: Spec-Bench's
questions (all turns; the first `holdout` per task left out, since benchmarks run on those),
prompt files, the target's chat template, and the target's greedy answers in batches."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..errors import DynaTreeError
from ..rng import seeded
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


# Documents the target writes itself (`--self-documents`), and the conversations each becomes: the
# long-input requests of Spec-Bench's weakest tasks for a feature head (summaries, facts and quotes over
# an article or an encyclopedia text), over text the target wrote, so none of it is benchmark text.
# Each entry: (request that writes the document, conversations that use it; "{doc}" is the text).
# No German sentences for "Translate German to English": the embedded target does not write German
# (0 of 11 tries were German sentences; docs/results/eagle-gpu/README.md), so its "translations" would
# be of non-German text, unlike Spec-Bench's WMT sentences.
DOCUMENT_KINDS = (
    ("Write a short news article of about 200 words about {topic}. Reply with the article only.",
     (["Summarize: {doc}"],
      ["Summarize the following article in two sentences.\n\n{doc}", "Now write a headline for the article."],
      ["{doc}\n\nWhat are the three most important facts in the article above?"])),
    ("Write three paragraphs of an encyclopedia entry about {topic}. Reply with the text only.",
     (["{doc}\nSummarize the text above in a few sentences.",
       "Quote the sentence of the text that matters most for your summary."],
      ["{doc}\nWhat is the main topic of the text above? Answer with reference to the text."])),
)


SPEC_BENCH_ASKS = "specbench-asks"


def other_asks(task: str, turns: list[str]) -> list[list[str]]:
    """Other requests over one Spec-Bench training question's own material (its article, passages,
    sentence or problem), as conversations: more answers of the kinds the benchmark asks for
    (summaries and answers over long documents, translations, worked problems) than the questions
    alone give, without any text of the held-out questions. No conversation starts with the
    question itself (the `specbench` source asks that one: the same turn twice would be answered
    twice and weigh double). MT-Bench questions have none."""
    first = turns[0]
    if task == "summarization" and first.startswith("Summarize: "):
        doc = first[len("Summarize: "):]
        return [[f"Summarize the following article in two sentences.\n\n{doc}", "Now write a headline for the article."],
                [f"{doc}\n\nWhat are the three most important facts in the article above?"]]
    if task == "rag" and "\n" in first:
        passages = first.rsplit("\n", 1)[0]
        return [[f"{passages}\nSummarize the text above in a few sentences.",
                 "Quote the sentence of the text that matters most for your summary."],
                [f"{passages}\nWhat is the main topic of the text above?"]]
    if task == "translation" and first.startswith("Translate German to English: "):
        sentence = first[len("Translate German to English: "):]
        return [[f"Translate the following German sentence into English, then explain the meaning of its main "
                 f"words.\n{sentence}", "Now translate the sentence into French."]]
    if task == "qa":
        return [[f"{first} Answer in one sentence.", "Tell me more about it."]]
    if task == "math_reasoning":
        return [[f"{first} Let's think step by step.", "Check your answer by solving the problem in another way."]]
    return []


def instruction_prompts(spec: str, holdout: int) -> tuple[list[list[str]], dict]:
    """Conversations (lists of user turns) from `spec`, and counts per source."""
    groups, info = instruction_sources(spec, holdout)
    return [conv for group in groups for conv in group], info


def _questions(path: Path, holdout: int) -> list[tuple[str, list[str]]]:
    """(task, user turns) of each question of a Spec-Bench-style .jsonl file, except the first
    `holdout` of each task (the ones the bench measures on)."""
    from ..prompts import questions, task_of

    seen: dict[str, int] = {}
    kept = []
    for _, category, turns in questions(path):
        task = task_of(category)
        seen[task] = seen.get(task, 0) + 1
        if seen[task] > holdout:
            kept.append((task, turns))
    return kept


def _per_task(path: Path) -> list[int]:
    """Questions per task of a Spec-Bench-style file, fewest first."""
    from ..prompts import questions, task_of

    counts: dict[str, int] = {}
    for _, category, _ in questions(path):
        counts[task_of(category)] = counts.get(task_of(category), 0) + 1
    return sorted(counts.values())


def instruction_sources(spec: str, holdout: int) -> tuple[list[list[list[str]]], dict]:
    """The conversations of each source of `spec` (comma-separated), in order, and counts per source."""
    from ..prompts import SPEC_BENCH, SPEC_BENCH_FILE, is_question_file, prompt_file

    groups, info = [], {}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        convs: list[list[str]] = []
        groups.append(convs)
        if part == SPEC_BENCH_ASKS:  # the benchmark's held-out questions give nothing
            convs += [conv for task, turns in _questions(SPEC_BENCH_FILE, holdout) for conv in other_asks(task, turns)]
            info[part] = {"conversations": len(convs), "held_out_per_task": holdout}
        elif part == SPEC_BENCH or (Path(part).is_file() and is_question_file(Path(part))):
            held = holdout if part == SPEC_BENCH else 0  # another question file is all training text
            convs += [turns for _, turns in _questions(SPEC_BENCH_FILE if part == SPEC_BENCH else Path(part), held)]
            info[part] = {"conversations": len(convs), "held_out_per_task": held}
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
            raise DynaTreeError(f"--prompts {part!r}: neither 'specbench', '{SPEC_BENCH_ASKS}' nor an existing file")
        if not convs and part in (SPEC_BENCH, SPEC_BENCH_ASKS):
            counts = _per_task(SPEC_BENCH_FILE)
            raise DynaTreeError(f"--holdout {holdout} leaves no question of --prompts {part} for training "
                                f"(its tasks have {counts[0]} to {counts[-1]} questions each)")
    return groups, info


def chat_ids(tokenizer, turns: list[str], answers: list[str]) -> list[int]:
    messages = []
    for user, answer in zip(turns, answers + [None]):
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": answer})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


SPECULATE_FROM = 256  # prompt tokens from which greedy answers are speculated one at a time (generate_batched)


@torch.no_grad()
def generate_batched(target: LoadedModel, prompts: list[list[int]], max_new: int, batch: int, bar=None,
                     sample: bool = False, seed: int = 0) -> list[list[int]]:
    """The target's answer ids to each prompt (greedy unless `sample`), EOS included when reached;
    prompts batched by length (left-padded). On a CPU, greedy answers to prompts of `SPECULATE_FROM`
    tokens or more (articles, passages) are decoded one at a time by this library's own exact greedy
    speculation (linear, n-gram drafter): on a CPU a batch of long prompts runs no faster per
    token than one prompt, while answers about a document copy from it (measured on Spec-Bench
    summarization/RAG material, 5 prompts x 200 tokens, 2 cores: batched 16 about 22 tok/s,
    one at a time 39, with n-gram speculation 69; the same tokens)."""
    out: list[list[int]] = [[] for _ in prompts]
    if not sample and target.device.type == "cpu":
        from ..api import generate

        for i in [i for i, p in enumerate(prompts) if len(p) >= SPECULATE_FROM]:
            out[i] = generate(prompt_ids=prompts[i], method="linear", target=target, draft="ngram",
                              max_new_tokens=max_new).new_token_ids
            if bar is not None:
                bar.update(1)
        prompts = [p if len(p) < SPECULATE_FROM else [] for p in prompts]
    pad = target.eos_ids[0] if target.eos_ids else 0
    order = sorted((i for i in range(len(prompts)) if prompts[i]), key=lambda i: len(prompts[i]))
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, len(order), batch):
        rows = order[start: start + batch]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in rows], device=target.device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows],
                            device=target.device)
        # a sampled batch draws from torch's global generators (transformers): seeded per batch, then given back
        draws = seeded(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)), target.device) if sample \
            else contextlib.nullcontext()
        with draws:
            result = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                           do_sample=sample, temperature=0.9 if sample else None,
                                           top_p=0.95 if sample else None, top_k=None,
                                           eos_token_id=target.eos_ids or None, pad_token_id=pad)
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
