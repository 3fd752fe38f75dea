"""A quantized base (QLoRA) on CPU, through bitsandbytes' CPU backend: packed adapters on an NF4
or FP4 base train as PEFT's QLoRA trains each alone on the same quantized model; an int8 base
gives what bitsandbytes' own layer gives, to its activation rounding; isolation, a join and a
resume from checkpoints hold on a quantized base, and the saved adapters load into PEFT on it."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

import lora_sweep as ls
from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft
from lora_sweep.config import ConfigError
from lora_sweep.engine import Failed, PackedJob
from lora_sweep.quantized import bitsandbytes_config, dequantize, recomputed_in_backward

from test_engine_equivalence import final_weights, four_trials, make_spec, rel, run_packed

pytest.importorskip("bitsandbytes", reason="the quantized base needs bitsandbytes (lora-sweep[quantization])")


def quantized_base(model_dir, quantization):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                quantization_config=bitsandbytes_config(quantization, torch.float32),
                                                device_map={"": "cpu"})


@pytest.mark.parametrize("quantization", ["nf4", "fp4"])
def test_packed_on_a_4bit_base_equals_peft_qlora_alone(quantization, tiny_llama_dir, toy_data, tmp_path):
    trials = four_trials()
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path, padding="max_seq_len", quantization=quantization),
                    trials, progress=False)
    assert all(layer.quantized for layer in job.layers.values())
    for t in job.trials:
        job.save_adapter(t, str(tmp_path / "init" / t))
    packed = run_packed(job)
    for cfg in trials:
        model = peft_model_for(quantized_base(tiny_llama_dir, quantization), cfg, job.spec.target_modules,
                               init_dir=str(tmp_path / "init" / cfg.trial_id))
        ref_losses, ref_weights = train_alone_with_peft(model, cfg, job.train_samples, job.pad_id)
        for step, (x, y) in enumerate(zip(packed[cfg.trial_id], ref_losses)):
            assert math.isclose(x, y, rel_tol=1e-5), f"{cfg.trial_id} step {step + 1}: {x} vs {y}"
        for key, value in final_weights(job.finished[cfg.trial_id]).items():
            ref_key = key.replace(".lora_A.weight", ".lora_A.default.weight").replace(
                ".lora_B.weight", ".lora_B.default.weight")
            assert rel(value, ref_weights[ref_key]) < 1e-4, f"{cfg.trial_id} {key}"


def test_saved_adapters_load_into_peft_on_the_quantized_base(tiny_llama_dir, toy_data, tmp_path):
    """A trained adapter saved by the job, loaded with `PeftModel.from_pretrained` on the same
    NF4 base, gives the packed model's logits for that adapter."""
    from peft import PeftModel

    cfg = ls.TrialConfig(rank=8, alpha=16, learning_rate=3e-3, max_steps=100, dropout=0.0, trial_id="a")
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path, padding="max_seq_len", quantization="nf4"),
                    [cfg], progress=False)
    for _ in range(4):
        job.step()
    job.save_adapter("a", str(tmp_path / "a"))
    rows = torch.tensor([job.train_samples[0].input_ids])
    with torch.no_grad():
        job.model.eval()
        job.segments.set([job.active["a"].key], [rows.numel()])
        packed = job.model(input_ids=rows).logits
        job.segments.clear()
        base = job.model(input_ids=rows).logits
        # train mode, whose math is eval's at dropout 0: in eval mode on a CPU with AVX512-BF16,
        # bitsandbytes' own forward takes an inference kernel that needs widths of multiples of 32
        peft = PeftModel.from_pretrained(quantized_base(tiny_llama_dir, "nf4"), str(tmp_path / "a")).train()
        loaded = peft(input_ids=rows).logits
    assert (packed - base).abs().max() > 1e-3  # the adapter changes the logits
    assert torch.allclose(loaded, packed, atol=1e-4, rtol=1e-4)


def nf4_layer():
    """A bitsandbytes NF4 layer of 64 x 128 random weights (seed 0), quantized on the CPU."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 128) / 10, requires_grad=False, quant_type="nf4")
    return layer.to("cpu")  # quantized here


def test_a_weight_repacked_by_bitsandbytes_for_cpu_inference_dequantises_as_before():
    """bitsandbytes' 4-bit forward in eval mode without gradients, on a CPU with AVX512-BF16,
    repacks the layer's weight in place for its inference kernel, its block scales rounded to
    bf16; `dequantize` reads it back as the weight it gave before, to that rounding (0.25% at
    most over 30 seeds; read as it is, the repacked weight is off by more than its own size)."""
    layer = nf4_layer()
    if not layer.support_avx512bf16_for_cpu:
        pytest.skip("bitsandbytes repacks 4-bit weights for inference only on a CPU with AVX512-BF16")
    before = dequantize(layer, torch.float32)
    with torch.no_grad():
        layer.eval()(torch.randn(3, 128))
    assert layer.weight.quant_state.packing_format_for_cpu
    assert rel(dequantize(layer, torch.float32), before) < 1e-2


def test_a_dequantised_weight_lives_only_while_its_layer_runs():
    """A product run under `recomputed_in_backward` saves no reference to the dequantised
    weight: it is freed once the forward drops it (every layer's full-precision weight kept to
    its backward is the size of a bf16 model), and the backward dequantises it again and gives
    the gradient of the weight it was."""
    layer = nf4_layer()
    x = torch.randn(8, 128, requires_grad=True)
    weight = dequantize(layer, torch.float32)
    expected = weight.sum(0).expand(8, 128).clone()  # d sum(x W^T) / dx
    alive = weakref.ref(weight)
    with recomputed_in_backward(layer, weight):
        y = x @ weight.t()  # saves a transposed view of the weight
    del weight
    gc.collect()
    assert alive() is None
    y.sum().backward()
    torch.testing.assert_close(x.grad, expected)


def test_an_int8_base_gives_what_bitsandbytes_gives(tiny_llama_dir, toy_data, tmp_path):
    """LLM.int8 also rounds the activations to int8; the packed layer multiplies by the
    dequantised weight in full precision. The two agree to that rounding, and the job trains."""
    model = quantized_base(tiny_llama_dir, "int8")
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.in_features)
    with torch.no_grad():
        ours = x @ dequantize(layer, torch.float32).t()
        theirs = layer(x).float()
    assert rel(ours, theirs) < 0.02
    trials = [ls.TrialConfig(rank=8, learning_rate=1e-2, max_steps=8, batch_size=4, dropout=0.0, trial_id="a")]
    losses = run_packed(PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path, quantization="int8"), trials,
                                  progress=False))["a"]
    assert losses[-1] < losses[0] - 0.2


def test_isolation_join_and_resume_on_a_quantized_base(tiny_llama_dir, toy_data, tmp_path):
    """On an NF4 base: a trial whose weights turn inf fails alone and its pack-mates train on
    bit for bit; a trial joins mid-run; a job stopped after step 2 and started again from its
    checkpoints ends with the adapters of the run that was never stopped."""
    def trials():
        return [ls.TrialConfig(rank=4, learning_rate=3e-3, max_steps=4, dropout=0.0, seed=i, trial_id=t)
                for i, t in enumerate("ab")]

    joiner = ls.TrialConfig(rank=8, learning_rate=2e-3, max_steps=2, dropout=0.0, seed=9, trial_id="j")

    def spec(out):
        return make_spec(tiny_llama_dir, toy_data, tmp_path / out, padding="max_seq_len", quantization="nf4",
                         eval_every=2, checkpoint_every=1)

    def run(out, poison=False, stop_after=None):
        job = PackedJob(spec(out), trials() + ([ls.TrialConfig(rank=4, max_steps=4, trial_id="x")] if poison else []),
                        progress=False)
        events = []
        for step in range(1, 5):
            if step == 2:
                job.add_trial(joiner)
            if poison and step == 2:
                job.optimizer.adapters["x"].flat[0] = math.inf
            events += job.step()
            if stop_after == step:
                return job, events
        return job, events

    healthy, _ = run("healthy")
    poisoned, events = run("poisoned", poison=True)
    assert [e.trial_id for e in events if isinstance(e, Failed)] == ["x"]
    for t in "abj":
        assert torch.equal(final_weights(healthy.finished[t])["base_model.model.model.layers.0.self_attn.q_proj"
                                                             ".lora_A.weight"],
                           final_weights(poisoned.finished[t])["base_model.model.model.layers.0.self_attn.q_proj"
                                                               ".lora_A.weight"])
    stopped, _ = run("resumed", stop_after=2)
    stopped.release_locks()
    del stopped
    resumed = PackedJob(spec("resumed"), trials() + [joiner], progress=False)
    list(resumed.run())
    for t in "abj":
        for key, value in final_weights(resumed.finished[t]).items():
            assert rel(value, final_weights(healthy.finished[t])[key]) < 1e-5, (t, key)


def test_quantization_takes_known_formats_and_a_loadable_base(tiny_llama_dir, toy_data, tmp_path):
    with pytest.raises(ConfigError, match="quantization.*nf4, fp4, int8"):
        make_spec(tiny_llama_dir, toy_data, tmp_path, quantization="int4")
    with pytest.raises(ConfigError, match="factory returns its model as it is"):
        make_spec(lambda: None, toy_data, tmp_path, quantization="nf4", tokenizer=tiny_llama_dir)


def test_the_benchmark_builds_a_4bit_base_layer_by_layer_and_both_sides_train_on_it(tmp_path):
    from benchmarks.quantized import build_quantized, main

    model = build_quantized("tiny", "nf4", "cpu", torch.float32)
    linears = [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m).__name__ == "Linear4bit" and m.weight.dtype == torch.uint8 for m in linears)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all() and logits.std() > 0
    result = main(["--dry", "--out", str(tmp_path / "q.json"), "--work-dir", str(tmp_path / "work")])
    assert [(r["method"], r["k"]) for r in result["runs"]] == [("packed", 2), ("peft", 1)]
    assert all(r["tokens_per_s"] > 0 for r in result["runs"]) and result["versions"]["bitsandbytes"]
