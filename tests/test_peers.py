"""transformers' own methods, wrapped: same tokens as ours, statistics that add up."""

from __future__ import annotations

import pytest

from conftest import ARCHS, noisy_copy, tiny
from dynatree import generate


@pytest.mark.parametrize("arch", ARCHS)
def test_peers_match_ar_and_report_stats(arch):
    target = tiny(arch, eos_ids=[])
    prompt = [5, 6, 7, 5, 6, 7, 5]
    ar = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)
    for method, draft in [("hf-ar", None), ("hf-lookup", None), ("hf-assisted", noisy_copy(arch, 0, 0.08))]:
        rec = generate(method=method, target=target, draft=draft, prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)
        assert rec["new_token_ids"] == ar["new_token_ids"], method
        s = rec["stats"]
        assert s["new_tokens"] == 30
        assert 1 <= s["iterations"] <= 30
        assert s["new_tokens"] == s["iterations"] + s["accepted_tokens"]
        assert s["acceptance_rate"] is None or 0 <= s["acceptance_rate"] <= 1
        assert 0 < s["ttft_s"] <= s["wall_s"]
        if method == "hf-ar":
            assert s["iterations"] == 30 and s["drafted_tokens"] == 0
        if method == "hf-assisted":
            assert s["accepted_tokens"] > 0 and s["iterations"] < 30


def test_peer_stops_at_eos_like_ours():
    target = tiny("llama", eos_ids=[])
    prompt = [9, 10, 11, 9, 10]
    full = generate(method="ar", target=target, prompt_ids=prompt, max_new_tokens=30, ignore_eos=True)["new_token_ids"]
    eos = full[7]
    stopped = tiny("llama", eos_ids=[eos])
    for method in ("ar", "hf-ar", "hf-lookup", "dynatree"):
        rec = generate(method=method, target=stopped, prompt_ids=prompt, max_new_tokens=30)
        assert rec["new_token_ids"] == full[: full.index(eos) + 1], method
