"""The dropout mask of the LoRA branch, drawn from a seed.

Placeholder generator: torch's CPU generator seeded per call. It is replaced by a
counter-based (Philox) mask that the Triton kernels reproduce in registers.
"""

from __future__ import annotations

import torch


def dropout_keep_mask(seed: int, rows: int, cols: int, p: float, device=None) -> torch.Tensor:
    """Boolean keep-mask [rows, cols]: True with probability 1 - p, a pure function of `seed`."""
    g = torch.Generator().manual_seed(int(seed))
    return (torch.rand(rows, cols, generator=g) >= p).to(device)
