"""Cross-entropy through a frozen output layer, computed a block of rows at a time.

A feature head's training step spends most of its time not in its own layer but in the output layer
over the sub-vocabulary: for 16 sequences of 640 rows, three passes, the logits are 3 x 10,240 x 8,192
values, and the plain route (logits, then log-softmax, its backward with a zero-filled gradient of the
same size, the argmax for the statistics, the gather of the learnt rows) writes and rereads them
several times over (docs/results/eagle-train-speed). Here each block of rows is multiplied and turned
into its loss, argmax and the gradient with respect to its input at once, so a block's logits (a few
MB) are written once and reread while recent, and only the input-sized gradient is kept for the
backward pass (the idea of fused linear cross-entropy kernels such as Liger's, written here for the
CPU). The output layer's weight is frozen: no gradient is computed for it.

Under autocast the products run in autocast's dtype (as `x @ weight.T` and its backward would; the
weight is cast once per call) and the softmax in float32 (as `F.cross_entropy` would); the loss is
float32, the mean over the rows whose target is not `IGNORE`. First-order gradients only.

With `teacher` (soft labels, `--label-loss soft`), a row's target is not its hard label but the teacher's
distribution over the same rows of the output layer, `softmax(teacher_row @ weight.T)`, computed in the
same block (never stored whole): the loss is the cross-entropy `-sum p log q`, its gradient `q - p`, as
EAGLE's classification loss takes the target's distribution. `target` then only says which rows learn.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IGNORE = -100  # a row's target that takes no loss (still counted in the argmax)
BLOCK = 512  # rows per block: 512 x 8192 float32 logits are 16 MB


def _blocks(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, block: int, grad: torch.Tensor | None,
            teacher: torch.Tensor | None = None):
    """(mean loss over the learnt rows, argmax per row), writing d(mean loss)/dx into `grad` unless None;
    against the teacher's distributions when `teacher` (rows' features) is given, else the hard targets."""
    learnt = target != IGNORE
    n = max(int(learnt.sum()), 1)
    if torch.is_autocast_enabled(x.device.type):  # cast the frozen weight once, not per block and product
        weight = weight.to(torch.get_autocast_dtype(x.device.type))
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    best = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for s in range(0, x.shape[0], block):
        e = min(s + block, x.shape[0])
        raw = x[s:e] @ weight.T  # (under autocast, in its dtype)
        best[s:e] = raw.argmax(-1)
        logits = raw.float()
        ok = learnt[s:e]
        t = torch.where(ok, target[s:e], 0)
        lse = logits.logsumexp(-1)
        if teacher is None:
            picked = logits.gather(1, t[:, None])[:, 0]
        else:  # the teacher's distribution p over the same rows; sum p * logits per row
            p = (teacher[s:e] @ weight.T).float().softmax(-1)
            picked = (p * logits).sum(-1)
        # (where, not a product with the mask: a non-finite ignored row must not reach the sum)
        total += torch.where(ok, lse - picked, 0.0).sum()
        if grad is not None:  # d loss / d logits = (softmax - target distribution) / n on learnt rows, 0 elsewhere
            probs = logits.sub_(lse[:, None]).exp_()
            if teacher is None:
                probs[torch.arange(e - s, device=x.device), t] -= 1.0
            else:
                probs.sub_(p)
            probs.masked_fill_(~ok[:, None], 0.0)
            # (the product is linear in each row: the rows are scaled after it, at 1/14 of the width)
            grad[s:e] = (probs.to(weight.dtype) @ weight) / n
    return total / n, best


class _OutputLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, block: int,
                teacher: torch.Tensor | None):
        grad = torch.empty_like(x)
        loss, best = _blocks(x, weight, target, block, grad, teacher)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(best)
        return loss, best

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_best):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None, None


def output_loss(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                block: int = BLOCK, teacher: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy of `x @ weight.T` [rows, vocabulary] against `target` [rows] over the rows whose
    target is not IGNORE (0 when there is none), argmax of each row's logits), computed `block` rows at a
    time; differentiable in `x` only (`weight`, the frozen output layer, must not need a gradient). The
    gradient is computed with the loss, so only when autograd will ask for it. With `teacher` [rows, width]
    (frozen), each learnt row's target is the distribution `softmax(teacher @ weight.T)` instead of its
    hard label (soft labels; `target` still names the rows that learn)."""
    if weight.requires_grad:
        raise ValueError("output_loss keeps the output layer frozen: pass weight.detach()")
    if teacher is not None and (teacher.requires_grad or teacher.shape != x.shape):
        raise ValueError(f"output_loss: the teacher's features must be frozen and shaped as x {tuple(x.shape)}, "
                         f"got {tuple(teacher.shape)}{' needing a gradient' if teacher.requires_grad else ''}")
    if teacher is not None and teacher.device != x.device:
        raise ValueError(f"output_loss: the teacher's features are on {teacher.device}, the rows on {x.device}")
    if teacher is not None and teacher.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise ValueError(f"output_loss: the teacher's features are {teacher.dtype}, the output layer "
                         f"{weight.dtype} (outside autocast they must match)")
    if bool(((target != IGNORE) & ((target < 0) | (target >= weight.shape[0]))).any()):
        raise ValueError(f"output_loss: a target outside 0..{weight.shape[0] - 1} that is not IGNORE ({IGNORE})")
    if torch.is_grad_enabled() and x.requires_grad and bool((target != IGNORE).any()):
        return _OutputLoss.apply(x, weight, target, block, teacher)
    with torch.no_grad():
        return _blocks(x, weight, target, block, None, teacher)
