"""attention.py: grouped-query SDPA without K/V copies gives transformers' SDPA results."""

from __future__ import annotations

import pytest
import torch

from helpers import fresh, steps
from dynatree.attention import GQA_SDPA, STOCK, stock_attention, use_gqa_attention
from dynatree.models import load_model


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
