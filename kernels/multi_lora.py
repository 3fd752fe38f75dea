"""The packed multi-LoRA linear on the Triton kernels, as one autograd Function.

LoRAFusion's split at the rank-r tensor S, per call:

    forward   S  = dropout(x) @ A_i^T                       shrink.py     (mask from the seed)
              Y  = x @ W^T + bias + scale_i * S @ B_i^T      lora_gemm.py  (one output write)
    backward  dS = scale_i * dY @ B_i                        shrink.py
              dB = scale_i * dY_i^T @ S_i                    row_reduce.py
              dA = dS_i^T @ dropout(x_i)                     row_reduce.py (mask regenerated)
              dX = dY @ W + mask_i / (1 - p_i) * (dS @ A_i)  lora_gemm.py

Saved for backward: x, S ([tokens, rank] in x's dtype), the packed adapters and the routing
tables; no dropout mask, no dropped x. W and bias are frozen: no gradient is ever computed
for them. The adapters are packed once per call into the compute dtype (`pack_adapters`).
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


def pack_adapters(lora_a, lora_b, ranks, dtype):
    """The adapters with rows, packed for the kernels in the compute dtype: A_i stacked into
    [R_total, in] and B_i^T into [R_total, out] (adapter i from row r_offset_i). Four copy
    kernels per call, whatever the number of adapters; gradients still go to each A_i, B_i."""
    used = [i for i, r in enumerate(ranks) if r]
    if not used:
        return None, None
    a_cat = torch.cat([lora_a[i].detach() for i in used])  # (R_total, in)
    b_cat = torch.cat([lora_b[i].detach() for i in used], dim=1)  # (out, R_total)
    a_pack = a_cat.to(dtype)
    bt_pack = torch.empty(b_cat.shape[1], b_cat.shape[0], device=b_cat.device, dtype=dtype).copy_(b_cat.t())
    return a_pack, bt_pack


class _TritonMultiLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, meta: LoRABatchMeta, adapter_ids, *lora_tensors):
        # lora_tensors: A_i, B_i of each adapter in `adapter_ids` (those with LoRA)
        from .lora_gemm import lora_gemm
        from .shrink import lora_shrink

        x = x.contiguous()
        lora_a = [None] * len(meta.ranks)
        lora_b = [None] * len(meta.ranks)
        for j, i in enumerate(adapter_ids):
            lora_a[i], lora_b[i] = lora_tensors[2 * j], lora_tensors[2 * j + 1]
        a_pack, bt_pack = pack_adapters(lora_a, lora_b, meta.ranks, x.dtype)
        if a_pack is None:  # no LoRA rows at all: the kernels have nothing to read
            a_pack = x.new_empty(0, x.shape[1])
            bt_pack = x.new_empty(0, weight.shape[0])
        s = torch.empty(x.shape[0], meta.rank_stride, device=x.device, dtype=x.dtype)  # (tokens, rank)
        lora_shrink(x, a_pack, s, meta, apply_scale=False, dropout=True)
        if meta.config.fused_base:
            y = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=x.dtype)
            lora_gemm(x, weight, bias, s, bt_pack, y, meta, forward=True, fused_base=True)
        else:
            y = F.linear(x, weight, bias)
            lora_gemm(x, weight, None, s, bt_pack, y, meta, forward=True, fused_base=False)
        ctx.save_for_backward(x, weight, s, a_pack, bt_pack)
        ctx.meta, ctx.adapter_ids = meta, adapter_ids
        ctx.lora_meta = [(t.shape, t.dtype) for t in lora_tensors]
        return y

    @staticmethod
    def backward(ctx, dy):
        from .lora_gemm import lora_gemm
        from .row_reduce import lora_row_reduce
        from .shrink import lora_shrink

        x, weight, s, a_pack, bt_pack = ctx.saved_tensors
        meta = ctx.meta
        dy = dy.contiguous()
        ds = torch.empty_like(s)  # (tokens, rank)
        lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False)

        lora_grads = [None] * len(ctx.lora_meta)
        if any(ctx.needs_input_grad[5:]) and meta.r_total:
            grad_dtype = ctx.lora_meta[0][1]
            db = torch.empty(meta.db_numel, device=x.device, dtype=grad_dtype)
            da = torch.empty(meta.da_numel, device=x.device, dtype=grad_dtype)
            lora_row_reduce(dy, s, db, meta, out_is_b=True)
            lora_row_reduce(x, ds, da, meta, out_is_b=False)
            da_off = db_off = 0
            for j, i in enumerate(ctx.adapter_ids):
                if meta.ranks[i] == 0:  # adapter without rows: no gradient, as in the reference
                    continue
                (a_shape, _), (b_shape, _) = ctx.lora_meta[2 * j], ctx.lora_meta[2 * j + 1]
                lora_grads[2 * j] = da[da_off : da_off + a_shape.numel()].view(a_shape)
                lora_grads[2 * j + 1] = db[db_off : db_off + b_shape.numel()].view(b_shape)
                da_off += a_shape.numel()
                db_off += b_shape.numel()

        dx = None
        if ctx.needs_input_grad[0]:
            if meta.config.fused_base:
                dx = torch.empty_like(x)
                lora_gemm(dy, weight, None, ds, a_pack, dx, meta, forward=False, fused_base=True)
            else:
                dx = dy @ weight
                lora_gemm(dy, weight, None, ds, a_pack, dx, meta, forward=False, fused_base=False)
        return (dx, None, None, None, None, *lora_grads)


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
    seeds = per_adapter_seeds(seed, len(seg_lens))
    max_rank = max((a.shape[0] for a in lora_a if a is not None), default=0)
    if config is None:
        config = config_for(x.shape[0], seg_lens, weight.shape[1], weight.shape[0], max_rank, x.is_cuda)
    meta = LoRABatchMeta.build(seg_lens, lora_a, lora_b, scales, dropout_p, seeds,
                               weight.shape[1], weight.shape[0], x.device, config)
    adapter_ids = tuple(i for i, a in enumerate(lora_a) if a is not None)
    flat = [t for i in adapter_ids for t in (lora_a[i], lora_b[i])]
    return _TritonMultiLoRALinear.apply(x, weight, bias, meta, adapter_ids, *flat)
