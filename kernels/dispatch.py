"""Which path a kernel call takes: Triton on CUDA tensors, the torch reference elsewhere.

One switch for every op in this package, so a run never mixes the two paths by accident:
`LORA_SWEEP_KERNELS=torch` forces the references (for A/B runs and debugging), and a
machine without Triton, or a GPU older than Ampere, falls back to them with one warning.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

# The kernels' MMAs take bf16 or fp16 operands on tensor cores from Ampere (8.0) on. Compiled
# for a T4 (7.5) or a V100 (7.0), their bf16 dots fall back to scalar code that spills
# registers, and one pass needs more shared memory than a T4 has
# (tests/test_kernels_compile.py checks the GPUs from Ampere on).
MIN_CAPABILITY = (8, 0)


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the ops of this package run their Triton kernels for `x`: on a CUDA GPU of
    compute capability `MIN_CAPABILITY` or newer, unless `LORA_SWEEP_KERNELS=torch` or
    Triton is not installed."""
    if not x.is_cuda or os.environ.get("LORA_SWEEP_KERNELS", "") == "torch":
        return False
    return _triton_runs_on(x.device)


@functools.lru_cache(maxsize=None)
def _triton_runs_on(device: torch.device) -> bool:
    """Whether Triton is installed and `device` is new enough; each reason to fall back warns once."""
    try:
        import triton  # noqa: F401
    except ImportError:
        warnings.warn("Triton is not installed (`pip install lora-sweep[triton]`): using the torch references of the "
                      "kernels.")
        return False
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        warnings.warn(f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}; "
                      f"the Triton kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: using the torch "
                      "references of the kernels.")
        return False
    return True
