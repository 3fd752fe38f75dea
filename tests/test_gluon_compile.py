"""The Gluon GEMM compiled for Hopper (sm_90) on this machine, with no GPU.

Gluon kernels do not run under TRITON_INTERPRET=1, so CI cannot check the Gluon GEMM's
results (the GPU tests do). It can check that the installed Triton still compiles it: Gluon
is experimental and renames its calls between releases (3.9 renamed three), and a release
the kernel was not written for should fail here rather than on a user's GPU. The compiled
kernel must also keep within what was measured: the register budget it is launched with,
no spills to local memory, and shared memory within a Hopper block's 227 KB.

The compiler runs in a process of its own, with an empty cache (`compile_offline`).
"""

from __future__ import annotations

import json

import pytest
from compile_offline import compile_in_fresh_process, resource_usage

HOPPER_SHARED_BYTES = 227 * 1024  # a block's shared memory at most on sm_90 (opt-in)
# forward, out_dropout, has_bias, ranks per LoRA step (16: the unmasked term's operands in two
# buffers in the output tile's; 64: through the K steps' ring, `lora_in_ring`, with the wgmmas
# 16 and 32 deep that an adapter of a smaller rank takes)
VARIANTS = {"Y": (True, False, False, 16), "Y_bias": (True, False, True, 16), "dX": (False, False, False, 16),
            "dX_dropout": (False, True, False, 16), "Y_rank_step_64": (True, False, False, 64),
            "dX_rank_step_64": (False, False, False, 64)}


def compile_for_hopper(forward: bool, out_dropout: bool, has_bias: bool, r_step: int):
    """`_lora_gemm_gluon_kernel` compiled for sm_90 with the descriptors `lora_gemm_gluon` builds."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from lora_sweep.kernels import lora_gemm_gluon as g

    M, K, N, block_m = 256, 128, 512, 128
    bf16 = dict(dtype=torch.bfloat16)
    tensors = (torch.empty(M, K, **bf16), torch.empty((N, K) if forward else (K, N), **bf16),
               torch.empty(M, N, **bf16), torch.empty(M, r_step, **bf16), torch.empty(r_step, N, **bf16))
    descs = dict(zip(("a_desc", "w_desc", "c_desc", "s_desc", "l_desc"),
                     g.launch_descriptors(*tensors, forward, block_m, r_step)))
    pointers = dict(bias_ptr="*bf16", mask_ptr="*u8", block_tiles_ptr="*i64", tiles_ptr="*i64",
                    adapters_i_ptr="*i64", adapters_f_ptr="*fp32")
    constants = dict(FORWARD=forward, OUT_DROPOUT=out_dropout, HAS_BIAS=has_bias, STAGES=g.STAGES, GROUP_M=8,
                     PDL=True, LORA_SLOTS=g.lora_slots(r_step, block_m), LORA_IN_RING=g.lora_in_ring(r_step, block_m),
                     num_warps=g.NUM_WARPS)
    kernel = g._lora_gemm_gluon_kernel
    signature = {name: mangle_type(descs[name]) if name in descs else pointers.get(name)
                 or ("constexpr" if name in constants else "i32") for name in kernel.arg_names}
    source = GluonASTSource(kernel, signature, {(kernel.arg_names.index(k),): v for k, v in constants.items()}, {})
    return triton.compile(source, target=GPUTarget("cuda", 90, 64),
                          options=dict(num_warps=g.NUM_WARPS, maxnreg=g.MAX_REGISTERS, **g.LAUNCH_OPTIONS))


@pytest.fixture(scope="module")
def usage_by_variant() -> dict:
    pytest.importorskip("triton")
    from lora_sweep.kernels import lora_gemm_gluon
    from lora_sweep.kernels.metadata import gluon_release

    import triton

    if lora_gemm_gluon.gluon is None or not gluon_release(triton.__version__):
        pytest.skip("the Gluon GEMM is used only with the Triton releases it was checked with")
    return compile_in_fresh_process(__file__, timeout=600)  # afresh: a cached kernel would hide a rename


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gluon_gemm_compiles_for_hopper_within_its_budget(usage_by_variant, variant):
    from lora_sweep.kernels.lora_gemm_gluon import MAX_REGISTERS

    usage = usage_by_variant[variant]
    assert 0 < usage["SHARED"] <= HOPPER_SHARED_BYTES
    assert int(usage["REG"]) <= MAX_REGISTERS
    assert int(usage["STACK"]) == 0 and int(usage["LOCAL"]) == 0, f"the kernel spills: {usage}"


if __name__ == "__main__":  # the compiling process of `usage_by_variant`: one JSON line
    print(json.dumps({name: resource_usage(compile_for_hopper(*flags)) for name, flags in VARIANTS.items()}))
