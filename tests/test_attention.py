"""attention.py: grouped-query SDPA without K/V copies gives transformers' SDPA results."""

from __future__ import annotations

import pytest
import torch

from conftest import config, tiny
from dynatree import cache as kv
from dynatree.attention import GQA_SDPA, STOCK, stock_attention, use_gqa_attention
from dynatree.models import load_model
from dynatree.tree import additive_mask
from transformers import AutoModelForCausalLM


def fresh(arch: str, dtype=torch.float32):
    torch.manual_seed(11)
    return AutoModelForCausalLM.from_config(config(arch)).to(dtype).eval()


@torch.no_grad()
def steps(model) -> list[torch.Tensor]:
    """Logits of a prefill (no mask: causal), a one-token step and a masked 5-token tree step."""
    loaded = tiny()  # only for its forward(); the model is swapped in below
    loaded = type(loaded)(model=model, tokenizer=loaded.tokenizer, name="x")
    cache = kv.new_cache(model)
    prompt = [5, 9, 14, 9, 5, 9, 14, 30, 31, 7]
    out = [loaded.forward(cache, prompt, list(range(10)), None)]
    out.append(loaded.forward(cache, [8], [10], None))
    # a hand-drawn tree below the 11 cached tokens: root 0 -> 1, 2; 1 -> 3; 2 -> 4
    parents = [-1, 0, 0, 1, 2]
    allowed = torch.zeros(5, 16, dtype=torch.bool)
    allowed[:, :11] = True
    for i, p in enumerate(parents):
        allowed[i, 11 + i] = True
        while p >= 0:
            allowed[i, 11 + p] = True
            p = parents[p]
    depth = [0, 1, 1, 2, 2]
    out.append(loaded.forward(cache, [3, 4, 5, 6, 7], [11 + d for d in depth], additive_mask(allowed, model.dtype, "cpu")))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gqa_attention_gives_stock_sdpa_logits(dtype):
    stock, gqa = fresh("llama", dtype), fresh("llama", dtype)
    assert stock.config._attn_implementation == STOCK
    assert use_gqa_attention(gqa) and gqa.config._attn_implementation == GQA_SDPA
    for a, b in zip(steps(stock), steps(gqa)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("arch", ["gpt_neox", "gpt2"])
def test_models_without_grouped_heads_keep_stock_attention(arch):
    model = fresh(arch)
    assert not use_gqa_attention(model)
    assert model.config._attn_implementation == STOCK


def test_eager_attention_is_left_alone():
    model = fresh("llama")
    model.set_attn_implementation("eager")
    assert not use_gqa_attention(model)
    assert model.config._attn_implementation == "eager"


def test_stock_attention_switches_back_for_the_block_only():
    model = fresh("llama")
    use_gqa_attention(model)
    with stock_attention(model, None):
        assert model.config._attn_implementation == STOCK
    assert model.config._attn_implementation == GQA_SDPA
    with pytest.raises(RuntimeError), stock_attention(model):
        raise RuntimeError("boom")
    assert model.config._attn_implementation == GQA_SDPA


def test_loaded_gqa_checkpoint_uses_it(saved_tiny):
    assert load_model(str(saved_tiny)).model.config._attn_implementation == GQA_SDPA
