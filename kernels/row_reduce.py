"""Adapter gradients: reductions over each adapter's own rows.

dB_i = scale_i * dY_i^T @ S_i      ([out, r_i])
dA_i = dS_i^T @ dropout(x_i)       ([r_i, in]; the mask the forward shrink stored)

Stage 1 (`_row_reduce_kernel`): one program per (chunk, column block, rank block) sums its
chunk's rows (chunks never span adapters) in fp32: whole steps of rows read through a TMA
descriptor where TMA can describe x or dY, then the chunk's last rows, masked. A chunk's
rank blocks are neighbouring programs, which read the same tiles of x or dY (the second from
L2), and each takes the smallest rank block that holds its adapter's rank
(`fit_rank_block`). When every adapter fits in one chunk it writes the final gradient
directly; otherwise it writes a partial and stage 2 (`_chunk_sum_kernel`) adds an adapter's
partials in chunk order. Both orders are fixed, so the gradients are deterministic (no
atomics), and an adapter's chunks start at its own first row. The MMAs use the big
operand's dtype (bf16 on GPU) with fp32 accumulation; gradients are written in the
adapters' dtype.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._triton_common import (MIN_RANK_BLOCK, RANK_BLOCK_SIZES, fit_rank_block, load_adapter, load_keep_mask,
                             load_row_block)
from .dropout import dropout_keep_mask
from .metadata import (ADAPTER_FLOAT_COLS, ADAPTER_INT_COLS, LAUNCH_OPTIONS, LoRABatchMeta, cdiv, db_rows_per_step,
                       reduce_grid, reduce_rank_block, reduction_stages, tma_ready)

_CHUNK_FIRST_COL = ADAPTER_INT_COLS.index("chunk_first")


@triton.jit
def _store_grad(out_ptr, acc, r_offset, rank, offs_n, offs_r, N, OUT_IS_B: tl.constexpr):
    """Store acc [BLOCK_N, BLOCK_R] as adapter i's dB_i, an [N, rank] block from element
    N * r_offset of the flat dB, or as its rows r_offset.. of dA [r_total, N] (the A stacked)."""
    if OUT_IS_B:
        ptrs = out_ptr + r_offset * N + offs_n[:, None].to(tl.int64) * rank + offs_r[None, :]
    else:
        ptrs = out_ptr + (r_offset + offs_r[None, :]).to(tl.int64) * N + offs_n[:, None]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_r < rank)[None, :])


@triton.jit
def _store_chunk_sum(out_ptr, acc, coef, chunk, r_offset, rank, offs_n, offs_r, N, rank_stride,
                     OUT_IS_B: tl.constexpr, DIRECT: tl.constexpr):
    """A chunk's sum acc [BLOCK_N, BLOCK_R]: the gradient itself, times coef, where every
    adapter has one chunk (DIRECT); else its fp32 partial, row `chunk` of [n_chunks, N,
    rank_stride], which `_chunk_sum_kernel` adds up."""
    if DIRECT:
        _store_grad(out_ptr, acc * coef, r_offset, rank, offs_n, offs_r, N, OUT_IS_B)
    else:
        part_ptrs = (out_ptr + chunk.to(tl.int64) * N * rank_stride
                     + offs_n[:, None].to(tl.int64) * rank_stride + offs_r[None, :])
        tl.store(part_ptrs, acc, mask=(offs_n < N)[:, None] & (offs_r < rank)[None, :])


@triton.jit
def _row_reduce_kernel(
    # pointers
    u_ptr,  # [M, N] rows: dY (for dB) or x (for dA)
    u_desc,  # TMA descriptor of u in blocks [BLOCK_M, BLOCK_N] (read if U_TMA)
    v_ptr,  # [M, rank_stride] in u's dtype: S (for dB) or dS (for dA)
    out_ptr,  # DIRECT: dB (flat [N, r_i] blocks) or dA [r_total, N]; else fp32 partials [n_chunks, N, rank_stride]
    mask_ptr,  # uint8 [M, n_groups]: x's keep-mask nibbles (dA with dropout)
    chunks_ptr,  # int64 [n_chunks, 3]: adapter, row_start, row_end
    adapters_i_ptr,  # int64 [n_adapters, N_INT_COLS]
    adapters_f_ptr,  # fp32 [n_adapters, N_FLOAT_COLS]
    seeds_ptr,  # int64 [n_adapters]: this layer's dropout seeds
    # sizes
    N,
    rank_stride,
    n_groups,
    # strides
    stride_um,
    stride_vm,
    # meta-parameters
    OUT_IS_B: tl.constexpr,  # True: dB_i [N, rank] (scale applied); False: dA_i [rank, N] (dropout on u)
    DIRECT: tl.constexpr,  # every adapter has one chunk: write the gradient, not a partial
    HAS_DROPOUT: tl.constexpr,  # some adapter has p > 0 (dA only)
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # the largest rank block; grid axis 0 covers the largest rank
    U_TMA: tl.constexpr,  # u's tiles through u_desc, else through pointers
):
    # grid (rank block, chunk, column block): a chunk's rank blocks run side by side, so the
    # second reads u's tile from L2
    pid_r, chunk, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    adapter, row_start, row_end = load_row_block(chunks_ptr, chunk)
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)
    r0 = pid_r * BLOCK_R
    if r0 >= rank:
        return
    # the adapter's own rank block (as in the shrink): one body per block size, one run
    fit = fit_rank_block(rank - r0, BLOCK_R)
    for halvings in tl.static_range(RANK_BLOCK_SIZES):
        if (BLOCK_R >> halvings) >= MIN_RANK_BLOCK:
            if fit == BLOCK_R >> halvings:
                _reduce_rows(u_ptr, u_desc, v_ptr, out_ptr, mask_ptr, chunk, pid_n, row_start, row_end, r0, rank,
                             threshold, r_offset, scale, inv_keep, N, rank_stride, n_groups, stride_um, stride_vm,
                             OUT_IS_B, DIRECT, HAS_DROPOUT, U_TMA, BLOCK_M, BLOCK_N, BLOCK_R >> halvings)


@triton.jit
def _reduce_rows(u_ptr, u_desc, v_ptr, out_ptr, mask_ptr, chunk, pid_n, row_start, row_end, r0, rank, threshold,
                 r_offset, scale, inv_keep, N, rank_stride, n_groups, stride_um, stride_vm, OUT_IS_B: tl.constexpr,
                 DIRECT: tl.constexpr, HAS_DROPOUT: tl.constexpr, U_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """One program's sum over its chunk's rows, columns pid_n * BLOCK_N .. and rank columns
    r0 .. r0 + BLOCK_R: whole steps of BLOCK_M rows, then the chunk's last rows, masked."""
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    n_mask = offs_n < N
    r_mask = offs_r < rank
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    full_end = row_start + (row_end - row_start) // BLOCK_M * BLOCK_M
    for m0 in range(row_start, full_end, BLOCK_M):
        rows = m0 + offs_m
        if U_TMA:
            ut = u_desc.load([m0, n0])  # columns past N come as zeros
        else:
            ut = tl.load(u_ptr + rows[:, None].to(tl.int64) * stride_um + offs_n[None, :], mask=n_mask[None, :],
                         other=0.0)
        acc = _reduce_step(acc, ut, v_ptr, mask_ptr, rows, rows < row_end, threshold, offs_r, r_mask, n0,
                           n_groups, stride_vm, OUT_IS_B, HAS_DROPOUT, BLOCK_N)
    if full_end < row_end:
        # The last rows: zeroed past the chunk, where the next adapter's rows begin. Zeros in
        # v alone would not do: a non-finite value there (an adapter that diverged) times
        # zero is NaN, and must not reach this adapter's gradient.
        rows = full_end + offs_m
        m_mask = rows < row_end
        ut = tl.load(u_ptr + rows[:, None].to(tl.int64) * stride_um + offs_n[None, :],
                     mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _reduce_step(acc, ut, v_ptr, mask_ptr, rows, m_mask, threshold, offs_r, r_mask, n0, n_groups,
                           stride_vm, OUT_IS_B, HAS_DROPOUT, BLOCK_N)

    if OUT_IS_B:
        coef = scale
    else:
        coef = inv_keep
    _store_chunk_sum(out_ptr, acc, coef, chunk, r_offset, rank, offs_n, offs_r, N, rank_stride, OUT_IS_B, DIRECT)


@triton.jit
def _reduce_step(acc, ut, v_ptr, mask_ptr, rows, m_mask, threshold, offs_r, r_mask, n0, n_groups, stride_vm,
                 OUT_IS_B: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc += u's tile [BLOCK_M, BLOCK_N]^T (dropped, for dA) @ v's rows [BLOCK_M, BLOCK_R]."""
    if not OUT_IS_B:
        if HAS_DROPOUT:
            if threshold > 0:
                keep = load_keep_mask(mask_ptr, rows.to(tl.int64), m_mask, n0, n_groups, BLOCK_N)
                ut = tl.where(keep, ut, tl.zeros_like(ut))
    vt = tl.load(v_ptr + rows[:, None].to(tl.int64) * stride_vm + offs_r[None, :],
                 mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    return tl.dot(tl.trans(ut), vt.to(ut.dtype), acc)


@triton.jit
def _chunk_sum_kernel(
    # pointers
    part_ptr,  # fp32 [n_chunks, N, rank_stride] partials of stage 1
    out_ptr,  # dB (flat [N, r_i] blocks) or dA [r_total, N]
    adapters_i_ptr,  # int64 [n_adapters, N_INT_COLS]
    adapters_f_ptr,  # fp32 [n_adapters, N_FLOAT_COLS]
    seeds_ptr,  # int64 [n_adapters]: this layer's dropout seeds
    # sizes
    N,
    rank_stride,
    # meta-parameters
    OUT_IS_B: tl.constexpr,
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    CHUNK_FIRST_COL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    adapter = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_r = tl.program_id(2)
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)
    r0 = pid_r * BLOCK_R
    if r0 >= rank:
        return
    first = tl.load(adapters_i_ptr + adapter * N_INT_COLS + CHUNK_FIRST_COL)
    count = tl.load(adapters_i_ptr + adapter * N_INT_COLS + CHUNK_FIRST_COL + 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    mask = (offs_n < N)[:, None] & (offs_r < rank)[None, :]
    ptrs = part_ptr + first * N * rank_stride + offs_n[:, None].to(tl.int64) * rank_stride + offs_r[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for _ in range(0, count):  # chunk order: deterministic
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += N * rank_stride
    if OUT_IS_B:
        coef = scale
    else:
        coef = inv_keep
    _store_grad(out_ptr, acc * coef, r_offset, rank, offs_n, offs_r, N, OUT_IS_B)


def lora_row_reduce(
    u: torch.Tensor,  # [M, N] contiguous: dY (dB) or x (dA)
    v: torch.Tensor,  # [M, meta.rank_stride] in u's dtype: S (dB) or dS (dA)
    out: torch.Tensor,  # dB flat (B_i's [N, r_i] block from N * r_offset_i) or dA [r_total, N] (the A_i stacked)
    meta: LoRABatchMeta,
    out_is_b: bool,
    mask_nibbles: Optional[torch.Tensor] = None,  # dA with dropout: the forward shrink's mask
) -> torch.Tensor:
    """All adapters' dB (out_is_b) or dA, adapter i at its `r_offset` column or row. dB and dA
    have blocks of their own (`KernelConfig.reduce_*` and `db_*`)."""
    assert u.is_contiguous() and v.shape == (u.shape[0], meta.rank_stride) and out.is_contiguous()
    assert out.numel() == u.shape[1] * meta.r_total
    has_dropout = (not out_is_b) and meta.has_dropout
    if has_dropout:
        assert mask_nibbles is not None and mask_nibbles.shape == (u.shape[0], cdiv(u.shape[1], 4))
    cfg = meta.config
    N = u.shape[1]
    block_m, block_n, warps = ((db_rows_per_step(meta), cfg.db_block_n, cfg.db_warps) if out_is_b
                               else (cfg.reduce_block_m, cfg.reduce_block_n, cfg.reduce_warps))
    block_r = reduce_rank_block(cfg, meta.block_r, out_is_b)
    n_blocks, r_blocks = reduce_grid(cfg, N, meta.max_rank, meta.block_r, out_is_b)
    if meta.n_chunks == 0 or r_blocks == 0:
        return out
    direct = meta.max_chunks_per_adapter <= 1
    part = out if direct else torch.empty(meta.n_chunks, N, meta.rank_stride, device=u.device,
                                          dtype=torch.float32)
    u_tma = tma_ready(u)
    u_desc = TensorDescriptor.from_tensor(u, [block_m, block_n]) if u_tma else u
    _row_reduce_kernel[(r_blocks, meta.n_chunks, n_blocks)](
        u, u_desc, v, part, mask_nibbles if has_dropout else v, *meta.chunk_args(),
        N, meta.rank_stride, cdiv(N, 4),
        u.stride(0), v.stride(0),
        OUT_IS_B=out_is_b,
        DIRECT=direct,
        HAS_DROPOUT=has_dropout,
        U_TMA=u_tma,
        N_INT_COLS=len(ADAPTER_INT_COLS),
        N_FLOAT_COLS=len(ADAPTER_FLOAT_COLS),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=warps,
        num_stages=reduction_stages(meta, block_m),
        **LAUNCH_OPTIONS,
    )
    if not direct:
        chunk_sum(part, out, meta, N, block_r, out_is_b)
    return out


def chunk_sum(part: torch.Tensor, out: torch.Tensor, meta: LoRABatchMeta, N: int, block_r: int, out_is_b: bool):
    """Stage 2: each adapter's gradient, the sum of its chunks' fp32 partials (`part`, [n_chunks,
    N, rank_stride]) in chunk order, times its scale (dB) or 1 / (1 - p) (dA), into `out`.

    Its columns per program are its own, not the first stage's: an fp32 accumulator of
    `chunk_sum_values` (2048 on GPU, 16 registers a thread, so 128 columns of a rank block of
    16 and 16 of one of 128). Stage 1's 256 columns of a 128-wide rank block would take 256
    registers a thread and spill."""
    block_n = max(16, meta.config.chunk_sum_values // block_r)
    _chunk_sum_kernel[(meta.adapters_i.shape[0], cdiv(N, block_n), cdiv(meta.max_rank, block_r))](
        part, out, meta.adapters_i, meta.adapters_f, meta.seeds,
        N, meta.rank_stride,
        OUT_IS_B=out_is_b,
        N_INT_COLS=len(ADAPTER_INT_COLS),
        N_FLOAT_COLS=len(ADAPTER_FLOAT_COLS),
        CHUNK_FIRST_COL=_CHUNK_FIRST_COL,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        num_warps=4,
        **LAUNCH_OPTIONS,
    )


def reference_lora_row_reduce(
    u: torch.Tensor,  # [M, N]: dY (dB) or x (dA)
    v: torch.Tensor,  # [M, >= max rank]: S (dB) or dS (dA)
    ranks: Sequence[int],
    seg_lens: Sequence[int],
    out_is_b: bool,
    scales: Sequence[float],
    dropout_p: Sequence[float],
    seeds: Sequence[int],
) -> list[Optional[torch.Tensor]]:
    """fp32 per-adapter gradients (None where an adapter has no LoRA or no rows)."""
    grads, start = [], 0
    for i, (r, rows) in enumerate(zip(ranks, seg_lens)):
        ui, vi = u[start : start + rows].float(), v[start : start + rows, :r].float()
        start += rows
        if r == 0 or rows == 0:
            grads.append(None)
        elif out_is_b:
            grads.append(scales[i] * ui.t() @ vi)
        else:
            if dropout_p[i] > 0:
                keep = dropout_keep_mask(seeds[i], rows, u.shape[1], dropout_p[i], device=u.device)
                ui = ui * keep / (1.0 - dropout_p[i])
            grads.append(vi.t() @ ui)
    return grads
