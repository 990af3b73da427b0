"""Attention-sink KV window: exact against AR under the same policy, bounded caches, bad input."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import ARCHS, VOCAB, examples, hf_greedy, make_drafter, method_options, tiny
from dynatree import DynaTreeError, generate, make_config
from dynatree import cache as kv
from dynatree.decode import Decoder
from dynatree.methods import METHODS
from dynatree.tree import additive_mask
from dynatree.window import KVWindow


@functools.cache
def windowed_reference(arch: str, prompt: tuple[int, ...], max_new: int, sink: int, recent: int) -> list[int]:
    """Greedy decoding under the window policy, independent of the engine: the whole sequence
    in one pass without a cache, each position t attending to [0, sink) and [t - recent, t]."""
    model = tiny(arch).model
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            pos = torch.arange(len(seq), device=model.device)
            allowed = (pos[None, :] <= pos[:, None]) & ((pos[None, :] < sink) | (pos[None, :] >= pos[:, None] - recent))
            logits = model(torch.tensor([seq], device=model.device), attention_mask=additive_mask(allowed, torch.float64, model.device),
                           position_ids=pos[None]).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_is_plain_greedy_when_the_window_covers_everything(arch):
    prompt = (5, 6, 7, 5, 6)
    assert windowed_reference(arch, prompt, 20, 2, 100) == hf_greedy(tiny(arch), list(prompt), 20)
    assert windowed_reference(arch, prompt, 20, 1, 4) != windowed_reference(arch, prompt, 20, 2, 100)


@st.composite
def cases(draw):
    arch = draw(st.sampled_from(ARCHS))
    method = draw(st.sampled_from(["ar", "linear", "fixed-tree", "dynatree"]))
    drafter = draw(st.sampled_from(["self", "noisy", "ngram"])) if method != "ar" else None
    motif = draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=5))
    prompt = (motif * draw(st.integers(1, 4)))[:16]
    sink = draw(st.integers(0, 3))
    recent = draw(st.integers(sink + 1, 10))
    return arch, method, drafter, prompt, draw(st.integers(1, 30)), sink, recent, method_options(draw, method)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_windowed_speculation_equals_windowed_ar(case):
    arch, method, drafter_kind, prompt, max_new, sink, recent, options = case
    window = KVWindow(sink, recent)
    target = tiny(arch, eos_ids=[])
    drafter = make_drafter(drafter_kind, arch) if drafter_kind else None
    if drafter is not None and hasattr(drafter, "window"):
        drafter.window = window
    decoder = Decoder(target, METHODS[method].policy_cls(make_config(method, **options)), drafter, window)
    for _ in decoder.steps(prompt, max_new, ignore_eos=True):
        assert kv.length(decoder.run.cache) <= sink + recent  # memory stays bounded
        if drafter is not None and hasattr(drafter, "cache"):
            assert kv.length(drafter.cache) <= sink + recent
    assert decoder.run.new_tokens == windowed_reference(arch, tuple(prompt), max_new, sink, recent), (method, options)


def test_deep_tree_beyond_the_window_is_exact():
    """A perfect draft and a tree deeper than RECENT: ancestors leave a node's window too."""
    target = tiny("llama", eos_ids=[])
    policy = METHODS["linear"].policy_cls(make_config("linear", k=8))
    drafter = make_drafter("self", "llama")
    drafter.window = KVWindow(1, 3)  # the draft under the same policy predicts the target exactly
    decoder = Decoder(target, policy, drafter, KVWindow(1, 3))
    run = decoder.generate([9, 10, 11, 9, 10], 30, ignore_eos=True)
    assert max(run.stats.accepted_lens) > 3
    assert run.new_tokens == windowed_reference("llama", (9, 10, 11, 9, 10), 30, 1, 3)


def test_api_and_record():
    target = tiny("gpt_neox", eos_ids=[])
    rec = generate(method="dynatree", target=target, prompt_ids=[5, 6, 7, 5, 6], max_new_tokens=20,
                   ignore_eos=True, kv_window="2,6")
    assert rec.run.kv_window == "2,6"
    assert rec.new_token_ids == windowed_reference("gpt_neox", (5, 6, 7, 5, 6), 20, 2, 6)


@pytest.mark.parametrize("text, message", [
    ("4,4", "sink (4) must be smaller than the recent window (4)"),
    ("8,2", "must be smaller than the recent window"),
    ("4", "takes SINK,RECENT"),
    ("a,b", "takes SINK,RECENT"),
    ("-1,8", "SINK >= 0 and RECENT >= 1"),
    ("0,0", "SINK >= 0 and RECENT >= 1"),
])
def test_bad_windows(text, message):
    with pytest.raises(DynaTreeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KVWindow.parse(text)


def test_window_larger_than_context_and_hf_methods():
    small = tiny("llama", context=64, eos_ids=[])
    with pytest.raises(DynaTreeError, match="keeps 70 tokens, more than the context length 64"):
        generate(method="ar", target=small, prompt_ids=[5, 6], max_new_tokens=4, kv_window="6,64")
    with pytest.raises(DynaTreeError, match="not available for 'hf-lookup'"):
        generate(method="hf-lookup", target=small, prompt_ids=[5, 6], max_new_tokens=4, kv_window="2,8")
