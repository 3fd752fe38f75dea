"""Fused multi-LoRA kernels and their plain torch references.

`multi_lora_linear` is the public entry point: the Triton kernels on CUDA, the torch
reference elsewhere or when `LORA_SWEEP_KERNELS=torch`. `triton_multi_lora_linear` runs the
Triton path explicitly (CPU tensors too, under TRITON_INTERPRET=1). Triton is imported only
when its path runs, so the reference works without it.

`per_adapter_lm_loss` is the chunked LM head + cross-entropy: per-adapter token-loss sums
without materialising the [tokens, vocab] logits (its cross-entropy in one Triton kernel on
CUDA). `rms_norm` is a frozen model's RMSNorm and `silu_mul` a gated MLP's SiLU(gate) * up,
each one kernel each way (Triton on CUDA, as `uses_triton` decides).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .dispatch import uses_triton
from .dropout import dropout_keep_mask
from .lm_loss import per_adapter_lm_loss, reference_per_adapter_lm_loss
from .reference import Seeds, reference_multi_lora_linear, reference_rms_norm, reference_silu_mul


def multi_lora_linear(
    x: torch.Tensor,  # [tokens, in], adapters' rows contiguous in adapter order
    weight: torch.Tensor,  # [out, in], frozen
    bias: Optional[torch.Tensor],  # [out] or None, frozen
    lora_a: Sequence[Optional[torch.Tensor]],  # each [r_i, in], or None: no LoRA on that segment
    lora_b: Sequence[Optional[torch.Tensor]],  # each [out, r_i], or None
    scales: Sequence[float],
    dropout_p: Sequence[float],
    seg_lens: Sequence[int],  # rows per adapter, sum == tokens, zeros allowed
    seed: Seeds = 0,
    frame=None,  # a `frame.TableFrame` whose current layout is `seg_lens`: the Triton path's tables
) -> torch.Tensor:
    """`x @ weight.T + bias` plus `scale_i * dropout_i(x_i) @ A_i.T @ B_i.T` on segment i,
    differentiable in x, A_i and B_i. See `reference_multi_lora_linear` for the semantics."""
    if uses_triton(x):
        from .multi_lora import triton_multi_lora_linear

        return triton_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seed,
                                        frame=frame)
    return reference_multi_lora_linear(x, weight, bias, lora_a, lora_b, scales, dropout_p, seg_lens, seed)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm with a frozen weight: `reference_rms_norm` in two Triton
    kernels on CUDA, the reference itself elsewhere."""
    if uses_triton(x):
        from .rmsnorm import rms_norm as run

        return run(x, weight, eps)
    return reference_rms_norm(x, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's SiLU(gate) * up: `reference_silu_mul` in one Triton kernel each way on
    CUDA, the reference itself elsewhere."""
    if uses_triton(gate):
        from .swiglu import silu_mul as run

        return run(gate, up)
    return reference_silu_mul(gate, up)


def triton_multi_lora_linear(*args, **kwargs) -> torch.Tensor:
    """The Triton path explicitly (see `multi_lora.triton_multi_lora_linear`)."""
    from .multi_lora import triton_multi_lora_linear as run

    return run(*args, **kwargs)


__all__ = [
    "multi_lora_linear",
    "uses_triton",
    "triton_multi_lora_linear",
    "reference_multi_lora_linear",
    "dropout_keep_mask",
    "per_adapter_lm_loss",
    "reference_per_adapter_lm_loss",
    "rms_norm",
    "silu_mul",
]
