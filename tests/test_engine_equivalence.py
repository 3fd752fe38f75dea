"""An adapter trained packed equals the same adapter trained alone with PEFT.

The reference is what a user runs today (`benchmarks/peft_baseline.py`): a PEFT model (here
loaded from the packed job's saved initial adapter, so both start from the same weights),
torch's AdamW, transformers' schedules and `clip_grad_norm_`, the HF model's own loss, the
same samples in the same order. Everything is fp32 on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

import lora_sweep as ls
from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft
from lora_sweep.engine import PackedJob, Report

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def four_trials(dropout=0.0):
    return [
        ls.TrialConfig(rank=4, alpha=8, learning_rate=3e-3, batch_size=1, max_steps=10, dropout=dropout,
                       seed=1, trial_id="a"),
        ls.TrialConfig(rank=8, alpha=4, learning_rate=1e-3, batch_size=2, max_steps=10, dropout=dropout,
                       weight_decay=0.1, warmup_steps=3, lr_scheduler="cosine", seed=2, trial_id="b"),
        ls.TrialConfig(rank=16, alpha=64, learning_rate=5e-4, batch_size=3, max_steps=10, dropout=dropout,
                       max_grad_norm=0.05, use_rslora=True, lr_scheduler="constant", seed=3, trial_id="c"),
        ls.TrialConfig(rank=8, alpha=16, learning_rate=2e-3, batch_size=2, max_steps=10, dropout=dropout,
                       gradient_accumulation_steps=2, target_modules=ATTENTION, seed=4, trial_id="d"),
    ]


def make_spec(model_dir, toy_data, tmp_path, **kw):
    train, _ = toy_data
    kw = {"max_seq_len": 32, "eval_every": 1, "output_dir": str(tmp_path / "runs"), **kw}
    return ls.JobSpec(base_model=model_dir, train_data=train, **kw)


def run_packed(job: PackedJob) -> dict[str, list[float]]:
    """Per-trial list of train losses, one per optimizer step (eval_every=1, no eval data)."""
    losses: dict[str, list[float]] = {}
    for event in job.run():
        if isinstance(event, Report):
            losses.setdefault(event.trial_id, []).append(event.metrics["train_loss"])
    return losses


def final_weights(path):
    return load_file(f"{path}/adapter_model.safetensors")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("arch,padding", [("tiny_llama_dir", "max_seq_len"), ("tiny_qwen_dir", "max_seq_len"),
                                          ("tiny_llama_dir", "packed")])
def test_packed_equals_peft_alone(arch, padding, request, toy_data, tmp_path):
    """`padding="packed"` puts several samples in a row (position ids restart per sample):
    the adapters must still train exactly as alone with one padded row per sample."""
    model_dir = request.getfixturevalue(arch)
    job = PackedJob(make_spec(model_dir, toy_data, tmp_path, padding=padding), four_trials(), progress=False)
    for t in job.trials:  # the packed job's own initial adapters seed the references
        job.save_adapter(t, str(tmp_path / "init" / t))
    packed = run_packed(job)

    for cfg in four_trials():
        model = peft_model_for(model_dir, cfg, job.spec.target_modules, init_dir=str(tmp_path / "init" / cfg.trial_id))
        ref_losses, ref_weights = train_alone_with_peft(model, cfg, job.train_samples, job.pad_id)
        got = packed[cfg.trial_id]
        assert len(got) == cfg.max_steps
        for step, (x, y) in enumerate(zip(got, ref_losses)):
            assert math.isclose(x, y, rel_tol=1e-5), f"{cfg.trial_id} step {step + 1}: {x} vs {y}"
        saved = final_weights(job.finished[cfg.trial_id])
        assert len(saved) == len([k for k in ref_weights if "lora_A" in k]) * 2
        for key, value in saved.items():
            ref_key = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
                ".lora_B.weight", ".lora_B.default.weight")
            assert rel(value, ref_weights[ref_key]) < 1e-4, f"{cfg.trial_id} {key}"
        # the attention-only adapter has no MLP weights
        if cfg.target_modules == ATTENTION:
            assert not any("mlp" in k for k in saved)


def test_losses_go_down_and_differ_by_hyperparameters(tiny_llama_dir, toy_data, tmp_path):
    trials = [ls.TrialConfig(rank=8, learning_rate=lr, max_steps=12, batch_size=4, dropout=0.0, trial_id=f"lr{lr}")
              for lr in (1e-5, 1e-2)]
    losses = run_packed(PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path), trials, progress=False))
    slow, fast = losses["lr1e-05"], losses["lr0.01"]
    assert fast[-1] < fast[0] - 0.3
    assert abs(slow[-1] - slow[0]) < abs(fast[-1] - fast[0])
