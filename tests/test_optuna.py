"""PackedLoRASampler: packed Optuna sweeps on real storages with a tiny Llama on the CPU.

Everything goes through the public API (`study.ask`/`tell` happen inside `optimize`; the tests
read the study back). Worker processes for the resume and multi-worker tests are this file
run as a script (see `worker_main` at the bottom).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections import Counter

import optuna
import pytest
import torch
from safetensors.torch import load_file
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.storages import JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

import lora_sweep as ls
import lora_sweep.integrations.optuna as lso
from lora_sweep.engine import Finished, PackedJob
from lora_sweep.integrations.optuna import PackedLoRASampler
from lora_sweep.rank_group import RankGroupJob

from conftest import torch_threads

optuna.logging.set_verbosity(optuna.logging.WARNING)

SPACE = {"learning_rate": FloatDistribution(1e-3, 3e-2, log=True), "rank": IntDistribution(2, 8)}
NO_PRUNING = optuna.pruners.NopPruner()  # Optuna's default MedianPruner would prune the later trials
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def make_spec(model_dir, train, dev, output_dir, **kw):
    return ls.JobSpec(base_model=str(model_dir), train_data=train, eval_data=dev, max_seq_len=32,
                      output_dir=str(output_dir), **{"eval_every": 1, "padding": "max_seq_len", **kw})


@pytest.fixture
def spec(tiny_llama_dir, toy_data, tmp_path):
    train, dev = toy_data
    return make_spec(tiny_llama_dir, train, dev, tmp_path / "runs")


@pytest.fixture
def job_log(monkeypatch):
    """Wrap the real PackedJob (not a mock) to count base-model loads and see when trials join."""
    log = {"jobs": 0, "joins": []}  # joins: (job steps done, trials active) at each add_trial

    class CountingJob(ls.PackedJob):
        def __init__(self, *args, **kwargs):
            log["jobs"] += 1
            super().__init__(*args, **kwargs)

        def add_trial(self, cfg, state=None):
            log["joins"].append((len(self.step_stats), len(self.trials)))
            return super().add_trial(cfg, state=state)

    monkeypatch.setattr(lso, "PackedJob", CountingJob)
    return log


@contextlib.contextmanager
def optuna_log_lines(level):
    """The messages Optuna's loggers emit at `level` and above, meanwhile."""
    lines = []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())
    optuna.logging.set_verbosity(min(level, optuna.logging.WARNING))
    logging.getLogger("optuna").addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger("optuna").removeHandler(handler)
        optuna.logging.set_verbosity(optuna.logging.WARNING)


def finished_count(study) -> int:
    """Finished trials, without the FAILed ones whose params were enqueued again."""
    return sum(1 for t in study.trials if t.state in FINISHED and not t.user_attrs.get("requeued"))


# --------------------------------------------------------------------------- a sweep end to end


def test_journal_sweep_packs_trials_and_loads_the_base_model_once(spec, tmp_path, job_log):
    study = optuna.create_study(storage=JournalStorage(JournalFileBackend(str(tmp_path / "journal.log"))),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2))
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 4, "batch_size": 2},
                                max_concurrent=4)
    sampler.optimize(n_trials=8, show_progress_bar=False)

    trials = study.trials
    assert len(trials) == 8 and all(t.state in FINISHED for t in trials)
    assert job_log["jobs"] == 1 and len(sampler.jobs) == 1
    pack_ids = Counter(t.user_attrs["pack_id"] for t in trials)
    assert pack_ids.most_common(1)[0][1] >= 2
    for t in trials:
        assert t.intermediate_values, t.number
        assert t.user_attrs["tokens_per_second"] > 0
        config = ls.TrialConfig.from_dict(t.user_attrs["config"])
        assert (config.learning_rate, config.rank, config.max_steps) == (
            t.params["learning_rate"], t.params["rank"], 4)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert complete
    for t in complete:
        assert t.value == t.intermediate_values[4]
        assert os.path.exists(os.path.join(t.user_attrs["adapter_dir"], "adapter_config.json"))


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
def test_successive_halving_prunes_and_refills_the_running_job(spec, job_log, direction):
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    study = optuna.create_study(direction=direction, pruner=pruner, sampler=optuna.samplers.RandomSampler(seed=0))
    maximizing_a_loss = pytest.warns(UserWarning, match="maximizes")  # allowed, with a warning
    with maximizing_a_loss if direction == "maximize" else contextlib.nullcontext():
        sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 5, "batch_size": 2},
                                    max_concurrent=3)
    sampler.optimize(n_trials=9, show_progress_bar=False)

    states = Counter(t.state for t in study.trials)
    assert states[TrialState.PRUNED] >= 2 and states[TrialState.COMPLETE] >= 1, states
    assert len(study.trials) == 9 and job_log["jobs"] == 1
    # freed slots were refilled while the job was running: trials joined after steps, next to others
    assert any(steps > 0 and active > 0 for steps, active in job_log["joins"])
    # the pruner follows the study's direction: the best first value survives the first rung
    first = {t.number: t.intermediate_values[1] for t in study.trials}
    best = (min if direction == "minimize" else max)(first, key=first.get)
    assert study.trials[best].last_step > 1
    assert study.best_value == (min if direction == "minimize" else max)(
        t.value for t in study.trials if t.state == TrialState.COMPLETE)


def test_hyperband_prunes_concurrent_trials(spec):
    pruner = optuna.pruners.HyperbandPruner(min_resource=1, max_resource=6, reduction_factor=2)
    study = optuna.create_study(pruner=pruner, sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4))
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 6, "batch_size": 2},
                                max_concurrent=4)
    sampler.optimize(n_trials=12, show_progress_bar=False)
    states = Counter(t.state for t in study.trials)
    assert states[TrialState.PRUNED] >= 2 and states[TrialState.COMPLETE] >= 1, states
    assert states[TrialState.PRUNED] + states[TrialState.COMPLETE] == 12


def test_recorded_value_equals_the_engine_alone(spec, tmp_path):
    def space(trial):
        return ls.TrialConfig(rank=trial.suggest_int("rank", 2, 8), learning_rate=trial.suggest_float(
            "learning_rate", 1e-3, 1e-2, log=True), batch_size=2, dropout=0.0, seed=trial.number)

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, space, trial_defaults={"max_steps": 5}, max_concurrent=3)
    sampler.optimize(n_trials=3, show_progress_bar=False)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3

    for t in study.trials:
        cfg = ls.TrialConfig.from_dict({**t.user_attrs["config"], "trial_id": "alone"})
        assert cfg.seed == t.number and cfg.max_steps == 5 and cfg.dropout == 0.0
        job = ls.PackedJob(make_spec(spec.base_model, spec.train_data, spec.eval_data, tmp_path / f"alone{t.number}"),
                           [cfg], progress=False)
        finished = [e for e in job.run() if isinstance(e, ls.Finished)]
        assert t.value == finished[0].metrics["eval_loss"]  # bit for bit: pack-mates change nothing


def test_invalid_and_diverging_configs_fail_alone(spec, caplog):
    bad = {
        0: ({"dropout": 1.5}, "dropout"),  # invalid: a ConfigError before any training
        1: ({"rank": 100}, "rank"),  # larger than the tiny model's layers: the engine's Failed event
        2: ({"learning_rate": 1e30}, "non-finite"),  # diverges: the loss stops being finite
    }

    def space(trial):
        fields, _ = bad.get(trial.number, ({}, None))
        return {"rank": 4, "learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True), **fields}

    study = optuna.create_study(pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, space, trial_defaults={"max_steps": 4, "batch_size": 2})
    with caplog.at_level(logging.WARNING, logger="lora_sweep"), optuna_log_lines(logging.WARNING) as lines:
        sampler.optimize(n_trials=5, show_progress_bar=False)

    warnings = lines + [r.getMessage() for r in caplog.records if r.name.startswith("lora_sweep")]
    for t in study.trials:
        if t.number in bad:
            assert t.state == TrialState.FAIL, t.number
            assert bad[t.number][1] in t.user_attrs["fail_reason"]
            mentions = [w for w in warnings if f"Trial {t.number} failed" in w or f"trial-{t.number}" in w]
            assert len(mentions) == 1, mentions  # one warning per rejected trial
        else:
            assert t.state == TrialState.COMPLETE and math.isfinite(t.value)
    assert study.trials[2].user_attrs["pack_id"] == study.trials[3].user_attrs["pack_id"]  # a pack-mate went on
    assert study.trials[0].user_attrs["pack_id"] is None  # never joined a job


def test_a_trial_out_of_memory_fails_alone(spec, out_of_memory_when):
    """Every microbatch runs out of memory while trial 2 is in the job: the engine moves it out
    until its pack-mates finish, then it fails alone."""
    out_of_memory_when(lambda job, padded_tokens: "oom-trial-2" in job.trials)
    study = optuna.create_study(study_name="oom", pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 3, "batch_size": 2},
                                max_concurrent=3)
    sampler.optimize(n_trials=5, show_progress_bar=False)

    assert study.trials[2].state == TrialState.FAIL
    assert "out of memory" in study.trials[2].user_attrs["fail_reason"]
    assert [t.state for t in study.trials if t.number != 2] == [TrialState.COMPLETE] * 4
    assert len({t.user_attrs["pack_id"] for t in study.trials}) == 1


def test_default_space_is_plora_table_1_with_ranks_clipped_to_the_model(spec, caplog):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1), pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, trial_defaults={"max_steps": 1})
    with caplog.at_level(logging.WARNING, logger="lora_sweep"):
        sampler.optimize(n_trials=4, show_progress_bar=False)
        sampler.optimize(n_trials=5, show_progress_bar=False)
    clipped = [r.getMessage() for r in caplog.records if "clipped" in r.getMessage()]
    assert clipped == ["The default search space's ranks 8..128 are clipped to 8..24: the model's smallest "
                       "targeted layer is 24 wide."]  # the tiny model's k/v projections; said once
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 5
    for t in study.trials:
        assert set(t.params) == {"learning_rate", "batch_size", "rank", "alpha_ratio"}
        assert 2e-5 <= t.params["learning_rate"] <= 4e-4 and 8 <= t.params["rank"] <= 24
        config = t.user_attrs["config"]
        assert config["alpha"] == pytest.approx(t.params["alpha_ratio"] * t.params["rank"])


def test_objective_style_and_its_misuse(spec):
    def objective(trial):
        return ls.TrialConfig(rank=trial.suggest_int("rank", 2, 8),
                              learning_rate=trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True), batch_size=2)

    study = optuna.create_study(pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, trial_defaults={"max_steps": 2})
    with pytest.raises(TypeError, match=r"keyword arguments only.*optimize\(objective=objective"):
        sampler.optimize(objective, n_trials=2)
    with pytest.raises(ValueError, match="`objective` and the sampler's `search_space`"):
        PackedLoRASampler(study, spec, SPACE).optimize(objective=objective, n_trials=2)
    assert not study.trials  # refused at once
    sampler.optimize(objective=objective, n_trials=2, show_progress_bar=False)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:
        assert set(t.params) == {"rank", "learning_rate"} and t.user_attrs["config"]["rank"] == t.params["rank"]
        assert t.user_attrs["config"]["max_steps"] == 2


def test_a_search_function_that_raises_or_returns_junk_fails_its_trial_alone(spec, tmp_path):
    def objective(trial):
        lr = trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)
        if trial.number == 1:
            return 1 / 0
        if trial.number == 2:
            return lr  # an Optuna objective's value, not a config
        return {"rank": 4, "learning_rate": lr, "batch_size": 2}

    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", pruner=NO_PRUNING)
    PackedLoRASampler(study, spec, trial_defaults={"max_steps": 2}).optimize(
        objective=objective, n_trials=4, show_progress_bar=False)
    states = [t.state for t in study.trials]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE]
    assert "ZeroDivisionError" in study.trials[1].user_attrs["fail_reason"]
    assert "returned a float, but must return a TrialConfig" in study.trials[2].user_attrs["fail_reason"]


def test_max_trials_callback_stops_the_asking(spec):
    study = optuna.create_study(pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 2, "batch_size": 2},
                                max_concurrent=4)
    sampler.optimize(callbacks=[optuna.study.MaxTrialsCallback(5)], show_progress_bar=False)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 5


def test_progress_logs_each_trial_as_optuna_does_and_the_bars_stay_clean(spec, capsys):
    study = optuna.create_study(pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 2, "batch_size": 2})
    with optuna_log_lines(logging.INFO) as lines:
        sampler.optimize(n_trials=2)
    for t in study.trials:
        assert sum(line.startswith(f"Trial {t.number} finished with value: {t.value} and parameters: {t.params}. "
                                   "Best is trial ") for line in lines) == 1, lines
    err = capsys.readouterr().err
    loading, bars = err.split("trials:", 1)  # the base model loads before the sweep's bars open
    assert "\x1b[" not in loading
    assert "lora_sweep:" in bars and "2/2" in bars  # the job's steps, the trials


def test_plain_optuna_still_works_and_sampling_is_delegated(spec):
    def objective(trial):
        return trial.suggest_float("x", -1, 1) ** 2

    plain = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    plain.optimize(objective, n_trials=5)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    inner = study.sampler
    PackedLoRASampler(study, spec)
    again = PackedLoRASampler(study, spec)  # a second wrapper unwraps the first
    assert study.sampler is again and again._sampler is inner
    study.optimize(objective, n_trials=5)
    assert [t.params for t in study.trials] == [t.params for t in plain.trials]


def test_median_pruner_warns_and_bad_arguments_raise(spec):
    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=5))
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 1})
    with pytest.warns(UserWarning, match="n_startup_trials=5"):
        sampler.optimize(n_trials=1, show_progress_bar=False)
    with pytest.raises(ValueError, match="eval_data"):
        PackedLoRASampler(study, ls.JobSpec(base_model=spec.base_model, train_data=spec.train_data))
    with pytest.raises(ls.ConfigError, match="both in the search space and fixed"):
        PackedLoRASampler(study, spec, SPACE, trial_defaults={"rank": 4})
    with pytest.raises(ValueError, match="n_trials"):
        sampler.optimize(n_trials=0)
    for devices in ([], [[]], [["cuda:0", ""]], [None]):
        with pytest.raises(ValueError, match="device groups"):
            PackedLoRASampler(study, spec, devices=devices)
    # a group of one is that device; a group of several with a model factory cannot reach its ranks
    assert PackedLoRASampler(study, spec, devices=[[0], "cpu"])._devices == ["cuda:0", "cpu"]
    with pytest.raises(ValueError, match="not a factory"):
        RankGroupJob(ls.JobSpec(base_model=lambda: None, train_data=spec.train_data), ["cpu", "cpu"])


def test_interrupted_sweep_resumes_with_the_same_jobs(spec, job_log):
    """Ctrl-C mid-sweep: running trials are told FAIL and re-enqueued; the next optimize call
    reruns them on the job that is still loaded and ends with the requested number of trials."""
    def interrupt_once(study, trial):
        if not interrupted:
            interrupted.append(trial.number)
            raise KeyboardInterrupt

    interrupted = []
    study = optuna.create_study(pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 3, "batch_size": 2},
                                max_concurrent=3)
    with pytest.raises(KeyboardInterrupt):
        sampler.optimize(n_trials=5, callbacks=[interrupt_once], show_progress_bar=False)
    restarted = [t for t in study.trials if t.state == TrialState.FAIL]
    assert restarted and all(t.user_attrs["requeued"] and "KeyboardInterrupt" in t.user_attrs["fail_reason"]
                             for t in restarted)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]

    sampler.optimize(n_trials=5, show_progress_bar=False)
    assert finished_count(study) == 5 and job_log["jobs"] == 1
    reruns = [t for t in study.trials if "restart_of" in t.user_attrs]
    assert sorted(t.user_attrs["restart_of"] for t in reruns) == sorted(t.number for t in restarted)
    for t in reruns:
        assert t.params == study.trials[t.user_attrs["restart_of"]].params and t.state == TrialState.COMPLETE
    before = len(study.trials)
    sampler.optimize(n_trials=5, show_progress_bar=False)  # already there: nothing to do
    assert len(study.trials) == before


def test_several_devices_run_one_job_each(spec):
    study = optuna.create_study(pruner=NO_PRUNING)
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 2, "batch_size": 2},
                                max_concurrent=2, devices=["cpu", "cpu"])
    sampler.optimize(n_trials=6, show_progress_bar=False)
    assert len(sampler.jobs) == 2
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 6
    assert {t.user_attrs["pack_id"] for t in study.trials} == {job.pack_id for job in sampler.jobs}


# --------------------------------------------------------------------------- worker processes


def start_worker(tmp_path, storage: str, name: str, n_trials: int, max_steps: int, model_dir, toy_data,
                 checkpoint_every=None, start_with=()):
    """A sweep worker in a process of its own (`worker_main`). Workers named in `start_with`
    wait for each other once their imports are done, before they sweep."""
    data = tmp_path / "data"
    if not data.exists():
        data.mkdir()
        for split, rows in zip(("train", "eval"), toy_data):
            (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = dict(storage=storage, model=str(model_dir), data=str(data), output=str(tmp_path / "runs"),
                n_trials=n_trials, max_steps=max_steps, log=str(tmp_path / f"{name}.trials"),
                checkpoint_every=checkpoint_every, name=name, start_with=list(start_with))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, __file__, json.dumps(args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, timeout: float, what: str, worker=None):
    deadline = time.monotonic() + timeout
    while not condition():
        if worker is not None and worker.poll() is not None:
            pytest.fail(f"the worker exited before {what}:\n{worker.stdout.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # RDBStorage(heartbeat_interval=)
def test_resume_after_the_worker_is_killed(tiny_llama_dir, toy_data, tmp_path):
    storage_url = f"sqlite:///{tmp_path / 'study.db'}"
    worker = start_worker(tmp_path, storage_url, "killed", 6, 20, tiny_llama_dir, toy_data)
    storage = RDBStorage(storage_url, heartbeat_interval=60)  # Optuna's own heartbeat on, too

    def mid_sweep():
        try:
            trials = optuna.load_study(study_name="sweep", storage=storage).trials
        except KeyError:  # not created yet
            return False
        return any(t.state == TrialState.COMPLETE for t in trials) and any(
            t.state == TrialState.RUNNING and t.intermediate_values for t in trials)

    wait_for(mid_sweep, 120, "a trial completes while others run", worker)
    worker.kill()  # SIGKILL: no cleanup, trials stay RUNNING
    worker.wait()
    study = optuna.load_study(study_name="sweep", storage=storage, pruner=NO_PRUNING)
    left_running = [t.number for t in study.trials if t.state == TrialState.RUNNING]
    assert left_running

    sampler = PackedLoRASampler(study, make_spec(tiny_llama_dir, *toy_data, tmp_path / "runs"), SPACE,
                                trial_defaults={"max_steps": 20, "batch_size": 2}, max_concurrent=2)
    sampler.optimize(n_trials=6, show_progress_bar=False)

    trials = study.trials
    table = "\n".join(f"{t.number} {t.state.name} {t.params} {t.user_attrs}" for t in trials)
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)], table
    assert finished_count(study) == 6, table
    for number in left_running:
        assert trials[number].user_attrs["requeued"] and "stopped" in trials[number].user_attrs["fail_reason"], table
        rerun = [t for t in trials if t.user_attrs.get("restart_of") == number]
        if trials[number].params:  # (killed while sampling it, a trial has no params to run again)
            assert len(rerun) == 1 and rerun[0].params == trials[number].params, table
            assert rerun[0].state in FINISHED


@pytest.mark.slow
def test_a_trial_its_worker_never_claimed_is_failed_before_the_budget_counts(spec, tmp_path):
    """A worker killed between creating a trial and claiming it leaves a RUNNING trial without
    params or owner. A sweep started at once waits until it is old enough to tell from a live
    worker's new trial, fails it, and runs its full budget without it."""
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'study.db'}", pruner=NO_PRUNING)
    orphan = study._storage.create_new_trial(study._study_id)  # RUNNING, unclaimed, a moment old
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 2, "batch_size": 2})
    sampler.optimize(n_trials=2, show_progress_bar=False)

    trials = study.trials
    table = "\n".join(f"{t.number} {t.state.name} {t.params} {t.user_attrs}" for t in trials)
    failed = next(t for t in trials if t._trial_id == orphan)
    assert failed.state == TrialState.FAIL and failed.user_attrs["requeued"], table
    assert "unknown worker stopped" in failed.user_attrs["fail_reason"], table
    assert not [t for t in trials if t.state == TrialState.RUNNING], table
    assert finished_count(study) == 2, table


@pytest.mark.slow
def test_killed_trials_continue_from_their_checkpoints(tiny_llama_dir, toy_data, tmp_path):
    """kill -9 mid-sweep on a JournalStorage; the rerun of each killed trial continues from its
    engine checkpoint and ends with the value of that config trained without interruption."""
    journal = str(tmp_path / "journal.log")
    worker = start_worker(tmp_path, journal, "killed", 4, 16, tiny_llama_dir, toy_data, checkpoint_every=2)
    storage = JournalStorage(JournalFileBackend(journal))

    def past_a_checkpoint():
        try:
            trials = optuna.load_study(study_name="sweep", storage=storage).trials
        except KeyError:
            return False
        return any(t.state == TrialState.RUNNING and len(t.intermediate_values) >= 5 for t in trials)

    wait_for(past_a_checkpoint, 120, "a trial passes a checkpoint", worker)
    worker.kill()
    worker.wait()
    killed = [t for t in optuna.load_study(study_name="sweep", storage=storage).trials
              if t.state == TrialState.RUNNING and len(t.intermediate_values) >= 5]
    assert killed

    with torch_threads(1):  # as the worker ran: then the rerun matches bit for bit
        study = optuna.load_study(study_name="sweep", storage=storage, pruner=NO_PRUNING)
        spec = make_spec(tiny_llama_dir, *toy_data, tmp_path / "runs", checkpoint_every=2)
        PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": 16, "batch_size": 2},
                          max_concurrent=2).optimize(n_trials=4, show_progress_bar=False)
        check_reruns(study, killed, tiny_llama_dir, toy_data, tmp_path)


def check_reruns(study, killed, tiny_llama_dir, toy_data, tmp_path):
    for dead in killed:
        rerun = next(t for t in study.trials if t.user_attrs.get("restart_of") == dead.number)
        assert rerun.state == TrialState.COMPLETE
        assert min(rerun.intermediate_values) > 2  # continued from a checkpoint, not from step 1
        config = {**rerun.user_attrs["config"], "trial_id": "alone"}
        alone = PackedJob(make_spec(tiny_llama_dir, *toy_data, tmp_path / "alone"),
                          [ls.TrialConfig.from_dict(config)], progress=False)
        last = [e for e in alone.run() if isinstance(e, Finished)][0]
        assert rerun.value == last.metrics["eval_loss"]
        got = load_file(os.path.join(rerun.user_attrs["adapter_dir"], "adapter_model.safetensors"))
        want = load_file(os.path.join(last.adapter_dir, "adapter_model.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.slow
def test_two_workers_on_one_journal_never_train_a_trial_twice(tiny_llama_dir, toy_data, tmp_path):
    journal = str(tmp_path / "journal.log")
    workers = [start_worker(tmp_path, journal, name, 8, 10, tiny_llama_dir, toy_data, start_with=("a", "b"))
               for name in ("a", "b")]
    for w in workers:
        out, _ = w.communicate(timeout=180)
        assert w.returncode == 0, out

    trained = {name: json.loads("[" + (tmp_path / f"{name}.trials").read_text().strip().replace("\n", ",") + "]")
               for name in ("a", "b")}
    study = optuna.load_study(study_name="sweep", storage=JournalStorage(JournalFileBackend(journal)))
    numbers_a, numbers_b = ({r["number"] for r in rows} for rows in trained.values())
    assert numbers_a and numbers_b and not numbers_a & numbers_b  # both worked, on different trials
    assert len(trained["a"]) + len(trained["b"]) == len(study.trials)  # each trial ended exactly once
    assert 8 <= len(study.trials) <= 9  # racing workers may overshoot by one, as with MaxTrialsCallback
    assert all(t.state in FINISHED for t in study.trials)
    dirs = [t.user_attrs["adapter_dir"] for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(dirs) == len(set(dirs))


# --------------------------------------------------------------------------- the notebook


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    path = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "optuna_quickstart.ipynb")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]


# --------------------------------------------------------------------------- worker process entry point


def worker_main(args: dict) -> None:
    """One sweep worker, as a user runs it on each machine: load the study, sweep, exit."""
    if args["storage"].startswith("sqlite"):
        storage = RDBStorage(args["storage"], heartbeat_interval=60)
    else:
        storage = JournalStorage(JournalFileBackend(args["storage"]))
    study = optuna.create_study(study_name="sweep", storage=storage, load_if_exists=True, pruner=NO_PRUNING,
                                sampler=optuna.samplers.TPESampler(constant_liar=True))
    spec = ls.JobSpec(base_model=args["model"], train_data=os.path.join(args["data"], "train.jsonl"),
                      eval_data=os.path.join(args["data"], "eval.jsonl"), max_seq_len=32, eval_every=1,
                      output_dir=args["output"], checkpoint_every=args.get("checkpoint_every"),
                      padding="max_seq_len")
    sampler = PackedLoRASampler(study, spec, SPACE, trial_defaults={"max_steps": args["max_steps"], "batch_size": 2},
                                max_concurrent=2, heartbeat_interval=1.0)

    def log_trial(study, trial):
        with open(args["log"], "a") as f:
            f.write(json.dumps({"number": trial.number, "pid": os.getpid()}) + "\n")

    # Workers meant to overlap start together: on a loaded machine one of them can otherwise
    # finish the whole sweep before the other is through its imports.
    if args["start_with"]:
        folder = os.path.dirname(args["log"])
        open(os.path.join(folder, f"{args['name']}.ready"), "w").close()
        wait_for(lambda: all(os.path.exists(os.path.join(folder, f"{n}.ready")) for n in args["start_with"]), 120,
                 f"workers {args['start_with']} to start")
    sampler.optimize(n_trials=args["n_trials"], callbacks=[log_trial], show_progress_bar=False)


if __name__ == "__main__":
    worker_main(json.loads(sys.argv[1]))
