"""What users run today: one LoRA fine-tune per trial with PEFT, torch AdamW, transformers'
schedules and `clip_grad_norm_`, the model's own loss. The tests use it as the reference an
adapter trained packed must equal; the benchmarks time it against `PackedJob`."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, get_scheduler

import lora_sweep as ls
from lora_sweep.data import SampleStream, collate


def peft_model_for(model_or_dir, cfg: ls.TrialConfig, target_modules, init_dir=None, dtype=torch.float32,
                   device="cpu"):
    """A trainable PEFT model for `cfg`: from `init_dir` (a saved adapter, to start from the same
    weights as a packed run) or PEFT's own initialisation."""
    base = model_or_dir
    if isinstance(model_or_dir, str):
        base = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=dtype, attn_implementation="eager"
                                                    if device == "cpu" else "sdpa").to(device)
    if init_dir is not None:
        return PeftModel.from_pretrained(base, init_dir, is_trainable=True)
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, use_rslora=cfg.use_rslora,
                        target_modules=list(cfg.target_modules or target_modules), task_type="CAUSAL_LM")
    return get_peft_model(base, config)


def train_alone_with_peft(model, cfg: ls.TrialConfig, samples, pad_id, device="cpu", steps=None, on_step=None):
    """Train `model` (from `peft_model_for`) on `cfg`'s own sample stream. Returns the loss of
    every optimizer step and the final LoRA weights (PEFT state-dict names). `on_step(k, tokens)`
    is called after optimizer step k with the real (non-padding) tokens it trained on."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, foreach=True)
    sched = get_scheduler(cfg.lr_scheduler, opt, num_warmup_steps=cfg.warmup_steps,
                          num_training_steps=cfg.max_steps)
    stream = SampleStream(len(samples), cfg.seed)
    losses = []
    for _ in range(steps or cfg.max_steps):
        micro, tokens = [], 0
        for _ in range(cfg.gradient_accumulation_steps):
            rows = [samples[i] for i in stream.take(cfg.batch_size)]
            tokens += sum(len(s) for s in rows)
            batch = collate([rows], pad_id, device)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
            (out.loss / cfg.gradient_accumulation_steps).backward()
            micro.append(out.loss.detach())
        if cfg.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(torch.stack(micro).mean())
        if on_step is not None:
            on_step(len(losses), tokens)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}
    return [float(x) for x in losses], weights
