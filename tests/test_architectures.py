"""The architecture matrix: every transformers causal-LM architecture listed here is either exact
(every method's greedy tokens equal transformers' greedy generate(), float64, over prompts and
lengths) or refused at load by the exactness probe with a one-line reason. Never wrong tokens,
never a traceback. The README's list of architectures is checked against these lists.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import EOS, VOCAB, hf_greedy, tokenizer
from dynatree import api
from dynatree.attention import use_gqa_attention
from dynatree.errors import DynaTreeError
from dynatree.kernels import use_packed_linears
from dynatree.models import load_model
from dynatree.runtime import LoadedModel
from dynatree.probe import check_tree_exact

_DIMS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
_GPT = dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)
# model_type (and variant) -> the config fields that make it tiny; sliding windows of 8 tokens, so the
# generations below cross them (test_sliding.py tests those architectures in depth)
EXACT = {
    "llama": _DIMS, "mistral": dict(_DIMS, sliding_window=8),
    "qwen2": dict(_DIMS, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "gemma2": dict(_DIMS, head_dim=8, sliding_window=8),
    "gemma3_text": dict(_DIMS, head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "cohere2": dict(_DIMS, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "qwen3": dict(_DIMS, head_dim=8), "gemma": dict(_DIMS, head_dim=8), "phi": dict(_DIMS, partial_rotary_factor=0.5),
    "phi3": _DIMS, "gpt_neox": dict(_DIMS, rotary_pct=0.5), "gpt2": _GPT, "gptj": dict(_GPT, rotary_dim=4),
    "codegen": dict(_GPT, n_ctx=256, rotary_dim=4),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                word_embed_proj_dim=32),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=False, multi_query=True),
    "stablelm": _DIMS, "olmo": _DIMS, "olmo2": _DIMS, "starcoder2": dict(_DIMS, sliding_window=8),
    "gpt_bigcode": _GPT, "persimmon": _DIMS, "cohere": _DIMS, "granite": _DIMS, "helium": dict(_DIMS, head_dim=8),
    "glm": dict(_DIMS, head_dim=8),
}
REFUSED = {  # model type -> what the refusal says
    "mpt": (dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=256, expansion_ratio=2), "ALiBi"),
    "bloom": (dict(hidden_size=32, n_layer=2, n_head=4), "ALiBi"),
    "falcon-alibi": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True), "ALiBi"),
}
METHODS = ("ar", "linear", "dynatree", "specinfer", "wetap", "dsbd", "mtad")


def build(kind: str, seed: int) -> LoadedModel:
    fields = EXACT[kind] if kind in EXACT else REFUSED[kind][0]
    config = AutoConfig.for_model(kind.split("-")[0], vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS,
                                  pad_token_id=0, initializer_range=0.3, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    use_gqa_attention(model)  # as load_model does
    use_packed_linears(model)
    return LoadedModel(model=model, tokenizer=tokenizer(), name=f"tiny-{kind}", eos_ids=[])


@functools.cache
def pair(kind: str) -> tuple[LoadedModel, LoadedModel]:
    """A tiny target and a draft of the same architecture (another seed)."""
    return build(kind, 0), build(kind, 1)


@functools.cache
def reference(kind: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy(pair(kind)[0], list(prompt), n)


@pytest.mark.parametrize("kind", sorted(EXACT))
def test_exact_architectures_pass_the_probe_and_decode_exactly(kind):
    target, draft = pair(kind)
    check_tree_exact(target)
    check_tree_exact(draft)

    @settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(prompt=st.lists(st.sampled_from([5, 9, 11, 30, 31, 44]), min_size=1, max_size=12),
           n=st.integers(1, 20), method=st.sampled_from(METHODS))
    def check(prompt, n, method):
        drafter = {"ar": None, "dynatree": "ngram"}.get(method, draft)
        got = api.generate(method=method, target=target, draft=drafter, prompt_ids=prompt, max_new_tokens=n,
                           ignore_eos=True).new_token_ids
        assert got == reference(kind, tuple(prompt), n), (kind, method)

    check()
    for method in METHODS:  # every method at least once, on a repetitive prompt the n-gram drafter copies
        prompt = [5, 9, 11, 5, 9, 11, 5, 30]
        drafter = {"ar": None, "dynatree": "ngram"}.get(method, draft)
        got = api.generate(method=method, target=target, draft=drafter, prompt_ids=prompt, max_new_tokens=16,
                           ignore_eos=True).new_token_ids
        assert got == reference(kind, tuple(prompt), 16), (kind, method)


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_architectures_fail_the_probe_with_a_reason(kind):
    with pytest.raises(DynaTreeError, match=REFUSED[kind][1]) as err:
        check_tree_exact(build(kind, 0))
    assert "\n" not in str(err.value) and "refused" in str(err.value)


def test_load_model_runs_the_probe(tmp_path):
    model = build("mpt", 0)
    model.model.save_pretrained(tmp_path)
    model.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(DynaTreeError, match="mpt.*ALiBi"):
        load_model(str(tmp_path))


def test_the_probe_catches_a_mask_that_is_ignored():
    """A model whose attention drops the 4-D mask (plain causal attention instead) must be refused."""
    target = build("llama", 0)
    forward = target.model.forward

    def causal_only(*args, attention_mask=None, **kw):
        return forward(*args, attention_mask=None, **kw)

    target.model.forward = causal_only
    try:
        with pytest.raises(DynaTreeError, match="does not follow the tree mask"):
            check_tree_exact(target)
    finally:
        del target.model.forward


def test_readme_lists_the_matrix():
    text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    exact = re.search(r"Exact \(tested\): (.*)", text)
    refused = re.search(r"Refused at load: (.*)", text)
    assert exact and refused, "README needs the 'Exact (tested):' and 'Refused at load:' lines"
    assert [k.strip("` .") for k in exact[1].split(",")] == sorted(EXACT)
    assert [k.strip("` .") for k in refused[1].split(",")] == sorted(REFUSED)
