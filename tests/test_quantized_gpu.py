"""On CUDA: packed adapters on an NF4 base (bf16 compute, fp32 adapters) train as PEFT's QLoRA
trains each alone on the same quantized model, same initial adapters and samples, dropout 0:
every step's loss within bf16 tolerance over 20 steps, with the step replayed from CUDA graphs
and launched eagerly. Skipped without a GPU or bitsandbytes;
run it on one with `TRITON_INTERPRET=0 pytest tests/test_quantized_gpu.py`."""

from __future__ import annotations

import os

import pytest
import torch

import lora_sweep as ls
from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft
from lora_sweep.quantized import bitsandbytes_config
from lora_sweep.tiny import tiny_model_path

from test_graphed_gpu import close, rows, small_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and Triton compiled, not interpreted)")
pytest.importorskip("bitsandbytes", reason="the quantized base needs bitsandbytes (lora-sweep[quantization])")

STEPS = 20
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("graphs", [True, False], ids=["replayed", "eager"])
def test_packed_on_an_nf4_base_trains_as_peft_qlora_alone(graphs, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = str(tmp_path / "base")
    small_llama().save_pretrained(model_dir)
    trials = [ls.TrialConfig(rank=r, alpha=2 * r, learning_rate=lr, batch_size=b, dropout=0.0, max_steps=STEPS,
                             seed=i, trial_id=f"t{i}")
              for i, (r, lr, b) in enumerate([(8, 1e-3, 2), (16, 3e-4, 4), (64, 5e-4, 1)])]
    spec = ls.JobSpec(base_model=model_dir, tokenizer=tiny_model_path(), train_data=rows(), max_seq_len=64,
                      eval_every=1, output_dir=str(tmp_path / "runs"), device="cuda", dtype="bfloat16",
                      quantization="nf4", target_modules=list(TARGETS), cuda_graphs=graphs)
    job = ls.PackedJob(spec, trials, progress=False)
    assert all(layer.quantized for layer in job.layers.values())
    for t in job.trials:
        job.save_adapter(t, str(tmp_path / "init" / t))
    packed: dict[str, list[float]] = {}
    for event in job.run():
        if isinstance(event, ls.Report):
            packed.setdefault(event.trial_id, []).append(event.metrics["train_loss"])

    reference = {}
    for cfg in trials:
        base = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": "cuda"},
            quantization_config=bitsandbytes_config("nf4", torch.bfloat16))
        model = peft_model_for(base, cfg, TARGETS, init_dir=str(tmp_path / "init" / cfg.trial_id))
        reference[cfg.trial_id], _ = train_alone_with_peft(model, cfg, job.train_samples, job.pad_id, device="cuda")
        del base, model
    assert all(len(v) == STEPS for v in packed.values())
    assert all(s["graphed"] == graphs for s in job.step_stats)
    close(packed, reference, first=1e-2, drift=3e-2)
    for tid, losses in packed.items():
        assert losses[-1] < losses[0], tid
