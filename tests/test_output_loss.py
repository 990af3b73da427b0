"""The feature head's training loss through the frozen output layer, a block of rows at a time
(distill/output_loss.py), against the plain route it replaces: logits, F.cross_entropy, argmax."""

import pytest
import torch
import torch.nn.functional as F

from dynatree.distill.output_loss import IGNORE, output_loss


def _case(rows=10, width=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g)
    target = torch.randint(0, vocab, (rows,), generator=g)
    return x, weight, target


def _plain(x, weight, target):
    logits = x @ weight.T
    return F.cross_entropy(logits, target, ignore_index=IGNORE), logits.argmax(-1)


@pytest.mark.parametrize("block", [1, 3, 10, 512])
def test_loss_gradient_and_argmax_equal_the_plain_route_in_float32(block):
    x, weight, target = _case()
    target[[1, 4, 5]] = IGNORE  # rows that take no loss but still count in the argmax
    loss, best = output_loss(x, weight, target, block=block)
    (grad,) = torch.autograd.grad(2.5 * loss, x)  # a scaled loss scales the gradient
    x2 = x.detach().clone().requires_grad_()
    ref_loss, ref_best = _plain(x2, weight, target)
    (ref_grad,) = torch.autograd.grad(2.5 * ref_loss, x2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(best, ref_best)
    assert grad[[1, 4, 5]].abs().max() == 0  # ignored rows get no gradient


def test_every_row_ignored_gives_zero_loss_and_no_gradient_to_compute():
    x, weight, target = _case()
    loss, best = output_loss(x, weight, torch.full_like(target, IGNORE), block=4)
    assert float(loss) == 0.0 and not loss.requires_grad  # (unrolled_loss adds no such term)
    assert torch.equal(best, (x @ weight.T).argmax(-1))


def test_a_non_finite_ignored_row_does_not_reach_the_loss_or_the_gradient():
    """As with the plain route, which takes the loss on the learnt rows' logits only."""
    x, weight, target = _case()
    with torch.no_grad():
        x[1] = float("inf")
    target[1] = IGNORE
    loss, _ = output_loss(x, weight, target, block=4)
    (grad,) = torch.autograd.grad(loss, x)
    keep = [i for i in range(len(target)) if i != 1]
    torch.testing.assert_close(loss, _plain(x.detach()[keep], weight, target[keep])[0])
    assert torch.isfinite(grad).all() and grad[1].abs().max() == 0


def test_a_target_outside_the_vocabulary_is_refused():
    x, weight, target = _case()
    for bad in (-1, weight.shape[0]):
        target[3] = bad
        with pytest.raises(ValueError, match="outside 0..49"):
            output_loss(x, weight, target)


def test_a_second_derivative_is_refused_not_silently_wrong():
    x, weight, target = _case()
    loss, _ = output_loss(x, weight, target)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice|does not require grad"):
        torch.autograd.grad(grad.sum(), x)


def test_under_bfloat16_autocast_it_follows_autocast_like_the_plain_route():
    """The product in bfloat16 (its argmax on the bfloat16 logits), the softmax in float32."""
    x, weight, target = _case(rows=40, width=64, vocab=300, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, best = output_loss(x, weight, target, block=16)
        (grad,) = torch.autograd.grad(loss, x)
        x2 = x.detach().clone().requires_grad_()
        ref_loss, ref_best = _plain(x2, weight, target)
        (ref_grad,) = torch.autograd.grad(ref_loss, x2)
    assert loss.dtype == torch.float32 and ref_loss.dtype == torch.float32
    # bfloat16 logits either way; a CPU whose bfloat16 product rounds a row by the rows beside it (blocks of 16
    # here, 40 there) may differ by its rounding step (0.4%), and flip an argmax on a near-tie
    torch.testing.assert_close(loss, ref_loss, rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=0.02, atol=2e-3)  # the gradient rounds through bfloat16
    assert int((best != ref_best).sum()) <= 2
    float_loss, _ = _plain(x.detach(), weight, target)  # ... and bfloat16 logits they are: apart from float32's
    assert not torch.allclose(loss, float_loss, rtol=1e-6, atol=0)


def test_without_gradients_it_only_measures(monkeypatch):
    """Under no_grad (the held-out evaluation) no input gradient is computed, even for an input that
    requires one."""
    from dynatree.distill import output_loss as module

    x, weight, target = _case()
    monkeypatch.setattr(module._OutputLoss, "apply", lambda *a: pytest.fail("computed a gradient nobody asks for"))
    with torch.no_grad():
        loss, best = output_loss(x, weight, target)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _plain(x.detach(), weight, target)[0])
    assert torch.equal(best, (x.detach() @ weight.T).argmax(-1))


def test_the_output_layer_must_be_frozen():
    x, weight, target = _case()
    with pytest.raises(ValueError, match="frozen"):
        output_loss(x, weight.requires_grad_(), target)


def _plain_soft(x, weight, teacher, target):
    """Soft labels the plain route: cross-entropy against softmax(teacher @ W.T) on the learnt rows."""
    keep = target != IGNORE
    p = (teacher @ weight.T).softmax(-1)[keep]
    logq = (x @ weight.T).log_softmax(-1)[keep]
    return -(p * logq).sum(-1).mean()


@pytest.mark.parametrize("block", [1, 3, 512])
def test_soft_labels_give_the_cross_entropy_against_the_teachers_distribution_and_its_gradient(block):
    x, weight, target = _case()
    teacher = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    target[[2, 6]] = IGNORE
    loss, best = output_loss(x, weight, target, block=block, teacher=teacher)
    (grad,) = torch.autograd.grad(loss, x)
    x2 = x.detach().clone().requires_grad_()
    ref = _plain_soft(x2, weight, teacher, target)
    (ref_grad,) = torch.autograd.grad(ref, x2)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(best, (x.detach() @ weight.T).argmax(-1))
    assert grad[[2, 6]].abs().max() == 0
    # the hard label's loss is another: soft labels are not silently ignored
    hard, _ = output_loss(x, weight, target, block=block)
    assert abs(float(hard) - float(loss)) > 1e-3


def test_soft_labels_from_a_teacher_equal_to_the_student_leave_only_its_entropy_and_no_gradient():
    """p = q: the loss is the entropy of q, the gradient q - p is zero."""
    x, weight, target = _case()
    loss, _ = output_loss(x, weight, target, teacher=x.detach().clone())
    (grad,) = torch.autograd.grad(loss, x)
    q = (x.detach() @ weight.T).softmax(-1)
    torch.testing.assert_close(loss, -(q * q.log()).sum(-1).mean(), rtol=1e-6, atol=1e-6)
    assert grad.abs().max() < 1e-6


def test_a_teacher_of_another_shape_or_needing_a_gradient_is_refused():
    x, weight, target = _case()
    with pytest.raises(ValueError, match="teacher's features must be frozen and shaped as x"):
        output_loss(x, weight, target, teacher=torch.randn(x.shape[0], x.shape[1] + 1))
    with pytest.raises(ValueError, match="needing a gradient"):
        output_loss(x, weight, target, teacher=torch.randn(x.shape, requires_grad=True))
    with pytest.raises(ValueError, match="shaped as x"):  # a row too few
        output_loss(x, weight, target, teacher=torch.randn(x.shape[0] - 1, x.shape[1]))
    with pytest.raises(ValueError, match=r"^output_loss: the teacher's features are torch.bfloat16, the output "
                                         r"layer torch.float32 \(outside autocast they must match\)$"):
        output_loss(x, weight, target, teacher=torch.randn(x.shape).bfloat16())
    with pytest.raises(ValueError, match=r"^output_loss: the teacher's features are on meta, the rows on cpu$"):
        output_loss(x, weight, target, teacher=torch.randn(x.shape, device="meta"))


def test_soft_labels_under_bfloat16_autocast_follow_autocast_like_the_plain_route():
    """Under autocast both products (the student's and the teacher's) run in bfloat16 and the softmaxes
    in float32, as the plain route's would; a bfloat16 teacher is accepted there."""
    x, weight, target = _case(rows=40, width=64, vocab=300, seed=2)
    teacher = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    target[[0, 7]] = IGNORE
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for t in (teacher, teacher.bfloat16()):
            loss, _ = output_loss(x, weight, target, block=16, teacher=t)
            (grad,) = torch.autograd.grad(loss, x)
            x2 = x.detach().clone().requires_grad_()
            keep = target != IGNORE
            p = (t @ weight.T).float().softmax(-1)[keep]
            ref = -(p * (x2 @ weight.T).float().log_softmax(-1)[keep]).sum(-1).mean()
            (ref_grad,) = torch.autograd.grad(ref, x2)
            assert loss.dtype == torch.float32
            torch.testing.assert_close(loss, ref, rtol=5e-3, atol=5e-3)
            torch.testing.assert_close(grad, ref_grad.float(), rtol=0.02, atol=2e-3)
            assert grad[[0, 7]].abs().max() == 0
    float_ref = _plain_soft(x.detach(), weight, teacher, target)  # bfloat16 products: apart from float32's
    assert not torch.allclose(loss, float_ref, rtol=1e-6, atol=0)
