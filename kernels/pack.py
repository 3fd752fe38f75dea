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

B^T needs a transpose, and its B_i lie in tensors of their own. `_pack_bt_kernel` reads
each B_i where it lies, through a table of their addresses, and moves square tiles through
registers, reading and writing whole rows. torch's transposing copy reads along one axis
and writes along the other at about a quarter of the copy rate (KERNELS_NOTES v10); a cat
of the B_i before a transpose copies every B_i once more in fp32. On an H200, 32 adapters of
mixed ranks for 3584 -> 18944 packed in 0.074 ms, against 0.167 ms with the cat and 0.367
ms with torch's cat and transposing copy (`benchmarks/kernels.py --sections blocks`,
KERNELS_NOTES v18). The address table is cached by the addresses: an adapter's tensors
keep their storage while its optimizer updates them in place, and a table holds no values,
so a hit is right whatever now lies at those addresses.
"""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import torch
import triton
import triton.language as tl

from .metadata import cdiv, device_table

CAT_CAST_MAX_ELEMENTS = 2 ** 21  # A's elements up to which a cat and a cast pack it (module docstring)


@triton.jit
def _pack_bt_kernel(
    table_ptr,  # int64 [n_adapters, 3]: B_i's address, r_i, r_offset_i
    b_like_ptr,  # the B_i's dtype (any one of them)
    dst_ptr,  # [R_total, N] in the compute dtype: B^T, adapter i from row r_offset_i
    N,  # rows of every B_i (the layer's out features)
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """dst[r_offset_i + r, n] = B_i[n, r] for one adapter's tile of BLOCK_N rows and BLOCK_R ranks."""
    adapter = tl.program_id(1)
    rank = tl.load(table_ptr + adapter * 3 + 1)
    r0 = tl.program_id(2) * BLOCK_R
    if r0 >= rank:  # a rank block past this adapter's rank
        return
    src_ptr = tl.load(table_ptr + adapter * 3).to(tl.pointer_type(b_like_ptr.dtype.element_ty))
    r_offset = tl.load(table_ptr + adapter * 3 + 2)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    mask = (offs_n < N)[:, None] & (offs_r < rank)[None, :]
    tile = tl.load(src_ptr + offs_n[:, None].to(tl.int64) * rank + offs_r[None, :], mask=mask)
    dst = dst_ptr + (r_offset + offs_r)[:, None] * N + offs_n[None, :]
    tl.store(dst, tl.trans(tile).to(dst_ptr.dtype.element_ty), mask=tl.trans(mask))


@functools.lru_cache(maxsize=4096)
def _address_table(rows: tuple, device: torch.device) -> torch.Tensor:
    """(address, rank, r_offset) of each B_i, on the device (module docstring: why cached)."""
    return device_table(rows, 3, torch.int64, device)


def pack_bt(lora_b: Sequence[torch.Tensor], dtype: torch.dtype, block: int = 64) -> torch.Tensor:
    """B^T [R_total, out] in `dtype`, B_i^T from row r_offset_i, in one kernel. A B_i that is
    not contiguous is copied first; its copy's address then misses the table cache, which
    costs a host-to-device copy per call (one a CUDA graph cannot capture)."""
    lora_b = [b.contiguous() for b in lora_b]
    ranks = [b.shape[1] for b in lora_b]
    n = lora_b[0].shape[0]
    dst = lora_b[0].new_empty(sum(ranks), n, dtype=dtype)
    offsets = list(itertools.accumulate(ranks, initial=0))[:-1]  # r_offset_i: the ranks before adapter i
    table = _address_table(tuple((b.data_ptr(), r, o) for b, r, o in zip(lora_b, ranks, offsets)),
                           lora_b[0].device)
    _pack_bt_kernel[(cdiv(n, block), len(lora_b), cdiv(max(ranks), block))](table, lora_b[0], dst, n,
                                                                          BLOCK_N=block, BLOCK_R=block)
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
    return a_pack, pack_bt(lora_b, dtype)


def reference_pack_adapters(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], dtype: torch.dtype):
    """`pack_adapters` in plain torch: the same values, bit for bit (a copy and a cast)."""
    return torch.cat(list(lora_a)).to(dtype), torch.cat(list(lora_b), dim=1).t().to(dtype).contiguous()
