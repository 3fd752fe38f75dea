"""One admission rule for both tuner integrations (`lora_sweep.planner.fits_running_job`):
the same trials join, wait or fail in an Optuna sweep and in a Ray Tune pack server, on the CPU.

The job's memory is made small by giving the memory model a CPU of a few bytes more than
two trials need (`lora_sweep.costmodel.detect` is what the memory model asks)."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
from optuna.trial import TrialState

import lora_sweep as ls
import lora_sweep.costmodel as costmodel
import lora_sweep.integrations.optuna as lso
from lora_sweep.config import ConfigError
from lora_sweep.costmodel import GB, CostModel
from lora_sweep.integrations.optuna import PackedLoRASampler
from lora_sweep.planner import fits_running_job

SMALL = {"rank": 4, "batch_size": 2}  # two of these fit the job's memory, not three
LARGE = {"rank": 4, "batch_size": 16}  # does not fit even alone


@pytest.fixture
def spec(tiny_llama_dir, toy_data, tmp_path):
    train, dev = toy_data
    return ls.JobSpec(base_model=tiny_llama_dir, train_data=train, eval_data=dev, max_seq_len=32, eval_every=1,
                      output_dir=str(tmp_path / "runs"))


@pytest.fixture
def room_for_two(spec, monkeypatch):
    """The memory model sees a device with room for 2.5 SMALL trials; returns that model."""
    cpu = costmodel.detect("cpu")
    model = CostModel.from_model(spec, cpu)
    capacity = model.peak_memory(0, 0, 0) + 2.5 * model.trial_memory(ls.TrialConfig(**SMALL))
    small = dataclasses.replace(cpu, memory_gb=capacity / model.load_factor / GB)
    monkeypatch.setattr(costmodel, "detect", lambda device=None: small)
    return CostModel.from_model(spec, small)


def without_trial_id(message: str) -> str:
    return message.split(": ", 1)[1]


def test_the_rule(room_for_two):
    small = [ls.TrialConfig(**SMALL, trial_id=str(i)) for i in range(3)]
    assert fits_running_job([], small[0], room_for_two, max_adapters=3)
    assert fits_running_job(small[:1], small[1], room_for_two, max_adapters=3)
    assert not fits_running_job(small[:2], small[2], room_for_two, max_adapters=3)  # memory
    assert not fits_running_job(small[:1], small[1], room_for_two, max_adapters=1)  # the cap
    assert not fits_running_job(small[:1], small[1], room_for_two, max_adapters=3, moved_out=1)
    assert fits_running_job(small[:2], small[2], None, max_adapters=3)  # no memory model: the cap alone
    with pytest.raises(ConfigError, match="GB of GPU memory"):  # never fits: an error, not a wait
        fits_running_job(small[:1], ls.TrialConfig(**LARGE), room_for_two, max_adapters=3)
    corrected = room_for_two.after_out_of_memory(small[:2])  # two trials ran out of memory after all
    assert not fits_running_job(small[:1], small[1], corrected, max_adapters=3)


def test_optuna_and_ray_tune_admit_the_same_trials(spec, room_for_two, monkeypatch):
    pytest.importorskip("ray")
    from lora_sweep.integrations.ray_tune import PackServer

    # Ray Tune: a pack server (in this process) with 3 slots
    server = PackServer(spec, "pack", max_adapters=3)
    try:
        answers = [server.try_join({**SMALL, "max_steps": 1000, "trial_id": str(i)}) for i in range(3)]
        large = server.try_join({**LARGE, "trial_id": "large"})
        tickets = [ticket for status, ticket in answers if status == "joined"]
    finally:
        for ticket in tickets:
            server.leave(ticket)
        server.shutdown()
    assert [status for status, _ in answers] == ["joined", "joined", "full"]
    assert large[0] == "invalid"

    # Optuna: 3 slots, the same trials; the third waits for a slot, the large one fails alone
    joins = []  # trials in the job when one joins

    class RecordingJob(ls.PackedJob):
        def add_trial(self, cfg, state=None):
            joins.append(len(self.trials))
            return super().add_trial(cfg, state=state)

    monkeypatch.setattr(lso, "PackedJob", RecordingJob)
    configs = [SMALL, SMALL, SMALL, LARGE]
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    sampler = PackedLoRASampler(study, spec, lambda trial: configs[trial.number], trial_defaults={"max_steps": 2},
                                max_concurrent=3)
    sampler.optimize(n_trials=4, show_progress_bar=False)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3 + [TrialState.FAIL]
    assert max(joins) == 1  # never a third trial beside two
    assert without_trial_id(study.trials[3].user_attrs["fail_reason"]) == without_trial_id(large[1])
