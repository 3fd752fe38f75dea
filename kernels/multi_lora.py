"""The packed multi-LoRA linear on the Triton kernels, as one autograd Function.

LoRAFusion's split at the rank-r tensor S, per call:

    forward   S  = dropout(x) @ A_i^T                       shrink.py     (mask from the seed, kept)
              Y  = x @ W^T + bias + scale_i * S @ B_i^T      lora_gemm.py  (one output write)
    backward  dS = scale_i * dY @ B_i                        shrink.py
              dB = scale_i * dY_i^T @ S_i                    row_reduce.py
              dA = dS_i^T @ dropout(x_i)                     row_reduce.py (mask kept by the shrink)
              dX = dY @ W + mask_i / (1 - p_i) * (dS @ A_i)  lora_gemm.py

Saved for backward: x, S ([tokens, rank] in x's dtype), the dropout keep-mask (drawn once,
by the forward shrink, as uint8 nibbles: 1/8 of x's size), the packed adapters and the
routing tables; no dropped x. W and bias are frozen: no gradient is ever computed for them.
The adapters enter concatenated (`cat_adapters`: one autograd edge each for all A and all B,
whatever the number of adapters) and are packed into the compute dtype per call
(`pack_adapters`); the backward writes dA and dB in the same concatenated layout, and the
cat's own backward hands each adapter its slice.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .dropout import empty_mask_nibbles
from .metadata import KernelConfig, LoRABatchMeta, config_for, fuse_base_for
from .reference import Seeds, per_adapter_seeds


def _check_inputs(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens):
    n = len(seg_lens)
    if not (len(lora_a) == len(lora_b) == len(scales) == len(dropout_p) == n):
        raise ValueError("lora_a, lora_b, scales, dropout_p and seg_lens must have one entry per adapter.")
    if any(int(s) < 0 for s in seg_lens) or sum(int(s) for s in seg_lens) != x.shape[0]:
        raise ValueError(f"seg_lens must be >= 0 and sum to x's {x.shape[0]} rows, got {list(seg_lens)}.")
    out_f, in_f = weight.shape
    if x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(f"x must be [tokens, {in_f}], got {tuple(x.shape)}.")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight ({weight.dtype}) and x ({x.dtype}) must share a dtype on the Triton path.")
    dtypes = set()
    for i, (a, b) in enumerate(zip(lora_a, lora_b)):
        if (a is None) != (b is None):
            raise ValueError(f"Adapter {i}: `lora_a` and `lora_b` must both be None or both be tensors.")
        if a is None:
            continue
        r = a.shape[0]
        if a.shape != (r, in_f) or b.shape != (out_f, r) or r < 1:
            raise ValueError(f"Adapter {i}: expected A [r, {in_f}] and B [{out_f}, r], "
                             f"got {tuple(a.shape)} and {tuple(b.shape)}.")
        dtypes |= {a.dtype, b.dtype}
    if len(dtypes) > 1:
        raise TypeError(f"All adapters must share one dtype, got {sorted(map(str, dtypes))}.")


def cat_adapters(lora_a, lora_b, ranks):
    """The adapters that have rows, concatenated in adapter order (autograd records the cat,
    so gradients reach each A_i and B_i): A [R_total, in] with A_i from row r_offset_i, and
    B flat, B_i's [out, r_i] block from element out * r_offset_i. Each adapter's slice of
    either is contiguous, so its gradient is too. None, None when no adapter has rows."""
    used = [i for i, r in enumerate(ranks) if r]
    if not used:
        return None, None
    return torch.cat([lora_a[i] for i in used]), torch.cat([lora_b[i].reshape(-1) for i in used])


@torch.no_grad()
def pack_adapters(a_cat, lora_b, ranks, dtype):
    """The adapters with rows as the kernels read them, in the compute dtype: A [R_total, in]
    (`a_cat`, from `cat_adapters`) and B^T [R_total, out], both row-major. B^T is the B_i
    side by side, transposed once: a few ops whatever the number of adapters, not a
    transpose per adapter (host time: the packing runs in every call)."""
    a_pack = a_cat.detach().to(dtype)
    b_side_by_side = torch.cat([b for b, r in zip(lora_b, ranks) if r], dim=1)  # [out, R_total]
    bt_pack = a_pack.new_empty(b_side_by_side.shape[::-1]).copy_(b_side_by_side.t())  # cast and transpose: one copy
    return a_pack, bt_pack


def _base_plus_lora(a, weight, bias, s, lora_pack, meta, forward, mask_nibbles=None):
    """Y = x W^T + b + LoRA (forward) or dX = dY W + LoRA (backward): the base GEMM fused with
    the LoRA term where the config says so and TMA can read the operands, else cuBLAS and the
    LoRA term added in place."""
    from .lora_gemm import lora_gemm, tma_ready

    fused = meta.config.fused_base and (forward or meta.config.fuse_dx) and tma_ready(a, weight)
    if fused:
        out = a.new_empty(a.shape[0], weight.shape[0] if forward else weight.shape[1])
    else:
        out = F.linear(a, weight, bias) if forward else a @ weight
        bias = None
    return lora_gemm(a, weight, bias, s, lora_pack, out, meta, forward=forward, fused_base=fused,
                     mask_nibbles=mask_nibbles)


class _TritonMultiLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, meta: LoRABatchMeta, a_cat, b_flat, a_pack, bt_pack):
        # a_cat [R_total, in], b_flat [out * R_total]: the adapters with rows (`cat_adapters`),
        # the autograd edges; a_pack, bt_pack: the same in x's dtype, as the kernels read them
        from .shrink import lora_shrink

        x = x.contiguous()
        s = torch.empty(x.shape[0], meta.rank_stride, device=x.device, dtype=x.dtype)  # (tokens, rank)
        mask_nibbles = empty_mask_nibbles(x.shape[0] if meta.has_dropout else 0, x.shape[1], x.device)
        lora_shrink(x, a_pack, s, meta, apply_scale=False, dropout=True, mask_nibbles=mask_nibbles)
        y = _base_plus_lora(x, weight, bias, s, bt_pack, meta, forward=True)
        ctx.save_for_backward(x, weight, s, a_pack, bt_pack, mask_nibbles)
        ctx.meta = meta
        ctx.grad_dtype = a_cat.dtype if a_cat is not None else x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        from .row_reduce import lora_row_reduce
        from .shrink import lora_shrink

        x, weight, s, a_pack, bt_pack, mask_nibbles = ctx.saved_tensors
        meta = ctx.meta
        dy = dy.contiguous()
        ds = torch.empty_like(s)  # (tokens, rank)
        lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False)

        da = db = None
        if (ctx.needs_input_grad[4] or ctx.needs_input_grad[5]) and meta.r_total:
            db = torch.empty(dy.shape[1] * meta.r_total, device=x.device, dtype=ctx.grad_dtype)
            da = torch.empty(meta.r_total, x.shape[1], device=x.device, dtype=ctx.grad_dtype)
            lora_row_reduce(dy, s, db, meta, out_is_b=True)
            lora_row_reduce(x, ds, da, meta, out_is_b=False, mask_nibbles=mask_nibbles)

        dx = None
        if ctx.needs_input_grad[0]:
            dx = _base_plus_lora(dy, weight, None, ds, a_pack, meta, forward=False, mask_nibbles=mask_nibbles)
        return dx, None, None, None, da, db, None, None


def triton_multi_lora_linear(
    x: torch.Tensor,  # [tokens, in], adapters' rows contiguous in adapter order
    weight: torch.Tensor,  # [out, in], frozen
    bias: Optional[torch.Tensor],  # [out] or None, frozen
    lora_a: Sequence[Optional[torch.Tensor]],  # each [r_i, in], or None
    lora_b: Sequence[Optional[torch.Tensor]],  # each [out, r_i], or None
    scales: Sequence[float],
    dropout_p: Sequence[float],
    seg_lens: Sequence[int],
    seed: Seeds = 0,
    config: Optional[KernelConfig] = None,
) -> torch.Tensor:
    """The Triton path of `multi_lora_linear`, on any device Triton runs on (CUDA, or CPU
    tensors under TRITON_INTERPRET=1). `config` overrides the per-shape block sizes."""
    _check_inputs(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens)
    seg_lens = [int(s) for s in seg_lens]
    # a tensor of seeds (one per adapter, int64, on x's device) is used as it is
    seeds = seed if isinstance(seed, torch.Tensor) and seed.dim() == 1 else per_adapter_seeds(seed, len(seg_lens))
    max_rank = max((a.shape[0] for a in lora_a if a is not None), default=0)
    if config is None:
        # fused base GEMM for 16-bit inputs only on GPU: its fp32 dot would run in TF32, where torch's does not
        fuse_base = fuse_base_for(seg_lens) and (not x.is_cuda or x.element_size() == 2)
        config = config_for(max_rank, x.is_cuda, fuse_base)
    meta = LoRABatchMeta.build(seg_lens, lora_a, lora_b, scales, dropout_p, seeds,
                               weight.shape[1], weight.shape[0], x.device, config)
    a_cat, b_flat = cat_adapters(lora_a, lora_b, meta.ranks)
    if a_cat is None:  # no LoRA rows at all: the kernels have nothing to read
        a_pack, bt_pack = x.new_empty(0, x.shape[1]), x.new_empty(0, weight.shape[0])
    else:
        a_pack, bt_pack = pack_adapters(a_cat, lora_b, meta.ranks, x.dtype)
    return _TritonMultiLoRALinear.apply(x, weight, bias, meta, a_cat, b_flat, a_pack, bt_pack)
