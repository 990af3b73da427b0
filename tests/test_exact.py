"""Greedy exactness: every method's tokens equal transformers' greedy generate(), token for token.

Float64 tiny models of three architectures; drafters that always agree (the target itself),
often agree (a noisy copy), rarely agree (an unrelated model), the n-gram drafter, the
hybrid of n-gram and noisy copy, and a feature head fed the target's hidden states; many
prompts, lengths, EOS positions and hyperparameters, budget edge cases included.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ARCHS, VOCAB, examples, hf_greedy, make_drafter, method_options, noisy_copy, tiny
from dynatree import Decoder, make_config
from dynatree.drafters import HybridDrafter, LMDrafter, NgramDrafter
from dynatree.methods import METHODS

TREE_METHODS = ["linear", "fixed-tree", "dynatree", "wetap", "specinfer", "specexec", "opt-tree", "dsbd", "mtad"]
PERFECT = ["linear", "fixed-tree", "dynatree", "specinfer"]  # trees that always contain the draft's greedy chain
DRAFTERS = ["self", "noisy", "other", "ngram", "hybrid", "feature", "store", "hybrid-store"]


@functools.cache
def reference(arch: str, prompt: tuple[int, ...], max_new: int) -> list[int]:
    return hf_greedy(tiny(arch), list(prompt), max_new, eos=None)


@st.composite
def cases(draw):
    arch = draw(st.sampled_from(ARCHS))
    method = draw(st.sampled_from(["ar"] + TREE_METHODS))
    drafter = draw(st.sampled_from(DRAFTERS)) if method != "ar" else None
    # short repetitive prompts make the n-gram drafter and the loops of random models interesting
    motif = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6))
    prompt = (motif * draw(st.integers(1, 4)) + draw(st.lists(st.integers(0, VOCAB - 1), max_size=8)))[:24]
    max_new = draw(st.integers(1, 40))
    eos_at = draw(st.one_of(st.none(), st.integers(0, max_new - 1)))  # where EOS first appears, if anywhere
    return arch, method, drafter, prompt, max_new, eos_at, method_options(draw, method)


@settings(max_examples=examples(600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_greedy_equals_plain_decoding(case):
    arch, method, drafter_kind, prompt, max_new, eos_at, options = case
    full = reference(arch, tuple(prompt), max_new)
    if eos_at is None:
        eos, expected = None, full
    else:  # make the token at eos_at the EOS token: decoding must stop right after its first occurrence
        eos = full[eos_at]
        expected = full[: full.index(eos) + 1]
    target = tiny(arch, eos_ids=[eos] if eos is not None else [])
    policy = METHODS[method].policy_cls(make_config(method, **options))
    drafter = make_drafter(drafter_kind, arch) if drafter_kind else None
    run = Decoder(target, policy, drafter).generate(prompt, max_new, ignore_eos=eos is None)
    assert run.new_tokens == expected, (method, drafter_kind, options)
    stats = run.stats.summary()
    assert stats.new_tokens == len(expected)
    assert stats.acceptance_rate is None or 0.0 <= stats.acceptance_rate <= 1.0
    assert run.stats.accepted_tokens <= run.stats.drafted_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_reference_stops_at_eos_like_us(arch):
    """The EOS convention the hypothesis test assumes is transformers' own."""
    prompt = [5, 6, 7, 5, 6]
    full = reference(arch, tuple(prompt), 30)
    eos = full[10]
    assert hf_greedy(tiny(arch), prompt, 30, eos=eos) == full[: full.index(eos) + 1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", PERFECT)
def test_perfect_draft_accepts_everything(arch, method):
    """With the target as its own draft, every chain/tree accepts its whole deepest path."""
    prompt, max_new = [4, 9, 4, 9, 4], 30
    target = tiny(arch, eos_ids=[])
    options = {"linear": {"k": 4}, "fixed-tree": {"depth": 4, "branch": 2, "tau": 0.0},
               "dynatree": {"d0": 3, "d_max": 4, "rho_stop": 1e-9, "rho_deep": 2e-9, "tau": 0.0, "history": False},
               "specinfer": {"width": 2, "depth": 4}}[method]
    policy = METHODS[method].policy_cls(make_config(method, **options))
    run = Decoder(target, policy, LMDrafter(target, target.vocab_size)).generate(prompt, max_new, ignore_eos=True)
    assert run.new_tokens == reference(arch, tuple(prompt), max_new)
    assert run.stats.accepted_lens[:-1] == [4] * (len(run.stats.accepted_lens) - 1)
    assert run.stats.iterations < max_new / 4 + 2


@pytest.mark.parametrize("arch", ARCHS)
def test_reused_decoder_carries_no_stale_state(arch):
    """One decoder (its policy's adapted history and its drafter) across prompts: still exact."""
    target = tiny(arch, eos_ids=[])
    policy = METHODS["dynatree"].policy_cls(make_config("dynatree", d0=2, d_max=5, history_window=2))
    decoder = Decoder(target, policy, make_drafter("noisy", arch))
    prompts = [[5, 6, 7, 5, 6], [40, 41], [9] * 12, [70, 3, 70, 3, 70]]
    for prompt in prompts + prompts[::-1]:
        run = decoder.generate(prompt, 25, ignore_eos=True)
        assert run.new_tokens == reference(arch, tuple(prompt), 25)


@st.composite
def float32_cases(draw):
    arch = draw(st.sampled_from(ARCHS))
    method = draw(st.sampled_from(["linear", "fixed-tree", "dynatree", "specinfer", "opt-tree", "dsbd", "mtad",
                                   "specexec", "wetap"]))
    drafter = draw(st.sampled_from(["ngram", "noisy", "hybrid"]))
    motif = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6))
    prompt = (motif * draw(st.integers(1, 4)) + draw(st.lists(st.integers(0, VOCAB - 1), max_size=8)))[:24]
    return arch, method, drafter, prompt, draw(st.integers(1, 40))


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(float32_cases())
def test_float32_packed_path_commits_the_targets_argmax(case):
    """The production path: float32 models on oneDNN-packed linears (where the CPU has them),
    where exactness cannot be checked against transformers' float64 tokens. Every committed token
    must be the target's argmax for its prefix, up to a float32 rounding margin, in one plain
    causal pass over the whole output (ties within the margin may go either way)."""
    import torch

    arch, method, kind, prompt, max_new = case
    target = tiny(arch, dtype=torch.float32, eos_ids=[])
    draft = noisy_copy(arch, 0, 0.08, dtype=torch.float32)
    drafter = {"ngram": lambda: NgramDrafter(max_n=3),
               "noisy": lambda: LMDrafter(draft, target.vocab_size),
               "hybrid": lambda: HybridDrafter(NgramDrafter(max_n=3), LMDrafter(draft, target.vocab_size))}[kind]()
    policy = METHODS[method].policy_cls(make_config(method))
    run = Decoder(target, policy, drafter).generate(prompt, max_new, ignore_eos=True)
    assert len(run.new_tokens) == max_new
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + run.new_tokens[:-1]], device=target.device)).logits[0, len(prompt) - 1:]
    chosen = logits.gather(1, torch.tensor(run.new_tokens, device=target.device)[:, None])[:, 0]
    margin = 1e-4 * (1.0 + logits.abs().amax(dim=1))
    assert bool((chosen >= logits.amax(dim=1) - margin).all()), (method, kind, prompt)
