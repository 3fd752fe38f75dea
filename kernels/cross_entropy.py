"""Token cross-entropy of one chunk of logits, and its gradient written over the logits.

The chunked LM loss (`lm_loss.py`) computes a chunk's logits in the model's dtype. In torch,
turning them into losses and into d(loss)/d(logits) takes about eight passes over the
[rows, vocab] tensor, most of them in fp32 (upcast, max, sum of exps, gather, subtract,
exp, scatter, mask, downcast): with a 128k vocabulary that is the biggest elementwise cost
of a training step. Here one program per row reads the row twice: once for its
log-sum-exp (online: running max and rescaled sum), once to write
`softmax - onehot(target)` back over the logits in their own dtype. Rows whose target is
IGNORE_INDEX get loss 0 and a zero gradient.

The arithmetic is the reference's (`reference.reference_cross_entropy_rows`): fp32 inside,
one rounding of the gradient to the logits' dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata import LAUNCH_OPTIONS
from .reference import IGNORE_INDEX, reference_cross_entropy_rows  # noqa: F401  (the torch reference)


@triton.jit
def _cross_entropy_kernel(logits_ptr, targets_ptr, loss_ptr, V, IGNORE: tl.constexpr,
                          WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * V
    target = tl.load(targets_ptr + row)
    valid = target != IGNORE

    # pass 1: log-sum-exp with a running max, so the row is read once
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target_logit = tl.load(row_ptr + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))

    # pass 2: d(loss)/d(logits) = softmax - onehot(target), over the logits
    if WRITE_GRAD:
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
            grad = tl.where(valid, grad, 0.0)
            tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < V)


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, need_grad: bool):
    """(losses fp32 [rows], gradient or None): `reference_cross_entropy_rows` in one Triton
    kernel. With `need_grad` the gradient is written over `logits` (which must be contiguous)
    and returned: the caller gives up its logits."""
    if not logits.is_contiguous():
        raise ValueError("cross_entropy_rows writes the gradient over `logits`: they must be contiguous")
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(4096, triton.next_power_of_2(vocab))
        _cross_entropy_kernel[(rows,)](logits, targets.contiguous(), losses, vocab, IGNORE=IGNORE_INDEX,
                                       WRITE_GRAD=need_grad, BLOCK=block, num_warps=8 if block >= 2048 else 4,
                                       **LAUNCH_OPTIONS)
    return losses, (logits if need_grad else None)
