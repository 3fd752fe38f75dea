"""The Triton multi-LoRA kernels under TRITON_INTERPRET=1 on CPU fp32 tensors, against the
torch references: outputs and every gradient (x, A_i, B_i) over random segment tables with
empty and one-row segments, adapters without LoRA, odd ranks and 1..40 adapters; the dropout
mask bit-equal to Triton's Philox and reproducible from each adapter's own seed."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from conftest import use_triton_interpreter

triton = use_triton_interpreter("_triton_common", "pack", "shrink", "lora_gemm", "row_reduce", "ds_db",
                                "multi_lora")
import triton.language as tl  # noqa: E402

from lora_sweep.kernels import (  # noqa: E402
    dropout_keep_mask,
    multi_lora_linear,
    reference_multi_lora_linear,
    triton_multi_lora_linear,
)
from lora_sweep.kernels._triton_common import fit_rank_block, keep_mask  # noqa: E402
from lora_sweep.kernels.dropout import (  # noqa: E402
    empty_mask_nibbles,
    keep_mask_from_nibbles,
    keep_threshold,
    philox_randint4x,
)
from lora_sweep.kernels.ds_db import lora_ds_db  # noqa: E402
from lora_sweep.kernels.lora_gemm import lora_gemm, reference_lora_gemm  # noqa: E402
from lora_sweep.kernels.metadata import (  # noqa: E402
    INTERPRET_CONFIG,
    LoRABatchMeta,
    config_for,
    db_rows_per_step,
    gemm_programs,
    gluon_release,
    reduce_chunk_rows,
    reduction_stages,
    shrink_blocks,
    shrink_k_splits,
    split_min_rows,
)
from lora_sweep.kernels.multi_lora import beside_programs  # noqa: E402
from lora_sweep.kernels.pack import pack_adapters, reference_pack_adapters  # noqa: E402
from lora_sweep.kernels.row_reduce import lora_row_reduce, reference_lora_row_reduce  # noqa: E402
from lora_sweep.kernels.shrink import lora_shrink, reference_lora_shrink  # noqa: E402

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

CONFIGS = {
    "fused": INTERPRET_CONFIG,
    "cublas_base": dataclasses.replace(INTERPRET_CONFIG, fused_base=False),
    # 32-row tiles; the shrink runs one 32-row program per tile, or smaller programs with a
    # doubled K step where the layout has few tiles (`shrink_blocks`); 64-row chunks sum
    # partials of several tiles
    "split_chunks": dataclasses.replace(INTERPRET_CONFIG, block_m=32, shrink_block_m=32, chunk_rows=64),
    # chunks of up to 4096 rows: an adapter is one chunk unless the interpreter's 4 "SMs" would
    # idle (`reduce_chunk_rows`), and the reductions write most gradients directly
    "direct": dataclasses.replace(INTERPRET_CONFIG, chunk_rows=4096),
    # dS by the shrink and dB by the row reduction, two passes over dY (the other configs take
    # one pass, `ds_db.py`, wherever every rank fits one rank block)
    "two_pass_dy": dataclasses.replace(INTERPRET_CONFIG, one_pass_dy=False),
}


def assert_close(actual, expected, dtype=torch.float32, what=""):
    # relative to the tensor's scale: gradients of long segments are sums of many terms
    scale = max(expected.abs().max().item(), 1.0)
    tol = TOL[dtype]
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= tol["atol"] * scale + tol["rtol"] * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


# --------------------------------------------------------------------------- dropout masks


@triton.jit
def _randint4x_kernel(out_ptr, offsets_ptr, seed, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.load(offsets_ptr + i, mask=i < n, other=0)
    r0, r1, r2, r3 = tl.randint4x(seed, offs)
    for w, r in enumerate((r0, r1, r2, r3)):
        tl.store(out_ptr + w * n + i, r.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF, mask=i < n)


@triton.jit
def _keep_mask_kernel(out_ptr, seed, rows, cols, threshold, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c0 = tl.program_id(1) * BLOCK_C
    c = c0 + tl.arange(0, BLOCK_C)
    keep = keep_mask(seed, r.to(tl.int64), c0, cols, threshold, BLOCK_C)
    tl.store(out_ptr + r[:, None] * cols + c[None, :], keep.to(tl.int8), mask=(r < rows)[:, None] & (c < cols)[None, :])


@pytest.mark.parametrize("seed", [0, 1, 123456789, 2**40 + 7, -5])
def test_philox_matches_triton_randint4x(seed):
    g = torch.Generator().manual_seed(0)
    offsets = torch.cat([torch.arange(64), torch.randint(0, 2**62, (200,), generator=g)])
    out = torch.zeros(4, offsets.numel(), dtype=torch.int64)
    _randint4x_kernel[(triton.cdiv(offsets.numel(), 64),)](out, offsets, seed, offsets.numel(), BLOCK=64)
    for w, ref in enumerate(philox_randint4x(seed, offsets)):
        assert torch.equal(out[w], ref), f"word {w}"


@pytest.mark.parametrize("rows,cols,p,seed", [(5, 37, 0.3, 7), (33, 64, 0.05, 2**35), (1, 3, 0.5, -1)])
def test_keep_mask_bit_equal_to_kernel(rows, cols, p, seed):
    out = torch.zeros(rows, cols, dtype=torch.int8)
    _keep_mask_kernel[(triton.cdiv(rows, 16), triton.cdiv(cols, 16))](
        out, seed, rows, cols, keep_threshold(p), BLOCK_R=16, BLOCK_C=16)
    assert torch.equal(out.bool(), dropout_keep_mask(seed, rows, cols, p))


def test_keep_mask_rate_and_seeding():
    m = dropout_keep_mask(3, 256, 256, 0.25)
    assert abs(m.float().mean().item() - 0.75) < 0.01
    # every column position keeps at the rate, independently of its neighbour (another word of
    # the same Philox draw): 8192 samples per position of a group of eight, 5 sigma ~ 0.024
    by_position = m.float().reshape(256, 32, 8)
    assert (by_position.mean(dim=(0, 1)) - 0.75).abs().max().item() < 0.025
    both = (by_position[..., 0::2] * by_position[..., 1::2]).mean(dim=(0, 1))
    assert (both - 0.75**2).abs().max().item() < 0.03
    assert torch.equal(m, dropout_keep_mask(3, 256, 256, 0.25))
    assert not torch.equal(m, dropout_keep_mask(4, 256, 256, 0.25))
    # a segment's first rows do not depend on how many rows follow
    assert torch.equal(m[:10], dropout_keep_mask(3, 10, 256, 0.25))
    assert dropout_keep_mask(3, 4, 5, 0.0).all()
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_keep_mask(3, 4, 5, 1.0)


# --------------------------------------------------------------------------- the fused op


def random_case(n_adapters, seed, in_f=40, out_f=56, max_rows=24, dropout=True, ranks=(1, 3, 8, 16, 17, 33)):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seg_lens = [rng.choice([0, 1, rng.randint(2, max_rows)]) for _ in range(n_adapters)]
    if sum(seg_lens) == 0:
        seg_lens[0] = 5
    lora_a, lora_b = [], []
    for _ in range(n_adapters):
        if rng.random() < 0.2:
            lora_a.append(None)
            lora_b.append(None)
            continue
        r = rng.choice(ranks)
        lora_a.append(torch.randn(r, in_f, requires_grad=True))
        lora_b.append(torch.randn(out_f, r, requires_grad=True))  # not PEFT's zeros: gradients must flow
    scales = [rng.choice([0.25, 1.0, 2.0]) for _ in range(n_adapters)]
    dropout_p = [rng.choice([0.0, 0.1, 0.5]) if dropout else 0.0 for _ in range(n_adapters)]
    seeds = [rng.randint(-2**40, 2**40) for _ in range(n_adapters)]
    x = torch.randn(sum(seg_lens), in_f, requires_grad=True)
    weight = torch.randn(out_f, in_f)
    bias = torch.randn(out_f) if rng.random() < 0.7 else None
    return x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds


def check_against_reference(case, config):
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = case
    y = triton_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds, config=config)
    y_ref = reference_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert_close(y, y_ref, what="output")

    params = [x] + [t for pair in zip(lora_a, lora_b) for t in pair if t is not None]
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, params, dy, allow_unused=True)
    grads_ref = torch.autograd.grad(y_ref, params, dy, allow_unused=True)
    for k, (g, g_ref) in enumerate(zip(grads, grads_ref)):
        if g_ref is None:  # adapter with no rows: no gradient, as in the reference
            assert g is None or not g.any(), f"grad {k}"
            continue
        assert g.dtype == params[k].dtype and g.shape == params[k].shape
        assert_close(g, g_ref, what=f"grad {k}")


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n_adapters,seed", [(1, 0), (2, 1), (5, 2), (13, 3)])
def test_matches_reference(n_adapters, seed, config):
    check_against_reference(random_case(n_adapters, seed), CONFIGS[config])


def test_matches_reference_forty_adapters():
    check_against_reference(random_case(40, 7, max_rows=6), CONFIGS["split_chunks"])


@pytest.mark.parametrize("out_f", [100, 24])
def test_one_pass_over_dy_in_column_groups_matches_reference(out_f):
    # every segment within one row step of the pass over dY: its programs take groups of
    # column blocks (`ds_db_col_group`), 7 blocks of 16 in groups of 4 (the last group's last
    # block past the edge), or 2 blocks in one group of 2
    from lora_sweep.kernels.ds_db import ds_db_col_group

    case = random_case(9, 8, out_f=out_f, max_rows=INTERPRET_CONFIG.db_block_m)
    meta = _meta(case, INTERPRET_CONFIG)
    n_col_blocks = -(-out_f // INTERPRET_CONFIG.ds_db_block_n)
    assert meta.sm_count == 4 and ds_db_col_group(meta, n_col_blocks) == min(4, n_col_blocks)
    check_against_reference(case, INTERPRET_CONFIG)


def test_one_pass_over_dy_on_half_column_blocks_matches_reference():
    # one adapter of 30 rows, a chunk of two row steps: on 32 columns a block the pass over dY
    # runs 2 programs on the interpreter's 4 "SMs", so it takes blocks of 16 (`ds_db_blocks`),
    # 3 programs for 40 columns, still one wave, the last block past the edge
    from lora_sweep.kernels.ds_db import ds_db_blocks

    config = dataclasses.replace(INTERPRET_CONFIG, ds_db_block_n=32, ds_db_warps=4)
    torch.manual_seed(3)
    lora_a, lora_b = [torch.randn(7, 40, requires_grad=True)], [torch.randn(40, 7, requires_grad=True)]
    case = (torch.randn(30, 40, requires_grad=True), torch.randn(40, 40), torch.randn(40), lora_a, lora_b, [2.0],
            [0.1], [30], [5])
    meta = _meta(case, config)
    assert meta.n_chunks == 1 and meta.longest_chunk == 30
    assert ds_db_blocks(meta, 40) == (16, 2)
    check_against_reference(case, config)


@pytest.mark.parametrize("config", ["fused", "cublas_base"])
def test_matches_reference_above_one_rank_step(config):
    # ranks past the GEMM's rank step of 64 (`rank_blocks`): the LoRA term takes two and three steps
    check_against_reference(random_case(4, 11, ranks=(5, 70, 130)), CONFIGS[config])


def test_matches_reference_without_dropout():
    # no mask on dX's LoRA term either: both fused GEMMs add it after their K loop
    check_against_reference(random_case(5, 31, dropout=False, ranks=(3, 16, 17, 40)), CONFIGS["fused"])


def test_large_ranks_span_several_rank_blocks():
    # rank 130 > the shrink's 128-wide block and > the expand's 64-wide rank step
    case = random_case(3, 11, in_f=24, out_f=20, max_rows=20, ranks=(130, 5))
    check_against_reference(case, CONFIGS["fused"])


@triton.jit
def _fit_rank_block_kernel(left_ptr, out_ptr, BLOCK_R: tl.constexpr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, fit_rank_block(tl.load(left_ptr + i), BLOCK_R))


@pytest.mark.parametrize("block_r", [16, 32, 64, 128])
def test_each_adapter_takes_the_smallest_rank_block_holding_its_rank(block_r):
    left = torch.arange(1, 2 * block_r + 2, dtype=torch.int32)
    got = torch.zeros_like(left)
    _fit_rank_block_kernel[(left.numel(),)](left, got, BLOCK_R=block_r)
    want = [min(block_r, max(16, 1 << (r - 1).bit_length())) for r in left.tolist()]
    assert got.tolist() == want


def test_mixed_ranks_take_every_rank_block_size():
    # in a pack whose largest rank block is 128, ranks of each block size 16..128 and a second block
    case = random_case(12, 13, in_f=24, out_f=20, max_rows=20, ranks=(5, 20, 40, 100, 130))
    check_against_reference(case, CONFIGS["fused"])


def test_widths_tma_cannot_read_fall_back_to_the_in_place_add():
    # fp32 rows of 37 and 23 values are not 16-byte multiples: the base GEMM cannot be fused there
    case = random_case(5, 4, in_f=37, out_f=23)
    check_against_reference(case, CONFIGS["fused"])
    x, weight, bias, lora_a, lora_b, *_ = case
    meta = _meta(case, CONFIGS["fused"])
    a_pack, bt_pack = pack_adapters(*_adapters_with_rows(lora_a, lora_b, meta), x.dtype)
    s = torch.zeros(x.shape[0], meta.rank_stride)
    with pytest.raises(ValueError, match="TMA"):
        lora_gemm(x.detach(), weight, bias, s, bt_pack, torch.empty(x.shape[0], 23), meta, forward=True,
                  fused_base=True)


def test_gluon_gemm_only_on_the_triton_releases_it_was_checked_with():
    # Gluon changes between Triton releases (3.9 renamed three calls): a release never checked on a GPU
    # takes the Triton GEMM
    assert all(gluon_release(r) for r in ("3.6.0", "3.6.1", "3.6", "3.7.1", "3.8.0", "3.9.0"))
    assert not any(gluon_release(r) for r in ("3.10.0", "3.60.0", "3.5.1", "4.0.0"))


def test_shrink_programs_shrink_where_the_layout_has_few_tiles():
    cfg = config_for(16, True, True)  # 128-row tiles, 64-row shrink programs, K step 64
    h100 = 232448 * 2 // 3  # two thirds of an H100's shared memory per program
    # 2048 tokens, 4 adapters r16 (16 tiles) on 132 SMs: 16-row programs, K step 256
    assert shrink_blocks(16, 1, 16, cfg, 132, h100) == (16, 256)
    # 16384 tokens: 128 tiles already give 256 programs of 64 rows
    assert shrink_blocks(128, 1, 16, cfg, 132, h100) == (64, 64)
    # rank blocks of 128 columns, rows halved to 16 (the shrink that draws the mask, K not
    # split): the K step stops growing where the buffers would not fit
    cfg128 = config_for(128, True, True)
    for stage_bytes in (h100, 96 * 1024):
        bm, bk = shrink_blocks(16, 1, 128, cfg128, 132, stage_bytes)
        assert bm == 16 and (bm + 128) * bk * 2 * cfg128.shrink_stages <= stage_bytes
    assert shrink_blocks(16, 1, 128, cfg128, 132, h100) == (16, 128)
    case = random_case(2, 5, max_rows=24)
    meta = _meta(case, CONFIGS["split_chunks"])  # 2 tiles at most, 4 "SMs" on the interpreter
    assert (meta.mask_shrink_block_m, meta.mask_shrink_block_k) == (16, 2 * CONFIGS["split_chunks"].shrink_block_k)


def test_shrinks_split_k_rather_than_cut_rows_below_the_rank_block():
    cfg = config_for(64, True, True)  # rank blocks of 64, 64-row shrink programs at most
    h100 = 232448 * 2 // 3
    # 2048 tokens, 4 adapters r64 (16 tiles): rows stop at 64, and K splits four ways to fill 132 SMs
    assert split_min_rows(cfg, 64) == 64
    assert shrink_blocks(16, 1, 64, cfg, 132, h100, split_min_rows(cfg, 64)) == (64, 64)
    assert shrink_k_splits(16 * 2, 14336, 64, 132) == 4
    assert shrink_k_splits(16 * 2, 512, 64, 132) == 2  # each split keeps four K steps
    assert shrink_k_splits(128 * 2, 4096, 64, 132) == 1  # 16384 tokens: the tiles fill the SMs
    # for the shrink that draws the mask, whose K is never split, rows halve to 16
    assert shrink_blocks(16, 1, 64, cfg, 132, h100)[0] == 16
    # rank 16: 16-row programs read no more of their adapter than of x; they fill the SMs unsplit
    cfg16 = config_for(16, True, True)
    assert shrink_blocks(16, 1, 16, cfg16, 132, h100, split_min_rows(cfg16, 16)) == (16, 256)
    assert shrink_k_splits(16 * 8, 4096, 256, 132) == 1


def test_shrink_splits_count_the_programs_with_rows():
    # 2048 tokens of 32 adapters r64: 32 tiles of 64 rows, whose second 64-row sub-tile of the
    # 128-row tile is empty; 32 programs with rows, so K splits four ways on 132 SMs
    cfg = config_for(64, True, True)
    ranks = [64] * 32
    a = [torch.empty(64, 4096)] * 32
    meta = LoRABatchMeta.build([64] * 32, a, [torch.empty(4096, 64)] * 32, [1.0] * 32, [0.0] * 32,
                               list(range(32)), 4096, 4096, torch.device("cpu"), cfg)
    assert (meta.n_tiles, meta.shrink_block_m, meta.shrink_programs) == (32, 64, 32) and meta.ranks == tuple(ranks)
    meta = dataclasses.replace(meta, sm_count=132)  # as on an H100 (the interpreter counts 4)
    assert meta.k_splits(4096) == 4


@pytest.mark.parametrize("k_splits", [2, 3])
def test_shrink_split_over_k_equals_whole_k(k_splits):
    # K of 100 and 136 in steps of 32: the last split is shorter than the others and ends mid-step
    case = random_case(5, 41, in_f=100, out_f=136)
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = case
    x = x.detach()
    meta = _meta(case, CONFIGS["fused"])
    assert meta.has_dropout
    a_pack, bt_pack = pack_adapters(*_adapters_with_rows(lora_a, lora_b, meta), x.dtype)
    dy = torch.randn(x.shape[0], weight.shape[0])
    for u, lora_pack, kw in ((x, a_pack, dict(apply_scale=False, dropout=True)),
                             (dy, bt_pack, dict(apply_scale=True, dropout=False))):
        outs, masks = [], []
        for splits in (1, k_splits):
            out = torch.full((x.shape[0], meta.rank_stride), float("nan"))  # what is not written stays NaN
            mask = empty_mask_nibbles(x.shape[0], x.shape[1], x.device) if kw["dropout"] else None
            if mask is not None:
                mask.fill_(0xFF)
            lora_shrink(u, lora_pack, out, meta, mask_nibbles=mask, k_splits=splits, **kw)
            outs.append(out)
            masks.append(mask)
        assert outs[0].isnan().any() and not outs[0].isnan().all()
        assert torch.equal(outs[0].isnan(), outs[1].isnan())  # the same elements written
        assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5, equal_nan=True)
        if masks[0] is not None:  # every split draws and stores the mask of its own columns
            assert torch.equal(masks[0], masks[1])


@pytest.mark.parametrize("programs", [1, 3])
def test_shrink_beside_the_gemm_equals_a_program_per_block(programs):
    # a few programs, each looping over whole tiles with K whole in steps of `beside_block_k`
    # (K of 100 and 136: the last step ends mid-step), x's blocks through TMA (whole blocks
    # of rows, whatever the tile's); rank 130 takes two rank blocks, so the programs loop over
    # rank blocks too; empty and one-row segments, adapters without LoRA
    case = random_case(7, 3, in_f=100, out_f=136, dropout=False, ranks=(1, 16, 33, 130))
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = case
    x = x.detach()
    meta = _meta(case, CONFIGS["fused"])
    assert meta.max_rank > meta.block_r and not meta.has_dropout
    a_pack, bt_pack = pack_adapters(*_adapters_with_rows(lora_a, lora_b, meta), x.dtype)
    dy = torch.randn(x.shape[0], weight.shape[0])
    for u, lora_pack, apply_scale in ((x, a_pack, False), (dy, bt_pack, True)):
        outs = []
        for beside in (None, programs):
            out = torch.full((x.shape[0], meta.rank_stride), float("nan"))  # what is not written stays NaN
            lora_shrink(u, lora_pack, out, meta, apply_scale=apply_scale, dropout=False, programs=beside)
            outs.append(out)
        assert outs[0].isnan().any() and not outs[0].isnan().all()
        assert torch.equal(outs[0].isnan(), outs[1].isnan())  # the same elements written
        assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-4, equal_nan=True)


def test_gemm_programs_finish_as_soon_on_fewer_sms():
    # 2048 tokens on 132 SMs: 256 pairs (4096 columns of 256) in two rounds of 128 programs, not
    # 124 programs of two and 8 of one; 896 (14336 columns) in 7 rounds of 128; 1184 (18944
    # columns) need all 132; 224 (3584 columns) take 112
    assert [gemm_programs(n, 132) for n in (256, 896, 1184, 224, 100, 132, 133, 0)] == [128, 128, 132, 112, 100,
                                                                                           132, 67, 0]
    for n in range(1, 600):
        programs = gemm_programs(n, 132)
        assert programs <= 132 and -(-n // programs) == -(-n // min(n, 132))


def test_shrinks_go_beside_the_gemm_where_the_spare_sms_can_stream_every_tile():
    # On 132 SMs, 2048 tokens leave 4 SMs spare beside a GEMM of 4096 or 14336 columns: four
    # tiles each, enough for S at rank 16 (4 x (128 + 16) rows within 576), not at rank 64 nor
    # for dS (512); 20 SMs beside dX of 3584 columns (112 programs of two pairs), enough for
    # 32 tiles of rank up to 128; 512 tokens leave 68 beside a GEMM of 4096 columns, 20
    # beside one of 14336 (224 pairs: 112 programs of two)
    def programs(tokens, n, rank, n_cols, forward=True):
        cfg = config_for(rank, True, True)
        meta = LoRABatchMeta.build([tokens // n] * n, [torch.empty(rank, 64)] * n, [torch.empty(64, rank)] * n,
                                   [1.0] * n, [0.0] * n, list(range(n)), 64, 64, torch.device("cpu"), cfg)
        return beside_programs(dataclasses.replace(meta, sm_count=132), n_cols, forward)

    assert [programs(2048, 4, 16, n_cols) for n_cols in (4096, 14336, 18944)] == [4, 4, 0]
    assert [programs(2048, 4, 16, n_cols, forward=False) for n_cols in (4096, 3584)] == [0, 20]
    assert programs(2048, 4, 64, 4096) == programs(2048, 32, 16, 4096) == 0
    assert [programs(2048, 32, rank, 3584, forward=False) for rank in (16, 64, 128)] == [20, 20, 20]
    assert programs(512, 4, 128, 4096) == 68 and programs(512, 4, 16, 14336, forward=False) == 20


def test_matches_reference_with_the_shrinks_split_over_k():
    # one row of one adapter, K of 264 and 300 in steps of 32 (the last split ends mid-step):
    # each shrink that draws no mask splits K over programs, each keeping
    # `SHRINK_SPLIT_MIN_STEPS` K steps, on the interpreter's 4 "SMs"
    case = random_case(1, 5, in_f=264, out_f=300, dropout=False)
    meta = _meta(case, CONFIGS["fused"])
    assert meta.k_splits(264) > 1 and meta.k_splits(300) > 1
    check_against_reference(case, CONFIGS["fused"])


def test_reduction_chunks_shrink_until_every_sm_has_a_program():
    cfg = config_for(16, True, True)  # 128-row tiles, chunks of 1024 rows at most
    # 2048 rows of one adapter, 32 programs per chunk (dA, 4096 columns of 128): 2 chunks would
    # run 64 programs on 132 SMs, 4 chunks of 512 rows run 128, more than half the SMs
    assert reduce_chunk_rows([2048], [True], 32, cfg, 132) == 512
    assert reduce_chunk_rows([2048], [True], 32, cfg, 300) == 256
    assert reduce_chunk_rows([16384], [True], 32, cfg, 132) == 1024  # 16 chunks are enough
    assert reduce_chunk_rows([64] * 32, [True] * 32, 16, cfg, 132) == 1024  # 32 short adapters, 32 chunks
    assert reduce_chunk_rows([2048, 4096], [True, False], 32, cfg, 132) == 512  # rows without LoRA: no chunks
    assert reduce_chunk_rows([2048], [True], 32, cfg, 10**6) == 128  # never below the tile height
    # on the interpreter (4 "SMs"): one adapter's 24 rows, 24 -> 16 columns (one column block per
    # chunk in each reduction), make one chunk of the config's 32 rows, so they split into 2 of
    # 16; the gradients match the reference
    torch.manual_seed(0)
    case = (torch.randn(24, 24, requires_grad=True), torch.randn(16, 24), torch.randn(16),
            [torch.randn(8, 24, requires_grad=True)], [torch.randn(16, 8, requires_grad=True)], [2.0], [0.1], [24], [5])
    meta = _meta(case, CONFIGS["fused"])
    assert meta.chunk_rows == 16 and meta.n_chunks == 2 and meta.max_chunks_per_adapter == 2
    check_against_reference(case, CONFIGS["fused"])


def test_reduction_pipelines_no_deeper_than_their_chunks():
    # chunks of 64-row steps: 32 adapters of 64 rows take one step each, 128-row segments two,
    # and longer ones the config's three stages; rows without LoRA make no chunks
    cfg = dataclasses.replace(INTERPRET_CONFIG, block_m=64, chunk_rows=1024)
    x, w = torch.randn(1, 8), torch.randn(8, 8)

    def stages(seg_lens, ranks, config=cfg):
        lora_a = [torch.randn(r, 8) if r else None for r in ranks]
        lora_b = [torch.randn(8, r) if r else None for r in ranks]
        case = (x, w, None, lora_a, lora_b, [1.0] * len(ranks), [0.0] * len(ranks), seg_lens, list(range(len(ranks))))
        return reduction_stages(_meta(case, config), 64)

    assert stages([64] * 32, [16] * 32) == 1
    assert stages([128, 40], [16, 16]) == 2
    assert stages([4000, 64], [16, 16]) == cfg.reduce_stages == 3
    assert stages([64, 4000], [16, 0]) == 1


def test_db_steps_are_no_taller_than_the_chunks_need():
    # dB steps 128 rows where some rank takes two of its rank blocks (above 64), halved while
    # the longest chunk fits in half a step: 32 adapters of 64 rows step 64 rows at a time,
    # 16 adapters of 128 rows and longer chunks 128; up to rank 64 the steps stay 64 rows
    def rows_per_step(seg_lens, rank):
        cfg = config_for(rank, True, True)
        n = len(seg_lens)
        meta = LoRABatchMeta.build(seg_lens, [torch.empty(rank, 64)] * n, [torch.empty(64, rank)] * n, [1.0] * n,
                                   [0.0] * n, list(range(n)), 64, 64, torch.device("cpu"), cfg)
        return db_rows_per_step(meta)

    assert [rows_per_step(seg_lens, 128) for seg_lens in ([64] * 32, [128] * 16, [1024] * 16, [40, 100])] == [
        64, 128, 128, 128]
    assert [rows_per_step([1024] * 16, rank) for rank in (16, 64)] == [64, 64]


def test_tiles_cut_at_adapters_and_row_blocks():
    # tiles: one adapter's rows within one block_m-row block; row blocks: runs of tiles, no padding
    def tables(seg_lens, block_m):
        cfg = dataclasses.replace(INTERPRET_CONFIG, block_m=block_m, chunk_rows=4 * block_m)
        a = [torch.zeros(4, 8) if rows else None for rows in seg_lens]
        b = [torch.zeros(8, 4) if rows else None for rows in seg_lens]
        n = len(seg_lens)
        meta = LoRABatchMeta.build(seg_lens, a, b, [1.0] * n, [0.0] * n, [0] * n, 8, 8, torch.device("cpu"), cfg)
        return meta.tiles.tolist(), meta.block_tiles.tolist(), meta.n_blocks

    # 32 adapters of 64 rows: two tiles per 128-row block, 16 blocks (one adapter of 2048 rows makes as many)
    tiles, blocks, n_blocks = tables([64] * 32, 128)
    assert tiles == [[i, 64 * i, 64 * i + 64] for i in range(32)] and blocks == list(range(0, 33, 2))
    assert n_blocks == 16 == tables([2048], 128)[2]
    # an empty adapter makes no tile; a long one is cut at every multiple of the block
    tiles, blocks, n_blocks = tables([100, 0, 300], 128)
    assert tiles == [[0, 0, 100], [2, 100, 128], [2, 128, 256], [2, 256, 384], [2, 384, 400]]
    assert blocks == [0, 2, 3, 4, 5] and n_blocks == 4
    assert tables([0, 0], 128) == ([], [0], 0)
    assert config_for(16, False, True).fused_base and not config_for(16, False, False).fused_base


def test_no_lora_at_all_and_no_rows():
    x, weight, bias, *_ = random_case(1, 0)
    y = triton_multi_lora_linear(x, weight, bias, [None, None], [None, None], [1.0, 1.0], [0.0, 0.0],
                                 [x.shape[0], 0], config=INTERPRET_CONFIG)
    assert_close(y, torch.nn.functional.linear(x, weight, bias), what="base only")
    empty = torch.zeros(0, weight.shape[1])
    a, b = torch.randn(4, weight.shape[1]), torch.randn(weight.shape[0], 4)
    y = triton_multi_lora_linear(empty, weight, None, [a], [b], [1.0], [0.1], [0], config=INTERPRET_CONFIG)
    assert y.shape == (0, weight.shape[0])


def test_only_adapter_grads_or_only_x_grad():
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = random_case(4, 5)
    x = x.detach()
    y = triton_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds,
                                 config=INTERPRET_CONFIG)
    y.sum().backward()  # x needs no gradient: dX is skipped
    x.requires_grad_(True)
    frozen = [None if a is None else a.detach() for a in lora_a]
    frozen_b = [None if b is None else b.detach() for b in lora_b]
    y = triton_multi_lora_linear(x, weight, bias, frozen, frozen_b, scales, dropout_p, seg_lens, seeds,
                                 config=INTERPRET_CONFIG)
    (g,) = torch.autograd.grad(y.sum(), [x])
    y_ref = reference_multi_lora_linear(x, weight, bias, frozen, frozen_b, scales, dropout_p, seg_lens, seeds)
    assert_close(g, torch.autograd.grad(y_ref.sum(), [x])[0], what="dx")


def test_adapter_result_independent_of_pack_position():
    """Dropout counters start at each adapter's own first row: the same adapter with the same
    seed gives the same output and gradients alone or packed behind others."""
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = random_case(3, 9, dropout=False)
    a = torch.randn(17, x.shape[1], requires_grad=True)
    b = torch.randn(weight.shape[0], 17, requires_grad=True)
    xi = torch.randn(13, x.shape[1])
    alone = triton_multi_lora_linear(xi, weight, bias, [a], [b], [0.5], [0.3], [13], [99], config=INTERPRET_CONFIG)
    ga = torch.autograd.grad(alone.sum(), [a, b])
    packed_x = torch.cat([x.detach(), xi])
    packed = triton_multi_lora_linear(packed_x, weight, bias, lora_a + [a], lora_b + [b], scales + [0.5],
                                      dropout_p + [0.3], seg_lens + [13], seeds + [99], config=INTERPRET_CONFIG)
    gp = torch.autograd.grad(packed[-13:].sum(), [a, b])
    assert_close(packed[-13:], alone, what="output")
    for g1, g2 in zip(ga, gp):
        assert_close(g1, g2, what="grad")


def test_dropout_masks_the_lora_branch_only():
    """p close to 1 drops almost all of the LoRA input, never the base path."""
    torch.manual_seed(0)
    x, weight = torch.randn(9, 32), torch.randn(24, 32)
    a, b = torch.randn(4, 32), torch.randn(24, 4)
    y = triton_multi_lora_linear(x, weight, None, [a], [b], [1.0], [0.5], [9], [1], config=INTERPRET_CONFIG)
    keep = dropout_keep_mask(1, 9, 32, 0.5)
    expected = x @ weight.t() + ((x * keep / 0.5) @ a.t()) @ b.t()
    assert_close(y, expected, what="dropout on the LoRA input")


# --------------------------------------------------------------------------- each kernel vs its reference


def _meta(case, config):
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = case
    return LoRABatchMeta.build(seg_lens, lora_a, lora_b, scales, dropout_p, seeds,
                               weight.shape[1], weight.shape[0], x.device, config)


def _adapters_with_rows(lora_a, lora_b, meta):
    """The A_i and the B_i that the kernels pack: adapters with rows, in order."""
    used = [i for i, r in enumerate(meta.ranks) if r]
    return [lora_a[i] for i in used], [lora_b[i] for i in used]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_adapters_equal_the_reference(dtype):
    # odd ranks and widths: tiles end mid-row and mid-column; rank 70 takes two rank blocks,
    # and A (37 wide) fewer column blocks than B^T (301); alone, the rank-1 adapter takes tiles
    # of 16 ranks by 256 columns
    torch.manual_seed(3)
    ranks, in_f, out_f = [1, 3, 17, 70, 5], 37, 301
    lora_a = [torch.randn(r, in_f) for r in ranks]
    lora_b = [torch.randn(out_f, r) for r in ranks]
    for a, b in ((lora_a, lora_b), (lora_a[:1], lora_b[:1])):  # five adapters, and one
        for got, want in zip(pack_adapters(a, b, dtype), reference_pack_adapters(a, b, dtype)):
            assert got.dtype == dtype and got.is_contiguous() and got.shape == want.shape
            if dtype == torch.float32:
                assert torch.equal(got, want)
            else:  # the interpreter's casts to bf16 truncate (a GPU rounds to nearest, as torch)
                assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0)
    # the adapters are read through a cached table of their addresses: updated in place, as an
    # optimizer updates them, the next packing reads the new values
    with torch.no_grad():
        for t in lora_a + lora_b:
            t.mul_(-2.0).add_(1.0)
    for got, want in zip(pack_adapters(lora_a, lora_b, torch.float32),
                         reference_pack_adapters(lora_a, lora_b, torch.float32)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("config", ["fused", "split_chunks"])
def test_each_kernel_matches_its_reference(config):
    case = random_case(6, 21)
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = case
    x = x.detach()
    meta = _meta(case, CONFIGS[config])
    ranks = [0 if a is None else a.shape[0] for a in lora_a]
    rows_with_lora = torch.cat([torch.full((n,), r > 0) for n, r in zip(seg_lens, ranks)])
    a_pack, bt_pack = pack_adapters(*_adapters_with_rows(lora_a, lora_b, meta), x.dtype)
    assert a_pack.shape == (meta.r_total, x.shape[1]) and bt_pack.shape == (meta.r_total, weight.shape[0])

    s = torch.zeros(x.shape[0], meta.rank_stride)
    mask_nibbles = empty_mask_nibbles(x.shape[0], x.shape[1], x.device)
    lora_shrink(x, a_pack, s, meta, apply_scale=False, dropout=True, mask_nibbles=mask_nibbles)
    s_ref = reference_lora_shrink(x, lora_a, seg_lens, False, dropout_p=dropout_p, seeds=seeds)
    assert_close(s[:, : s_ref.shape[1]][rows_with_lora], s_ref[rows_with_lora], what="shrink S")
    # the mask the backward reads: each dropped segment's nibbles hold its seed's Philox mask
    start = 0
    for rows, r, p, seed in zip(seg_lens, ranks, dropout_p, seeds):
        if r and p > 0 and rows:
            want = dropout_keep_mask(seed, rows, x.shape[1], p)
            assert torch.equal(keep_mask_from_nibbles(mask_nibbles[start : start + rows], x.shape[1]), want)
        start += rows

    dy = torch.randn(x.shape[0], weight.shape[0])
    ds = torch.zeros_like(s)
    lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False)
    ds_ref = reference_lora_shrink(dy, lora_b, seg_lens, True, scales=scales)
    assert_close(ds[:, : ds_ref.shape[1]][rows_with_lora], ds_ref[rows_with_lora], what="shrink dS")

    y = torch.empty(x.shape[0], weight.shape[0])
    lora_gemm(x, weight, bias, s, bt_pack, y, meta, forward=True, fused_base=True)
    y_ref = reference_lora_gemm(x, weight, bias, s, lora_b, seg_lens, True, scales, dropout_p, seeds)
    assert_close(y, y_ref, what="gemm forward")
    dx = torch.empty_like(x)
    lora_gemm(dy, weight, None, ds, a_pack, dx, meta, forward=False, fused_base=True, mask_nibbles=mask_nibbles)
    dx_ref = reference_lora_gemm(dy, weight, None, ds, lora_a, seg_lens, False, scales, dropout_p, seeds)
    assert_close(dx, dx_ref, what="gemm backward")

    # dB flat: the B_i blocks one after another; dA [R_total, in]: the A_i stacked (the Function
    # hands each adapter a view of its block)
    for out_is_b, u, v, shape in ((True, dy, s, (weight.shape[0] * meta.r_total,)),
                                  (False, x, ds, (meta.r_total, x.shape[1]))):
        got = torch.zeros(shape)
        lora_row_reduce(u, v, got, meta, out_is_b=out_is_b, mask_nibbles=mask_nibbles)
        refs = [g for g in reference_lora_row_reduce(u, v, meta.ranks, seg_lens, out_is_b, scales, dropout_p, seeds)
                if g is not None]
        want = torch.cat([g.reshape(-1) if out_is_b else g for g in refs]) if refs else torch.zeros(shape)
        assert_close(got, want, what="dB" if out_is_b else "dA")
        if out_is_b:  # dS and dB from one pass over dY: the same values as the shrink and the reduction
            ds_one, db_one = torch.zeros_like(s), torch.zeros(shape)
            lora_ds_db(dy, s, bt_pack, ds_one, db_one, meta)
            assert_close(ds_one[:, : ds_ref.shape[1]][rows_with_lora], ds_ref[rows_with_lora], what="one-pass dS")
            assert_close(db_one, want, what="one-pass dB")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the diverged rows' own sums
@pytest.mark.parametrize("tma", [True, False])
def test_a_diverged_adapter_leaves_its_neighbours_gradients_alone(tma, monkeypatch):
    # Adapter 1's dY and x rows are non-finite (a diverged trial). Its neighbours' chunks end
    # mid-step, where a reduction's last step reads past them into adapter 1's rows: their
    # dA and dB must still be exactly what they are without adapter 1's rows poisoned. The
    # reductions read x and dY through TMA, or through pointers, as on a GPU without TMA.
    from lora_sweep.kernels import row_reduce

    if not tma:
        monkeypatch.setattr(row_reduce, "tma_ready", lambda *tensors: False)
    torch.manual_seed(5)
    seg_lens, ranks, in_f, out_f = [21, 19, 23], [16, 33, 5], 40, 56
    lora_a = [torch.randn(r, in_f) for r in ranks]
    lora_b = [torch.randn(out_f, r) for r in ranks]
    weight = torch.randn(out_f, in_f)
    case = (torch.randn(63, in_f), weight, None, lora_a, lora_b, [1.0, 2.0, 0.5], [0.0] * 3, seg_lens, [1, 2, 3])
    meta = _meta(case, CONFIGS["fused"])
    rows = [slice(0, 21), slice(21, 40), slice(40, 63)]
    x, dy = torch.randn(63, in_f), torch.randn(63, out_f)
    s, ds = torch.randn(63, meta.rank_stride), torch.randn(63, meta.rank_stride)
    poisoned_x, poisoned_dy = x.clone(), dy.clone()
    poisoned_x[rows[1]], poisoned_dy[rows[1]] = float("nan"), float("inf")
    for out_is_b, clean, poisoned, v in ((True, dy, poisoned_dy, s), (False, x, poisoned_x, ds)):
        shape = (out_f * meta.r_total,) if out_is_b else (meta.r_total, in_f)
        want, got = torch.zeros(shape), torch.zeros(shape)
        lora_row_reduce(clean, v, want, meta, out_is_b=out_is_b)
        lora_row_reduce(poisoned, v, got, meta, out_is_b=out_is_b)
        sizes = [out_f * r for r in ranks] if out_is_b else ranks
        for i, (g, w) in enumerate(zip(got.split(sizes), want.split(sizes))):
            if i == 1:
                assert not g.isfinite().all(), "the diverged adapter's own gradient"
            else:
                assert torch.equal(g, w), f"adapter {i}'s {'dB' if out_is_b else 'dA'}"


# --------------------------------------------------------------------------- public entry point


def test_public_entry_on_cpu_is_the_reference(monkeypatch):
    case = random_case(4, 3)
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = case
    y = multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds)
    y_ref = reference_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds)
    assert torch.equal(y, y_ref)
    monkeypatch.setenv("LORA_SWEEP_KERNELS", "torch")
    assert torch.equal(multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds), y_ref)


def test_bad_inputs_raise():
    x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds = random_case(2, 1)
    with pytest.raises(ValueError, match="seg_lens"):
        triton_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, [1, 1], seeds)
    with pytest.raises(ValueError, match="one entry per adapter"):
        triton_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales[:1], dropout_p, seg_lens, seeds)
    with pytest.raises(ValueError, match="dropout_p"):
        a, b = torch.randn(2, x.shape[1]), torch.randn(weight.shape[0], 2)
        triton_multi_lora_linear(x, weight, bias, [a], [b], [1.0], [1.0], [x.shape[0]], 0)
    with pytest.raises(ValueError, match="expected A"):
        triton_multi_lora_linear(x, weight, bias, [torch.randn(2, 3)], [torch.randn(3, 2)], [1.0], [0.0],
                                 [x.shape[0]], 0)
