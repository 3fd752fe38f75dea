"""The adapters, packed per call as the kernels read them.

Every kernel reads adapter i's A_i ([r_i, in]) and B_i^T ([r_i, out]) as rows r_offset_i..
of two matrices in the compute dtype (bf16 on GPU): A [R_total, in], the A_i stacked, and
B^T [R_total, out]. The adapters themselves stay fp32 parameters of their own, as PEFT keeps
them, so the packing runs in every call and reads every adapter once.

A is one multi-tensor copy (`torch._foreach_copy_`, which casts as it copies) into the
slices of the packed matrix: each element read once in fp32 and written once in bf16. That
copy gives each block of its kernel 64k elements of one tensor, so a few small adapters run
on a few SMs. Up to `CAT_CAST_MAX_ELEMENTS` a cat and a cast pack A instead: two kernels
across the whole GPU, at the cost of one more fp32 round trip. GPU time on an H100
(KERNELS_NOTES v11): 0.004 against 0.008 ms for 4 adapters of rank 16 at 4096 wide; for 32
of mixed ranks the multi-tensor copy wins, 0.021 against 0.033 ms.

B^T needs a transpose. torch's transposing copy reads along one axis and writes along the
other, at about a quarter of the copy rate, so `_transpose_cast_kernel` moves square tiles
through registers instead, reading and writing whole rows. Side by side on an H100, packing
32 adapters of mixed ranks for 3584 -> 18944 took 0.20 ms against torch's 0.45 ms
(`benchmarks/kernels.py --sections blocks`, KERNELS_NOTES v10).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .metadata import cdiv

CAT_CAST_MAX_ELEMENTS = 2 ** 21  # A's elements up to which a cat and a cast pack it (module docstring)


@triton.jit
def _transpose_cast_kernel(
    src_ptr,  # [M, N], rows contiguous
    dst_ptr,  # [N, M], rows contiguous, in the destination dtype
    M,
    N,
    stride_src,
    stride_dst,
    BLOCK: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tile = tl.load(src_ptr + offs_m[:, None].to(tl.int64) * stride_src + offs_n[None, :], mask=mask)
    dst = dst_ptr + offs_n[:, None].to(tl.int64) * stride_dst + offs_m[None, :]
    tl.store(dst, tl.trans(tile).to(dst_ptr.dtype.element_ty), mask=tl.trans(mask))


def transpose_cast(src: torch.Tensor, dtype: torch.dtype, block: int = 64) -> torch.Tensor:
    """src.t() in `dtype`, contiguous ([N, M] from a row-contiguous [M, N])."""
    assert src.dim() == 2 and src.stride(1) == 1
    M, N = src.shape
    dst = src.new_empty(N, M, dtype=dtype)
    if src.numel():
        _transpose_cast_kernel[(cdiv(M, block), cdiv(N, block))](src, dst, M, N, src.stride(0), dst.stride(0),
                                                               BLOCK=block)
    return dst


@torch.no_grad()
def pack_adapters(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], dtype: torch.dtype):
    """(A [R_total, in], B^T [R_total, out]) in `dtype`, adapter i from row r_offset_i.
    `lora_a`, `lora_b`: the adapters with rows, in order (A_i [r_i, in], B_i [out, r_i]).
    A few ops whatever the number of adapters: host time, since this runs in every call."""
    ranks = [a.shape[0] for a in lora_a]
    if sum(ranks) * lora_a[0].shape[1] <= CAT_CAST_MAX_ELEMENTS:
        a_pack = torch.cat(list(lora_a)).to(dtype)
    else:
        a_pack = lora_a[0].new_empty(sum(ranks), lora_a[0].shape[1], dtype=dtype)
        torch._foreach_copy_(a_pack.split(ranks), list(lora_a))
    b_side_by_side = lora_b[0] if len(lora_b) == 1 else torch.cat(list(lora_b), dim=1)  # [out, R_total]
    bt_pack = transpose_cast(b_side_by_side.contiguous(), dtype)
    return a_pack, bt_pack


def reference_pack_adapters(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], dtype: torch.dtype):
    """`pack_adapters` in plain torch: the same values, bit for bit (a copy and a cast)."""
    return torch.cat(list(lora_a)).to(dtype), torch.cat(list(lora_b), dim=1).t().to(dtype).contiguous()
