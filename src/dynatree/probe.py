"""The load-time exactness probe: one small tree step, as the decoder runs it, against plain decoding.

Tree verification is exact only if the model's attention follows the 4-D mask and the explicit
`position_ids` it is given, and if its KV cache can be compacted by index. Architectures that
compute positions from a key's slot in the cache (ALiBi by slot, as transformers' MPT does), ignore
the mask, or keep state outside the cache break one of these silently. The probe finds out
before any decoding: a prompt, then a branched tree (siblings in consecutive cache slots, a
grandchild), then the commit of one path and one more step, each compared with the logits of
sequential decoding of the same tokens. A model that fails is refused with a one-line reason.
For a model with sliding-window layers and a window of at most `MAX_PROBED_WINDOW` tokens the
prompt is longer than the window, so the step also checks that each tree node sees only the
keys inside the window of its own position (larger windows cost too long a prompt to probe;
their masks are tested on small-window models of each such architecture).
"""

from __future__ import annotations

import torch

from . import cache as kv
from .errors import DynaTreeError
from .tree import TreeBuilder

PROMPT_LEN = 6
MAX_PROBED_WINDOW = 256  # sliding windows up to this are crossed by the probe's prompt
# Tolerance on the logits, relative to their scale: batched and one-by-one attention reduce in a
# different order, so they agree to rounding, while a wrong position or mask moves logits by O(1).
TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3}
HALF_TOLERANCE = 5e-2


def _tokens(vocab: int, n: int) -> list[int]:
    """Distinct, repeatable token ids spread over the vocabulary (away from the special ids at 0..2)."""
    return [3 + (i * 7919) % max(1, vocab - 3) for i in range(n)]


def _sequential(loaded, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of plain causal decoding of `ids` (no cache, no mask given)."""
    out = loaded.model(input_ids=torch.tensor([ids], device=loaded.device), use_cache=False)
    return out.logits[0].float()


def _alibi(loaded) -> bool:
    cfg = loaded.model.config
    return cfg.model_type in ("mpt", "bloom") or bool(getattr(cfg, "alibi", False))


def _reason(loaded, worst: str) -> str:
    why = ("its ALiBi attention bias is computed from cache slots, not from the position ids a tree node is given"
           if _alibi(loaded) else "its attention does not follow the tree mask and position ids the engine passes")
    return (f"{loaded.name!r} ({loaded.model.config.model_type}) cannot be verified exactly with tree attention: "
            f"{why} ({worst}); refused rather than decoding tokens that differ from plain greedy decoding")


@torch.no_grad()
def check_tree_exact(loaded) -> None:
    """Raise DynaTreeError unless a tree step, a path commit and the next step reproduce sequential
    decoding's logits. Costs four short forwards of the model."""
    vocab = loaded.vocab_size
    window = loaded.layout.window
    n = PROMPT_LEN if window is None or window > MAX_PROBED_WINDOW else max(PROMPT_LEN, window + 2)
    prompt = _tokens(vocab, n)
    a, b, c, d = _tokens(vocab, n + 4)[n:]
    tree = TreeBuilder(prompt[-1])  # the root is the last committed token, not yet in the cache
    na = tree.add(0, a, 0.5)
    tree.add(0, b, 0.5)
    nc = tree.add(na, c, 1.0)
    built = tree.build()
    cached = n - 1
    tol = TOLERANCE.get(loaded.dtype, HALF_TOLERANCE)

    def compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        scale = float(want.abs().max()) + 1.0
        diff = float((got.float() - want).abs().max())
        if not diff <= tol * scale:  # also catches NaN
            raise DynaTreeError(_reason(loaded, f"{what}: logits differ by {diff:.3g}"))

    try:  # the eager model is what is probed (compiled=False)
        cache = kv.new_cache(loaded.model)
        positions = list(range(cached))
        loaded.forward(cache, prompt[:-1], positions, None, last_only=True, compiled=False)
        tree_pos = built.position_ids(cached)[0]
        mask = loaded.masks(built.allowed(cached), tree_pos, torch.cat([torch.arange(cached), tree_pos]))
        logits = loaded.forward(cache, built.tokens.tolist(), tree_pos.tolist(), mask, compiled=False).float()
        seq_a = _sequential(loaded, prompt + [a, c])  # root -> a -> c
        seq_b = _sequential(loaded, prompt + [b])  # root -> b
        compare(logits[0], seq_a[cached], "the tree's root")
        compare(logits[na], seq_a[cached + 1], "a first child")
        compare(logits[2], seq_b[cached + 1], "its sibling (next cache slot, same position)")
        compare(logits[nc], seq_a[cached + 2], "a grandchild")
        # commit root -> a -> c (dropping the sibling's slot), then one more token on top
        kv.keep(cache, cached, torch.tensor([0, na, nc]))
        nxt = loaded.forward(cache, [d], [cached + 3], None, compiled=False).float()
        compare(nxt[0], _sequential(loaded, prompt + [a, c, d])[cached + 3], "the step after a committed path")
    except DynaTreeError:
        raise
    except Exception as exc:  # noqa: BLE001 (a model whose forward rejects the engine's inputs is refused, named)
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        why = ("its ALiBi attention builds its bias from a 2-D padding mask and cache slots, so it cannot take "
               "a tree's 4-D mask and position ids" if _alibi(loaded) else
               "it cannot run a tree step with an explicit 4-D mask, position ids and cache")
        raise DynaTreeError(f"{loaded.name!r} ({loaded.model.config.model_type}) is refused: {why} "
                            f"({type(exc).__name__}: {text})") from None
