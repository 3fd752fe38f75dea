"""Load the base model once and put a `MultiLoRALinear` around each targeted linear layer."""

from __future__ import annotations

import logging
import os
import torch
from torch import nn

from .config import ConfigError, JobSpec
from .layers import FUSABLE_MLPS, FUSABLE_NORMS, FusedGatedMLP, FusedRMSNorm, MultiLoRALinear, SegmentTable
from .quantized import bitsandbytes_config, model_is_quantized

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: JobSpec) -> torch.device:
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec.device)


def resolve_dtype(spec: JobSpec, device: torch.device) -> torch.dtype:
    """bf16 base on CUDA, fp32 on CPU (bf16 matmuls on CPU are slow and gain nothing)."""
    if spec.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[spec.dtype]


def load_base_model(spec: JobSpec, device: torch.device, dtype: torch.dtype, on_meta: bool = False):
    """The frozen base causal LM and its tokenizer, from a hub id, a local dir or a factory.
    With `on_meta` (a hub id or local dir only), the model is built from its config on the meta
    device, no weight read: `distributed.materialize` fills it once it is sharded."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Eager attention on CPU: its per-row results do not depend on how long the other rows
    # of the microbatch are, so an adapter's training is bit-for-bit independent of its
    # pack-mates. SDPA's CPU kernel is not (its reduction depends on the padded length).
    attn = "eager" if device.type == "cpu" else "sdpa"
    if isinstance(spec.base_model, str) and on_meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.base_model), dtype=dtype,
                                                     attn_implementation=attn)
        tokenizer_source = spec.tokenizer if spec.tokenizer is not None else spec.base_model
    elif isinstance(spec.base_model, str):
        quantization = bitsandbytes_config(spec.quantization, dtype)
        placed = {"quantization_config": quantization, "device_map": {"": str(device)}} if quantization else {}
        model = AutoModelForCausalLM.from_pretrained(spec.base_model, dtype=dtype, attn_implementation=attn,
                                                     **placed)
        tokenizer_source = spec.tokenizer if spec.tokenizer is not None else spec.base_model
    else:
        model = spec.base_model()
        if not isinstance(model, nn.Module):
            raise ConfigError(f"The `base_model` factory returned {type(model).__name__}, not a torch model.",
                              field="base_model")
        if not model_is_quantized(model):  # a quantized model keeps its weights' formats
            model = model.to(dtype=dtype)
        model.config._attn_implementation = attn
        tokenizer_source = spec.tokenizer
    if tokenizer_source is None:
        raise ConfigError("`tokenizer` is required when `base_model` is a factory.", field="tokenizer")
    if isinstance(tokenizer_source, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    else:
        tokenizer = tokenizer_source
    if not (on_meta or model_is_quantized(model)):  # bitsandbytes places its layers when it loads them
        model.to(device)
    model.requires_grad_(False)
    model.config.use_cache = False
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def linear_layer_names(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every nn.Linear's last name component -> smallest (in, out) under that name.
    The LM head is left out: it is never adapted."""
    head = model.get_output_embeddings()
    shapes: dict[str, tuple[int, int]] = {}
    for full_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            short = full_name.rsplit(".", 1)[-1]
            dims = (module.in_features, module.out_features)
            shapes[short] = min(shapes.get(short, dims), dims, key=min)
    return shapes


def inject_multi_lora(model: nn.Module, target_modules, segments: SegmentTable) -> dict[str, MultiLoRALinear]:
    """Replace each targeted nn.Linear by a MultiLoRALinear wrapping it, in place.
    Returns full module name -> layer, in model order."""
    available = linear_layer_names(model)
    missing = [t for t in target_modules if t not in available]
    if len(missing) == len(target_modules):
        raise ConfigError(
            f"None of `target_modules` {list(target_modules)} is a linear layer of this model; "
            f"its linear layers are {sorted(available)}.", field="target_modules")
    if missing:
        logger.warning("target_modules %s not found in the model; adapting %s", missing,
                       [t for t in target_modules if t in available])
    layers: dict[str, MultiLoRALinear] = {}
    targets = set(target_modules)
    for full_name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in targets and isinstance(child, nn.Linear):
                name = f"{full_name}.{child_name}" if full_name else child_name
                layer = MultiLoRALinear(child, segments, layer_index=len(layers))
                setattr(module, child_name, layer)
                layers[name] = layer
    segments.num_layers = len(layers)
    return layers


def swap_children(model: nn.Module, swap) -> int:
    """Replace, in place, every submodule for which `swap(module)` returns a module by that
    module. Returns how many were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            replacement = swap(child)
            if replacement is not None:
                setattr(parent, name, replacement)
                count += 1
    return count


def fuse_rms_norms(model: nn.Module) -> int:
    """Replace the model's frozen RMSNorms of the kinds in `FUSABLE_NORMS` by `FusedRMSNorm`,
    in place. Returns how many were replaced."""
    return swap_children(model, lambda m: FusedRMSNorm(m) if type(m).__name__ in FUSABLE_NORMS
                          and not m.weight.requires_grad else None)


def fuse_gated_mlps(model: nn.Module) -> int:
    """Replace the model's gated MLPs of the kinds in `FUSABLE_MLPS` whose activation is SiLU
    (torch's or transformers' class) by `FusedGatedMLP`, in place, after `inject_multi_lora`
    (the fused MLP calls whatever projections it finds). Returns how many were replaced."""
    silu = ("SiLU", "SiLUActivation")
    return swap_children(model, lambda m: FusedGatedMLP(m) if type(m).__name__ in FUSABLE_MLPS
                          and type(getattr(m, "act_fn", None)).__name__ in silu else None)


def split_causal_lm(model: nn.Module) -> tuple[nn.Module, torch.Tensor]:
    """The decoder body (hidden states out) and the LM head weight, so the loss can be computed
    in row chunks instead of through full [tokens, vocab] logits."""
    body = getattr(model, model.base_model_prefix, None)
    head = model.get_output_embeddings()
    if body is None or head is None or getattr(head, "bias", None) is not None:
        raise ConfigError(f"{type(model).__name__} is not a causal LM with a bias-free output head.",
                          field="base_model")
    return body, head.weight

