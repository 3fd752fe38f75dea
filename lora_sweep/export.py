"""Save one adapter as a PEFT LoRA directory: `adapter_config.json` and
`adapter_model.safetensors` with PEFT's key names, loadable by `PeftModel.from_pretrained`."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from .config import TrialConfig


def peft_key(module_name: str, which: str) -> str:
    """PEFT's saved name for `lora_A`/`lora_B` of `module_name` (the adapter name is dropped)."""
    return f"base_model.model.{module_name}.{which}.weight"


def save_peft_adapter(path: str, cfg: TrialConfig, weights: dict[str, torch.Tensor],
                      target_modules: list[str], base_model_name: str) -> str:
    """Write `weights` (PEFT key -> tensor) and a LoraConfig of `cfg` to `path`; returns `path`."""
    from peft import LoraConfig

    os.makedirs(path, exist_ok=True)
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=sorted(target_modules),
        use_rslora=cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name,
    )
    config.save_pretrained(path)
    # copies: the weights are views into one buffer per adapter, and safetensors refuses
    # tensors that share memory
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    return path
