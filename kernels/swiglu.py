"""The gated MLP's SiLU(gate) * up, forward and both input gradients, one pass each way.

transformers' Llama-style MLP computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: in
torch that is two elementwise kernels forward and three backward over [tokens, intermediate]
tensors, the widest activations of the model (18944 columns on Qwen2.5-7B), plus SiLU's
output kept for the backward. Here the forward reads gate and up once and writes the product;
the backward reads gate, up and the incoming gradient once and writes both gradients. Only
gate and up are saved.

The arithmetic follows torch's: fp32 inside, SiLU's output rounded to the input dtype before
the product, and the product's gradient to gate rounded before SiLU's derivative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .metadata import LAUNCH_OPTIONS, cdiv
from .reference import reference_silu_mul  # noqa: F401  (the torch reference of this file's kernels)

_BLOCK = 1024


@triton.jit
def _silu_mul_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds SiLU's output
    tl.store(out_ptr + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd_kernel(gate_ptr, up_ptr, dout_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dtype = dgate_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    act = (gate * sig).to(dtype).to(tl.float32)
    dact = (dout * up).to(dtype).to(tl.float32)  # the product's gradient to SiLU's output, rounded as torch does
    tl.store(dup_ptr + offs, (dout * act).to(dtype), mask=mask)
    tl.store(dgate_ptr + offs, (dact * sig * (1.0 + gate * (1.0 - sig))).to(dtype), mask=mask)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        n = gate.numel()
        if n:
            _silu_mul_fwd_kernel[(cdiv(n, _BLOCK),)](gate, up, out, n, BLOCK=_BLOCK, num_warps=4,
                                                     **LAUNCH_OPTIONS)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dout = dout.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        n = gate.numel()
        if n:
            _silu_mul_bwd_kernel[(cdiv(n, _BLOCK),)](gate, up, dout, dgate, dup, n, BLOCK=_BLOCK,
                                                             num_warps=4, **LAUNCH_OPTIONS)
        return dgate, dup


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`reference_silu_mul` in one Triton kernel each way; differentiable in both inputs."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match in shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
                         f"and {tuple(up.shape)} {up.dtype}")
    return _SiluMul.apply(gate, up)
