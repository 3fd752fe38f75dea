"""The adapters, packed per call as the kernels read them.

Every kernel reads adapter i's A_i ([r_i, in]) and B_i^T ([r_i, out]) as rows r_offset_i..
of two matrices in the compute dtype (bf16 on GPU): A [R_total, in], the A_i stacked, and
B^T [R_total, out]. The adapters themselves stay fp32 parameters of their own, as PEFT keeps
them, so the packing runs in every call and reads every adapter once.

One kernel packs both (`_pack_kernel`): it reads each A_i and B_i where it lies, through a
table of their addresses, and writes its tiles cast (A) or transposed and cast (B^T),
reading and writing whole rows. Each element is read once in fp32 and written once in bf16,
whatever the number of adapters, in one launch: at 2048 tokens the packing is one of the
small kernels that make up the layer's fixed cost. A cat of the A_i before a cast copies
them once more in fp32; torch's transposing copy reads along one axis and writes along the
other at about a quarter of the copy rate. The address table is cached
by the addresses: an adapter's tensors keep their storage while its optimizer updates them
in place, and a table holds no values, so a hit is right whatever now lies at those
addresses.
"""

from __future__ import annotations

import functools
import itertools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .metadata import LAUNCH_OPTIONS, cdiv, device_table

_TABLE_COLS = 4  # address, rank, r_offset, is_b


@triton.jit
def _pack_kernel(
    table_ptr,  # int64 [n_sources, 4]: the source's address, r_i, r_offset_i, 1 for a B_i (else an A_i)
    like_ptr,  # the sources' dtype (any one of them)
    a_ptr,  # [R_total, K] in the compute dtype: A, adapter i from row r_offset_i
    bt_ptr,  # [R_total, N] in the compute dtype: B^T, adapter i from row r_offset_i
    K,  # columns of every A_i (the layer's in features)
    N,  # rows of every B_i (the layer's out features)
    TABLE_COLS: tl.constexpr,  # the table's width, _TABLE_COLS
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One tile of one source, BLOCK_R of its ranks by BLOCK_C columns of the packed matrix:
    A[r_offset_i + r, c] = A_i[r, c], or B^T[r_offset_i + r, c] = B_i[c, r]."""
    source = tl.program_id(1)
    rank = tl.load(table_ptr + source * TABLE_COLS + 1)
    is_b = tl.load(table_ptr + source * TABLE_COLS + 3) != 0
    width = tl.where(is_b, N, K)
    r0 = tl.program_id(2) * BLOCK_R
    c0 = tl.program_id(0) * BLOCK_C
    if r0 >= rank or c0 >= width:  # a block past this source's rank or width
        return
    src_ptr = tl.load(table_ptr + source * TABLE_COLS).to(tl.pointer_type(like_ptr.dtype.element_ty))
    r_offset = tl.load(table_ptr + source * TABLE_COLS + 2)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_c = c0 + tl.arange(0, BLOCK_C)
    mask = (offs_r < rank)[:, None] & (offs_c < width)[None, :]  # [BLOCK_R, BLOCK_C]
    dst_rows = (r_offset + offs_r)[:, None]
    if is_b:  # B_i [N, r_i]: read [BLOCK_C, BLOCK_R], written transposed
        b_tile = tl.load(src_ptr + offs_c[:, None].to(tl.int64) * rank + offs_r[None, :], mask=tl.trans(mask))
        tl.store(bt_ptr + dst_rows * N + offs_c[None, :], tl.trans(b_tile).to(bt_ptr.dtype.element_ty), mask=mask)
    else:
        a_tile = tl.load(src_ptr + offs_r[:, None].to(tl.int64) * K + offs_c[None, :], mask=mask)
        tl.store(a_ptr + dst_rows * K + offs_c[None, :], a_tile.to(a_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=4096)
def _address_table(rows: tuple, device: torch.device) -> torch.Tensor:
    """(address, rank, r_offset, is_b) of each source, on the device (module docstring: why cached)."""
    return device_table(rows, _TABLE_COLS, torch.int64, device)


def pack_into(a_pack: torch.Tensor, bt_pack: torch.Tensor, lora_a: Sequence[torch.Tensor],
              lora_b: Sequence[torch.Tensor], block_r: Optional[int] = None, tile_values: int = 4096) -> None:
    """Write each A_i into rows r_offset_i.. of `a_pack` and each B_i^T into those of
    `bt_pack`, in one kernel. Either list may be empty, which leaves its matrix alone. A source
    that is not contiguous is copied first; its copy's address then misses the table cache,
    which costs a host-to-device copy per call (one a CUDA graph cannot capture).

    Each program moves a tile of `tile_values` values: `block_r` ranks (by default the largest
    adapter's rank rounded up to a power of two, 16 to 64) by as many columns as make up the
    rest. Square 64 x 64 tiles left three quarters of every tile of a rank-16 adapter empty, and
    four times the programs."""
    lora_a, lora_b = [t.contiguous() for t in lora_a], [t.contiguous() for t in lora_b]
    sources = lora_a + lora_b
    if not sources:
        return
    rows = []
    for group, is_b in ((lora_a, 0), (lora_b, 1)):
        ranks = [t.shape[is_b] for t in group]
        offsets = itertools.accumulate(ranks, initial=0)  # r_offset_i: the ranks before adapter i
        rows += [(t.data_ptr(), r, o, is_b) for t, r, o in zip(group, ranks, offsets)]
    table = _address_table(tuple(rows), sources[0].device)
    n_cols = max(a_pack.shape[1] if lora_a else 0, bt_pack.shape[1] if lora_b else 0)
    max_rank = max(r for _, r, _, _ in rows)
    block_r = block_r or min(64, max(16, triton.next_power_of_2(max_rank)))
    block_c = tile_values // block_r
    grid = (cdiv(n_cols, block_c), len(sources), cdiv(max_rank, block_r))
    _pack_kernel[grid](table, sources[0], a_pack, bt_pack, a_pack.shape[1], bt_pack.shape[1],
                       TABLE_COLS=_TABLE_COLS, BLOCK_C=block_c, BLOCK_R=block_r, **LAUNCH_OPTIONS)


@torch.no_grad()
def pack_adapters(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], dtype: torch.dtype):
    """(A [R_total, in], B^T [R_total, out]) in `dtype`, adapter i from row r_offset_i.
    `lora_a`, `lora_b`: the adapters with rows, in order (A_i [r_i, in], B_i [out, r_i])."""
    r_total = sum(a.shape[0] for a in lora_a)
    a_pack = lora_a[0].new_empty(r_total, lora_a[0].shape[1], dtype=dtype)
    bt_pack = lora_b[0].new_empty(r_total, lora_b[0].shape[0], dtype=dtype)
    pack_into(a_pack, bt_pack, lora_a, lora_b)
    return a_pack, bt_pack


def reference_pack_adapters(lora_a: Sequence[torch.Tensor], lora_b: Sequence[torch.Tensor], dtype: torch.dtype):
    """`pack_adapters` in plain torch: the same values, bit for bit (a copy and a cast)."""
    return torch.cat(list(lora_a)).to(dtype), torch.cat(list(lora_b), dim=1).t().to(dtype).contiguous()
