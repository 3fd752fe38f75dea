"""dS and dB from one pass over dY, for packs of small ranks.

dS   = scale_i * dY @ B_i          ([tokens, rank]; the dX GEMM and dA read it)
dB_i = scale_i * dY_i^T @ S_i      ([out, r_i])

The two-pass backward reads dY twice: the dS shrink walks row blocks over all columns, the
dB reduction walks column blocks over a chunk's rows. Here one program owns a (chunk,
column block) pair and streams the chunk's rows of dY once, with both MMAs on each
[BLOCK_M, BLOCK_N] tile of it (`_ds_db_kernel`): dB's accumulator stays in registers over
the rows, as in the row reduction; dS sums over columns, so each column block writes its
share as an fp32 partial, and `_ds_sum_kernel` adds a row's partials in column order. No
atomics: the gradients are deterministic, as on the two-pass path.

The partials cost 8 * rank_stride bytes per row per column block (written, then read),
against the 2 * out bytes per row of dY's second read: a win for rank blocks of 16 only,
which is where `config_for` turns it on (`KernelConfig.one_pass_dy`).
Where every chunk is a single row step (32 adapters of 64 rows at 2048 tokens), a program
takes a group of column blocks (`ds_db_col_group`) and writes one dS partial for all of
them, so the sum adds a quarter as many.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import triton
import triton.language as tl

from ._triton_common import let_next_kernel_start, load_adapter, load_row_block, wait_for_previous_kernel
from .metadata import (ADAPTER_FLOAT_COLS, ADAPTER_INT_COLS, LAUNCH_OPTIONS, LoRABatchMeta, cdiv, reduction_stages,
                       takes_one_pass)
from .row_reduce import _store_chunk_sum, chunk_sum, lora_row_reduce
from .shrink import lora_shrink


@triton.jit(do_not_specialize=["M"])  # per-step ints: metadata.py
def _ds_db_kernel(
    # pointers
    dy_ptr,  # [M, N] rows
    s_ptr,  # [M, rank_stride] in dY's dtype: the forward's S
    bt_ptr,  # [R_total, N] packed B^T in dY's dtype; adapter i at row r_offset_i
    ds_part_ptr,  # fp32 [n_col_blocks, M, rank_stride]: each column block's share of dS (unscaled)
    db_ptr,  # DIRECT: dB (flat [N, r_i] blocks); else fp32 partials [n_chunks, N, rank_stride]
    chunks_ptr,  # int64 [n_chunks, 3]: adapter, row_start, row_end
    adapters_i_ptr,  # int64 [n_adapters, N_INT_COLS]
    adapters_f_ptr,  # fp32 [n_adapters, N_FLOAT_COLS]
    seeds_ptr,  # int64 [n_adapters] (read by load_adapter, unused here)
    # sizes
    M,
    N,
    rank_stride,
    # strides
    stride_dym,
    stride_sm,
    # meta-parameters
    DIRECT: tl.constexpr,  # every adapter has one chunk: write dB itself, not a partial
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per step
    BLOCK_N: tl.constexpr,  # columns of dY per column block
    BLOCK_R: tl.constexpr,  # >= the pack's largest rank: one rank block
    COL_GROUP: tl.constexpr,  # column blocks per program; above 1 only where every chunk is one row step
):
    chunk = tl.program_id(0)
    group = tl.program_id(1)  # this program's COL_GROUP column blocks, and its dS partial
    adapter, row_start, row_end = load_row_block(chunks_ptr, chunk)
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)

    offs_r = tl.arange(0, BLOCK_R)
    offs_m = tl.arange(0, BLOCK_M)
    r_mask = offs_r < rank
    ds_part_ptr += group.to(tl.int64) * M * rank_stride
    # With COL_GROUP above 1 every chunk is one row step (the launch sees to it), and the rows'
    # dS adds up over the group's column blocks in registers: one partial for the group, not
    # one per column block. (The row step stays a loop of its own: with the rows fixed over
    # the group's loop, their [BLOCK_M, BLOCK_N] masks and offsets would be hoisted out of
    # it, into registers.)
    ds = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for g in range(COL_GROUP):
        offs_n = (group * COL_GROUP + g) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        # the adapter's B^T for this column block, [BLOCK_R, BLOCK_N]: read once, used by every row step
        bt = tl.load(bt_ptr + (r_offset + offs_r)[:, None] * N + offs_n[None, :],
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        db_acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for m0 in range(row_start, row_end, BLOCK_M):
            rows = m0 + offs_m
            m_mask = rows < row_end
            dyt = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dym + offs_n[None, :],
                          mask=m_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_N]
            st = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_sm + offs_r[None, :],
                         mask=m_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
            db_acc = tl.dot(tl.trans(dyt), st, db_acc)
            if COL_GROUP == 1:  # this column block's share of the rows' dS
                ds = tl.dot(dyt, tl.trans(bt))
                tl.store(ds_part_ptr + rows[:, None].to(tl.int64) * rank_stride + offs_r[None, :], ds,
                         mask=m_mask[:, None] & r_mask[None, :])
            else:
                ds = tl.dot(dyt, tl.trans(bt), ds)
        _store_chunk_sum(db_ptr, db_acc, scale, chunk, r_offset, rank, offs_n, offs_r, N, rank_stride, True, DIRECT)
    if COL_GROUP > 1:
        rows = row_start + offs_m
        tl.store(ds_part_ptr + rows[:, None].to(tl.int64) * rank_stride + offs_r[None, :], ds,
                 mask=(rows < row_end)[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["M"])  # per-step ints: metadata.py
def _ds_sum_kernel(
    ds_part_ptr,  # fp32 [n_col_blocks, M, rank_stride]
    ds_ptr,  # [M, rank_stride] in dY's dtype: dS, written for rows of adapters with LoRA
    tiles_ptr,  # int64 [n_tiles, 3]: adapter, row_start, row_end
    adapters_i_ptr,
    adapters_f_ptr,
    seeds_ptr,
    M,
    rank_stride,
    n_col_blocks,
    stride_dsm,
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: a divisor of the tile height (grid axis 1 covers the tile)
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (`KernelConfig.pdl`)
):
    wait_for_previous_kernel(PDL)  # the pass over dY wrote the partials
    let_next_kernel_start(PDL)  # the dX GEMM reads dS only once its K loop is done
    tile = tl.program_id(0)
    adapter, row_start, row_end = load_row_block(tiles_ptr, tile)
    row_start += tl.program_id(1) * BLOCK_M
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)
    if rank == 0 or row_start >= row_end:
        return
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_m < row_end)[:, None] & (offs_r < rank)[None, :]
    ptrs = ds_part_ptr + offs_m[:, None].to(tl.int64) * rank_stride + offs_r[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for _ in range(0, n_col_blocks):  # column order: deterministic
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += M * rank_stride
    out_ptrs = ds_ptr + offs_m[:, None].to(tl.int64) * stride_dsm + offs_r[None, :]
    tl.store(out_ptrs, (acc * scale).to(ds_ptr.dtype.element_ty), mask=mask)


def ds_db_blocks(meta: LoRABatchMeta, n_cols: int) -> tuple[int, int]:
    """(columns of dY per column block, warps) of the one pass over `n_cols` columns:
    `config.ds_db_block_n` on `config.ds_db_warps`, or blocks of half the columns on half the
    warps (the registers a thread holds stay the same) where chunks of several row steps leave
    SMs without a program and half the columns still make one wave at most.

    At 2048 x 4096^2 the chunks of 1 and 4 x r16 (512 rows) run 64 programs of 256 columns on
    132 SMs, and the pass runs faster on 128 columns and 4 warps. At 2048 x 4096 -> 14336 x
    1 r16 the halving would make 112 programs 224, two waves, and the layer slower: hence one
    wave at most."""
    cfg = meta.config
    block_n, warps = cfg.ds_db_block_n, cfg.ds_db_warps
    several_steps = meta.longest_chunk > cfg.db_block_m  # else the column groups take fewer programs
    if several_steps and block_n >= 32 and warps >= 2 \
            and meta.n_chunks * cdiv(n_cols, block_n // 2) <= meta.sm_count:
        block_n, warps = block_n // 2, warps // 2
    return block_n, warps


def ds_db_col_group(meta: LoRABatchMeta, n_col_blocks: int) -> int:
    """Column blocks per program of the one pass over dY: `config.ds_db_col_group` where every
    chunk is one row step (32 adapters of 64 rows at 2048 tokens), halved while the grid would
    leave some of the device's `meta.sm_count` SMs without a program; else 1. Each program
    then writes one dS partial for its group instead of one per column block, and the dS sum
    adds that many fewer."""
    cfg = meta.config
    group = cfg.ds_db_col_group if meta.longest_chunk <= cfg.db_block_m else 1
    while group > 1 and meta.n_chunks * cdiv(n_col_blocks, group) < meta.sm_count:
        group //= 2
    return max(1, min(group, n_col_blocks))


def lora_ds_db(
    dy: torch.Tensor,  # [M, N] contiguous
    s: torch.Tensor,  # [M, meta.rank_stride] in dy's dtype: the forward's S
    bt_pack: torch.Tensor,  # [R_total, N] in dy's dtype: packed B^T
    ds: torch.Tensor,  # [M, meta.rank_stride] in dy's dtype: dS, written (rows of adapters without LoRA are not)
    db: torch.Tensor,  # flat dB: B_i's [N, r_i] block from element N * r_offset_i
    meta: LoRABatchMeta,
) -> None:
    """dS (as `lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False)` computes it)
    and every adapter's dB (as `lora_row_reduce(dy, s, db, meta, out_is_b=True)`), reading dY once.
    Needs the pack's largest rank within one rank block (`meta.max_rank <= meta.block_r`)."""
    assert dy.is_contiguous() and bt_pack.is_contiguous() and db.is_contiguous()
    assert s.shape == ds.shape == (dy.shape[0], meta.rank_stride) and s.dtype == ds.dtype == bt_pack.dtype == dy.dtype
    assert meta.max_rank <= meta.block_r, "one pass needs every rank within one rank block"
    cfg = meta.config
    M, N = dy.shape
    if meta.n_chunks == 0:
        return
    block_n, warps = ds_db_blocks(meta, N)
    n_col_blocks = cdiv(N, block_n)
    col_group = ds_db_col_group(meta, n_col_blocks)
    n_parts = cdiv(n_col_blocks, col_group)  # dS partials: one per program of a chunk
    direct = meta.max_chunks_per_adapter <= 1
    common = dict(N_INT_COLS=len(ADAPTER_INT_COLS), N_FLOAT_COLS=len(ADAPTER_FLOAT_COLS), BLOCK_R=meta.block_r)
    ds_part = torch.empty(n_parts, M, meta.rank_stride, device=dy.device, dtype=torch.float32)
    db_part = db if direct else torch.empty(meta.n_chunks, N, meta.rank_stride, device=dy.device,
                                            dtype=torch.float32)
    _ds_db_kernel[(meta.n_chunks, n_parts)](
        dy, s, bt_pack, ds_part, db_part, *meta.chunk_args(),
        M, N, meta.rank_stride,
        dy.stride(0), s.stride(0),
        DIRECT=direct,
        BLOCK_M=cfg.db_block_m,
        BLOCK_N=block_n,
        COL_GROUP=col_group,
        num_warps=warps,
        num_stages=reduction_stages(meta, cfg.db_block_m),
        **common,
        **LAUNCH_OPTIONS,
    )
    sum_m = min(32, cfg.block_m)
    _ds_sum_kernel[(meta.n_tiles, cfg.block_m // sum_m)](
        ds_part, ds, *meta.args(), M, meta.rank_stride, n_parts, ds.stride(0),
        BLOCK_M=sum_m, PDL=cfg.pdl, num_warps=4, launch_pdl=cfg.pdl, **common, **LAUNCH_OPTIONS)
    if not direct:
        chunk_sum(db_part, db, meta, N, meta.block_r, out_is_b=True)


def lora_ds_and_db(
    dy: torch.Tensor,
    s: torch.Tensor,
    bt_pack: torch.Tensor,
    ds: torch.Tensor,
    db: torch.Tensor,
    meta: LoRABatchMeta,
    db_pass: Callable[[], ContextManager] = contextlib.nullcontext,
) -> None:
    """dS and every adapter's dB (arguments as `lora_ds_db`): by the one pass where the config
    takes it (`KernelConfig.one_pass_dy`) and every rank fits one rank block, else by the dS
    shrink and the dB row reduction. The dB reduction of two passes is launched inside
    `db_pass()` (the backward's second stream, under a CUDA graph)."""
    if takes_one_pass(meta.config, meta.max_rank, meta.block_r):
        lora_ds_db(dy, s, bt_pack, ds, db, meta)
    else:
        lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False)
        with db_pass():  # queued after the shrink, which needs none of it
            lora_row_reduce(dy, s, db, meta, out_is_b=True)
