"""The chunk cross-entropy kernel under TRITON_INTERPRET=1 on CPU tensors against its torch
reference: per-row losses, the gradient written over the logits, ignored rows, vocabularies
that are not a multiple of the block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import use_triton_interpreter

use_triton_interpreter("cross_entropy")  # before the kernels are imported

from lora_sweep.kernels.cross_entropy import cross_entropy_rows  # noqa: E402
from lora_sweep.kernels.reference import IGNORE_INDEX, reference_cross_entropy_rows  # noqa: E402


def make_case(rows, vocab, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    targets[torch.rand(rows, generator=g) < 0.25] = IGNORE_INDEX
    return logits, targets


@pytest.mark.parametrize("rows,vocab", [(9, 50), (4, 4096), (3, 5000), (1, 1), (0, 64)])
def test_losses_and_gradient_equal_the_reference(rows, vocab):
    logits, targets = make_case(rows, vocab, torch.float32)
    want_losses, want_grad = reference_cross_entropy_rows(logits.clone(), targets, need_grad=True)
    got_losses, got_grad = cross_entropy_rows(logits, targets, need_grad=True)
    assert got_grad is logits  # written in place: the chunk's logits are given up
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def test_reference_is_torch_cross_entropy():
    logits, targets = make_case(12, 77, torch.float32)
    leaf = logits.clone().requires_grad_(True)
    want = F.cross_entropy(leaf, targets, reduction="none", ignore_index=IGNORE_INDEX)
    (want_grad,) = torch.autograd.grad(want.sum(), leaf)
    losses, grad = reference_cross_entropy_rows(logits, targets, need_grad=True)
    torch.testing.assert_close(losses, want)
    torch.testing.assert_close(grad, want_grad)
    assert torch.all(grad[targets == IGNORE_INDEX] == 0) and torch.all(losses[targets == IGNORE_INDEX] == 0)


def test_without_gradient_the_logits_are_left_alone():
    logits, targets = make_case(5, 300, torch.float32)
    before = logits.clone()
    losses, grad = cross_entropy_rows(logits, targets, need_grad=False)
    assert grad is None and torch.equal(logits, before)
    torch.testing.assert_close(losses, reference_cross_entropy_rows(before, targets, False)[0])


def test_non_contiguous_logits_are_refused():
    logits, targets = make_case(4, 10, torch.float32)
    with pytest.raises(ValueError, match="contiguous"):
        cross_entropy_rows(logits.t().contiguous().t(), targets, need_grad=True)
