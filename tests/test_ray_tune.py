"""Ray Tune integration on a real local Ray instance: packing, ASHA refills, equality with the
engine alone, Optuna with median stopping, per-trial errors, pause and resume, Population Based
Training, a proxy that dies, a callback whose pack servers are gone.

One `ray.init` and one `PackedExecutor` (one CPU pack server, 3 slots) serve the whole module.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")
from ray import tune  # noqa: E402
from ray.tune.experimental.output import _infer_user_metrics  # noqa: E402
from ray.tune.schedulers import (  # noqa: E402
    ASHAScheduler, FIFOScheduler, MedianStoppingRule, PopulationBasedTraining, TrialScheduler)
from ray.tune.search import Searcher  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import lora_sweep as ls  # noqa: E402
from lora_sweep.engine import Finished, PackedJob, Report, with_new_hyperparameters  # noqa: E402
from lora_sweep.integrations.ray_tune import PackedExecutor, _LeaveWhenTuneIsDone  # noqa: E402

from conftest import torch_threads  # noqa: E402

pytestmark = pytest.mark.slow

SLOTS = 3  # adapters per pack: fewer than the trials, so that slots get refilled


@pytest.fixture(scope="module")
def spec(tiny_llama_dir, toy_data, tmp_path_factory):
    train, dev = toy_data
    return ls.JobSpec(base_model=tiny_llama_dir, train_data=train, eval_data=dev, max_seq_len=32, eval_every=5,
                      output_dir=str(tmp_path_factory.mktemp("ray_runs")))


@pytest.fixture(scope="module")
def executor(spec):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # Short leases so that the dead-proxy test is quick; heartbeats come every second.
    executor = PackedExecutor(spec, max_adapters_per_server=SLOTS, lease_seconds=5.0, poll_seconds=0.5)
    yield executor
    executor.shutdown()
    ray.shutdown()


def trial(**overrides) -> dict:
    """A Tune config: TrialConfig fields, dropout 0 so that runs are deterministic."""
    return {"rank": 4, "alpha": 8.0, "dropout": 0.0, "batch_size": 4, "max_steps": 20, **overrides}


class Replay(Searcher):
    """A searcher that suggests exactly these configs, in order."""

    def __init__(self, configs: list[dict]):
        super().__init__()
        self.configs = list(configs)

    def suggest(self, trial_id: str):
        return self.configs.pop(0) if self.configs else Searcher.FINISHED

    def on_trial_complete(self, trial_id: str, result=None, error: bool = False):
        pass


def points(configs: list[dict]) -> dict:
    """tune.run / TuneConfig arguments that run exactly these configs, in order."""
    return {"search_alg": Replay(configs), "num_samples": len(configs)}


def joins_and_leaves(executor, trial_ids) -> list[dict]:
    return [e for e in executor.history() if e["trial_id"] in trial_ids]


def test_asha_sweep_packs_trials_and_refills_stopped_slots(executor, tmp_path):
    analysis = executor.run(
        config=trial(max_steps=100, learning_rate=tune.grid_search([3e-2, 1e-6, 2e-6, 1e-2, 3e-6, 4e-6])),
        scheduler=ASHAScheduler(metric="eval_loss", mode="min", max_t=20, grace_period=1, reduction_factor=2),
        storage_path=str(tmp_path), verbose=0,
    )
    assert executor.capacity == SLOTS
    results = analysis.results_df
    assert len(results) == 6
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    assert results["eval_loss"].notna().all() and (results["step"] >= 5).all()
    assert results["pack_id"].value_counts().max() >= 2  # trials shared a pack
    assert (results["step"] < 100).any(), "ASHA stopped no trial"

    (stats,) = executor.stats()
    assert stats["model_loads"] == 1  # the base model was loaded once, for every trial
    assert set(results["pack_id"]) == {stats["pack_id"]}
    assert stats["active"] == 0

    # The pack server's own record: ASHA-stopped trials left, and freed slots went to new
    # trials that joined the job while their pack-mates kept training.
    history = joins_and_leaves(executor, set(results.index))
    stopped = {e["trial_id"] for e in history if e["event"] == "leave" and e["reason"] == "stopped"}
    assert stopped == set(results.index[results["step"] < 100])
    assert all(e["active"] <= SLOTS for e in history)
    first_leave = min(e["time"] for e in history if e["event"] == "leave")
    refills = [e for e in history if e["event"] == "join" and e["time"] > first_leave and e["pack_mates"] > 0]
    assert refills, history

    # Every trial's last checkpoint is its adapter in PEFT format.
    for t in analysis.trials:
        files = os.listdir(t.checkpoint.path)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files)
        # `run` keeps two checkpoints per trial, not one per report
        assert len([d for d in os.listdir(t.local_path) if d.startswith("checkpoint_")]) <= 2


def test_tune_eval_loss_equals_the_engine_alone(executor, spec, tmp_path):
    configs = [trial(learning_rate=1e-2, seed=1), trial(rank=8, learning_rate=3e-3, lr_scheduler="cosine", seed=2)]
    analysis = executor.run(config={}, **points(configs), storage_path=str(tmp_path), verbose=0)
    assert all(t.status == "TERMINATED" for t in analysis.trials)

    for t in analysis.trials:
        cfg = ls.TrialConfig.from_dict(t.config, trial_id="alone")
        job = PackedJob(spec, [cfg], progress=False)
        with torch_threads(1):  # as the pack server's actor ran
            alone = [e.metrics["eval_loss"] for e in job.run() if isinstance(e, Report)]
        tuned = list(analysis.trial_dataframes[t.trial_id]["eval_loss"])
        assert len(tuned) == len(alone) == cfg.max_steps // spec.eval_every
        for step, (x, y) in enumerate(zip(tuned, alone)):
            assert math.isclose(x, y, rel_tol=1e-6), f"{t.config} report {step}: tune {x} vs alone {y}"
        # The checkpoint Tune kept is the adapter the engine trains alone.
        tuned_weights = load_file(os.path.join(t.checkpoint.path, "adapter_model.safetensors"))
        alone_weights = load_file(os.path.join(job.finished["alone"], "adapter_model.safetensors"))
        assert tuned_weights.keys() == alone_weights.keys()
        for key in alone_weights:
            assert (tuned_weights[key] - alone_weights[key]).abs().max() < 1e-6, key


def test_invalid_and_diverging_trials_error_alone(executor, tmp_path):
    configs = [
        trial(learning_rate=1e-2),
        trial(rank=0),  # TrialConfig rejects it in the proxy
        trial(rank=4096),  # larger than the model's layers: the pack server rejects it
        trial(lora_rank=8),  # not a TrialConfig field
        trial(learning_rate=1e30, max_steps=100),  # the loss becomes NaN within a few steps
        trial(learning_rate=3e-3),
    ]
    tuner = tune.Tuner(  # the Tuner API, with the ResultGrid
        executor.trainable,
        tune_config=tune.TuneConfig(max_concurrent_trials=executor.capacity, reuse_actors=True, **points(configs)),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[executor.callback]),
    )
    start = time.time()
    grid = tuner.fit()
    by_config = {repr(sorted(r.config.items())): r for r in grid}
    results = [by_config[repr(sorted(c.items()))] for c in configs]

    assert results[0].error is None and results[5].error is None
    assert results[0].metrics["step"] == 20 and results[5].metrics["step"] == 20
    assert "`rank` is 0" in str(results[1].error)
    assert "`rank` is 4096" in str(results[2].error) and "smallest in/out dimension" in str(results[2].error)
    assert "lora_rank" in str(results[3].error)
    assert "non-finite" in str(results[4].error)
    assert grid.num_errors == 4
    # Only the diverging adapter left its pack as failed; the invalid ones never joined.
    failed = [e for e in executor.history() if e["time"] > start and e.get("reason") == "failed"]
    assert len(failed) == 1


def test_optuna_search_with_median_stopping(executor, tmp_path):
    from ray.tune.search.optuna import OptunaSearch

    analysis = executor.run(
        config=trial(learning_rate=tune.loguniform(1e-4, 3e-2), rank=tune.choice([4, 8])),
        search_alg=OptunaSearch(metric="eval_loss", mode="min", seed=0), num_samples=4,
        scheduler=MedianStoppingRule(metric="eval_loss", mode="min", grace_period=1, min_samples_required=2),
        storage_path=str(tmp_path), verbose=0,
        time_budget_s=120, raise_on_failed_trial=False,  # a hang fails here with the trials' states
    )
    states = [(t.status, t.last_result.get("step")) for t in analysis.trials]
    assert len(states) == 4 and all(status == "TERMINATED" for status, _ in states), (states, executor.history()[-12:])
    best = analysis.get_best_trial("eval_loss", "min", scope="last")
    assert best.last_result["eval_loss"] < 3.8


def test_a_dead_proxy_loses_its_slot(executor, tmp_path):
    """Kill a trial's proxy process mid-training: no `finally` runs and, with `tune.run`
    called directly without `executor.callback`, nobody tells the pack server, so only the
    lease can free the slot. Its pack-mate trains on."""
    start = time.time()
    killed = {}

    def kill_the_long_trial():
        while time.time() < start + 60:
            for e in executor.history():
                if e["time"] > start and e["event"] == "join" and e["config"]["max_steps"] == 100_000:
                    time.sleep(1.0)  # let it train a little
                    os.kill(e["proxy"]["pid"], signal.SIGKILL)
                    killed.update(e)
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_long_trial, daemon=True)
    killer.start()
    analysis = tune.run(executor.trainable, config={}, **points([trial(max_steps=150), trial(max_steps=100_000)]),
                        time_budget_s=90,  # ends the long trial if the kill went wrong
                        storage_path=str(tmp_path), verbose=0, raise_on_failed_trial=False)
    killer.join()
    assert killed, "the long trial never joined"
    statuses = {t.config["max_steps"]: t.status for t in analysis.trials}
    assert statuses == {150: "TERMINATED", 100_000: "ERROR"}

    while time.time() < start + 60:  # the lease (5 s) expires
        leaves = [e for e in joins_and_leaves(executor, {killed["trial_id"]}) if e["event"] == "leave"]
        if leaves:
            break
        time.sleep(0.5)
    assert [e["reason"] for e in leaves] == ["lease expired"]
    assert executor.stats()[0]["active"] == 0


class PauseOnce(FIFOScheduler):
    """Pauses every trial once, at its second report, as MedianStoppingRule and HyperBand do
    when they yield a trial's resources to others; FIFO resumes it from its checkpoint.

    It is slow with each trial's first report, so the pack trains ahead of Tune (as with a
    busy driver) and the second report waits in the pack server's queue behind others.
    """

    def __init__(self):
        super().__init__()
        self.paused = set()

    def on_trial_result(self, tune_controller, trial, result):
        if result["training_iteration"] == 1:
            time.sleep(1.0)  # the pack reaches the last step meanwhile
        if result["training_iteration"] == 2 and trial.trial_id not in self.paused:
            self.paused.add(trial.trial_id)
            return TrialScheduler.PAUSE
        return TrialScheduler.CONTINUE


def test_paused_trials_resume_where_tune_left_them(executor, spec, tmp_path):
    """A resumed trial continues from the engine state in its Tune checkpoint (no retraining),
    Tune sees each step once, and the result equals the engine alone."""
    start = time.time()
    scheduler = PauseOnce()
    analysis = executor.run(config=trial(learning_rate=tune.grid_search([1e-2, 3e-3])), scheduler=scheduler,
                            storage_path=str(tmp_path), verbose=0)
    assert len(scheduler.paused) == 2
    assert all(t.status == "TERMINATED" for t in analysis.trials)
    resumes = [e for e in executor.history() if e["time"] > start and e["event"] == "join" and e["resume_step"]]
    assert sorted(e["trial_id"] for e in resumes) == sorted(t.trial_id for t in analysis.trials)
    assert all(e["resume_step"] == 10 and e["from_state"] for e in resumes)
    for t in analysis.trials:
        assert list(analysis.trial_dataframes[t.trial_id]["step"]) == [5, 10, 15, 20]  # none twice, none missing
        job = PackedJob(spec, [ls.TrialConfig.from_dict(t.config)], progress=False)
        alone = [e.metrics["eval_loss"] for e in job.run() if isinstance(e, Finished)]
        assert math.isclose(t.last_result["eval_loss"], alone[0], rel_tol=1e-6)


def result_rows(trial) -> list[dict]:
    """The trial's result.json, one row per report Tune logged."""
    with open(os.path.join(trial.local_path, "result.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_population_based_training_continues_exploited_trials_with_the_new_learning_rate(executor, tmp_path):
    """Synchronous PBT pauses every trial at a perturbation until all got there, then restarts
    the worst from the best one's checkpoint with a mutated learning rate: that adapter goes on
    from the donor's step with the new rate, and every report stays in result.json."""
    start = time.time()
    new_lr = 5e-3
    pbt = PopulationBasedTraining(time_attr="training_iteration", metric="eval_loss", mode="min", synch=True,
                                  perturbation_interval=2, quantile_fraction=0.5, resample_probability=1.0,
                                  hyperparam_mutations={"learning_rate": [new_lr]})
    analysis = executor.run(config=trial(learning_rate=tune.grid_search([1e-2, 1e-5, 2e-5])), scheduler=pbt,
                            storage_path=str(tmp_path), verbose=0)
    assert all(t.status == "TERMINATED" for t in analysis.trials), [t.error_file for t in analysis.trials]
    exploits = [e for e in executor.history()
                if e["time"] > start and e["event"] == "join" and e["new_hyperparameters"]]
    assert exploits and all(e["new_hyperparameters"] == ["learning_rate"] and e["from_state"] for e in exploits)
    assert len(exploits) == 1 and exploits[0]["resume_step"] == 10 and exploits[0]["config"]["learning_rate"] == new_lr

    for t in analysis.trials:
        rows = result_rows(t)
        assert [r["step"] for r in rows] == [5, 10, 15, 20], (t.trial_id, rows)  # none lost at the pause
        assert "learning_rate" not in rows[-1] and "eval_loss" in _infer_user_metrics([t])
    for e in exploits:
        rows = result_rows(next(t for t in analysis.trials if t.trial_id == e["trial_id"]))
        for r in rows:
            if r["step"] > e["resume_step"]:  # the donor's optimizer step count, the new peak rate
                assert math.isclose(r["lr"], new_lr * (1 - r["step"] / 20), rel_tol=1e-6), r


def test_a_new_rank_cannot_continue_a_state(spec):
    cfg = ls.TrialConfig(rank=4, alpha=8.0, dropout=0.0, batch_size=2, max_steps=4, trial_id="a")
    job = PackedJob(spec, [cfg], progress=False)
    job.step()
    state = job.trial_state("a")
    moved = with_new_hyperparameters(state, ls.TrialConfig(**{**cfg.to_dict(), "learning_rate": 1e-3}))
    assert moved["config"]["learning_rate"] == 1e-3 and moved["optimizer"] is state["optimizer"]
    with pytest.raises(ls.ConfigError, match="`rank` = 4, but the new config has 8"):
        with_new_hyperparameters(state, ls.TrialConfig(**{**cfg.to_dict(), "rank": 8}))


def test_a_callback_whose_pack_servers_are_gone_is_quiet(executor, tmp_path, caplog):
    """`Tuner.restore` brings back the callback of the run it restores; its executor's pack
    servers are gone, so it tells the ones running now."""
    stale = _LeaveWhenTuneIsDone(("lora_sweep-gone-0",))
    tuner = tune.Tuner(executor.trainable, param_space=trial(max_steps=5),
                       tune_config=tune.TuneConfig(num_samples=1),
                       run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0, callbacks=[stale]))
    with caplog.at_level(logging.WARNING, logger="lora_sweep"):
        (result,) = tuner.fit()
    assert result.error is None and result.metrics["step"] == 5
    assert not [r for r in caplog.records if r.name.startswith("lora_sweep")], caplog.text
    assert len(stale._servers()) == len(executor.servers)  # the live ones
