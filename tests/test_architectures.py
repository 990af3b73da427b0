"""The architecture matrix: every transformers causal-LM architecture listed here is either exact
(every method's greedy tokens equal transformers' greedy generate(), float64, over prompts and
lengths) or refused at load by the exactness probe with a one-line reason. Never wrong tokens,
never a traceback. The README's list of architectures is checked against these lists.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import DEVICE, EOS, VOCAB, hf_greedy, random_head, tokenizer
from dynatree import api
from dynatree.attention import use_gqa_attention, use_slot_alibi
from dynatree.errors import DynaTreeError
from dynatree.featurehead import FeatureHead, target_features
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
    # ALiBi by slot, made exact (attention.use_slot_alibi); untied embeddings: tied, the tiny model repeats one token
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4, tie_word_embeddings=False),
}
REFUSED = {  # model type -> (tiny config, what the refusal says, why: the README's words)
    "mpt": (dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=256, expansion_ratio=2), "ALiBi",
            "ALiBi by cache slot, and a mask turned into booleans that cannot carry a correction"),
    "falcon-alibi": (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True), "ALiBi",
                     "ALiBi from a 2-D padding mask, written over the mask's values"),
}
METHODS = ("ar", "linear", "dynatree", "specinfer", "wetap", "dsbd", "mtad")


def build(kind: str, seed: int) -> LoadedModel:
    fields = EXACT[kind] if kind in EXACT else REFUSED[kind][0]
    config = AutoConfig.for_model(kind.split("-")[0], vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS,
                                  pad_token_id=0, initializer_range=0.3, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval().to(DEVICE)
    use_slot_alibi(model)  # as load_model does
    use_gqa_attention(model)
    use_packed_linears(model)
    return LoadedModel(model=model, tokenizer=tokenizer(), name=f"tiny-{kind}", eos_ids=[])


@functools.cache
def pair(kind: str) -> tuple[LoadedModel, LoadedModel]:
    """A tiny target and a draft of the same architecture (another seed)."""
    return build(kind, 0), build(kind, 1)


@functools.cache
def head_for(kind: str) -> FeatureHead:
    """A random feature head reading the tiny target's last hidden state (an EAGLE-style drafter)."""
    target = pair(kind)[0]
    hidden, rows = target_features(target.model)
    return random_head(target.name, f"head-{kind}", 7, hidden=hidden, rows=rows, context=256)


@functools.cache
def reference(kind: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy(pair(kind)[0], list(prompt), n)


@pytest.mark.parametrize("kind", sorted(EXACT))
def test_exact_architectures_pass_the_probe_and_decode_exactly(kind):
    target, draft = pair(kind)
    check_tree_exact(target)
    check_tree_exact(draft)

    @settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(prompt=st.lists(st.sampled_from([5, 9, 11, 30, 31, 44]), min_size=1, max_size=12),
           n=st.integers(1, 20), method=st.sampled_from(METHODS), lm=st.booleans())
    def check(prompt, n, method, lm):
        drafter = None if method == "ar" else draft if lm or method != "dynatree" else "ngram"
        got = api.generate(method=method, target=target, draft=drafter, prompt_ids=prompt, max_new_tokens=n,
                           ignore_eos=True).new_token_ids
        assert got == reference(kind, tuple(prompt), n), (kind, method)

    check()
    # every method at least once, on a repetitive prompt the n-gram drafter copies; dynatree with both drafters,
    # and two tree methods with a feature head fed the target's hidden states (BLOOM's among them)
    for method, drafter in [(m, {"ar": None, "dynatree": "ngram"}.get(m, draft)) for m in METHODS] + [
            ("dynatree", draft), ("dynatree", head_for(kind)), ("specinfer", head_for(kind))]:
        prompt = [5, 9, 11, 5, 9, 11, 5, 30]
        got = api.generate(method=method, target=target, draft=drafter, prompt_ids=prompt, max_new_tokens=16,
                           ignore_eos=True).new_token_ids
        assert got == reference(kind, tuple(prompt), 16), (kind, method)
    # the draft above is another random model, whose tokens may all be rejected (equality would then show only
    # root steps): the target as its own draft gets whole paths accepted, committed from the tree's cache entries
    for method in METHODS[1:]:
        got = api.generate(method=method, target=target, draft=target, prompt_ids=[5, 30, 9], max_new_tokens=16,
                           ignore_eos=True)
        assert got.new_token_ids == reference(kind, (5, 30, 9), 16), (kind, method)
        assert got.stats.accepted_tokens > 0, (kind, method)


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_refused_architectures_fail_the_probe_with_a_reason(kind):
    with pytest.raises(DynaTreeError, match=REFUSED[kind][1]) as err:
        check_tree_exact(build(kind, 0))
    assert "\n" not in str(err.value) and "refused" in str(err.value)


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_load_model_runs_the_probe_and_the_cli_says_why_in_one_line(kind, tmp_path, capsys):
    from dynatree.cli import main

    model = build(kind, 0)
    model.model.save_pretrained(tmp_path)
    model.tokenizer.save_pretrained(tmp_path)
    with pytest.raises(DynaTreeError, match=f"{kind.split('-')[0]}.*ALiBi"):
        load_model(str(tmp_path))
    capsys.readouterr()  # (saving's progress bars)
    assert main(["generate", "w5 w6 w7", "--target", str(tmp_path), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "ALiBi" in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_bloom_loads_exact_eagerly_and_compiled(tmp_path):
    """BLOOM by path through load_model: switched to tree-aware ALiBi, probed, and every tree method's
    greedy tokens equal transformers' own, eagerly and compiled (the tree's mask reaches the mask
    builder aside from the arguments: a compiled graph must read each step's mask, not the first)."""
    built = build("bloom", 0)
    built.model.save_pretrained(tmp_path)
    built.tokenizer.save_pretrained(tmp_path)
    target = load_model(str(tmp_path), dtype="float64")
    assert target.alibi_slopes is not None
    prompt = [5, 9, 11, 5, 9, 11, 5, 30, 31]
    want = hf_greedy(target, prompt, 24)
    for method, drafter, compiled in [("dynatree", "ngram", False), ("fixed-tree", "ngram", True),
                                      ("specinfer", target, True), ("ar", None, True)]:
        got = api.generate(method=method, target=target, draft=drafter, prompt_ids=prompt, max_new_tokens=24,
                           ignore_eos=True, compile=compiled)
        assert got.new_token_ids == want, (method, compiled)
        if method != "ar":
            assert got.stats.accepted_tokens > 0, method  # tree steps were verified, not only the root


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


ROOT = Path(__file__).resolve().parents[1]
LISTED_IN = ("README.md", "docs/cli.md")
BEGIN, END = "<!-- architectures: written by `python tests/test_architectures.py` from its matrix -->", \
    "<!-- end of architectures -->"


def matrix_text() -> str:
    """The lists the docs show, written from EXACT and REFUSED."""
    exact = ", ".join(f"`{k}`" for k in sorted(EXACT))
    refused = "; ".join(f"`{k}` ({REFUSED[k][2]})" for k in sorted(REFUSED))
    return f"{BEGIN}\nExact (tested): {exact}.\nRefused at load: {refused}.\n{END}"


def with_matrix(text: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + matrix_text() + text[end:]


@pytest.mark.parametrize("doc", LISTED_IN)
def test_docs_list_the_matrix(doc):
    text = (ROOT / doc).read_text()
    assert BEGIN in text and END in text, f"{doc} needs the generated architecture lists"
    assert with_matrix(text) == text, f"{doc}'s architecture lists are stale: run python tests/test_architectures.py"


if __name__ == "__main__":  # rewrite the docs' lists from the matrix
    for doc in LISTED_IN:
        (ROOT / doc).write_text(with_matrix((ROOT / doc).read_text()))
