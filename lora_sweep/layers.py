"""`MultiLoRALinear`: a frozen linear layer that owns many LoRA adapters at once.

Each adapter is added only to its own rows of the input. Which rows belong to which
adapter is the `SegmentTable`, shared by every layer of the model and set once per
microbatch by the engine, so the model's forward signature stays untouched.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import nn

from .data import to_device
from .kernels import multi_lora_linear, rms_norm, silu_mul, uses_triton
from .quantized import dequantize, is_quantized, recomputed_in_backward


@dataclass
class SegmentTable:
    """Row layout of the current microbatch: adapter `names[i]` owns the next `tokens[i]`
    rows of the flattened [batch * seq, features] input. Its dropout masks are seeded by its
    trial seed `seeds[i]`, its own micro-step count `steps[i]` and the layer index, so they
    do not depend on pack-mates. An empty table means "no adapters": layers compute the base
    output only."""

    names: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    num_layers: int = 0  # MultiLoRALinear layers reading this table (set when they are made)
    # the kernels' tables of a CUDA graph's step (`kernels.frame.TableFrame`), whose current
    # layout is `tokens`; None: tables of the layout itself
    frame: object = None
    _layer_seeds: dict = field(default_factory=dict, repr=False)

    def set(self, names, tokens, steps=None, seeds=None, frame=None) -> None:
        self.names, self.tokens = list(names), [int(t) for t in tokens]
        self.steps = [int(s) for s in steps] if steps is not None else [0] * len(self.names)
        self.seeds = [int(s) for s in seeds] if seeds is not None else [0] * len(self.names)
        self.frame = frame
        self._layer_seeds = {}

    def clear(self) -> None:
        self.set([], [])

    def dropout_seeds(self, layer_index: int, device: Optional[torch.device] = None):
        """Layer `layer_index`'s dropout seed of every adapter: ints, or with a `device` an
        int64 tensor there. Computed for all layers at once per microbatch and copied to the
        device once, not once per layer."""
        if device not in self._layer_seeds:
            table = layer_seed_table(self.seeds, self.steps, max(self.num_layers, layer_index + 1))
            self._layer_seeds[device] = table.tolist() if device is None else to_device(torch.from_numpy(table),
                                                                                        torch.int64, device)
        return self._layer_seeds[device][layer_index]

    def read_seeds_from(self, rows: torch.Tensor) -> None:
        """Give layer l the dropout seeds in `rows[l]` (int64 [num_layers, adapters] on the
        layers' device, `layer_seed_table`'s values) instead of computing them. A CUDA graph
        captures the reads of `rows`; its owner refills them before every replay."""
        self._layer_seeds = {rows.device: rows}


# The name of the rows after a step's samples that a CUDA graph pads its tokens with: no
# adapter has it (adapter names are word characters), so they get the base layer alone.
PADDING_SEGMENT = "<padding>"


def layer_seed_table(seeds, steps, num_layers: int) -> np.ndarray:
    """int64 [num_layers, adapters]: layer l's dropout seed of each adapter of trial seed
    `seeds[i]` at micro-step `steps[i]` (`mix_seed`)."""
    layers = np.arange(num_layers)[:, None]
    return mix_seed(np.array(seeds, dtype=np.int64)[None, :], layers, np.array(steps, dtype=np.int64)[None, :])


def mix_seed(*parts):
    """A 31-bit seed from integers (splitmix64 rounds): each (trial seed, layer, step) gets
    its own dropout stream, independent of which other adapters share the microbatch.
    Integers give an int; numpy arrays broadcast and give an int64 array."""
    h = np.full(np.broadcast_shapes(*(np.shape(p) for p in parts)) or (1,), 0x9E3779B97F4A7C15, dtype=np.uint64)
    for p in parts:  # uint64 arithmetic wraps modulo 2**64, as the splitmix64 rounds need
        h = (h ^ (np.asarray(p, dtype=np.int64).astype(np.uint64))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    seeds = (h & np.uint64(0x7FFFFFFF)).astype(np.int64)
    return int(seeds.reshape(-1)[0]) if all(np.ndim(p) == 0 for p in parts) else seeds


def _linear_holding(weight: torch.Tensor) -> nn.Linear:
    """A bias-free `nn.Linear` whose weight is `weight`, built without nn.Linear's own
    initialisation: constructing a pack's thousands of small layers the usual way (even
    through `skip_init`) cost about 0.3 ms each, a second for 16 adapters on a 1B model."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = weight.shape[1], weight.shape[0]
    layer.weight = nn.Parameter(weight)
    layer.register_parameter("bias", None)
    return layer


class MultiLoRALinear(nn.Module):
    """A frozen `nn.Linear` plus any number of LoRA adapters of different ranks.

    Adapter `name` adds `scaling * lora_B(lora_A(dropout(x)))` to the rows the shared
    `SegmentTable` gives it, as PEFT's `LoraLayer` does for a whole batch. The state-dict
    names are PEFT's: `base_layer.weight`, `lora_A.<name>.weight`, `lora_B.<name>.weight`.
    The work itself is `lora_sweep.kernels.multi_lora_linear` (Triton on CUDA, the torch
    reference elsewhere). The base may be a bitsandbytes 4-bit or 8-bit layer (QLoRA), whose
    weight is dequantised once per forward for the whole pack (`quantized.py`).
    """

    adapter_layer_names = ("lora_A", "lora_B")
    other_param_names = ("scaling", "lora_dropout")

    def __init__(self, base_layer: nn.Linear, segments: SegmentTable, layer_index: int):
        super().__init__()
        self.base_layer = base_layer
        self.base_layer.requires_grad_(False)
        self.quantized = is_quantized(base_layer)  # bitsandbytes' 4-bit or 8-bit layer (quantized.py)
        self.segments = segments
        self.layer_index = layer_index
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.lora_dropout: dict[str, float] = {}
        # name -> (A weight, B weight, scaling, dropout): what forward reads for every adapter
        # of every microbatch, in one dict lookup
        self._adapters: dict[str, tuple] = {}

    def add_adapter(self, name: str, rank: int, scaling: float, dropout: float,
                    generator: torch.Generator, dtype: torch.dtype) -> None:
        """PEFT's default init: A Kaiming-uniform (a=sqrt(5)) from `generator`, B zeros. A is
        drawn in fp32 on the generator's device (the engine's: a CPU draw of a whole pack's A
        matrices took seconds), then cast to `dtype`."""
        device = self.base_layer.weight.device
        # Same bound as nn.init.kaiming_uniform_(a=sqrt(5)), drawn from the trial's own generator.
        bound = 1.0 / math.sqrt(self.in_features)
        a = torch.empty(rank, self.in_features, device=generator.device, dtype=torch.float32)
        a = a.uniform_(-bound, bound, generator=generator).to(device, dtype)
        lora_a = _linear_holding(a)
        lora_b = _linear_holding(torch.zeros(self.out_features, rank, device=device, dtype=dtype))
        self.lora_A[name] = lora_a
        self.lora_B[name] = lora_b
        self.scaling[name] = float(scaling)
        self.lora_dropout[name] = float(dropout)
        self._adapters[name] = (lora_a.weight, lora_b.weight, float(scaling), float(dropout))

    def rename_adapter(self, name: str, new_name: str) -> None:
        """Adapter `name`, its weights and settings as they are, is `new_name` from now on; a
        layer without it is left alone."""
        if name not in self._adapters:
            return
        for attr in self.adapter_layer_names:
            getattr(self, attr)[new_name] = getattr(self, attr).pop(name)
        for attr in self.other_param_names:
            getattr(self, attr)[new_name] = getattr(self, attr).pop(name)
        self._adapters[new_name] = self._adapters.pop(name)

    def delete_adapter(self, name: str) -> None:
        for attr in self.adapter_layer_names:
            if name in getattr(self, attr):
                del getattr(self, attr)[name]
        for attr in self.other_param_names:
            getattr(self, attr).pop(name, None)
        self._adapters.pop(name, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.segments
        if not table.names:
            return self._base_product(x)
        lead, flat = x.shape[:-1], x.reshape(-1, self.in_features)  # (tokens, in)
        none = (None, None, 0.0, 0.0)  # an adapter that does not target this layer
        lora_a, lora_b, scales, dropout_p = zip(*(self._adapters.get(name, none) for name in table.names))
        if not self.training:
            dropout_p = (0.0,) * len(dropout_p)
        weight, saved = self._base_weight(x)
        with saved:
            out = multi_lora_linear(flat, weight, self.base_layer.bias, lora_a, lora_b, scales, dropout_p,
                                    table.tokens,
                                    table.dropout_seeds(self.layer_index, x.device if uses_triton(x) else None),
                                    frame=table.frame)
        return out.reshape(*lead, self.out_features)

    def _base_weight(self, x: torch.Tensor) -> tuple[torch.Tensor, contextlib.AbstractContextManager]:
        """The base's weight for `x`'s product, and the context to run that product in. A
        quantized weight is dequantised once for the whole pack, in `x`'s dtype, and again in
        the backward rather than kept (`recomputed_in_backward`)."""
        if not self.quantized:
            return self.base_layer.weight, contextlib.nullcontext()
        weight = dequantize(self.base_layer, x.dtype)
        return weight, recomputed_in_backward(self.base_layer, weight)

    def _base_product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b with no adapter. A quantized weight is dequantised as in a pack's forward:
        bitsandbytes' own 4-bit forward, on a CPU with AVX512-BF16 in eval mode, repacks the
        weight in place into a layout only its inference kernel reads."""
        if not self.quantized:
            return self.base_layer(x)
        weight, saved = self._base_weight(x)
        bias = self.base_layer.bias
        with saved:
            return nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, adapters={list(self.lora_A)}"


class FusedRMSNorm(nn.Module):
    """A frozen transformers RMSNorm (`FUSABLE_NORMS`) computed by `kernels.rms_norm`: one
    kernel each way on CUDA instead of about sixteen fp32 elementwise passes, the same
    formula elsewhere. It keeps the wrapped module's `weight` and `variance_epsilon` under
    their own names, so the model's state dict does not change; `original` is the module it
    replaced."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.weight = original.weight
        self.variance_epsilon = float(original.variance_epsilon)
        self.__dict__["original"] = original  # not a submodule: no second copy of `weight` in the state dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


# transformers' RMSNorms that compute weight * bf16(x * rsqrt(mean(x^2) + eps)); others (Gemma's
# 1 + weight, for one) keep their own forward
FUSABLE_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "Qwen2MoeRMSNorm")


class FusedGatedMLP(nn.Module):
    """A transformers gated MLP with SiLU (`FUSABLE_MLPS`) whose `act_fn(gate) * up` is
    `kernels.silu_mul`: one kernel each way on CUDA instead of five passes over the model's
    widest activations, the same formula elsewhere. `gate_proj`, `up_proj` and `down_proj`
    stay its children under their own names (adapted or not), so the state dict does not
    change; `original` is the module it replaced."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = original.gate_proj, original.up_proj, original.down_proj
        self.__dict__["original"] = original  # not a submodule: no second copy of the projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


# transformers' MLPs whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x))
FUSABLE_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
