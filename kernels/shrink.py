"""Segmented shrink: each tile's rows times its own adapter's low-rank matrix.

The adapters come packed per call (`pack.pack_adapters`): A_i stacked into one
[R_total, in] matrix and B_i^T into one [R_total, out], in x's dtype, adapter i at row
r_offset_i. Both shrinks read the same layout: row r_offset_i + r, column k.

Forward, S = dropout(x) @ A_i^T ([tokens, rank], LoRAFusion's split point): the dropout
mask is drawn from the adapter's seed in registers, so the dropped x never exists, and
stored (`mask_nibbles`: one uint8 per four columns, a bit each) for the backward.
Backward, dS = scale_i * dY @ B_i ([tokens, rank]). Both read the big operand (x or dY)
once when the pack's largest rank fits one rank block (<= 128); the MMAs use the big
operand's dtype (bf16 on GPU) with fp32 accumulation; S / dS are stored in that dtype too,
since every MMA that reads them takes that dtype anyway.

Where the layout has few tiles (a few thousand tokens), the programs of one output block of
a shrink that draws no mask may split K between them (`metadata.shrink_k_splits`): each
writes an fp32 partial and a second, small launch adds the partials up in split order, so
the result does not depend on which program finished first. Otherwise a program of a
rank-64 adapter would be cut to 16 rows to give every SM work, and read four bytes of its
adapter (from L2) for each byte of x or dY.

Where the fused GEMM that reads S (dS) leaves SMs spare (`multi_lora.beside_programs`), the
shrink runs "beside" it, at the same time: a few programs, one per spare SM, each looping
over whole tiles with K whole in long steps and deep pipelines, x (dY) through a TMA
descriptor, while the GEMM runs its K loop on the other SMs (`lora_shrink(programs=...)`).

Every program takes the smallest rank block that holds its adapter's rank
(`fit_rank_block`), not the pack's largest, so that a rank-8 adapter in a pack of rank 128
does not run 128-wide MMAs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._triton_common import (MIN_RANK_BLOCK, RANK_BLOCK_SIZES, fit_rank_block, keep_nibbles, let_next_kernel_start,
                             load_adapter, load_row_block, nibbles_to_mask, store_nibbles, wait_for_previous_kernel)
from .dropout import dropout_keep_mask
from .metadata import (ADAPTER_FLOAT_COLS, ADAPTER_INT_COLS, LAUNCH_OPTIONS, LoRABatchMeta, beside_stages, cdiv,
                       tma_ready)


@triton.jit(do_not_specialize=["n_items"])  # per-step ints: metadata.py
def _shrink_kernel(
    # pointers
    x_ptr,  # [M, K] rows: x (forward) or dY (backward)
    lora_ptr,  # [R_total, K] packed adapters in x's dtype: A (forward) or B^T (backward); adapter i at row r_offset_i
    out_ptr,  # [M, rank_stride] in x's dtype: S or dS
    part_ptr,  # fp32 [SPLIT_K, M, rank_stride]: each split's partial (written only if SPLIT_K > 1)
    mask_ptr,  # uint8 [M, n_groups]: the keep-mask's nibbles, written where dropout applies (S only)
    tiles_ptr,  # int64 [n_tiles, 3]: adapter, row_start, row_end
    adapters_i_ptr,  # int64 [n_adapters, N_INT_COLS]
    adapters_f_ptr,  # fp32 [n_adapters, N_FLOAT_COLS]
    seeds_ptr,  # int64 [n_adapters]: this layer's dropout seeds
    # sizes
    K,
    k_per_split,  # columns of K per split, a multiple of BLOCK_K
    n_groups,
    n_items,  # LOOPED: tiles x rank blocks
    n_rank_blocks,  # LOOPED: rank blocks per tile (grid axis 2 otherwise)
    # strides
    stride_xm,
    stride_om,
    stride_part,  # elements between two splits' partials
    # meta-parameters
    APPLY_SCALE: tl.constexpr,  # multiply by the adapter's scale (dS)
    HAS_DROPOUT: tl.constexpr,  # some adapter has p > 0: draw the mask on x (S)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program: the tile table's block_m / grid axis 1
    BLOCK_R: tl.constexpr,  # rank columns per program at most; grid axis 2 covers the largest rank
    BLOCK_K: tl.constexpr,  # reduction step over K
    SPLIT_K: tl.constexpr,  # programs per output block, each over k_per_split columns of K
    LOOPED: tl.constexpr,  # a few programs (grid axis 0), each over every n-th (tile, rank block): beside the GEMM
    X_TMA: tl.constexpr,  # x_ptr is a TMA descriptor of [BLOCK_M, BLOCK_K] blocks
    PDL: tl.constexpr,  # launched with programmatic dependent launch (`KernelConfig.pdl`)
):
    wait_for_previous_kernel(PDL)  # it packed the adapters, or wrote dY
    let_next_kernel_start(PDL)  # the fused GEMM reads S only once its K loop is done; a splits' sum waits
    if LOOPED:  # whole tiles, K whole: item i is tile i // n_rank_blocks, rank block i % n_rank_blocks
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            _shrink_block(x_ptr, lora_ptr, out_ptr, part_ptr, mask_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr,
                          seeds_ptr, item // n_rank_blocks, 0, 0, item % n_rank_blocks, K, k_per_split, n_groups,
                          stride_xm, stride_om, stride_part, APPLY_SCALE, HAS_DROPOUT, EVEN_K, N_INT_COLS,
                          N_FLOAT_COLS, BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, X_TMA)
    else:
        _shrink_block(x_ptr, lora_ptr, out_ptr, part_ptr, mask_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr,
                      seeds_ptr, tl.program_id(0), tl.program_id(1) // SPLIT_K, tl.program_id(1) % SPLIT_K,
                      tl.program_id(2), K, k_per_split, n_groups, stride_xm, stride_om, stride_part, APPLY_SCALE,
                      HAS_DROPOUT, EVEN_K, N_INT_COLS, N_FLOAT_COLS, BLOCK_M, BLOCK_R, BLOCK_K, SPLIT_K, X_TMA)


@triton.jit
def _shrink_block(x_ptr, lora_ptr, out_ptr, part_ptr, mask_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr, seeds_ptr,
                  tile, sub_tile, split, pid_r, K, k_per_split, n_groups, stride_xm, stride_om, stride_part,
                  APPLY_SCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_K: tl.constexpr,
                  N_INT_COLS: tl.constexpr, N_FLOAT_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, X_TMA: tl.constexpr):
    """One output block: sub-tile `sub_tile` (BLOCK_M rows) of `tile`, rank block `pid_r`, split
    `split` of K; nothing where the tile has no LoRA, the rank block is past the adapter's rank
    or the sub-tile past the segment."""
    adapter, row_start, row_end = load_row_block(tiles_ptr, tile)
    row_start += sub_tile * BLOCK_M
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)
    r0 = pid_r * BLOCK_R
    if r0 < rank and row_start < row_end:
        # the adapter's own rank block, so that a rank-8 adapter in a pack of rank 128 does not
        # run 128-wide MMAs: the body is compiled once per block size and each block runs one
        fit = fit_rank_block(rank - r0, BLOCK_R)
        for halvings in tl.static_range(RANK_BLOCK_SIZES):
            if (BLOCK_R >> halvings) >= MIN_RANK_BLOCK:  # compile-time: smaller blocks do not exist
                if fit == BLOCK_R >> halvings:
                    _shrink_rows(x_ptr, lora_ptr, out_ptr, part_ptr, mask_ptr, row_start, row_end, r0, rank,
                                 seg_start, seed, threshold, r_offset, scale, inv_keep, pid_r, split * k_per_split,
                                 k_per_split, K, n_groups, stride_xm, stride_om, split * stride_part, APPLY_SCALE,
                                 HAS_DROPOUT, EVEN_K, BLOCK_M, BLOCK_R >> halvings, BLOCK_K, SPLIT_K, X_TMA)


@triton.jit
def _shrink_rows(x_ptr, lora_ptr, out_ptr, part_ptr, mask_ptr, row_start, row_end, r0, rank, seg_start, seed,
                 threshold, r_offset, scale, inv_keep, pid_r, k_start, k_per_split, K, n_groups, stride_xm, stride_om,
                 part_offset, APPLY_SCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 X_TMA: tl.constexpr):
    """One program's rows and rank columns r0 .. r0 + BLOCK_R of S (or dS), over K's columns
    k_start .. k_start + k_per_split: the whole of K, or one split's partial."""
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < row_end
    r_mask = offs_r < rank
    if not X_TMA:
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    # (k, r) tile of the adapter's rows
    l_ptrs = lora_ptr + (r_offset + offs_r)[None, :] * K + (k_start + offs_k)[:, None]
    seg_rows = (offs_m - seg_start).to(tl.int64)  # rows within the adapter's segment: dropout counters

    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if EVEN_K:
            lt = tl.load(l_ptrs, mask=r_mask[None, :], other=0.0)
            if not X_TMA:
                xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            lt = tl.load(l_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            if not X_TMA:
                xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if X_TMA:  # rows past the tile are other adapters' (or zeros past x's end): computed, never stored
            xt = x_ptr.load([row_start, k0])
        if HAS_DROPOUT:
            if threshold > 0:
                nibbles = keep_nibbles(seed, seg_rows, k0, K, threshold, BLOCK_K)
                xt = tl.where(nibbles_to_mask(nibbles, BLOCK_K), xt, tl.zeros_like(xt))
                if pid_r == 0:  # programs of other rank blocks draw the same mask
                    store_nibbles(mask_ptr, nibbles, offs_m.to(tl.int64), m_mask, k0, n_groups, BLOCK_K)
        acc = tl.dot(xt, lt, acc)
        if not X_TMA:
            x_ptrs += BLOCK_K
        l_ptrs += BLOCK_K

    if HAS_DROPOUT:
        acc = acc * inv_keep  # 1 / (1 - p); 1 for p == 0
    if APPLY_SCALE:
        acc = acc * scale
    rows_cols = offs_m[:, None].to(tl.int64) * stride_om + offs_r[None, :]
    if SPLIT_K > 1:  # the sum kernel adds the splits up and stores S
        tl.store(part_ptr + part_offset + rows_cols, acc, mask=m_mask[:, None] & r_mask[None, :])
    else:
        tl.store(out_ptr + rows_cols, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _split_sum_kernel(
    part_ptr,  # fp32 [SPLIT_K, M, rank_stride]: the splits' partials
    out_ptr,  # [M, rank_stride] in x's dtype: S or dS
    tiles_ptr,  # int64 [n_tiles, 3]: adapter, row_start, row_end
    adapters_i_ptr,  # int64 [n_adapters, N_INT_COLS]
    adapters_f_ptr,  # fp32 [n_adapters, N_FLOAT_COLS]
    seeds_ptr,  # int64 [n_adapters]
    stride_om,
    stride_part,  # elements between two splits' partials
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # the shrink's blocks and grid, without its splits
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """S (or dS) of one shrink output block: its SPLIT_K partials added in split order, so
    that the sum is the same whichever split finished first; the block's elements are those
    the shrink wrote (rows in the tile, columns below the adapter's rank)."""
    wait_for_previous_kernel(PDL)  # the shrink wrote the partials
    let_next_kernel_start(PDL)
    adapter, row_start, row_end = load_row_block(tiles_ptr, tl.program_id(0))
    row_start += tl.program_id(1) * BLOCK_M
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)
    r0 = tl.program_id(2) * BLOCK_R
    if r0 >= rank or row_start >= row_end:
        return
    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_r = r0 + tl.arange(0, BLOCK_R)
    mask = (offs_m < row_end)[:, None] & (offs_r < rank)[None, :]
    rows_cols = offs_m[:, None].to(tl.int64) * stride_om + offs_r[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + split * stride_part + rows_cols, mask=mask, other=0.0)
    tl.store(out_ptr + rows_cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def shrink_launch(meta: LoRABatchMeta, K: int, draws_mask: bool) -> tuple[int, int, int]:
    """(rows, K step, splits of K) of the programs of a shrink over K columns in `meta`'s
    layout. The shrink that draws the dropout mask keeps K whole (`metadata.shrink_k_splits`)."""
    if draws_mask:
        return meta.mask_shrink_block_m, meta.mask_shrink_block_k, 1
    return meta.shrink_block_m, meta.shrink_block_k, meta.k_splits(K)


def lora_shrink(
    x: torch.Tensor,  # [M, K], contiguous
    lora_pack: torch.Tensor,  # [R_total, K] in x's dtype: packed A (S) or B^T (dS)
    out: torch.Tensor,  # [M, meta.rank_stride], x's dtype
    meta: LoRABatchMeta,
    apply_scale: bool,
    dropout: bool,
    mask_nibbles: Optional[torch.Tensor] = None,  # uint8 [M, ceil(K / 4)] (`empty_mask_nibbles`): the mask kept
    k_splits: Optional[int] = None,  # programs per output block over K; None: `shrink_launch`'s
    programs: Optional[int] = None,  # beside the GEMM: this many programs, each looping over whole tiles
) -> torch.Tensor:
    """Launch the shrink over every tile of `meta`; rows of adapters without LoRA are left unwritten.
    With `dropout`, the rows of adapters with p > 0 also get their keep-mask in `mask_nibbles`.

    With `programs`, a few programs each take every programs-th (tile, rank block) in turn, K
    whole, so that the fused GEMM after it can run on the other SMs meanwhile
    (`multi_lora.beside_programs`); otherwise a program per output block."""
    assert x.is_contiguous() and lora_pack.is_contiguous() and out.shape == (x.shape[0], meta.rank_stride)
    assert lora_pack.dtype == x.dtype and lora_pack.shape[1] == x.shape[1]
    has_dropout = dropout and meta.has_dropout
    if has_dropout:
        assert mask_nibbles is not None and mask_nibbles.shape == (x.shape[0], cdiv(x.shape[1], 4))
    cfg = meta.config
    M, K = x.shape
    n_rank_blocks = cdiv(meta.max_rank, meta.block_r)
    n_items = meta.n_tiles * n_rank_blocks  # (tile, rank block) pairs: what the programs beside the GEMM loop over
    x_tma = False
    if programs:
        bm, bk, k_splits = cfg.block_m, cfg.beside_block_k, 1
        stages = beside_stages(cfg, meta.block_r, x.device)
        grid = (min(programs, n_items), 1, 1)
        x_tma = tma_ready(x)
    else:
        bm, bk, chosen_splits = shrink_launch(meta, K, has_dropout)
        k_splits = chosen_splits if k_splits is None else k_splits
        stages = cfg.shrink_stages if has_dropout else cfg.shrink_stages_no_dropout
        grid = (meta.n_tiles, cfg.block_m // bm, n_rank_blocks)  # sub-tiles: more programs in flight
    if n_items == 0:
        return out
    k_per_split = cdiv(cdiv(K, k_splits), bk) * bk
    k_splits = cdiv(K, k_per_split)  # a split of no columns would leave its partial unwritten
    part = out if k_splits == 1 else torch.empty(k_splits, M, out.shape[1], device=x.device, dtype=torch.float32)
    common = dict(N_INT_COLS=len(ADAPTER_INT_COLS), N_FLOAT_COLS=len(ADAPTER_FLOAT_COLS), BLOCK_M=bm,
                  BLOCK_R=meta.block_r, PDL=cfg.pdl, launch_pdl=cfg.pdl, **LAUNCH_OPTIONS)
    _shrink_kernel[(grid[0], grid[1] * k_splits, grid[2])](
        TensorDescriptor.from_tensor(x, [bm, bk]) if x_tma else x, lora_pack, out, part,
        mask_nibbles if has_dropout else out, *meta.args(),
        K, k_per_split, cdiv(K, 4), n_items, n_rank_blocks,
        x.stride(0), out.stride(0), M * out.shape[1],
        APPLY_SCALE=apply_scale,
        HAS_DROPOUT=has_dropout,
        EVEN_K=K % bk == 0,
        BLOCK_K=bk,
        SPLIT_K=k_splits,
        LOOPED=bool(programs),
        X_TMA=x_tma,
        num_warps=cfg.shrink_warps,
        num_stages=stages,
        **common,
    )
    if k_splits > 1:
        _split_sum_kernel[grid](part, out, *meta.args(), out.stride(0), M * out.shape[1], SPLIT_K=k_splits,
                                num_warps=4, **common)
    return out


def reference_lora_shrink(
    x: torch.Tensor,  # [M, K]
    lora: Sequence[Optional[torch.Tensor]],  # A_i [r_i, K] or (lora_is_b) B_i [K, r_i], or None
    seg_lens: Sequence[int],
    lora_is_b: bool,
    scales: Optional[Sequence[float]] = None,  # multiply by scale_i (dS)
    dropout_p: Optional[Sequence[float]] = None,  # drop x first (S)
    seeds: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """fp32 [M, max_rank]: segment i's rows hold its S (or dS) in columns < r_i, zeros elsewhere."""
    ranks = [0 if t is None else t.shape[1 if lora_is_b else 0] for t in lora]
    out = x.new_zeros(x.shape[0], max(ranks, default=0), dtype=torch.float32)
    start = 0
    for i, (t, rows) in enumerate(zip(lora, seg_lens)):
        xi = x[start : start + rows].float()
        if t is not None and rows:
            if dropout_p is not None and dropout_p[i] > 0:
                keep = dropout_keep_mask(seeds[i], rows, x.shape[1], dropout_p[i], device=x.device)
                xi = xi * keep / (1.0 - dropout_p[i])
            si = xi @ (t.float() if lora_is_b else t.float().t())
            out[start : start + rows, : ranks[i]] = si * (scales[i] if scales is not None else 1.0)
        start += rows
    return out
