"""One sweep over several base models and sequence lengths, on the CPU: a trial with its own
`max_seq_len` trains as it would in a job of that length alone, and an Optuna sweep over two
tiny bases of different sizes and two lengths trains each trial on its own base, never mixes
bases in a pack, loads each base once on the device, and gives each trial the adapter it
gets in a job of its base alone."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.torch import load_file

import lora_sweep as ls
from lora_sweep.config import check_against_model
from lora_sweep.engine import PackedJob

from conftest import save_tiny_model, torch_threads
from test_engine_equivalence import final_weights, make_spec, rel, run_packed

optuna = pytest.importorskip("optuna")


def alone(model_dir, toy_data, tmp_path, cfg: ls.TrialConfig, max_seq_len: int, name: str) -> dict:
    """`cfg`'s final adapter weights, trained alone in a job of `max_seq_len`."""
    single = ls.TrialConfig.from_dict({**cfg.to_dict(), "max_seq_len": None, "base_model": None})
    job = PackedJob(make_spec(model_dir, toy_data, tmp_path / name, max_seq_len=max_seq_len, eval_every=2),
                    [single], progress=False)
    run_packed(job)
    return final_weights(job.finished[cfg.trial_id])


def test_a_trial_with_its_own_max_seq_len_trains_as_in_a_job_of_that_length(tiny_llama_dir, toy_data, tmp_path):
    trials = [ls.TrialConfig(rank=4, learning_rate=3e-3, max_steps=4, dropout=0.0, batch_size=2, seed=1,
                             max_seq_len=12, trial_id="short"),
              ls.TrialConfig(rank=8, learning_rate=2e-3, max_steps=4, dropout=0.1, batch_size=2, seed=2,
                             trial_id="long")]
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "packed", max_seq_len=32, eval_every=2,
                              eval_data=toy_data[1]), trials, progress=False)
    events = list(job.run())
    assert len(job.active) == 0 and set(job.finished) == {"short", "long"}
    for cfg, length in zip(trials, (12, 32)):
        reference = alone(tiny_llama_dir, toy_data, tmp_path, cfg, length, cfg.trial_id)
        for key, value in final_weights(job.finished[cfg.trial_id]).items():
            assert rel(value, reference[key]) < 1e-5, (cfg.trial_id, key)
    evals = {e.trial_id: e.metrics["eval_loss"] for e in events if "eval_loss" in getattr(e, "metrics", {})}
    assert evals["short"] != evals["long"]
    with pytest.raises(ls.ConfigError, match=r"max_seq_len.*<= 32"):  # checked before the trial joins a job
        check_against_model(ls.TrialConfig(max_seq_len=64, trial_id="too-long"), job.spec, job.module_shapes)


def test_an_optuna_sweep_over_two_bases_and_two_lengths(tiny_llama_dir, char_tokenizer, toy_data, tmp_path):
    from lora_sweep.integrations.optuna import PackedLoRASampler

    large_dir = save_tiny_model("llama", char_tokenizer, tmp_path / "large", seed=5, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=3, tie_word_embeddings=False)
    dirs = {"small": tiny_llama_dir, "large": large_dir}
    bases = {name: make_spec(d, toy_data, tmp_path / "runs", max_seq_len=32, eval_every=2)
             for name, d in dirs.items()}

    def search(trial):
        return {"base_model": trial.suggest_categorical("base_model", ["small", "large"]),
                "max_seq_len": trial.suggest_categorical("max_seq_len", [12, 32]),
                "learning_rate": trial.suggest_float("learning_rate", 1e-3, 3e-3, log=True), "seed": trial.number}

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}",
                                sampler=optuna.samplers.RandomSampler(seed=3))
    for base in ("small", "large"):  # both bases surely come up
        study.enqueue_trial({"base_model": base, "max_seq_len": 12 if base == "small" else 32})
    sampler = PackedLoRASampler(study, bases, metric="train_loss", max_concurrent=2,
                                trial_defaults={"max_steps": 4, "rank": 4, "dropout": 0.0, "batch_size": 2})
    sampler.optimize(objective=search, n_trials=6, show_progress_bar=False)

    trials = study.get_trials()
    assert len(trials) == 6 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    packs: dict[str, set] = {}
    for t in trials:
        base = t.params["base_model"]
        assert t.user_attrs["base_model"] == base and t.user_attrs["config"]["base_model"] == base
        packs.setdefault(base, set()).add(t.user_attrs["pack_id"])
        with open(os.path.join(t.user_attrs["adapter_dir"], "adapter_config.json")) as f:
            assert json.load(f)["base_model_name_or_path"] == dirs[base]  # the PEFT adapter names its base
    # one job per base on the device, all the sweep long: each base loaded once, packs never mixed
    assert set(packs) == {"small", "large"} and all(len(p) == 1 for p in packs.values())
    assert packs["small"] != packs["large"] and len(sampler.jobs) == 2
    for t in trials[:2] + [t for t in trials[2:] if t.params["max_seq_len"] != trials[0].params["max_seq_len"]][:1]:
        cfg = ls.TrialConfig.from_dict(t.user_attrs["config"])
        reference = alone(dirs[cfg.base_model], toy_data, tmp_path, cfg, cfg.max_seq_len, f"alone-{t.number}")
        packed = load_file(os.path.join(t.user_attrs["adapter_dir"], "adapter_model.safetensors"))
        for key, value in packed.items():
            assert rel(value, reference[key]) < 1e-5, (t.number, key)


def test_a_base_is_admitted_within_what_the_other_bases_leave_of_the_gpu():
    from lora_sweep.costmodel import GB, CostModel
    from lora_sweep.planner import fits_running_job, memory_beside, new_job_fits

    small = CostModel.from_model("llama-3.2-1b", gpu="h100-sxm", max_seq_len=1024)
    large = CostModel.from_model("qwen2.5-7b", gpu="h100-sxm", max_seq_len=1024)
    trial = ls.TrialConfig(rank=16, batch_size=4)
    room = small.capacity_bytes - small.memory_per_gpu([trial])
    assert fits_running_job([], trial, small, max_adapters=4, beside_bytes=room - GB)
    assert not fits_running_job([], trial, small, max_adapters=4, beside_bytes=room + GB)
    assert not new_job_fits(trial, small, room + GB) and new_job_fits(trial, small, None)  # None: nothing known
    held = memory_beside([(large, [trial, trial]), (small, [])])
    assert held == large.memory_per_gpu([trial, trial]) + small.memory_per_gpu([])
    assert memory_beside([(large, [trial]), (None, [trial])]) is None  # a job without a memory model


def test_a_ray_tune_sweep_over_two_bases_and_two_lengths(tiny_llama_dir, char_tokenizer, toy_data, tmp_path):
    ray = pytest.importorskip("ray")
    from ray import tune

    from lora_sweep.integrations.ray_tune import PackedExecutor

    large_dir = save_tiny_model("llama", char_tokenizer, tmp_path / "large", seed=5, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=3, tie_word_embeddings=False)
    dirs = {"small": tiny_llama_dir, "large": large_dir}
    bases = {name: make_spec(d, toy_data, tmp_path / "runs", max_seq_len=32, eval_every=2)
             for name, d in dirs.items()}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with PackedExecutor(bases, max_adapters_per_server=3, poll_seconds=0.5) as executor:
            analysis = executor.run(
                config={"base_model": tune.grid_search(["small", "large"]), "max_seq_len": tune.grid_search([12, 32]),
                        "rank": 4, "dropout": 0.0, "batch_size": 2, "max_steps": 4, "learning_rate": 2e-3},
                storage_path=str(tmp_path / "tune"), verbose=0)
            (stats,) = executor.stats()
    finally:
        ray.shutdown()
    assert len(analysis.trials) == 4 and all(t.status == "TERMINATED" for t in analysis.trials)
    assert stats["base_loads"] == {"small": 1, "large": 1}  # each base loaded once on the device
    for t in analysis.trials:
        assert t.last_result["base_model"] == t.config["base_model"]
        assert t.last_result["pack_id"] == stats["packs"][t.config["base_model"]]  # packs never mix bases
        cfg = ls.TrialConfig.from_dict(t.config, trial_id=t.trial_id)
        with t.checkpoint.as_directory() as path:
            with open(os.path.join(path, "adapter_config.json")) as f:
                assert json.load(f)["base_model_name_or_path"] == dirs[cfg.base_model]
            packed = load_file(os.path.join(path, "adapter_model.safetensors"))
        with torch_threads(1):  # as the pack server's actor ran
            reference = alone(dirs[cfg.base_model], toy_data, tmp_path, cfg, cfg.max_seq_len, f"alone-{t.trial_id}")
        for key, value in packed.items():
            assert rel(value, reference[key]) < 1e-5, (t.trial_id, key)


def test_a_base_without_trials_for_base_idle_s_is_released(tiny_llama_dir, char_tokenizer, toy_data, tmp_path):
    """With `base_idle_s=0` each base's job (and its model) goes as soon as its last trial has
    left: the sweep ends holding none. A single base's job stays for the next `optimize`."""
    from lora_sweep.integrations.optuna import PackedLoRASampler

    large_dir = save_tiny_model("llama", char_tokenizer, tmp_path / "large", seed=5, hidden_size=64,
                                intermediate_size=128, num_hidden_layers=3, tie_word_embeddings=False)
    bases = {name: make_spec(d, toy_data, tmp_path / "runs", max_seq_len=32, eval_every=2)
             for name, d in {"small": tiny_llama_dir, "large": large_dir}.items()}
    defaults = {"max_steps": 2, "rank": 4, "dropout": 0.0}
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", pruner=optuna.pruners.NopPruner())
    for base in bases:
        study.enqueue_trial({"base_model": base})
    sampler = PackedLoRASampler(study, bases, metric="train_loss", trial_defaults=defaults, base_idle_s=0.0)
    sampler.optimize(n_trials=2, show_progress_bar=False)
    assert {t.user_attrs["base_model"] for t in study.get_trials()} == {"small", "large"}
    assert sampler.jobs == []
    single = PackedLoRASampler(optuna.create_study(storage=f"sqlite:///{tmp_path / 'single.db'}",
                                                   pruner=optuna.pruners.NopPruner()),
                               bases["small"], metric="train_loss", trial_defaults=defaults, base_idle_s=0.0)
    single.optimize(n_trials=1, show_progress_bar=False)
    assert len(single.jobs) == 1
