"""Grouped-query attention without copying K/V, through transformers' attention registry.

Models with fewer key/value heads than query heads (SmolLM2: 9 query, 3 KV heads) run SDPA
in transformers by repeating K and V to every query head (`repeat_kv`) whenever an
attention mask is passed on the CPU - and every tree step passes one. PyTorch's SDPA takes
the grouped heads directly (`enable_gqa=True`) with the same result (bit for bit on the
SmolLM2 shapes we checked; tests/test_attention.py allows 1e-5 in float32) without the copies,
so masked (tree) steps get faster while 1-token steps without a mask are unchanged; compiled
steps gain less, since inductor already fuses much of the copy (docs/benchmarks.md,
"Measurements behind the design").

`use_gqa_attention(model)` switches a loaded model to the registered implementation
`GQA_SDPA` when that pays (grouped KV heads, stock SDPA, CPU). It uses transformers' public
extension points (`AttentionInterface`, `AttentionMaskInterface`): no modeling code is
copied or patched. `stock_attention(...)` switches back for a block, so the hf-* baselines
run the attention transformers ships.

`use_exact_attention(model)` switches a bfloat16 model with low-bit weights (weights.py) to
`EXACT_SDPA`: the same attention computed in float64, rounded back to the model's dtype. Why:
a tree step lays a node's keys out differently from one-token decoding (siblings take cache
slots between a node and its ancestors, several queries share one kernel call), so SDPA sums in
another order; in float32 that moves the output by ~1e-7, which almost never changes a greedy
token, but rounded to bfloat16 (8 mantissa bits) it flips the last bit of some outputs, and the
flips grow through the layers until greedy tokens differ from `ar`'s (measured: docs/benchmarks.md,
"Measurements behind the design"). In float64 the two orders agree to ~1e-16, far below
bfloat16's rounding, so every row rounds to the same bfloat16 value as in one-token decoding.
The low-bit linear kernels compute each row on its own (tested), so
with this attention a tree step's logits are bit for bit those of one-token steps, provided the
dense layers left in the model (the output layer) are row-wise too: `load_model` checks them
(`weights.row_dependent_layers`), and a run says when they are not (`run.inexact_greedy`).

`use_slot_alibi(model)` makes BLOOM's ALiBi follow a tree's positions. BLOOM adds to each
attention score a per-head bias `slope * key_slot` (the key's slot in the cache; softmax ignores
the query's own term, so this is ALiBi's `-slope * distance`). In a tree step a node's ancestors
and siblings sit in consecutive slots, so slot and position differ for every key after the first
tree node, and the bias would be wrong. BLOOM's attention is outside transformers' attention
registry, but its mask is built through the mask registry by the name in
`config._attn_implementation`, and added to the scores before the softmax. So the model gets our
registered mask function `SLOT_ALIBI` (transformers' eager mask for every ordinary step), and
for a tree step `LoadedModel.forward` hands it, through `tree_mask`, the step's additive mask
with `slope * (key_position - key_slot)` added on each visible key (`alibi_correction`): bias plus
correction is `slope * key_position`, as in sequential decoding. (MPT and Falcon's ALiBi cannot
take this route: MPT turns the mask into booleans, Falcon overwrites the mask's values with its
bias; the probe refuses them.) Under torch.compile dynamo cannot trace the context variable, so
a compiled BLOOM step breaks its graph at the mask builder: exact, but several graphs per kind of
step, some built during the first timed steps (reported as `graphs_compiled_while_timed`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

GQA_SDPA = "dynatree_gqa_sdpa"
EXACT_SDPA = "dynatree_exact_sdpa"
STOCK = "sdpa"
SLOT_ALIBI = "dynatree_slot_alibi"
# the mask of the tree step running now on a SLOT_ALIBI model (set by `tree_mask` around one forward)
_TREE_MASK: contextvars.ContextVar = contextvars.ContextVar("dynatree_tree_mask", default=None)


def gqa_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                     is_causal=None, **kwargs):
    """SDPA over grouped KV heads. query [B, H, q, D]; key, value [B, H_kv, k, D] with H % H_kv == 0.

    Returns ([B, q, H, D], None) as every transformers attention function does. Causality
    follows transformers' SDPA: with no mask (the mask builder dropped it because plain
    causal attention is exact), several queries attend causally, one query attends to all.
    """
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        raise ValueError(f"{GQA_SDPA} supports neither position biases nor soft-capping")
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > query.shape[2]:
        # only a prefill into an empty preallocated cache has no mask with more keys than
        # queries (as in transformers' SDPA); its first q keys are the real ones
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def exact_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    """`gqa_sdpa_forward` in float64, the output rounded to the query's dtype (module docstring)."""
    mask = None if attention_mask is None else attention_mask.to(torch.float64)
    out, _ = gqa_sdpa_forward(module, query.to(torch.float64), key.to(torch.float64), value.to(torch.float64), mask,
                              dropout, scaling, is_causal, **kwargs)
    return out.to(query.dtype), None


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    for name, forward in ((GQA_SDPA, gqa_sdpa_forward), (EXACT_SDPA, exact_sdpa_forward)):
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, sdpa_mask)  # masks are built exactly as for SDPA


def slot_alibi_mask(*args, **kwargs):
    """SLOT_ALIBI's mask function: the tree step's mask while `tree_mask` holds one, else the mask
    transformers builds for eager attention (BLOOM's own), from the same arguments."""
    from transformers.masking_utils import eager_mask

    mask = _TREE_MASK.get()
    return eager_mask(*args, **kwargs) if mask is None else mask


@contextlib.contextmanager
def tree_mask(mask: torch.Tensor | None):
    """Hand `mask` to a SLOT_ALIBI model's mask function for the forwards run inside the block."""
    token = _TREE_MASK.set(mask)
    try:
        yield
    finally:
        _TREE_MASK.reset(token)


def use_slot_alibi(model: torch.nn.Module) -> bool:
    """Switch a BLOOM model to SLOT_ALIBI (module docstring); returns whether it was switched.
    (BLOOM does not support `set_attn_implementation`; its attention reads no implementation name,
    only its mask builder does, so the config's name is set directly.)"""
    from transformers import BloomForCausalLM

    if not isinstance(model, BloomForCausalLM) or model.config._attn_implementation not in ("eager", SLOT_ALIBI):
        return False
    from transformers import AttentionMaskInterface

    AttentionMaskInterface.register(SLOT_ALIBI, slot_alibi_mask)
    model.config._attn_implementation = SLOT_ALIBI
    return True


def alibi_slopes(model: torch.nn.Module) -> torch.Tensor | None:
    """The per-head ALiBi slopes [heads] (float32) of a model switched by `use_slot_alibi`, else None;
    read from the model's own bias builder (the bias of slot 1)."""
    if model.config._attn_implementation != SLOT_ALIBI:
        return None
    heads = model.config.n_head
    bias = model.transformer.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)  # [heads, 1, 2]
    return bias.reshape(heads, 2)[:, 1]


def alibi_correction(slopes: torch.Tensor, key_pos: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[heads, keys]: what turns BLOOM's bias by key slot into the bias by key position, rounded as
    BLOOM rounds its own (float32 products, then the model's dtype)."""
    slots = torch.arange(len(key_pos), dtype=torch.float32)
    by_pos = (slopes[:, None] * key_pos.float()[None]).to(dtype)
    by_slot = (slopes[:, None] * slots[None]).to(dtype)
    return by_pos - by_slot


def grouped_kv(config) -> bool:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    return bool(heads and kv_heads and kv_heads < heads)


def use_gqa_attention(model: torch.nn.Module) -> bool:
    """Switch `model` to GQA_SDPA if it has grouped KV heads, runs stock SDPA and sits on the CPU.

    (On CUDA, a masked SDPA with grouped heads falls back to the slow math kernel, so CUDA
    models keep transformers' choice.) Returns whether the model was switched."""
    config = model.config
    device = next(model.parameters()).device
    if config._attn_implementation != STOCK or not grouped_kv(config) or device.type != "cpu":
        return False
    can_switch = getattr(model, "_can_set_attn_implementation", None)  # False: attention outside the registry
    if can_switch is not None and not can_switch():
        return False
    _register()
    model.set_attn_implementation(GQA_SDPA)
    return config._attn_implementation == GQA_SDPA


def can_use_exact_attention(model: torch.nn.Module) -> bool:
    """Whether `model` runs stock SDPA (or GQA_SDPA) through transformers' attention registry."""
    if model.config._attn_implementation not in (STOCK, GQA_SDPA):
        return False
    can_switch = getattr(model, "_can_set_attn_implementation", None)  # False: attention outside the registry
    return can_switch is None or bool(can_switch())


def use_exact_attention(model: torch.nn.Module) -> bool:
    """Switch `model` to EXACT_SDPA if `can_use_exact_attention`; returns whether it was switched
    (module docstring)."""
    config = model.config
    if not can_use_exact_attention(model):
        return False
    _register()
    model.set_attn_implementation(EXACT_SDPA)
    return config._attn_implementation == EXACT_SDPA


@contextlib.contextmanager
def stock_attention(*models):
    """Run a block with transformers' own SDPA on every model switched by `use_gqa_attention`, and
    BLOOM's own eager mask on models switched by `use_slot_alibi`. Models in EXACT_SDPA (low-bit weights) keep it: their format's attention, without which
    transformers' greedy decoding of the same model would round otherwise than `ar`."""
    switched = [m for m in models if m is not None and m.config._attn_implementation == GQA_SDPA]
    alibi = [m for m in models if m is not None and m.config._attn_implementation == SLOT_ALIBI]
    for m in switched:
        m.set_attn_implementation(STOCK)
    for m in alibi:  # BLOOM's own mask builder (no set_attn_implementation: see use_slot_alibi)
        m.config._attn_implementation = "eager"
    try:
        yield
    finally:
        for m in switched:
            m.set_attn_implementation(GQA_SDPA)
        for m in alibi:
            m.config._attn_implementation = SLOT_ALIBI
