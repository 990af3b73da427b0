"""torch's global generators have one user at a time, and a library call gives them back as it found
them (rng.py): sampled hf-* decodes, building a model to train, sampling training answers."""

import threading

import torch

from helpers import tiny
from dynatree import rng
from dynatree.distill.chat import generate_batched


def test_seeded_gives_back_the_callers_state_and_draws_the_seeds_stream():
    torch.manual_seed(99)
    before = torch.get_rng_state()
    with rng.seeded(5):
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    assert torch.equal(inside, torch.rand(3))


def test_a_second_thread_waits_while_another_holds_the_generators():
    seen = []
    with rng.LOCK:
        worker = threading.Thread(target=lambda: seen.append(_draw(6)), daemon=True)
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not seen  # waits: its seeding cannot land in the middle of our draws
    worker.join(30)
    assert len(seen) == 1 and torch.equal(seen[0], _draw(6))


def _draw(seed):
    with rng.seeded(seed):
        return torch.rand(4)


def test_sampled_training_answers_are_seeded_and_leave_the_callers_generator_alone():
    target = tiny("llama", dtype=torch.float32)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    first = generate_batched(target, prompts, 6, batch=2, sample=True, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(77)  # another caller state: the same answers
    assert generate_batched(target, prompts, 6, batch=2, sample=True, seed=3) == first
    assert generate_batched(target, prompts, 6, batch=2, sample=True, seed=4) != first
