"""On CUDA: the model-level kernels (RMSNorm, SiLU(gate) * up, the chunk cross-entropy) and
the packed multi-LoRA layer in bf16 against a float64 reference on fresh random inputs,
outputs and gradients, relative error (Frobenius) below 1e-2, with the fused GEMMs in Triton
and, on Hopper, in Gluon; a diverged adapter's rows kept to itself by the Gluon GEMM; the
adapters' packing bit for bit against torch's; CUDA graphs of the layer, several alive at once, bit for bit against
eager calls. Skipped without a GPU; run it on one with
`pytest tests/test_fused_ops_gpu.py`."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from lora_sweep.kernels.metadata import gluon_gemm_runs
from lora_sweep.kernels.reference import IGNORE_INDEX, reference_cross_entropy_rows, reference_silu_mul

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and Triton compiled, not interpreted)")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("rows,hidden", [(4096, 2048), (1000, 3584), (37, 896)])
def test_rms_norm_bf16_against_float64(rows, hidden):
    from lora_sweep.kernels.rmsnorm import rms_norm

    torch.manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.float64) * 3
    w = torch.rand(hidden, device="cuda", dtype=torch.float64) + 0.5
    dy = torch.randn_like(x)
    x64 = x.clone().requires_grad_(True)
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    (want_dx,) = torch.autograd.grad(want, x64, dy)
    xb = x.bfloat16().requires_grad_(True)
    got = rms_norm(xb, w.bfloat16(), 1e-6)
    (got_dx,) = torch.autograd.grad(got, xb, dy.bfloat16())
    assert rel_err(got, want) < 1e-2 and rel_err(got_dx, want_dx) < 1e-2


@pytest.mark.parametrize("rows,width", [(4096, 8192), (333, 18944), (5, 100)])
def test_silu_mul_bf16_against_float64(rows, width):
    from lora_sweep.kernels.swiglu import silu_mul

    torch.manual_seed(rows)
    gate = torch.randn(rows, width, device="cuda", dtype=torch.float64) * 2
    up, dout = torch.randn_like(gate), torch.randn_like(gate)
    g64, u64 = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    want = reference_silu_mul(g64, u64)
    want_grads = torch.autograd.grad(want, (g64, u64), dout)
    gb, ub = gate.bfloat16().requires_grad_(True), up.bfloat16().requires_grad_(True)
    got = silu_mul(gb, ub)
    got_grads = torch.autograd.grad(got, (gb, ub), dout.bfloat16())
    assert rel_err(got, want) < 1e-2
    assert all(rel_err(g, w) < 1e-2 for g, w in zip(got_grads, want_grads))


@pytest.mark.parametrize("rows,vocab", [(512, 128256), (100, 151936), (7, 1000)])
def test_cross_entropy_bf16_against_float64(rows, vocab):
    from lora_sweep.kernels.cross_entropy import cross_entropy_rows

    torch.manual_seed(rows)
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float64) * 4
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    targets[::5] = IGNORE_INDEX
    want_losses, want_grad = reference_cross_entropy_rows(logits.clone(), targets, need_grad=True)
    # the kernel sees the logits as the model hands them over: rounded to bf16
    got_losses, got_grad = cross_entropy_rows(logits.bfloat16(), targets, need_grad=True)
    assert got_grad.dtype == torch.bfloat16
    assert rel_err(got_losses, want_losses) < 1e-2 and rel_err(got_grad, want_grad) < 1e-2
    assert torch.all(got_grad[::5] == 0) and torch.all(got_losses[::5] == 0)


# four adapters of one rank, and seven of ranks from 1 to 256 (several rank blocks, odd widths)
@pytest.mark.parametrize("ranks,in_f,out_f", [([16] * 4, 4096, 4096), ([8, 128, 1, 37, 64, 256, 200], 3584, 18944)])
def test_packed_adapters_equal_torch_bit_for_bit(ranks, in_f, out_f):
    from lora_sweep.kernels.pack import pack_adapters, reference_pack_adapters

    torch.manual_seed(len(ranks))
    lora_a = [torch.randn(r, in_f, device="cuda") for r in ranks]
    lora_b = [torch.randn(out_f, r, device="cuda") for r in ranks]
    for got, want in zip(pack_adapters(lora_a, lora_b, torch.bfloat16),
                         reference_pack_adapters(lora_a, lora_b, torch.bfloat16)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def _layer_grads(fn, x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds, dy, dtype, adapter_dtype):
    """y and the gradients of x, each A_i and each B_i of one forward and backward."""
    xs = x.detach().to(dtype, copy=True).requires_grad_(True)
    a = [t.detach().to(adapter_dtype, copy=True).requires_grad_(True) for t in lora_a]
    b = [t.detach().to(adapter_dtype, copy=True).requires_grad_(True) for t in lora_b]
    y = fn(xs, weight.to(dtype), None if bias is None else bias.to(dtype), a, b, scales, dropout_p, seg_lens, seeds)
    grads = torch.autograd.grad(y, [xs] + a + b, dy.to(dtype), allow_unused=True)
    return [y] + [g for g in grads]


def _check_layer_against_float64(seg_lens, ranks, in_f, out_f, config, p, dtype=torch.bfloat16):
    from lora_sweep.kernels import reference_multi_lora_linear, triton_multi_lora_linear

    torch.manual_seed(sum(seg_lens))
    x = torch.randn(sum(seg_lens), in_f, device="cuda", dtype=torch.float64)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.float64) / in_f ** 0.5
    bias = torch.randn(out_f, device="cuda", dtype=torch.float64)
    lora_a = [torch.randn(r, in_f, device="cuda", dtype=torch.float64) / in_f ** 0.5 for r in ranks]
    lora_b = [torch.randn(out_f, r, device="cuda", dtype=torch.float64) / r ** 0.5 for r in ranks]  # not zeros
    scales = [(2.0, 0.5, 1.0, 4.0, 0.25)[i % 5] for i in range(len(ranks))]
    # p: every adapter's dropout, or "mixed": 0.1, 0, 0.2, 0, ... (row blocks of adapters with and without)
    dropout_p = [(0.1, 0.0, 0.2, 0.0)[i % 4] for i in range(len(ranks))] if p == "mixed" else [p] * len(ranks)
    seeds = list(range(len(ranks)))
    dy = torch.randn(sum(seg_lens), out_f, device="cuda", dtype=torch.float64)
    args = (x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seeds, dy)
    got = _layer_grads(functools.partial(triton_multi_lora_linear, config=config), *args, dtype, torch.float32)
    want = _layer_grads(reference_multi_lora_linear, *args, torch.float64, torch.float64)
    # adapters of 64 rows or more: the gradient of a few rows is a handful of bf16 dot products,
    # whose cancellation alone can put it 1% off (an adapter without rows gets none)
    checked = [i for i, rows in enumerate(seg_lens) if rows >= 64]
    n = len(ranks)
    outputs = [("y", 0), ("dx", 1)] + [(f"dA{i}", 2 + i) for i in checked] + [(f"dB{i}", 2 + n + i) for i in checked]
    for name, k in outputs:
        assert rel_err(got[k], want[k]) < 1e-2, name


# ranks within 16 take one pass over dY for dS and dB (ds_db.py), larger ones two passes; empty,
# one-row and multi-chunk segments, dropout, a width TMA cannot read (in-place add)
@pytest.mark.parametrize("seg_lens,ranks,in_f,out_f", [
    ([3000, 0, 1, 1500, 77], [8, 16, 5, 1, 12], 4096, 11000),
    ([700, 5, 2100], [128, 3, 64], 3584, 4096),
    ([700, 300], [16, 30], 999, 745),
])
@pytest.mark.parametrize("pdl", [False, True])  # programmatic dependent launch (`KernelConfig.pdl`)
def test_multi_lora_linear_bf16_against_float64(seg_lens, ranks, in_f, out_f, pdl):
    from lora_sweep.kernels import metadata

    config = dataclasses.replace(metadata.config_for(max(ranks), True, True), pdl=pdl)
    _check_layer_against_float64(seg_lens, ranks, in_f, out_f, config, 0.1)


# chunks of one and two 64-row steps, whose reductions run one and two pipeline stages
# (`metadata.reduction_stages`): the one pass over dY (rank 16) and the two passes (rank 32)
@pytest.mark.parametrize("seg_lens,ranks,stages", [([64] * 32, [16] * 32, 1), ([128] * 6 + [40] * 3, [32] * 9, 2)])
def test_short_chunks_bf16_against_float64(seg_lens, ranks, stages):
    from lora_sweep.kernels import metadata

    config = metadata.config_for(max(ranks), True, True)
    meta = metadata.LoRABatchMeta.build(seg_lens, [torch.empty(r, 1024) for r in ranks],
                                        [torch.empty(2048, r) for r in ranks], [1.0] * len(ranks),
                                        [0.0] * len(ranks), list(range(len(ranks))), 1024, 2048,
                                        torch.device("cuda"), config)
    assert metadata.reduction_stages(meta, config.db_block_m) == stages
    _check_layer_against_float64(seg_lens, ranks, 1024, 2048, config, "mixed")


# 2048 tokens of four rank-64 adapters: the shrinks that draw no dropout mask split K over
# programs (`metadata.shrink_k_splits`), both of them without dropout, dS alone with it
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_shrinks_split_over_k_bf16_against_float64(p):
    from lora_sweep.kernels import metadata

    seg_lens, ranks = [512] * 4, [64] * 4
    config = metadata.config_for(max(ranks), True, True)
    meta = metadata.LoRABatchMeta.build(seg_lens, [torch.empty(r, 1024) for r in ranks],
                                        [torch.empty(2048, r) for r in ranks], [1.0] * 4, [p] * 4,
                                        list(range(4)), 1024, 2048, torch.device("cuda"), config)
    assert meta.k_splits(1024) > 1 and meta.k_splits(2048) > 1
    _check_layer_against_float64(seg_lens, ranks, 1024, 2048, config, p)


# fp16 models (`JobSpec.dtype="float16"`): the call's own config for 16-bit inputs (on Hopper the
# fused GEMM, in Gluon where it runs), and the Triton GEMM
@pytest.mark.parametrize("gluon", ["default", "triton"])
def test_multi_lora_linear_fp16_against_float64(gluon):
    from lora_sweep.kernels import metadata

    ranks = [128, 3, 64]
    config = metadata.config_for(max(ranks), True, metadata.fuses_base(torch.device("cuda"), 2))
    if gluon == "triton":
        config = dataclasses.replace(config, gluon_gemm=False)
    _check_layer_against_float64([700, 5, 2100], ranks, 3584, 4096, config, "mixed", torch.float16)


_needs_gluon_gemm = pytest.mark.skipif(not gluon_gemm_runs(), reason="the Gluon GEMM is written for Hopper (sm_90) "
                                   "and the Triton releases of `metadata.GLUON_TRITON_RELEASES`")


# The shrinks beside the fused GEMMs (`multi_lora.beside_programs`: on the SMs that the GEMMs'
# grids leave spare, while the GEMMs run): 512 rows, segments shorter than a tile, an adapter
# without rows, rank 200 in two rank blocks; and the same layout without programmatic dependent
# launch, where the shrinks run before the GEMMs
@_needs_gluon_gemm
@pytest.mark.parametrize("beside", [True, False])
def test_shrinks_beside_the_gemm_bf16_against_float64(beside):
    from lora_sweep.kernels import metadata, multi_lora

    seg_lens, ranks = [200, 5, 0, 77, 230], [16, 1, 8, 200, 64]
    config = dataclasses.replace(metadata.config_for(max(ranks), True, True), pdl=beside)
    meta = metadata.LoRABatchMeta.build(seg_lens, [torch.empty(r, 4096) for r in ranks],
                                        [torch.empty(4096, r) for r in ranks], [1.0] * 5, [0.0] * 5,
                                        list(range(5)), 4096, 4096, torch.device("cuda"), config)
    x = torch.empty(sum(seg_lens), 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    programs = [multi_lora._shrink_beside(x, w, meta, forward) for forward in (True, False)]
    assert all(programs) if beside else not any(programs)
    _check_layer_against_float64(seg_lens, ranks, 4096, 4096, config, 0.0)


# Both fused GEMMs take the Gluon kernel, dX's with the keep-mask where adapters have dropout:
# segments shorter than a row block (so blocks hold several adapters' rows, with and without
# dropout), ranks of one rank step of 16, of several, and ending mid-step (1, 17, 70, 130, 200),
# a bias; the Triton GEMM in the same run for comparison
@_needs_gluon_gemm
@pytest.mark.parametrize("seg_lens,ranks,in_f,out_f", [
    ([300, 5, 0, 77, 1, 2000, 130], [16, 1, 8, 17, 70, 130, 200], 4096, 4096),
    ([1000, 24, 1000], [16, 16, 16], 3584, 18944),
])
@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("p", [0.0, "mixed"])
def test_gluon_gemm_bf16_against_float64(seg_lens, ranks, in_f, out_f, gluon, pdl, p):
    from lora_sweep.kernels import metadata

    config = dataclasses.replace(metadata.config_for(max(ranks), True, True), gluon_gemm=gluon, pdl=pdl)
    _check_layer_against_float64(seg_lens, ranks, in_f, out_f, config, p)


@_needs_gluon_gemm
@pytest.mark.parametrize("dropout_p", [[0.0] * 3, [0.1, 0.0, 0.2]])
def test_gluon_gemm_keeps_a_diverged_adapters_rows_to_itself(dropout_p):
    """Adapter 1's rows of x and dY are non-finite (a diverged trial), and they share row blocks
    with adapters 0 and 2. Y, dX and the gradients of the others are bit for bit what they are
    without adapter 1's rows poisoned: the LoRA term masks each tile's rows of S (dS), with
    the keep-mask or without."""
    from lora_sweep.kernels import metadata, triton_multi_lora_linear

    torch.manual_seed(7)
    seg_lens, ranks, in_f, out_f = [50, 40, 300], [16, 20, 8], 1024, 2048
    x = torch.randn(sum(seg_lens), in_f, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(sum(seg_lens), out_f, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) / in_f ** 0.5
    lora_a = [torch.randn(r, in_f, device="cuda") / in_f ** 0.5 for r in ranks]
    lora_b = [torch.randn(out_f, r, device="cuda") / r ** 0.5 for r in ranks]
    config = dataclasses.replace(metadata.config_for(max(ranks), True, True), gluon_gemm=True)
    fn = functools.partial(triton_multi_lora_linear, config=config)
    args = (weight, None, lora_a, lora_b, [1.0, 2.0, 0.5], dropout_p, seg_lens, [1, 2, 3])
    clean = _layer_grads(fn, x, *args, dy, torch.bfloat16, torch.float32)
    x[50:90], dy[50:90] = float("nan"), float("inf")
    poisoned = _layer_grads(fn, x, *args, dy, torch.bfloat16, torch.float32)
    others = torch.cat([torch.arange(0, 50), torch.arange(90, 390)]).cuda()
    for k, name in ((0, "y"), (1, "dx")):
        assert torch.equal(poisoned[k][others], clean[k][others]), name
        assert not poisoned[k][50:90].isfinite().all(), name
    for i in (0, 2):
        assert torch.equal(poisoned[2 + i], clean[2 + i]), f"dA{i}"
        assert torch.equal(poisoned[5 + i], clean[5 + i]), f"dB{i}"


@_needs_gluon_gemm
def test_gluon_gemm_dispatch_eagerly_and_in_graphs():
    """On Hopper the default (`gluon_gemm=True`) runs the Gluon GEMM, as the profiler names the
    kernels, in eager calls and in a CUDA graph, whose replay gives bit for bit what the eager
    call gives; `gluon_gemm=False` runs the Triton GEMM."""
    from torch.profiler import ProfilerActivity, profile

    from lora_sweep.kernels import metadata, triton_multi_lora_linear

    torch.manual_seed(3)
    seg_lens, ranks, in_f, out_f = [300, 200, 524], [40, 8, 24], 1024, 2048
    x = torch.randn(sum(seg_lens), in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) / in_f ** 0.5
    bias = torch.randn(out_f, device="cuda", dtype=torch.bfloat16)
    lora_a = [(torch.randn(r, in_f, device="cuda") / in_f ** 0.5).requires_grad_(True) for r in ranks]
    lora_b = [(torch.randn(out_f, r, device="cuda") / r ** 0.5).requires_grad_(True) for r in ranks]
    dy = torch.randn(sum(seg_lens), out_f, device="cuda", dtype=torch.bfloat16)
    default = metadata.config_for(max(ranks), True, True)
    assert default.gluon_gemm

    def step(gluon):
        config = dataclasses.replace(default, gluon_gemm=gluon)
        y = triton_multi_lora_linear(x, weight, bias, lora_a, lora_b, [2.0, 1.0, 0.5], [0.0] * 3, seg_lens,
                                     [1, 2, 3], config=config)
        y.backward(dy)
        outs = [y.detach()] + [t.grad.clone() for t in [x] + lora_a + lora_b]
        for t in [x] + lora_a + lora_b:
            t.grad = None
        return outs

    def kernels_run(fn):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return {e.name for e in prof.events()}

    gluon = []
    names = kernels_run(lambda: gluon.extend(step(True)))
    assert "_lora_gemm_gluon_kernel" in names and "_lora_gemm_kernel" not in names
    names = kernels_run(lambda: step(False))
    assert "_lora_gemm_kernel" in names and "_lora_gemm_gluon_kernel" not in names

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(True)
    names = kernels_run(graph.replay)
    assert "_lora_gemm_gluon_kernel" in names and "_lora_gemm_kernel" not in names
    assert all(torch.equal(g, w) for g, w in zip(got, gluon))


def test_graphs_of_the_layer_kept_alive_together_replay_what_eager_computes():
    """Several CUDA graphs of the packed layer (fused or cuBLAS base, dropout, one or two
    passes over dY), captured one after the other and all kept alive, then replayed in turn:
    each replay gives bit for bit what the same call computes eagerly. Under capture the
    adapter gradients run on the backward's second stream, eagerly in line: a side-stream kernel that started before its inputs were written, or a gradient
    read before that stream finished, would show as a difference. The graphs share the
    cached routing and seed tables, built before capture; the caller keeps each graph's
    inputs (x, dY) alive, as CUDA graphs require."""
    from lora_sweep.kernels import metadata, triton_multi_lora_linear

    torch.manual_seed(0)
    seg_lens, ranks, in_f, out_f = [700, 0, 333, 1015], [16, 8, 64, 128], 1024, 1536
    x = torch.randn(sum(seg_lens), in_f, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) / in_f ** 0.5
    lora_a = [(torch.randn(r, in_f, device="cuda") / in_f ** 0.5).requires_grad_(True) for r in ranks]
    lora_b = [(torch.randn(out_f, r, device="cuda") / r ** 0.5).requires_grad_(True) for r in ranks]
    params = [x] + [t for i, t in enumerate(lora_a + lora_b) if seg_lens[i % len(ranks)]]
    fused, cublas = (metadata.config_for(max(ranks), True, fuse_base) for fuse_base in (True, False))
    calls = {"fused_base": (fused, 0.0), "cublas_base": (cublas, 0.0), "dropout": (fused, 0.1),
             "two_passes_over_dy": (dataclasses.replace(fused, one_pass_dy=False), 0.0),
             "one_pass_over_dy": (dataclasses.replace(fused, one_pass_dy=True), 0.0),
             # programmatic dependent launch: the GEMMs start before the shrink or the dS sum ends
             "pdl": (dataclasses.replace(fused, pdl=True), 0.0),
             "pdl_dropout": (dataclasses.replace(fused, pdl=True), 0.1),
             "pdl_two_passes_over_dy": (dataclasses.replace(fused, pdl=True, one_pass_dy=False), 0.0),
             # the fused GEMMs in Triton where the Gluon one would run (Hopper)
             "triton_gemm": (dataclasses.replace(fused, gluon_gemm=False), 0.0),
             "triton_gemm_dropout": (dataclasses.replace(fused, gluon_gemm=False), 0.1),
             "triton_gemm_pdl": (dataclasses.replace(fused, gluon_gemm=False, pdl=True), 0.0)}

    def step(config, p, dy):
        y = triton_multi_lora_linear(x, weight, None, lora_a, lora_b, [2.0, 1.0, 0.5, 4.0], [p] * len(ranks),
                                     seg_lens, [3, 5, 7, 9], config=config)
        y.backward(dy)
        outs = [y.detach()] + [t.grad for t in params]
        for t in params:
            t.grad = None
        return outs

    graphs = {}
    for name, (config, p) in calls.items():
        dy = torch.randn(sum(seg_lens), out_f, device="cuda", dtype=torch.bfloat16)
        want = step(config, p, dy)  # also compiles the kernels and fills the caches before capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(config, p, dy)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = step(config, p, dy)
        graphs[name] = (graph, got, want, dy)
    for _ in range(2):
        for name, (graph, got, want, _) in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(g, w) for g, w in zip(got, want)), name
