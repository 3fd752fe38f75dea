"""The cost model: shapes from configs, memory terms, step time, calibration, persistence."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from lora_sweep.config import ConfigError, JobSpec, TrialConfig
from lora_sweep.costmodel import (
    GB, GPUS, Calibration, CostModel, ModelShape, calibrate, detect, gpu_counts, gpu_profile,
    model_config_fields, profile_job,
)

QWEN_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return CostModel.from_model(QWEN_7B, gpu="h100-sxm", max_seq_len=512)


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("name, params", [
    ("qwen2.5-7b", 7_615_616_512),  # the published counts
    ("llama-3.2-1b", 1_235_814_400),
    ("llama-3.1-8b", 8_030_261_248),
])
def test_preset_parameter_counts(name, params):
    assert ModelShape.from_config(name).num_params == params


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("llama", True), ("qwen2", True), ("mistral", False)])
def test_shape_matches_a_meta_device_model(model_type, tied):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                                  tie_word_embeddings=tied)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in shape.linear_dims:
            assert shape.linear_dims[short] == (module.in_features, module.out_features)


def test_config_sources_agree(tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model(**QWEN_7B).save_pretrained(tmp_path)  # a local dir: config.json only
    spec = JobSpec(base_model=str(tmp_path), train_data=[{"text": "x"}])
    shapes = [ModelShape.from_config(s) for s in
              (QWEN_7B, "qwen2.5-7b", "Qwen2.5-7B", str(tmp_path), spec, AutoConfig.for_model(**QWEN_7B))]
    assert all(s == shapes[0] for s in shapes)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="Could not read a model config"):
        model_config_fields("/no/such/model/dir")
    with pytest.raises(ValueError, match="Llama-style"):
        ModelShape.from_config({"model_type": "gpt2", "n_embd": 768})
    with pytest.raises(TypeError, match="factory"):
        model_config_fields(JobSpec(base_model=lambda: None, train_data=[{"text": "x"}]))
    with pytest.raises(ConfigError, match="c_attn"):
        CostModel.from_model(QWEN_7B, gpu="h100-sxm", target_modules=("c_attn",))


# --------------------------------------------------------------------------- GPUs


def test_gpu_profiles():
    assert gpu_profile("H100 SXM") is GPUS["h100-sxm"] and gpu_profile("h100_sxm") is GPUS["h100-sxm"]
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l4", "a10g", "rtx4090"} <= set(GPUS)
    with pytest.raises(ValueError, match="`gpu`"):
        gpu_profile("tpu-v5")
    assert gpu_profile("cpu").name == "cpu"
    # the names CUDA reports, as results files record them
    assert gpu_profile("NVIDIA H200") is GPUS["h200"] and gpu_profile("NVIDIA H100 80GB HBM3") is GPUS["h100-sxm"]
    assert gpu_profile("NVIDIA A100-SXM4-40GB") is GPUS["a100-40gb"] and gpu_profile("NVIDIA L4") is GPUS["l4"]


def test_detect_falls_back_to_the_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu = detect()
    assert gpu.name == "cpu" and gpu.memory_gb > 0
    assert CostModel.from_model("llama-3.2-1b", gpu=None).dtype == "float32"  # auto on the CPU, as the engine


def test_detect_reads_the_cuda_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: type("P", (), {"total_memory": 85_029_158_912})())
    gpu = detect()
    assert gpu.name == "h100-sxm" and gpu.memory_gb == pytest.approx(85.03, abs=0.01)


def test_gpu_counts():
    assert gpu_counts(8) == [1, 2, 4, 8]
    assert gpu_counts(6) == [1, 2, 4, 6]
    assert gpu_counts(1) == [1]


# --------------------------------------------------------------------------- memory


def test_memory_terms(cm):
    shape = cm.shape
    lora_dims = shape.num_layers * sum(sum(shape.linear_dims[m]) for m in cm.target_modules)
    terms = cm.memory_terms(tokens=4096, rank_tokens=64 * 4096, rank_sum=64, num_gpus=1)
    assert terms["weights"] == shape.num_params * 2
    assert terms["adapter_states"] == 64 * lora_dims * 16  # fp32 weights, grads, Adam m and v
    assert terms["lora_activations"] == 64 * 4096 * shape.num_layers * 7 * 2  # S: tokens x rank per module
    assert terms["logits"] == cm.loss_chunk_tokens * shape.vocab_size * 4 * 2  # one chunk, not all tokens
    assert 3 * GB < terms["base_activations"] < 40 * GB
    # on two GPUs (each trial on one GPU): the trials' terms halve, a chunk of logits does not;
    # a 7B base (15 GB, under a quarter of 80 GB) stays whole on each GPU, unless told to shard:
    # then (FSDP) its weights halve but for the LM head and the two decoder layers held whole
    whole, halves = (dataclasses.replace(cm, shard_base=s).memory_terms(4096, 64 * 4096, 64, num_gpus=2)
                     for s in ("auto", True))
    for k in ("adapter_states", "base_activations", "lora_activations"):
        assert whole[k] == halves[k] == pytest.approx(terms[k] / 2)
    assert whole["logits"] == halves["logits"] == terms["logits"]
    assert whole["weights"] == terms["weights"]
    head = shape.vocab_size * shape.hidden_size * 2
    layer = (shape.num_params * 2 - head) / shape.num_layers
    assert halves["weights"] == pytest.approx(terms["weights"] / 2 + head / 2 + layer)


def test_a_base_over_a_quarter_of_a_gpu_is_sharded_on_several(cm):
    assert not cm.shards_base(1) and not cm.shards_base(2)  # 15 GB of 80
    assert CostModel.from_model("qwen2.5-7b", gpu="l4").shards_base(2)  # 15 GB of 24
    assert CostModel.from_model("qwen2.5-32b", gpu="h200").shards_base(2)  # 66 GB of 141
    assert not dataclasses.replace(cm, shard_base=True).shards_base(1)
    # a whole base sends nothing between GPUs: no gathered bytes in its step time
    assert cm.time_features(4096, 0, 1, 2)[5] == 0
    assert dataclasses.replace(cm, shard_base=True).time_features(4096, 0, 1, 2)[5] > 0


def test_logits_chunk_is_the_engines():
    from lora_sweep.kernels.lm_loss import default_chunk_rows

    for name in ("qwen2.5-7b", "llama-3.2-1b"):
        cm = CostModel.from_model(name, gpu="h100-sxm")
        assert cm.loss_chunk_tokens == default_chunk_rows(cm.shape.vocab_size)
        assert cm.memory_terms(0, 0, 0, 1)["logits"] <= 2 * 2**28  # 256 MiB of fp32 logits + a temporary


def test_gradient_checkpointing_shrinks_activations(cm):
    gc = dataclasses.replace(cm, gradient_checkpointing=True)
    plain = cm.memory_terms(8192, 0, 0, 1)["base_activations"]
    assert gc.memory_terms(8192, 0, 0, 1)["base_activations"] < plain / 5
    assert gc.step_seconds(8192, 0, 1) > cm.step_seconds(8192, 0, 1)  # recomputation costs time


def test_memory_is_linear_in_trials(cm):
    a, b = TrialConfig(rank=8, batch_size=4), TrialConfig(rank=128, batch_size=1, target_modules=("q_proj",))
    for d in (1, 2, 4):
        expected = (cm.static_memory(d) + cm.trial_memory(a) + cm.trial_memory(b)) / d
        assert cm.memory_per_gpu([a, b], d) == pytest.approx(expected)
    assert cm.effective_rank(b) == pytest.approx(128 * (3584 + 3584) / (cm.shape.lora_dims(cm.target_modules)))


def test_fits_and_min_gpus(cm):
    small, big = TrialConfig(rank=16, batch_size=2), TrialConfig(rank=16, batch_size=32)
    assert cm.fits([small], 1) and not cm.fits([big], 1) and cm.fits([big], 2)
    assert cm.min_gpus(small, 8) == 1 and cm.min_gpus(big, 8) == 2
    assert cm.min_gpus(TrialConfig(rank=16, batch_size=4096), 8) is None


def test_check_trial_names_the_trial_and_its_memory(cm):
    huge = TrialConfig(rank=64, batch_size=512, trial_id="huge")
    with pytest.raises(ConfigError, match=r"Trial 'huge': needs \d+\.\d GB of GPU memory") as info:
        cm.check_trial(huge, 8)
    assert info.value.trial_id == "huge"
    assert f"{cm.memory_per_gpu([huge], 8) * 8 / GB:.1f} GB" in str(info.value)
    cm.check_trial(TrialConfig(rank=64, batch_size=4), 1)  # fits: no error


# --------------------------------------------------------------------------- step time


def test_step_time_roofline(cm):
    t1 = cm.step_seconds(tokens=4096, rank_tokens=16 * 4096, num_adapters=1, num_gpus=1)
    assert 0.1 < t1 < 1.0  # a 7B forward/backward over 4k tokens on an H100
    assert cm.step_seconds(8192, 16 * 4096, 1) > t1 and cm.step_seconds(4096, 128 * 4096, 1) > t1
    assert cm.step_seconds(4096, 16 * 4096, 1, num_gpus=4) < t1  # faster, but
    assert 4 * cm.step_seconds(4096, 16 * 4096, 1, num_gpus=4) > t1  # less efficient (all-reduces)
    slow = CostModel.from_model(QWEN_7B, gpu="l4", max_seq_len=512)
    assert slow.step_seconds(4096, 0, 1) > 5 * t1


def test_step_times_follow_the_mean_sample_length_and_memory_the_longest(cm):
    short = dataclasses.replace(cm, mean_sample_tokens=128.0)
    trial = TrialConfig(rank=16, batch_size=8)
    assert short.trial_step_seconds(trial) < 0.5 * cm.trial_step_seconds(trial)  # a quarter of the tokens
    assert short.memory_per_gpu([trial]) == cm.memory_per_gpu([trial])  # a batch may still be all long samples
    with pytest.raises(ValueError, match="mean_sample_tokens.*max_seq_len"):
        dataclasses.replace(cm, mean_sample_tokens=513.0)


def test_time_outside_steps_counts_once_per_trial(cm):
    stats = [{"tokens": n, "rank_tokens": 16 * n, "num_adapters": 1, "seconds": cm.step_seconds(n, 16 * n, 1)}
             for n in (512, 4096)]
    fitted = calibrate(cm, stats, trial_seconds=0.25)
    trials = [TrialConfig(rank=16, batch_size=2, max_steps=10), TrialConfig(rank=8, batch_size=1, max_steps=30)]
    assert fitted.calibration.trial_seconds == 0.25 and "0.25 s/trial" in fitted.calibration.describe()
    without = dataclasses.replace(fitted, calibration=dataclasses.replace(fitted.calibration, trial_seconds=0.0))
    assert fitted.job_seconds(trials) == pytest.approx(without.job_seconds(trials) + 0.5)
    with pytest.raises(ValueError, match="trial_seconds"):
        calibrate(cm, stats, trial_seconds=-1.0)


def test_job_seconds_counts_trials_leaving(cm):
    trials = [TrialConfig(rank=8, batch_size=2, max_steps=10), TrialConfig(rank=32, batch_size=1, max_steps=25),
              TrialConfig(rank=16, batch_size=4, max_steps=5)]
    by_step = sum(cm.job_step_seconds([t for t in trials if t.max_steps > step], 2) for step in range(25))
    assert cm.job_seconds(trials, 2) == pytest.approx(by_step)
    assert cm.job_step_seconds(trials, 1) == pytest.approx(
        cm.fixed_step_seconds(1) + sum(cm.trial_step_seconds(t, 1) for t in trials))


# --------------------------------------------------------------------------- calibration


def _synthetic_stats(truth: CostModel, n: int, seed: int, gpus=(1, 2, 4)) -> list[dict]:
    rng = random.Random(seed)
    stats = []
    for _ in range(n):
        ranks = [rng.choice([8, 16, 32, 64, 128]) for _ in range(rng.randint(1, 8))]
        tokens = [rng.randint(100, 2048) for _ in ranks]
        d = rng.choice(gpus)
        rank_tokens = sum(r * t for r, t in zip(ranks, tokens))
        stats.append({
            "tokens": sum(tokens) - rng.randint(0, 50), "padded_tokens": sum(tokens), "rank_tokens": rank_tokens,
            "num_adapters": len(ranks), "rank_sum": sum(ranks), "num_gpus": d,
            "seconds": truth.step_seconds(sum(tokens), rank_tokens, len(ranks), d),
            "peak_memory_bytes": truth.peak_memory(sum(tokens), rank_tokens, sum(ranks), d),
        })
    return stats


def test_calibrate_recovers_known_coefficients(cm):
    cm = dataclasses.replace(cm, shard_base=True)  # FSDP on 2 and 4 GPUs: the gathered bytes vary
    roof = np.array(cm.calibration.time_coefs)
    true_coefs = roof * np.array([0.6, 3.0, 1.4, 1.8, 2.5, 0.7])
    truth = dataclasses.replace(cm, calibration=Calibration(
        true_coefs.tolist(), base_activation_scale=1.3, lora_activation_scale=0.6, workspace_bytes=1.5 * GB))
    fitted = calibrate(cm, _synthetic_stats(truth, 40, seed=0))
    got = np.array(fitted.calibration.time_coefs)
    np.testing.assert_allclose(got[[1, 3, 4, 5]], true_coefs[[1, 3, 4, 5]], rtol=1e-2)
    # every GPU reads every weight whole (FSDP gathers it), whatever the GPU count, so the
    # per-step overhead and the weight reads are told apart only as their sum
    reads = cm.time_features(0, 0, 0, 1)[2]
    assert got[0] + got[2] * reads == pytest.approx(true_coefs[0] + true_coefs[2] * reads, rel=1e-2)
    assert fitted.calibration.base_activation_scale == pytest.approx(1.3, rel=1e-2)
    assert fitted.calibration.lora_activation_scale == pytest.approx(0.6, rel=1e-2)
    assert fitted.calibration.workspace_bytes == pytest.approx(1.5 * GB, rel=1e-2)
    assert fitted.calibration.source == "calibrated from 40 steps"
    assert cm.calibration.source == "roofline"  # the input is not changed


def test_calibrate_leaves_out_steps_that_captured_a_graph(cm):
    # a step that captured a CUDA graph takes about a second more than its peers: in the fit,
    # ten of them would make every step of a sweep look ten times slower
    truth = dataclasses.replace(cm, calibration=Calibration([0.05, 0.004, 2e-13, 4e-15, 9e-15, 1e-12]))
    stats = _synthetic_stats(truth, 12, seed=2)
    captures = [{**s, "seconds": s["seconds"] + 1.0, "one_off": True} for s in stats[:10]]
    fitted = calibrate(cm, stats + captures)
    assert fitted.calibration.source == "calibrated from 12 steps"
    assert fitted.calibration == calibrate(cm, stats).calibration  # as if they were not there
    assert calibrate(cm, stats + [{**c, "one_off": False} for c in captures]).calibration != fitted.calibration
    with pytest.raises(ValueError, match="one-off and choosing steps left out"):
        calibrate(cm, captures[:1] + stats[:1])
    # the eager steps cuda_graphs="auto" times before it keeps replayed ones: not the job's steps
    trials = [{**s, "seconds": 5 * s["seconds"], "choosing": True} for s in stats[:6]]
    assert calibrate(cm, stats + trials).calibration == calibrate(cm, stats).calibration


def test_typical_steps_are_neither_captures_nor_the_choice_nor_stalls():
    from lora_sweep.costmodel import STALL_FACTOR, typical_steps

    steady = [{"seconds": 0.30 + 0.01 * (i % 3), "one_off": False, "choosing": False} for i in range(8)]
    capture = {"seconds": 1.5, "one_off": True, "choosing": False}
    trial = {"seconds": 0.45, "one_off": False, "choosing": True}  # an eager step "auto" timed
    stall = {"seconds": 9.4, "one_off": False, "choosing": False}  # a kernel compiled inside the step
    steps = [trial, trial, capture, *steady[:4], stall, *steady[4:]]
    assert typical_steps(steps) == steady
    slower = {"seconds": 0.9 * STALL_FACTOR * 0.31, "one_off": False, "choosing": False}  # large, not a stall
    assert typical_steps(steady + [slower]) == steady + [slower]
    assert typical_steps([stall, steady[0]]) == [stall, steady[0]]  # too few to call one a stall


def test_calibrate_on_one_job_predicts_that_job(cm):
    # One GPU count: the per-step overhead and the weight-read time cannot be told apart,
    # but the fit still predicts the profiled steps and keeps every coefficient >= 0.
    truth = dataclasses.replace(cm, calibration=Calibration([0.05, 0.004, 2e-13, 4e-15, 9e-15, 0.0]))
    stats = _synthetic_stats(truth, 12, seed=1, gpus=(1,))
    fitted = calibrate(cm, stats, num_gpus=1)
    for s in stats:
        predicted = fitted.step_seconds(s["padded_tokens"], s["rank_tokens"], s["num_adapters"], 1)
        assert predicted == pytest.approx(s["seconds"], rel=1e-3)
    assert min(fitted.calibration.time_coefs) >= 0
    # no step sent anything between GPUs: the link's rate keeps the roofline's proportion to the
    # other rates (the first fit's one factor), not whatever the solver left in an unseen column
    link = fitted.calibration.time_coefs[5] / cm.calibration.time_coefs[5]
    assert 1 <= link < 10


def test_calibrate_never_rates_the_gpu_above_its_peak(cm):
    # Host-bound steps: the time grows with the pack's adapters, not its FLOPs. An
    # unconstrained fit calls the base GEMMs free; the fit keeps every rate at or below peak.
    truth = dataclasses.replace(cm, calibration=Calibration([0.08, 0.01, 0.0, 0.0, 0.0, 0.0]))
    fitted = calibrate(cm, _synthetic_stats(truth, 12, seed=3, gpus=(1,)), num_gpus=1)
    floor = Calibration.floor(cm.gpu)
    assert all(c >= f * (1 - 1e-9) for c, f in zip(fitted.calibration.time_coefs, floor))
    assert fitted.calibration.time_coefs[3] > 0  # base FLOPs are never free


def test_calibrate_without_memory_keeps_memory_terms(cm):
    stats = _synthetic_stats(cm, 6, seed=2)
    for s in stats:
        s["peak_memory_bytes"] = None  # CPU
        del s["rank_sum"]
    fitted = calibrate(cm, stats)
    assert fitted.calibration.base_activation_scale == 1.0 and fitted.calibration.workspace_bytes == 0.0
    with pytest.raises(ValueError, match="at least 2"):
        calibrate(cm, stats[:1])


def test_save_load_round_trip(cm, tmp_path):
    fitted = calibrate(cm, _synthetic_stats(dataclasses.replace(cm, calibration=Calibration(
        [0.03, 0.002, 3e-13, 3e-15, 1e-14, 4e-12], 1.2, 0.9, 2 * GB)), 20, seed=3))
    path = tmp_path / "calibration.json"
    fitted.save(path)
    json.loads(path.read_text())  # plain JSON
    loaded = CostModel.load(path)
    assert loaded == fitted
    trial = TrialConfig(rank=32, batch_size=8)
    assert loaded.memory_per_gpu([trial], 2) == fitted.memory_per_gpu([trial], 2)
    assert loaded.job_seconds([trial], 2) == fitted.job_seconds([trial], 2)


# --------------------------------------------------------------------------- profiling


def _tiny_job(tmp_path, max_steps):
    from lora_sweep.engine import PackedJob
    from lora_sweep.tiny import tiny_model_path, tiny_task_paths

    spec = JobSpec(base_model=tiny_model_path(), train_data=tiny_task_paths()[0], max_seq_len=24,
                   output_dir=str(tmp_path), eval_every=100)
    return PackedJob(spec, [TrialConfig(rank=8, batch_size=2, max_steps=max_steps),
                            TrialConfig(rank=16, batch_size=4, max_steps=max_steps)], progress=False)


def test_profile_job_returns_steps_after_warmup(tmp_path):
    job = _tiny_job(tmp_path, max_steps=20)
    stats = profile_job(job, steps=5, warmup=2)
    assert len(stats) == 5 and all(s in job.step_stats[2:] for s in stats)
    assert all(s["rank_sum"] == 24 and s["num_adapters"] == 2 and s["seconds"] > 0 for s in stats)
    assert not any(s["one_off"] or s["choosing"] for s in job.step_stats)  # no CUDA graphs on the CPU


def test_profile_job_warns_when_the_job_ends_early(tmp_path):
    with pytest.warns(UserWarning, match="fewer than"):
        stats = profile_job(_tiny_job(tmp_path, max_steps=4), steps=10)
    assert len(stats) == 3


def test_a_quantized_base_weighs_its_linears_in_their_quantized_form():
    from lora_sweep.costmodel import QUANTIZED_BYTES_PER_PARAM

    plain = CostModel.from_model("qwen2.5-7b", "h100-sxm", dtype="bfloat16")
    s = plain.shape
    linear = s.num_layers * sum(a * b for a, b in s.linear_dims.values())
    for q in ("nf4", "int8"):
        quantized = CostModel.from_model("qwen2.5-7b", "h100-sxm", dtype="bfloat16", quantization=q)
        saved = linear * (2 - QUANTIZED_BYTES_PER_PARAM[q])
        assert quantized.weight_bytes() == pytest.approx(plain.weight_bytes() - saved)
        assert quantized.memory_terms(1024, 16 * 1024, 16, 1)["weights"] == quantized.weight_bytes()
        trials = [TrialConfig(rank=16)]
        assert quantized.memory_per_gpu(trials) == pytest.approx(plain.memory_per_gpu(trials) - saved)
    with pytest.raises(ValueError, match="quantization"):
        CostModel.from_model("qwen2.5-7b", "h100-sxm", quantization="int4")
