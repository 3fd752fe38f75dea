"""Base GEMM with the LoRA terms of its rows folded into its accumulator.

Forward:  Y  = x @ W^T + bias + scale_i * S @ B_i^T          (S from the shrink)
Backward: dX = dY @ W + keep_i / (1 - p_i) * (dS @ A_i)      (dS from the shrink of dY)

The LoRA term and the base GEMM share one fp32 accumulator, so the output is written once
(LoRAFusion's fused expand): `_lora_gemm_kernel`. The GEMM works on row blocks of `block_m`
rows, whichever adapters they hold, and adds the LoRA term tile by tile (`metadata`: a tile
is one adapter's rows within a row block), each tile's rows of S times its own adapter's
matrix. So segments are never padded to the block height; a block holding several
segments costs each further one its own LoRA steps, whose loads nothing hides. An unmasked
term (the forward's, and dX's when no adapter has dropout) is added after the K loop, so that
the loop may run before S (dS) is written (`KernelConfig.pdl`, below). dX's masked term (by the keep-mask nibbles the
forward shrink stored) is computed first, before the accumulator holds anything else:
masking it later would take a second accumulator. Its base operands arrive through TMA
descriptors (Hopper's bulk tensor copies, zero-filled past the edges): with them the GEMM
runs within 3-5% of cuBLAS, where pointer-based loads reach about 75%. The grid is
persistent (`_schedule`). `_lora_add_kernel` instead adds the LoRA term in place to a base
product cuBLAS already wrote to `out` (one extra read and write of it): for operands TMA
cannot describe, for 32-bit inputs, whose fused dot would run in TF32, and on the GPUs whose
MMA cannot hold the fused GEMM's accumulator (`metadata.fuses_base`).

On Hopper the GEMM is launched with programmatic dependent launch (`KernelConfig.pdl`): it
may start while the kernel before it (the one that writes S or dS: a shrink, or the sum of
dS's partials) still runs, on the SMs that kernel leaves free, and its K loop reads only x
(dY) and W; it waits for that kernel before it reads S (dS) or writes anything.

On Hopper the fused GEMM runs in Gluon instead (`lora_gemm_gluon.py`, `KernelConfig.gluon_gemm`):
warp-specialised, its loads pipelined across tiles, the LoRA term one more wgmma. This
kernel runs the fused GEMM where that one does not (datacenter Blackwell, Triton releases
the Gluon kernel was not checked with), and in CI's CPU checks.

The LoRA MMAs run on the base operand's dtype (bf16 on GPU: S/dS are stored in it and the
adapters are packed in it per call) with fp32 accumulation. The rank loop steps over each
tile's own adapter's rank, so small ranks are not padded to the pack's largest one.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._triton_common import load_adapter, load_keep_mask, load_row_block, wait_for_previous_kernel
from .dropout import dropout_keep_mask
from .lora_gemm_gluon import lora_gemm_gluon
from .metadata import ADAPTER_FLOAT_COLS, ADAPTER_INT_COLS, LAUNCH_OPTIONS, LoRABatchMeta, cdiv, sm_count, tma_ready


@triton.jit(do_not_specialize=["M", "n_blocks", "n_programs"])  # per-step ints: metadata.py
def _lora_gemm_kernel(
    a_desc,  # TMA descriptor of [M, K]: x (forward) or dY (backward), blocks [BLOCK_M, BLOCK_K]
    w_desc,  # TMA descriptor of W: [N, K] in blocks [BLOCK_N, BLOCK_K] (forward), [K, N] in [BLOCK_K, BLOCK_N] (backward)
    bias_ptr,  # [N], read only if HAS_BIAS
    s_ptr,  # [M, rank_stride] in a's dtype: S (forward) or dS (backward)
    lora_ptr,  # [R_total, N] packed adapters in a's dtype: B^T (forward) or A (backward); adapter i at row r_offset_i
    out_ptr,  # [M, N], written
    mask_ptr,  # uint8 [M, n_groups]: the forward's keep-mask nibbles (read if OUT_DROPOUT)
    block_tiles_ptr,  # int64 [n_blocks + 1]: row block b holds tiles block_tiles[b] .. block_tiles[b + 1]
    tiles_ptr,  # int64 [n_tiles, 3]: adapter, row_start, row_end
    adapters_i_ptr,  # int64 [n_adapters, N_INT_COLS]
    adapters_f_ptr,  # fp32 [n_adapters, N_FLOAT_COLS]
    seeds_ptr,  # int64 [n_adapters]: this layer's dropout seeds
    M,
    N,
    K,
    n_blocks,
    n_groups,
    n_programs,  # the grid's size: with fewer programs than (row block, n block) pairs, each loops over several
    stride_sm,
    stride_om,
    FORWARD: tl.constexpr,  # Y: scale_i, W read as [N, K]; else dX: W read as [K, N]
    OUT_DROPOUT: tl.constexpr,  # mask the LoRA term with the adapter's dropout mask (backward): added first
    HAS_BIAS: tl.constexpr,
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per row block (= the tables' block_m)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rank step of the LoRA term
    GROUP_M: tl.constexpr,  # row blocks per L2 group (triton tutorial 03's grouped ordering)
    K_STAGES: tl.constexpr,  # software-pipeline depth of the K loop
    WARP_SPECIALIZE: tl.constexpr,  # split the K loop's warps into loaders and MMA issuers
    PDL: tl.constexpr,  # launched with programmatic dependent launch (`KernelConfig.pdl`)
):
    """The fused path: out = the row block's LoRA terms + the base GEMM (+ bias), written once."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    for t in tl.range(tl.program_id(0), n_blocks * num_pid_n, n_programs):
        block, n0 = _grouped_tile(t, n_blocks, num_pid_n, GROUP_M, BLOCK_N)
        row_start = block * BLOCK_M
        offs_m, offs_n, first_tile, end_tile = _row_block(block_tiles_ptr, block, n0, BLOCK_M, BLOCK_N)
        n_mask = offs_n < N
        # an unmasked LoRA term comes after the K loop; a masked one first, as it would need an
        # accumulator of its own later
        if OUT_DROPOUT:
            wait_for_previous_kernel(PDL)  # it wrote dS
            acc, _ = _lora_term(s_ptr, lora_ptr, mask_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr, seeds_ptr,
                                first_tile, end_tile, offs_m, n0, N, n_groups, stride_sm, FORWARD, OUT_DROPOUT,
                                N_INT_COLS, N_FLOAT_COLS, BLOCK_M, BLOCK_N, BLOCK_R)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the base product accumulates on top of it; rows past M are zeros from TMA, never stored
        for ki in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=K_STAGES, warp_specialize=WARP_SPECIALIZE):
            at = a_desc.load([row_start, ki * BLOCK_K])
            if FORWARD:
                acc = tl.dot(at, w_desc.load([n0, ki * BLOCK_K]).T, acc)
            else:
                acc = tl.dot(at, w_desc.load([ki * BLOCK_K, n0]), acc)
        if not OUT_DROPOUT:  # tile by tile: each of the block's adapters adds its rows' term
            # The K loop read only x (dY) and W, written before the kernel before this one
            # (the shrink or the dS sum) started; its S (dS) is read from here on.
            wait_for_previous_kernel(PDL)
            for tile in tl.range(first_tile, end_tile, num_stages=1):
                rank, _, r_offset, scale, _, rows = _tile_of_block(tiles_ptr, adapters_i_ptr, adapters_f_ptr,
                                                                   seeds_ptr, tile, offs_m, N_INT_COLS, N_FLOAT_COLS)
                acc = _add_tile_lora(acc, s_ptr, lora_ptr, offs_m, offs_n, n_mask, rows, 0, rank, r_offset, scale,
                                     N, stride_sm, FORWARD, BLOCK_R)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M", "n_blocks"])  # per-step ints: metadata.py
def _lora_add_kernel(
    s_ptr, lora_ptr, out_ptr, mask_ptr, block_tiles_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr,
    seeds_ptr,  # as above
    M,
    N,
    n_blocks,
    n_groups,
    stride_sm,
    stride_om,
    FORWARD: tl.constexpr,
    OUT_DROPOUT: tl.constexpr,
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The in-place path: out (the cuBLAS base product) += the row block's LoRA terms."""
    block, n0 = _grouped_tile(tl.program_id(0), n_blocks, tl.cdiv(N, BLOCK_N), GROUP_M, BLOCK_N)
    offs_m, offs_n, first_tile, end_tile = _row_block(block_tiles_ptr, block, n0, BLOCK_M, BLOCK_N)
    acc, block_rank = _lora_term(s_ptr, lora_ptr, mask_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr, seeds_ptr,
                                 first_tile, end_tile, offs_m, n0, N, n_groups, stride_sm, FORWARD, OUT_DROPOUT,
                                 N_INT_COLS, N_FLOAT_COLS, BLOCK_M, BLOCK_N, BLOCK_R)
    if block_rank > 0:  # a block without LoRA has its result in `out` already
        out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        out_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _grouped_tile(t, n_blocks, num_pid_n, GROUP_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row block, first column) of the t-th (row block, n block) pair in grouped ordering, so
    that neighbouring programs share W blocks in L2."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_block = (t // num_pid_in_group) * GROUP_M
    group_size = min(n_blocks - first_block, GROUP_M)
    block = first_block + ((t % num_pid_in_group) % group_size)
    return block, ((t % num_pid_in_group) // group_size) * BLOCK_N


@triton.jit
def _row_block(block_tiles_ptr, block, n0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A row block's row and column offsets (columns from n0) and the range of its tiles."""
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    first_tile = tl.load(block_tiles_ptr + block).to(tl.int32)
    end_tile = tl.load(block_tiles_ptr + block + 1).to(tl.int32)
    return offs_m, offs_n, first_tile, end_tile


@triton.jit
def _lora_term(s_ptr, lora_ptr, mask_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr, seeds_ptr, first_tile, end_tile,
               offs_m, n0, N, n_groups, stride_sm, FORWARD: tl.constexpr, OUT_DROPOUT: tl.constexpr,
               N_INT_COLS: tl.constexpr, N_FLOAT_COLS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_R: tl.constexpr):
    """A row block's LoRA term in fp32, tile by tile: each tile's rows of S times its own
    adapter's L_i[:, n block] over that adapter's rank, then each row times its adapter's
    scale_i (forward) or masked by its adapter's dropout (backward); zeros in rows of
    adapters without LoRA. Also returns the largest rank among the block's tiles."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if OUT_DROPOUT:  # the mask is loaded before the accumulator is live: less register pressure
        dropped = tl.zeros((BLOCK_M,), dtype=tl.int1)  # rows whose adapter has p > 0
        for tile in tl.range(first_tile, end_tile, num_stages=1):
            _, threshold, _, _, _, rows = _tile_of_block(tiles_ptr, adapters_i_ptr, adapters_f_ptr, seeds_ptr, tile,
                                                         offs_m, N_INT_COLS, N_FLOAT_COLS)
            dropped = dropped | (rows & (threshold > 0))
        # the forward stored no mask for rows without dropout: they keep every column
        keep = load_keep_mask(mask_ptr, offs_m.to(tl.int64), dropped, n0, n_groups, BLOCK_N)
        keep = keep | (dropped == 0)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_factor = tl.zeros((BLOCK_M,), dtype=tl.float32)  # each row's scale_i (forward) or 1 / (1 - p_i)
    block_rank = tl.full((), 0, tl.int32)
    for tile in tl.range(first_tile, end_tile, num_stages=1):
        rank, _, r_offset, scale, inv_keep, rows = _tile_of_block(tiles_ptr, adapters_i_ptr, adapters_f_ptr,
                                                                  seeds_ptr, tile, offs_m, N_INT_COLS, N_FLOAT_COLS)
        # the scale multiplies the fp32 term below, not S's rounded tile
        acc = _add_tile_lora(acc, s_ptr, lora_ptr, offs_m, offs_n, n_mask, rows, 0, rank, r_offset, scale, N,
                             stride_sm, False, BLOCK_R)
        if FORWARD:
            row_factor = tl.where(rows, scale, row_factor)
        else:
            row_factor = tl.where(rows, inv_keep, row_factor)
        block_rank = tl.maximum(block_rank, rank)
    acc = acc * row_factor[:, None]
    if OUT_DROPOUT:
        acc = tl.where(keep, acc, 0.0)
    return acc, block_rank


@triton.jit
def _tile_of_block(tiles_ptr, adapters_i_ptr, adapters_f_ptr, seeds_ptr, tile, offs_m, N_INT_COLS: tl.constexpr,
                   N_FLOAT_COLS: tl.constexpr):
    """One tile of a row block whose rows are `offs_m`: its adapter's rank, dropout threshold,
    row offset in the packed adapters, scale and 1 / (1 - p), and which of the rows are the tile's."""
    adapter, row_start, row_end = load_row_block(tiles_ptr, tile)
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)
    return rank, threshold, r_offset, scale, inv_keep, (offs_m >= row_start) & (offs_m < row_end)


@triton.jit
def _add_tile_lora(acc, s_ptr, lora_ptr, offs_m, offs_n, n_mask, rows, r_first, rank, r_offset, scale, N, stride_sm,
                   SCALE_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc + one tile's LoRA term from rank step `r_first` on: S's `rows` (scaled by scale_i if
    SCALE_S) times L_i, one rank step at a time."""
    for r0 in tl.range(r_first, rank, BLOCK_R, num_stages=1):  # a few steps: not worth pipeline buffers
        st, lt = _lora_operands(s_ptr, lora_ptr, offs_m, offs_n, rows, n_mask, r0, rank, r_offset, scale, N,
                                stride_sm, SCALE_S, BLOCK_R)
        acc = tl.dot(st, lt, acc)
    return acc


@triton.jit
def _lora_operands(s_ptr, lora_ptr, offs_m, offs_n, m_mask, n_mask, r0, rank, r_offset, scale, N, stride_sm,
                   SCALE_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rank step r0 of a tile's LoRA term as two MMA operands: S[offs_m, r0:r0 + BLOCK_R] in the
    tile's rows (`m_mask`), zeros elsewhere (times scale_i if SCALE_S, rounded to S's dtype),
    and L_i's rows r0.. for the columns `offs_n`."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    st = tl.load(s_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_r[None, :],
                 mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    if SCALE_S:
        st = (st.to(tl.float32) * scale).to(s_ptr.dtype.element_ty)
    lt = tl.load(lora_ptr + (r_offset + offs_r)[:, None] * N + offs_n[None, :],
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    return st, lt


# the fused GEMM's K loop is warp-specialised where its output is at least this wide
GEMM_WS_MIN_N = 8192


def _schedule(n: int, n_pairs: int, device: torch.device) -> tuple[int, bool]:
    """(grid size, warp specialisation) of the fused base GEMM, Y and dX alike: persistent (one
    program per SM looping over its tiles, so that one tile's stores overlap the next one's
    loads), faster than one program per tile; warp-specialised where the output is wide
    (N >= `GEMM_WS_MIN_N`)."""
    return min(n_pairs, sm_count(device)), n >= GEMM_WS_MIN_N


def takes_gluon(a: torch.Tensor, meta: LoRABatchMeta) -> bool:
    """Whether the fused path runs the Gluon GEMM (`lora_gemm_gluon.py`) for operand `a`: where
    `KernelConfig.gluon_gemm` says so, for 16-bit operands in 128-row blocks."""
    cfg = meta.config
    return cfg.gluon_gemm and a.element_size() == 2 and cfg.block_m == 128


def lora_gemm(
    a: torch.Tensor,  # [M, K] contiguous: x or dY
    w: torch.Tensor,  # [N, K] (forward: x @ w^T) or [K, N] (backward: dY @ w)
    bias: Optional[torch.Tensor],  # [N]
    s: torch.Tensor,  # [M, meta.rank_stride] in a's dtype: S or dS
    lora_pack: torch.Tensor,  # [R_total, N] in a's dtype: packed B^T (forward) or A (backward)
    out: torch.Tensor,  # [M, N]: written, or (fused_base=False) already holding the base product
    meta: LoRABatchMeta,
    forward: bool,  # True: Y (B_i, scale, bias); False: dX (A_i, dropout mask)
    fused_base: bool,  # True needs tma_ready(a, w)
    mask_nibbles: Optional[torch.Tensor] = None,  # backward with dropout: the forward shrink's mask
) -> torch.Tensor:
    assert a.is_contiguous() and out.stride(1) == 1 and a.dtype == w.dtype == lora_pack.dtype == s.dtype
    assert lora_pack.is_contiguous() and lora_pack.shape[1] == out.shape[1]
    assert fused_base or bias is None, "the in-place path adds no bias: the base product in `out` has it"
    cfg = meta.config
    M, K = a.shape
    N = out.shape[1]
    block_n = cfg.gemm_block_n if fused_base else cfg.add_block_n
    n_pairs = meta.n_blocks * cdiv(N, block_n)  # (row block, n block) pairs
    if n_pairs == 0 or (not fused_base and meta.max_rank == 0):  # in place, no LoRA term: nothing to add
        return out
    out_dropout = (not forward) and meta.has_dropout
    if out_dropout:
        assert mask_nibbles is not None and mask_nibbles.shape == (M, cdiv(N, 4))
    common = dict(FORWARD=forward, OUT_DROPOUT=out_dropout, N_INT_COLS=len(ADAPTER_INT_COLS),
                  N_FLOAT_COLS=len(ADAPTER_FLOAT_COLS), BLOCK_M=cfg.block_m, BLOCK_N=block_n,
                  BLOCK_R=meta.block_r_expand, GROUP_M=cfg.group_m)
    mask = mask_nibbles if out_dropout else out
    if not fused_base:
        _lora_add_kernel[(n_pairs,)](s, lora_pack, out, mask, *meta.block_args(), M, N, meta.n_blocks, cdiv(N, 4),
                                     s.stride(0), out.stride(0), num_warps=cfg.add_warps, **common,
                                     **LAUNCH_OPTIONS)
        return out
    if not tma_ready(a, w):
        raise ValueError("The fused base GEMM needs TMA-ready operands (see `tma_ready`); use fused_base=False.")
    if takes_gluon(a, meta):
        return lora_gemm_gluon(a, w, bias, s, lora_pack, out, meta, forward, mask if out_dropout else None)
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.gemm_block_k])
    w_desc = TensorDescriptor.from_tensor(
        w, [cfg.gemm_block_n, cfg.gemm_block_k] if forward else [cfg.gemm_block_k, cfg.gemm_block_n])
    grid, warp_specialize = _schedule(N, n_pairs, a.device)
    _lora_gemm_kernel[(grid,)](a_desc, w_desc, bias if bias is not None else out, s, lora_pack, out, mask,
                               *meta.block_args(), M, N, K, meta.n_blocks, cdiv(N, 4), grid, s.stride(0),
                               out.stride(0),
                               HAS_BIAS=bias is not None, BLOCK_K=cfg.gemm_block_k, K_STAGES=cfg.gemm_stages,
                               WARP_SPECIALIZE=warp_specialize, PDL=cfg.pdl, launch_pdl=cfg.pdl,
                               num_warps=cfg.gemm_warps, **common, **LAUNCH_OPTIONS)
    return out


def reference_lora_gemm(
    a: torch.Tensor,  # [M, K]: x or dY
    w: torch.Tensor,  # [N, K] (forward) or [K, N] (backward)
    bias: Optional[torch.Tensor],
    s: torch.Tensor,  # [M, >= max rank]: S or dS
    lora: Sequence[Optional[torch.Tensor]],  # B_i [N, r_i] (forward) or A_i [r_i, N] (backward), or None
    seg_lens: Sequence[int],
    forward: bool,
    scales: Sequence[float],
    dropout_p: Sequence[float],
    seeds: Sequence[int],
) -> torch.Tensor:
    """fp32: the base product plus each segment's LoRA term, as `_lora_gemm_kernel` computes it."""
    base = a.float() @ (w.float().t() if forward else w.float())
    if bias is not None:
        base = base + bias.float()
    start = 0
    for i, (t, rows) in enumerate(zip(lora, seg_lens)):
        if t is not None and rows:
            r = t.shape[1] if forward else t.shape[0]
            term = s[start : start + rows, :r].float() @ (t.float().t() if forward else t.float())
            if forward:
                term = term * scales[i]
            elif dropout_p[i] > 0:
                keep = dropout_keep_mask(seeds[i], rows, base.shape[1], dropout_p[i], device=a.device)
                term = term * keep / (1.0 - dropout_p[i])
            base[start : start + rows] += term
        start += rows
    return base
