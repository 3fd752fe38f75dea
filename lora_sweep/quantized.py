"""A quantized base (QLoRA): bitsandbytes' 4-bit and 8-bit linear layers under the packed adapters.

A `MultiLoRALinear` whose base layer is bitsandbytes' `Linear4bit` (NF4 or FP4) or
`Linear8bitLt` dequantises its weight once per forward for the whole pack (`dequantize`) and
hands the result to the same kernels as a bf16 base: W = dequant(W_q) in the compute dtype,
Y = x W^T + b + the adapters' terms. The dequantised weight is not kept for the backward
(`recomputed_in_backward`): the backward dequantises again, so a layer's full-precision
weight lives only while that layer runs, as in bitsandbytes' own matmul.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import Any

import torch
from torch import nn

from .config import ConfigError

QUANTIZED_LINEARS = ("Linear4bit", "Linear8bitLt")  # bitsandbytes' module classes


def is_quantized(layer: nn.Module) -> bool:
    """Whether `layer` is one of bitsandbytes' quantized linear layers."""
    return any(c.__name__ in QUANTIZED_LINEARS for c in type(layer).__mro__)


def model_is_quantized(model: nn.Module) -> bool:
    return any(is_quantized(m) for m in model.modules())


def bitsandbytes_config(quantization: Any, dtype: torch.dtype):
    """transformers' `BitsAndBytesConfig` of `JobSpec.quantization`: "nf4" and "fp4" are 4-bit
    with `dtype` as their compute dtype, "int8" is LLM.int8(); a `BitsAndBytesConfig` is used
    as it is; None gives None."""
    if quantization is None:
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"quantization={quantization!r} needs bitsandbytes: pip install 'lora-sweep[quantization]'.",
                          field="quantization")
    from transformers import BitsAndBytesConfig

    if not isinstance(quantization, str):
        return quantization
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_compute_dtype=dtype)


def dequantize(layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The [out, in] weight of a bitsandbytes linear layer in `dtype`."""
    import bitsandbytes.functional as bnbf

    weight = layer.weight
    if type(weight).__name__ == "Params4bit" or getattr(weight, "quant_state", None) is not None:
        if getattr(weight.quant_state, "packing_format_for_cpu", False):
            # repacked by bitsandbytes' CPU inference forward: back to the layout its
            # dequantisation reads, as bitsandbytes itself does before saving or moving it
            weight.data, weight.quant_state = bnbf._convert_weight_packed_for_cpu_inverse(weight.data,
                                                                                          weight.quant_state)
        return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    scales = getattr(weight, "SCB", None)
    if scales is None:
        scales = getattr(layer.state, "SCB", None)
    if weight.dtype != torch.int8 or scales is None:  # not quantized yet (still on the host, say)
        return weight.data.to(dtype)
    return (weight.data.float() * (scales.float()[:, None] / 127.0)).to(dtype)


@contextlib.contextmanager
def recomputed_in_backward(layer: nn.Module, weight: torch.Tensor):
    """Inside, autograd saves no tensor that shares `weight`'s memory: it saves how to get it
    back (dequantising `layer` again, then the same view) and does so in the backward."""
    # the hooks hold the weight's device and address, never the weight itself: autograd keeps
    # them until the backward, and a reference there would keep every layer's dequantised
    # weight alive from its forward to its backward
    device, storage = weight.device, weight.untyped_storage().data_ptr()

    def pack(t: torch.Tensor):
        if t.device == device and t.untyped_storage().data_ptr() == storage:
            return ("dequantized", t.shape, t.stride(), t.storage_offset(), t.dtype)
        return t

    def unpack(saved):
        if isinstance(saved, tuple) and saved and saved[0] == "dequantized":
            _, shape, stride, offset, dtype = saved
            return dequantize(layer, dtype).as_strided(shape, stride, offset)
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
