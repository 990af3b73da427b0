"""Cross-entropy through a frozen output layer, computed a block of rows at a time.

A feature head's training step spends most of its time not in its own layer but in the output layer
over the sub-vocabulary: for 16 sequences of 640 rows, three passes, the logits are 3 x 10,240 x 8,192
values, and the plain route (logits, then log-softmax, its backward, the argmax for the statistics)
writes and rereads them several times over, with a zero-filled gradient of the same size (measured on
a 2-core CPU: log-softmax forward and backward, dtype copies and fills were 60% of a 6 s step).
Here each block of rows is multiplied, turned into its loss, argmax and the gradient with respect to
its input while it is still in cache, and only the input-sized gradient is kept for the backward pass
(the idea of fused linear cross-entropy kernels such as Liger's; written here for the CPU). The
output layer's weight is frozen: no gradient is computed for it.

Under autocast the block's product runs in autocast's dtype (as `x @ weight.T` would) and the softmax
in float32 (as `F.cross_entropy` would); the loss is the mean over the rows whose target is not
`IGNORE`.
"""

from __future__ import annotations

import torch

IGNORE = -100  # a row's target that takes no loss (still counted in the argmax)
BLOCK = 512  # rows per block: 512 x 8192 float32 logits are 16 MB


class _OutputLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, block: int):
        learnt = target != IGNORE
        n = max(int(learnt.sum()), 1)
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(x) if need_grad else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        best = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        for s in range(0, x.shape[0], block):
            e = min(s + block, x.shape[0])
            raw = x[s:e] @ weight.T  # (under autocast, in its dtype)
            best[s:e] = raw.argmax(-1)
            logits = raw.float()
            t, ok = target[s:e], learnt[s:e]
            lse = logits.logsumexp(-1)
            picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
            total += ((lse - picked) * ok).sum()
            if need_grad:  # d loss / d logits = (softmax - one-hot) / n on learnt rows, 0 elsewhere
                probs = logits.sub_(lse[:, None]).exp_()
                rows = ok.nonzero()[:, 0]
                probs[rows, t[rows]] -= 1.0
                # (the product is linear in each row: rows are scaled after it, at 1/14 of the width)
                grad[s:e] = (probs.to(weight.dtype) @ weight) * (ok.to(x.dtype) / n)[:, None]
        if need_grad:
            ctx.save_for_backward(grad)
        return total / n, best

    @staticmethod
    def backward(ctx, grad_loss, grad_best):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None


def output_loss(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of `x @ weight.T` [rows, vocabulary] against `target` [rows] over the rows whose
    target is not IGNORE (0 when there is none), argmax of each row's logits), computed `block` rows at a
    time; differentiable in `x` only (`weight`, the frozen output layer, must not need a gradient)."""
    if weight.requires_grad:
        raise ValueError("output_loss keeps the output layer frozen: pass weight.detach()")
    return _OutputLoss.apply(x, weight, target, block)
