"""RMSNorm of a frozen model, forward and input gradient, one Triton program per row.

transformers' LlamaRMSNorm (and Qwen2's, Mistral's, ...) upcasts to fp32 and runs six
elementwise kernels forward and about ten backward, each reading and writing the whole
[tokens, hidden] tensor, in fp32 for most of them. Here a row is read once forward (written
once, plus its fp32 1/rms for the backward) and x and dy are read once backward. The weight
is frozen, so no weight gradient is computed.

The arithmetic follows transformers': y = weight * bf16(x * rsqrt(mean(x^2) + eps)), in fp32
with the one rounding to the input dtype before the weight multiplies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata import LAUNCH_OPTIONS
from .reference import reference_rms_norm  # noqa: F401  (the torch reference of this file's kernels)


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)  # transformers rounds here
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, H, BLOCK: tl.constexpr):
    # y = w * x * r with r = (mean(x^2) + eps)^-1/2, so dx = r * g - r^3 * x * mean(g * x), g = dy * w
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dy_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32) \
        * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    dx = rstd * g - rstd * rstd * rstd * x * (tl.sum(g * x, axis=0) / H)
    tl.store(dx_ptr + row * H + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _launch_config(hidden: int) -> tuple[int, int]:
    block = triton.next_power_of_2(hidden)
    return block, min(16, max(1, block // 256))  # (BLOCK, num_warps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, hidden = x2.shape
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block, warps = _launch_config(hidden)
        if rows:
            _rms_norm_fwd_kernel[(rows,)](x2, weight, y, rstd, hidden, eps, BLOCK=block, num_warps=warps,
                                          **LAUNCH_OPTIONS)
        ctx.save_for_backward(x2, weight, rstd)
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        rows, hidden = x2.shape
        dy2 = dy.reshape(rows, hidden).contiguous()
        dx = torch.empty_like(x2)
        block, warps = _launch_config(hidden)
        if rows:
            _rms_norm_bwd_kernel[(rows,)](x2, weight, dy2, rstd, dx, hidden, BLOCK=block, num_warps=warps,
                                          **LAUNCH_OPTIONS)
        return dx.reshape(dy.shape), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference_rms_norm` in two Triton kernels; gradients for `x` only (the weight is frozen)."""
    if weight.requires_grad:
        raise ValueError("rms_norm computes no weight gradient: the weight must be frozen")
    return _RMSNorm.apply(x, weight, float(eps))
