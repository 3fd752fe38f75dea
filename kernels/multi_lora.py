"""The packed multi-LoRA linear on the Triton kernels, as one autograd Function.

LoRAFusion's split at the rank-r tensor S, per call:

    forward   S  = dropout(x) @ A_i^T                       shrink.py     (mask from the seed)
              Y  = x @ W^T + bias + scale_i * S @ B_i^T      lora_gemm.py  (one output write)
    backward  dS = scale_i * dY @ B_i                        shrink.py
              dB = scale_i * dY_i^T @ S_i                    row_reduce.py
              dA = dS_i^T @ dropout(x_i)                     row_reduce.py (mask regenerated)
              dX = dY @ W + mask_i / (1 - p_i) * (dS @ A_i)  lora_gemm.py

Saved for backward: x, S ([tokens, rank] in x's dtype) and the routing tables; no dropout mask,
no dropped x. W and bias are frozen: no gradient is ever computed for them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .metadata import KernelConfig, LoRABatchMeta, config_for
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
    return dtypes.pop() if dtypes else torch.float32


class _TritonMultiLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, meta: LoRABatchMeta, lora_dtype, adapter_ids, *lora_tensors):
        # lora_tensors: A_i, B_i of each adapter in `adapter_ids` (those with LoRA), contiguous
        from .lora_gemm import lora_gemm
        from .shrink import lora_shrink

        x = x.contiguous()
        s = torch.empty(x.shape[0], meta.rank_stride, device=x.device, dtype=x.dtype)  # (tokens, rank)
        lora_shrink(x, s, meta, lora_is_b=False, apply_scale=False, dropout=True)
        if meta.config.fused_base:
            y = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
            lora_gemm(x, weight, bias, s, y, meta, forward=True, fused_base=True)
        else:
            y = F.linear(x, weight, bias)
            lora_gemm(x, weight, None, s, y, meta, forward=True, fused_base=False)
        ctx.save_for_backward(x, weight, s, *lora_tensors)
        ctx.meta, ctx.lora_dtype, ctx.adapter_ids = meta, lora_dtype, adapter_ids
        return y

    @staticmethod
    def backward(ctx, dy):
        from .lora_gemm import lora_gemm
        from .row_reduce import lora_row_reduce
        from .shrink import lora_shrink

        x, weight, s, *lora_tensors = ctx.saved_tensors
        meta, lora_dtype = ctx.meta, ctx.lora_dtype
        dy = dy.contiguous()
        ds = torch.empty_like(s)  # (tokens, rank)
        lora_shrink(dy, ds, meta, lora_is_b=True, apply_scale=True, dropout=False)

        lora_grads = [None] * len(lora_tensors)
        if any(ctx.needs_input_grad[6:]):
            db = torch.empty(meta.db_numel, device=x.device, dtype=lora_dtype)
            da = torch.empty(meta.da_numel, device=x.device, dtype=lora_dtype)
            lora_row_reduce(dy, s, db, meta, out_is_b=True)
            lora_row_reduce(x, ds, da, meta, out_is_b=False)
            da_off = db_off = 0
            for j, i in enumerate(ctx.adapter_ids):
                a, b = lora_tensors[2 * j], lora_tensors[2 * j + 1]
                if meta.ranks[i] == 0:  # adapter without rows: no gradient, as in the reference
                    continue
                lora_grads[2 * j] = da[da_off : da_off + a.numel()].view_as(a)
                lora_grads[2 * j + 1] = db[db_off : db_off + b.numel()].view_as(b)
                da_off += a.numel()
                db_off += b.numel()

        dx = None
        if ctx.needs_input_grad[0]:
            if meta.config.fused_base:
                dx = torch.empty_like(x)
                lora_gemm(dy, weight, None, ds, dx, meta, forward=False, fused_base=True)
            else:
                dx = dy @ weight
                lora_gemm(dy, weight, None, ds, dx, meta, forward=False, fused_base=False)
        return (dx, None, None, None, None, None, *lora_grads)


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
    lora_dtype = _check_inputs(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens)
    seg_lens = [int(s) for s in seg_lens]
    seeds = per_adapter_seeds(seed, len(seg_lens))
    lora_a = [None if a is None else a.contiguous() for a in lora_a]
    lora_b = [None if b is None else b.contiguous() for b in lora_b]
    max_rank = max((a.shape[0] for a in lora_a if a is not None), default=0)
    if config is None:
        config = config_for(x.shape[0], seg_lens, weight.shape[1], weight.shape[0], max_rank, x.is_cuda)
    meta = LoRABatchMeta.build(seg_lens, lora_a, lora_b, scales, dropout_p, seeds,
                               weight.shape[1], weight.shape[0], x.device, config)
    adapter_ids = tuple(i for i, a in enumerate(lora_a) if a is not None)
    flat = [t for i in adapter_ids for t in (lora_a[i], lora_b[i])]
    return _TritonMultiLoRALinear.apply(x, weight, bias, meta, lora_dtype, adapter_ids, *flat)
