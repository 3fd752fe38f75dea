"""Chunked LM head + token cross-entropy, per adapter, without the full logits.

`per_adapter_lm_loss` walks each adapter's rows in chunks of `chunk_rows` (chunks never
span two adapters and start at the adapter's own first row), computes the chunk's logits
in the hidden's dtype, takes their token cross-entropy in fp32 (as transformers upcasts) and
keeps only the per-row losses (`cross_entropy.py` on CUDA, its torch reference elsewhere).
When `hidden` needs a gradient, the same pass turns the chunk's logits into
d(sum of losses)/d(hidden) = (softmax - onehot) @ W and stores only that [N, H] tensor;
backward scales its rows by the adapter's incoming gradient. So the [N, V] logits never
exist, and the logits are never recomputed.

Determinism: an adapter's sum depends only on its own rows: same chunk shapes, same
(>= 256-byte aligned) operands, same reduction order, whatever else is packed. The engine
relies on this: removing a failed adapter must not change its pack-mates' losses by one bit.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .dispatch import uses_triton
from .reference import IGNORE_INDEX, reference_cross_entropy_rows

_ALIGN = 256  # bytes; a chunk's operand is copied when its slice starts off this alignment


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk such that one chunk's fp32 logits stay under 256 MiB."""
    return max(16, min(4096, (1 << 26) // max(vocab_size, 1) // 16 * 16))


def _segments(seg_lens: Sequence[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for rows in seg_lens:
        out.append((start, int(rows)))
        start += int(rows)
    return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _chunk_loss(h, weight, t, need_grad):
    """Per-row losses (fp32) of one chunk and, if asked, d(sum of losses)/dh."""
    logits = h @ weight.t()  # (rows, V), in the hidden's dtype as the model's LM head computes them
    if uses_triton(logits):
        from .cross_entropy import cross_entropy_rows

        losses, grad_logits = cross_entropy_rows(logits, t, need_grad)
    else:
        losses, grad_logits = reference_cross_entropy_rows(logits, t, need_grad)
    return losses, (grad_logits @ weight if need_grad else None)  # (rows, H)


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, seg_lens, chunk_rows):
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        sums, counts = [], []
        for start, rows in _segments(seg_lens):
            chunk_sums = []
            for c0 in range(start, start + rows, chunk_rows):
                c1 = min(c0 + chunk_rows, start + rows)
                losses, g = _chunk_loss(_aligned(hidden[c0:c1]), weight, targets[c0:c1], need_grad)
                chunk_sums.append(losses.sum())
                if need_grad:
                    grad[c0:c1] = g
            zero = hidden.new_zeros((), dtype=torch.float32)
            sums.append(torch.stack(chunk_sums).sum() if chunk_sums else zero)
            counts.append((targets[start : start + rows] != IGNORE_INDEX).sum())
        ctx.seg_lens = seg_lens
        if need_grad:
            ctx.save_for_backward(grad)
        loss_sums = torch.stack(sums) if sums else hidden.new_zeros(0, dtype=torch.float32)
        token_counts = torch.stack(counts) if counts else targets.new_zeros(0)
        ctx.mark_non_differentiable(token_counts)
        return loss_sums, token_counts

    @staticmethod
    def backward(ctx, g_sums, g_counts):
        (grad,) = ctx.saved_tensors
        lens = torch.tensor(ctx.seg_lens)  # pinned and asynchronous: no wait for the GPU mid-backward
        lens = lens.pin_memory().to(grad.device, non_blocking=True) if grad.is_cuda else lens
        row_scale = g_sums.float().repeat_interleave(lens, output_size=grad.shape[0])  # (N,)
        return (grad * row_scale[:, None]).to(grad.dtype), None, None, None, None


class _ChunkedLMLossRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows):
        need_grad = ctx.needs_input_grad[0]
        grad = torch.empty_like(hidden) if need_grad else None
        losses = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for c0 in range(0, hidden.shape[0], chunk_rows):
            c1 = min(c0 + chunk_rows, hidden.shape[0])
            losses[c0:c1], g = _chunk_loss(_aligned(hidden[c0:c1]), weight, targets[c0:c1], need_grad)
            if need_grad:
                grad[c0:c1] = g
        if need_grad:
            ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx, g_rows):
        (grad,) = ctx.saved_tensors
        return (grad * g_rows.float()[:, None]).to(grad.dtype), None, None, None


def lm_loss_rows(hidden: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor,
                 chunk_rows: Optional[int] = None) -> torch.Tensor:
    """fp32 [N]: each row's token cross-entropy against `targets` (0 where IGNORE_INDEX),
    differentiable in `hidden`: the rows of `per_adapter_lm_loss` before any sum, in fixed
    chunks of `chunk_rows` whatever the rows belong to. Its work depends on N only, so a CUDA
    graph replays it for any layout of the rows."""
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [{hidden.shape[0]}], got {tuple(targets.shape)}.")
    chunk_rows = default_chunk_rows(lm_head_weight.shape[0]) if chunk_rows is None else int(chunk_rows)
    return _ChunkedLMLossRows.apply(hidden, lm_head_weight.detach(), targets, chunk_rows)


def per_adapter_lm_loss(
    hidden: torch.Tensor,  # [N, H]: valid, already-shifted positions, adapters' rows contiguous in order
    lm_head_weight: torch.Tensor,  # [V, H], frozen
    targets: torch.Tensor,  # [N] int64 (IGNORE_INDEX = -100 rows count nothing)
    seg_lens: Sequence[int],  # rows per adapter, sum == N
    chunk_rows: Optional[int] = None,  # default: default_chunk_rows(V)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sums fp32 [n_adapters], token_counts int64 [n_adapters]): each adapter's summed
    token cross-entropy and its number of counted tokens; differentiable in `hidden` only."""
    seg_lens = tuple(int(s) for s in seg_lens)
    if any(s < 0 for s in seg_lens) or sum(seg_lens) != hidden.shape[0]:
        raise ValueError(f"seg_lens must be >= 0 and sum to hidden's {hidden.shape[0]} rows, got {list(seg_lens)}.")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [{hidden.shape[0]}], got {tuple(targets.shape)}.")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"lm_head_weight must be [V, {hidden.shape[1]}], got {tuple(lm_head_weight.shape)}.")
    chunk_rows = default_chunk_rows(lm_head_weight.shape[0]) if chunk_rows is None else int(chunk_rows)
    if chunk_rows < 1:
        raise ValueError(f"The value of `chunk_rows` is {chunk_rows}, but must be `chunk_rows >= 1`.")
    return _ChunkedLMLoss.apply(hidden, lm_head_weight.detach(), targets, seg_lens, chunk_rows)


def reference_per_adapter_lm_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    seg_lens: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full [N, V] logits (hidden's dtype, upcast to fp32) and F.cross_entropy per segment."""
    logits = (hidden @ lm_head_weight.t()).float()
    sums, counts = [], []
    for start, rows in _segments(seg_lens):
        t = targets[start : start + rows]
        sums.append(F.cross_entropy(logits[start : start + rows], t, reduction="sum",
                                    ignore_index=IGNORE_INDEX))
        counts.append((t != IGNORE_INDEX).sum())
    return torch.stack(sums), torch.stack(counts)
