"""The Triton kernels compiled for the GPUs they run on (`dispatch.MIN_CAPABILITY` on: an
A100, an L4 or RTX 40, an H100, a B200, an RTX 50), on this machine, with no GPU.

CI checks the kernels' results under the interpreter, which says nothing of what the
compiler makes of them for a real GPU: whether a program's shared memory fits the device,
whether its registers spill, whether the loads of the big operands are pipelined. Here a
fused layer's real forward and backward, and the fused norm, SwiGLU and cross-entropy, run
on CPU tensors, with Triton's driver replaced by one that compiles each launch for a chosen
GPU and launches nothing (Triton's `warmup`), and with the device queries the launch sizes
depend on (capability, SMs, shared memory) answered as that GPU would.

Before Hopper there is no TMA, and Triton turns a TMA descriptor's loads into plain loads
that it does not pipeline; so there the kernels must take the paths without descriptors
(`metadata.has_tma`). The fused base GEMM's accumulator spills without a warpgroup MMA
(Hopper's, datacenter Blackwell's), so elsewhere the base GEMM is cuBLAS's
(`metadata.fuses_base`). Loads of dY that feed a transposed dot (the pass over dY, dB's
reduction) are not pipelined without TMA either; those loops stream 32 KB a step and are
left as they are, unmeasured on those GPUs. The compiler runs in a process of its own, with
an empty cache (`compile_offline`).
"""

from __future__ import annotations

import concurrent.futures
import json
import sys

import pytest
from compile_offline import compile_in_fresh_process, resource_usage

# capability -> (a GPU of that kind, its SMs, its shared memory per block, opt-in, in bytes)
GPUS = {80: ("A100", 108, 166912), 89: ("L4", 58, 101376), 90: ("H100", 132, 232448), 100: ("B200", 148, 232448),
        120: ("RTX 5090", 170, 101376)}
# (in, out, tokens, ranks, dropout): one pass over dY for dS and dB (rank 16), and two passes
# with mixed ranks up to 128, uneven segments and a rank that no block divides
PACKS = [(512, 1024, 1024, (16, 16, 16, 16), 0.05), (384, 768, 1000, (8, 128, 37, 64, 1), 0.1)]
# ptxas keeps the in-place LoRA add at 128 registers for sm_89 and spills 16 bytes there
MAX_SPILL_BYTES = 16


def compile_fused_layer(capability: int) -> dict:
    """Every kernel a fused layer's fwd+bwd launches for the GPU of `capability` (`GPUS`),
    compiled for it (`kernels`: name, shared memory, registers, spills, TMA descriptors,
    cp.async); on Hopper also the kernels the same layer compiled anew when run again at
    other token counts (`recompiled_for_new_lengths`)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from lora_sweep.kernels import lora_gemm, metadata
    from lora_sweep.kernels.multi_lora import triton_multi_lora_linear
    from lora_sweep.kernels.pack import pack_adapters
    from lora_sweep.kernels.shrink import lora_shrink
    from lora_sweep.kernels.cross_entropy import cross_entropy_rows
    from lora_sweep.kernels.rmsnorm import rms_norm
    from lora_sweep.kernels.swiglu import silu_mul

    _, n_sms, shared_bytes = GPUS[capability]

    class CompileOnly:  # Triton's driver for a GPU that is not here
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(CompileOnly())
    compiled = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((kernel, kwargs.get("LOOPED", False)))
        return kernel

    JITFunction.run = compile_only
    metadata.gpu_capability = lambda: divmod(capability, 10)
    metadata.has_tma = lambda device: capability >= 90  # the tensors here are on the CPU
    metadata.sm_count = lora_gemm.sm_count = lambda device: n_sms
    metadata.shared_memory_per_program = lambda device: shared_bytes

    def fused_layer(in_f, out_f, tokens, ranks, p):  # forward and backward, equal segments
        n = len(ranks)
        x = torch.randn(tokens, in_f, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(out_f, in_f, dtype=torch.bfloat16)
        lora_a = [torch.randn(r, in_f, requires_grad=True) for r in ranks]
        lora_b = [torch.randn(out_f, r, requires_grad=True) for r in ranks]
        seg_lens = [tokens // n] * (n - 1) + [tokens - tokens // n * (n - 1)]
        config = metadata.config_for(max(ranks), True, metadata.fuses_base(torch.device("cuda"), 2))  # as on such a GPU
        y = triton_multi_lora_linear(x, weight, None, lora_a, lora_b, [2.0] * n, [p] * n, seg_lens,
                                     torch.arange(n), config=config)
        y.backward(torch.ones_like(y))
        return x, y, lora_a, lora_b, seg_lens, config

    for in_f, out_f, tokens, ranks, p in PACKS:
        n = len(ranks)
        x, y, lora_a, lora_b, seg_lens, config = fused_layer(in_f, out_f, tokens, ranks, p)
        if capability == 90:  # the shrinks beside the Gluon GEMM, which runs on Hopper (`multi_lora._shrink_beside`)
            meta = metadata.LoRABatchMeta.build(seg_lens, lora_a, lora_b, [2.0] * n, [0.0] * n, list(range(n)),
                                                in_f, out_f, x.device, config)
            a_pack, bt_pack = pack_adapters(lora_a, lora_b, torch.bfloat16)
            s = x.new_empty(tokens, meta.rank_stride)
            lora_shrink(x.detach(), a_pack, s, meta, apply_scale=False, dropout=False, programs=n_sms // 32)
            lora_shrink(torch.ones_like(y), bt_pack, s, meta, apply_scale=True, dropout=False, programs=n_sms // 32)
    gate = torch.randn(256, 1024, dtype=torch.bfloat16, requires_grad=True)
    silu_mul(gate, torch.randn_like(gate)).sum().backward()
    h = torch.randn(256, 2048, dtype=torch.bfloat16, requires_grad=True)
    rms_norm(h, torch.randn(2048, dtype=torch.bfloat16), 1e-6).sum().backward()
    cross_entropy_rows(torch.randn(64, 128256, dtype=torch.bfloat16), torch.randint(0, 128256, (64,)), need_grad=True)

    recompiled = []
    if capability == 90:  # the first pack again at other lengths of as many row blocks: nothing new to compile
        seen, first_new = {id(kernel) for kernel, _ in compiled}, len(compiled)
        in_f, out_f, _, ranks, p = PACKS[0]
        for tokens in (1000, 1008):  # not a multiple of 16, then one, after the 1024 above
            fused_layer(in_f, out_f, tokens, ranks, p)
        recompiled = sorted({kernel.name for kernel, _ in compiled[first_new:] if id(kernel) not in seen})
        del compiled[first_new:]

    rows = []
    for kernel, looped in compiled:
        usage = resource_usage(kernel)
        rows.append(dict(name=kernel.name, looped=looped, shared=usage["SHARED"], regs=int(usage["REG"]),
                         spills=int(usage["STACK"]) + int(usage["LOCAL"]),
                         descriptors=any(str(t).startswith("tensordesc") for t in kernel.src.signature.values()),
                         cp_async="cp.async" in kernel.asm["ptx"]))
    return {"kernels": rows, "recompiled_for_new_lengths": recompiled}


@pytest.fixture(scope="module")
def compiles():
    """Every GPU's compile, started at once, two at a time (CI's two cores): each is one
    single-threaded process of its own."""
    pytest.importorskip("triton")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield {c: pool.submit(compile_in_fresh_process, __file__, str(c)) for c in sorted(GPUS)}


@pytest.fixture(scope="module", params=sorted(GPUS))
def kernels_for(request, compiles) -> tuple[int, list[dict]]:
    return request.param, compiles[request.param].result()["kernels"]


def test_a_step_of_a_new_length_compiles_no_kernel(compiles):
    # the integers that follow a step's tokens are not specialised (`kernels/metadata.py`):
    # 1000 tokens (not a multiple of 16), then 1008, run the kernels compiled for 1024
    assert compiles[90].result()["recompiled_for_new_lengths"] == []


def test_every_kernel_fits_the_gpus_shared_memory_and_registers(kernels_for):
    capability, rows = kernels_for
    names = {r["name"] for r in rows}
    assert {"_pack_kernel", "_shrink_kernel", "_split_sum_kernel", "_row_reduce_kernel", "_ds_db_kernel",
            "_silu_mul_fwd_kernel", "_rms_norm_bwd_kernel", "_cross_entropy_kernel"} <= names
    for r in rows:
        assert 0 <= r["shared"] <= GPUS[capability][2], r
        assert r["spills"] <= MAX_SPILL_BYTES, r


def test_the_base_gemm_is_fused_only_with_a_warpgroup_mma(kernels_for):
    capability, rows = kernels_for
    names = {r["name"] for r in rows}
    gemms = [r for r in rows if r["name"] in ("_lora_gemm_kernel", "_lora_gemm_gluon_kernel")]
    if capability in (90, 100):  # Triton's or Gluon's GEMM with the LoRA term, its operands through TMA
        assert gemms and all(r["descriptors"] for r in gemms)
    else:  # cuBLAS's GEMM, the LoRA term added in place
        assert not gemms and "_lora_add_kernel" in names


def test_before_hopper_no_kernel_reads_through_tma_and_the_shrinks_are_pipelined(kernels_for):
    capability, rows = kernels_for
    if capability >= 90:
        pytest.skip("TMA from Hopper on")
    assert not any(r["descriptors"] for r in rows)
    assert all(r["cp_async"] for r in rows if r["name"] == "_shrink_kernel")


def test_the_shrinks_beside_the_gemm_fit_and_are_pipelined(kernels_for):
    # on Hopper, a few programs each stream whole tiles with as many stages as fit
    # (`metadata.beside_stages`): most of the SM's shared memory
    capability, rows = kernels_for
    looped = [r for r in rows if r["looped"]]
    assert bool(looped) == (capability == 90)
    assert all(r["name"] == "_shrink_kernel" and r["cp_async"] and r["shared"] > GPUS[capability][2] // 2
               for r in looped)


if __name__ == "__main__":  # the compiling process of `kernels_for`: one JSON line
    print(json.dumps(compile_fused_layer(int(sys.argv[1]))))
