"""Base GEMM with each tile's own LoRA term folded into its accumulator.

Forward:  Y  = x @ W^T + bias + scale_i * S @ B_i^T          (S from the shrink)
Backward: dX = dY @ W + keep_i / (1 - p_i) * (dS @ A_i)      (dS from the shrink of dY)

The LoRA term is computed first into the fp32 accumulator (the backward applies the dropout
mask there, read from the nibbles the forward shrink stored), then the base GEMM
accumulates on top, so the output is written once (LoRAFusion's fused expand). With
`FUSED_BASE=False` the base product is already in `out` (cuBLAS) and the kernel adds the
LoRA term in place: one extra read and write of `out`, chosen per shape where cuBLAS wins.

The LoRA MMAs run on the base operand's dtype (bf16 on GPU: S/dS are stored in it and the
adapters are packed in it per call) with fp32 accumulation. The rank loop steps over the tile's
own adapter's rank, so small ranks are not padded to the pack's largest one.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ._triton_common import load_adapter, load_keep_mask
from .dropout import dropout_keep_mask
from .metadata import ADAPTER_FLOAT_COLS, ADAPTER_INT_COLS, LoRABatchMeta


@triton.jit
def _lora_gemm_kernel(
    # pointers
    a_ptr,  # [M, K] left operand of the base GEMM: x (forward) or dY (backward)
    w_ptr,  # base right operand, element (k, n) at k * stride_wk + n * stride_wn
    bias_ptr,  # [N], read only if HAS_BIAS
    s_ptr,  # [M, rank_stride] in a's dtype: S (forward) or dS (backward)
    lora_ptr,  # [R_total, N] packed adapters in a's dtype: B^T (forward) or A (backward); adapter i at row r_offset_i
    out_ptr,  # [M, N]: written (FUSED_BASE) or updated in place
    mask_ptr,  # uint8 [M, n_groups]: the forward's keep-mask nibbles (read if OUT_DROPOUT)
    tiles_ptr,  # int64 [n_tiles, 3]: adapter, row_start, row_end
    adapters_i_ptr,  # int64 [n_adapters, N_INT_COLS]
    adapters_f_ptr,  # fp32 [n_adapters, N_FLOAT_COLS]
    seeds_ptr,  # int64 [n_adapters]: this layer's dropout seeds
    # sizes
    N,
    K,
    n_tiles,
    n_groups,
    # strides
    stride_am,
    stride_wk,
    stride_wn,
    stride_sm,
    stride_om,
    # meta-parameters
    APPLY_SCALE: tl.constexpr,  # multiply the LoRA term by scale_i (forward)
    OUT_DROPOUT: tl.constexpr,  # mask the LoRA term with the adapter's dropout mask (backward)
    HAS_BIAS: tl.constexpr,
    FUSED_BASE: tl.constexpr,  # True: run the base GEMM here; False: add into the base product in `out`
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask in the main loop
    N_INT_COLS: tl.constexpr,
    N_FLOAT_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile (= the tile table's)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rank step of the LoRA term
    GROUP_M: tl.constexpr,  # tiles per L2 group (triton tutorial 03's grouped ordering)
):
    # grouped ordering over (tile, n block), so neighbouring programs share W blocks in L2
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_tile = (pid // num_pid_in_group) * GROUP_M
    group_size = min(n_tiles - first_tile, GROUP_M)
    tile = first_tile + ((pid % num_pid_in_group) % group_size)
    pid_n = (pid % num_pid_in_group) // group_size

    adapter = tl.load(tiles_ptr + tile * 3).to(tl.int32)
    row_start = tl.load(tiles_ptr + tile * 3 + 1).to(tl.int32)
    row_end = tl.load(tiles_ptr + tile * 3 + 2).to(tl.int32)
    rank, seg_start, seed, threshold, r_offset, scale, inv_keep = load_adapter(
        adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS, N_FLOAT_COLS)

    if not FUSED_BASE:
        if rank == 0:  # the base product in `out` is already this tile's result
            return

    offs_m = row_start + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < row_end
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # the tile's LoRA term first: acc = S_tile @ L_i[:, n block] over the adapter's own rank
    if rank > 0:
        if OUT_DROPOUT:  # loaded before the accumulator is live: less register pressure
            keep = tl.full((BLOCK_M, BLOCK_N), 1, tl.int1)
            if threshold > 0:
                keep = load_keep_mask(mask_ptr, offs_m.to(tl.int64), m_mask, pid_n * BLOCK_N, n_groups, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        s_ptrs = s_ptr + offs_m[:, None].to(tl.int64) * stride_sm + offs_r[None, :]
        l_ptrs = lora_ptr + (r_offset + offs_r)[:, None] * N + offs_n[None, :]  # (r, n) tile of the adapter's rows
        for r0 in tl.range(0, rank, BLOCK_R, num_stages=1):  # a few steps: not worth pipeline buffers
            r_mask = (r0 + offs_r) < rank
            st = tl.load(s_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            lt = tl.load(l_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = tl.dot(st, lt, acc)
            s_ptrs += BLOCK_R
            l_ptrs += BLOCK_R * N
        if APPLY_SCALE:
            acc = acc * scale
        if OUT_DROPOUT:
            acc = tl.where(keep, acc * inv_keep, 0.0)

    # the base product accumulates on top of it
    if FUSED_BASE:
        # clamp instead of masking: rows/cols past the tile's end load valid memory and are not stored
        rows = tl.minimum(offs_m, row_end - 1)
        cols = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + offs_k[:, None] * stride_wk + cols[None, :].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                at = tl.load(a_ptrs)
                wt = tl.load(w_ptrs)
            else:
                k_mask = (k0 + offs_k) < K
                at = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
                wt = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
            acc = tl.dot(at, wt, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if not FUSED_BASE:
        acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def lora_gemm(
    a: torch.Tensor,  # [M, K] contiguous: x or dY
    w: torch.Tensor,  # [N, K] (w_transposed: x @ w^T, forward) or [K, N] (dY @ w, backward)
    bias: Optional[torch.Tensor],  # [N]
    s: torch.Tensor,  # [M, meta.rank_stride] in a's dtype: S or dS
    lora_pack: torch.Tensor,  # [R_total, N] in a's dtype: packed B^T (forward) or A (backward)
    out: torch.Tensor,  # [M, N]: written, or (fused_base=False) already holding the base product
    meta: LoRABatchMeta,
    forward: bool,  # True: Y (B_i, scale, bias); False: dX (A_i, dropout mask)
    fused_base: bool,
    mask_nibbles: Optional[torch.Tensor] = None,  # backward with dropout: the forward shrink's mask
) -> torch.Tensor:
    assert a.is_contiguous() and out.stride(1) == 1 and a.dtype == w.dtype == lora_pack.dtype == s.dtype
    assert lora_pack.is_contiguous() and lora_pack.shape[1] == out.shape[1]
    cfg = meta.config
    M, K = a.shape
    N = out.shape[1]
    # forward reads W [N, K] as (k, n); backward reads W [K_base=out, N=in] as (k, n)
    stride_wk, stride_wn = (w.stride(1), w.stride(0)) if forward else (w.stride(0), w.stride(1))
    grid = (meta.n_tiles * triton.cdiv(N, cfg.gemm_block_n),)
    if grid[0] == 0 or (not fused_base and meta.max_rank == 0 and bias is None):
        return out
    out_dropout = (not forward) and meta.has_dropout
    if out_dropout:
        assert mask_nibbles is not None and mask_nibbles.shape == (M, triton.cdiv(N, 4))
    _lora_gemm_kernel[grid](
        a, w, bias if bias is not None else out, s, lora_pack, out, mask_nibbles if out_dropout else out,
        *meta.args(),
        N, K, meta.n_tiles, triton.cdiv(N, 4),
        a.stride(0), stride_wk, stride_wn, s.stride(0), out.stride(0),
        APPLY_SCALE=forward,
        OUT_DROPOUT=out_dropout,
        HAS_BIAS=bias is not None,
        FUSED_BASE=fused_base,
        EVEN_K=K % cfg.gemm_block_k == 0,
        N_INT_COLS=len(ADAPTER_INT_COLS),
        N_FLOAT_COLS=len(ADAPTER_FLOAT_COLS),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.gemm_block_n,
        BLOCK_K=cfg.gemm_block_k,
        BLOCK_R=meta.block_r_expand,
        GROUP_M=cfg.group_m,
        num_warps=cfg.gemm_warps,
        num_stages=cfg.gemm_stages,
    )
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
