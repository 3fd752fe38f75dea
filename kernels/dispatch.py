"""Which path a kernel call takes: Triton on CUDA tensors, the torch reference elsewhere.

One switch for every op in this package, so a run never mixes the two paths by accident:
`LORA_SWEEP_KERNELS=torch` forces the references (for A/B runs and debugging), and a
machine without Triton falls back to them with one warning.
"""

from __future__ import annotations

import os
import warnings

import torch

_warned_no_triton = False


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the ops of this package run their Triton kernels for `x`: on CUDA, unless
    `LORA_SWEEP_KERNELS=torch` or Triton is not installed."""
    global _warned_no_triton
    if not x.is_cuda or os.environ.get("LORA_SWEEP_KERNELS", "") == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        if not _warned_no_triton:
            warnings.warn("Triton is not installed (`pip install lora-sweep[triton]`): "
                          "using the torch references of the kernels.")
            _warned_no_triton = True
        return False
    return True
