"""The planner: the job MILP against brute force, whole-sweep plans, admission, microbatches."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import time

import cvxpy as cp
import pytest

from lora_sweep.config import ConfigError, TrialConfig
from lora_sweep.costmodel import CostModel
from lora_sweep.planner import FailedTrial, Plan, admit, best_job, pack_microbatches, packed_seconds, plan, plan_bases
from lora_sweep.planner import _first_fit_decreasing

QWEN_7B = "qwen2.5-7b"


def plora_table1(n: int, seed: int, max_steps: int = 200) -> list[TrialConfig]:
    """`n` configs from PLoRA's Table 1: lr 2e-5..4e-4, batch 1..32, rank 8..128, alpha r/4..4r (log scales)."""
    rng = random.Random(seed)
    log_uniform = lambda low, high: math.exp(rng.uniform(math.log(low), math.log(high)))  # noqa: E731
    trials = []
    for k in range(n):
        rank = round(log_uniform(8, 128))
        trials.append(TrialConfig(rank=rank, alpha=rank * log_uniform(0.25, 4), learning_rate=log_uniform(2e-5, 4e-4),
                                  batch_size=round(log_uniform(1, 32)), max_steps=max_steps, trial_id=f"t{k}"))
    return trials


@pytest.fixture(scope="module")
def cm() -> CostModel:
    return CostModel.from_model(QWEN_7B, gpu="h100-sxm", max_seq_len=512)


# --------------------------------------------------------------------------- the job MILP


def _brute_force(cm, trials, d, objective, required=None, max_seconds=math.inf, max_adapters=None):
    """The best throughput over every subset, from the cost model alone."""
    best = 0.0
    for size in range(1, len(trials) + 1):
        for subset in itertools.combinations(trials, size):
            if required is not None and required not in subset:
                continue
            if max_adapters is not None and size > max_adapters:
                continue
            if not cm.fits(subset, d) or cm.job_seconds(subset, d) > max_seconds:
                continue
            if objective == "time":
                value = sum(packed_seconds(cm, t, d, max_adapters) for t in subset)
            else:
                value = sum((t.rank if objective == "rank" else t.batch_size * cm.max_seq_len) * t.max_steps
                            for t in subset)
            best = max(best, value / cm.job_seconds(subset, d))
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("objective", ["time", "tokens", "rank"])
@pytest.mark.parametrize("num_gpus", [1, 2])
def test_best_job_equals_brute_force(cm, seed, objective, num_gpus):
    rng = random.Random(seed)
    trials = [TrialConfig(rank=rng.choice([8, 16, 32, 64, 128]), batch_size=rng.choice([1, 2, 4, 8, 16]),
                          max_steps=rng.choice([100, 200]), trial_id=f"t{i}") for i in range(rng.randint(7, 10))]
    chosen, throughput = best_job(cm, trials, num_gpus, objective=objective)
    assert cm.fits(chosen, num_gpus)
    assert throughput == pytest.approx(_brute_force(cm, trials, num_gpus, objective), rel=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_best_job_with_anchor_cap_and_adapter_limit_equals_brute_force(cm, seed):
    rng = random.Random(10 + seed)
    trials = [TrialConfig(rank=rng.choice([8, 32, 128]), batch_size=rng.choice([1, 2, 4, 8]), max_steps=100,
                          trial_id=f"t{i}") for i in range(9)]
    anchor = trials[rng.randrange(len(trials))]
    cap = 2.5 * cm.job_seconds([anchor], 1)
    chosen, throughput = best_job(cm, trials, 1, required=anchor, max_seconds=cap, max_adapters=3)
    assert anchor in chosen and len(chosen) <= 3 and cm.job_seconds(chosen, 1) <= cap * (1 + 1e-9)
    expected = _brute_force(cm, trials, 1, "time", required=anchor, max_seconds=cap, max_adapters=3)
    assert throughput == pytest.approx(expected, rel=1e-9)


def test_one_gpu_packs_every_trial_that_fits_into_one_job():
    """With a large fixed step time (what a host-bound step is), small trials are worth
    packing: leaving one out makes it pay the fixed time alone later. The default objective
    packs all 16 into one job; PLoRA's token throughput leaves the low-batch ones out."""
    cm = CostModel.from_model("llama-3.2-1b", gpu="h200", max_seq_len=256)
    cal = dataclasses.replace(cm.calibration, time_coefs=[0.2, 0.004] + cm.calibration.time_coefs[2:])
    cm = dataclasses.replace(cm, calibration=cal)
    trials = plora_table1(16, seed=0, max_steps=20)
    assert cm.fits(trials, 1)
    packed = plan(None, trials, num_gpus=1, cost_model=cm)
    assert [len(j.trials) for j in packed.jobs] == [16]
    by_tokens = plan(None, trials, num_gpus=1, cost_model=cm, objective="tokens")
    assert len(by_tokens.jobs) > 1 and by_tokens.makespan > 1.2 * packed.makespan


def test_best_job_when_nothing_fits(cm):
    assert best_job(cm, [TrialConfig(batch_size=64)], 1) == ([], 0.0)
    assert best_job(cm, [], 1) == ([], 0.0)


# --------------------------------------------------------------------------- whole sweeps


def _check_schedule(p: Plan, trials, cm):
    """Every trial once; jobs fit in memory; no GPU runs two jobs at once; stated times hold."""
    planned = [t for j in p.jobs for t in j.trials] + [f.trial for f in p.failed]
    assert sorted(map(id, planned)) == sorted(map(id, trials))
    for j in p.jobs:
        assert len(j.gpu_ids) == j.num_gpus == len(set(j.gpu_ids))
        assert all(0 <= g < p.num_gpus for g in j.gpu_ids)
        assert cm.memory_per_gpu(j.trials, j.num_gpus) <= cm.capacity_bytes
        assert j.end - j.start == pytest.approx(cm.job_seconds(j.trials, j.num_gpus))
    for g in range(p.num_gpus):
        spans = sorted((j.start, j.end) for j in p.jobs if g in j.gpu_ids)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert p.makespan >= p.lower_bound * (1 - 1e-12)


def test_trials_of_three_bases_share_8_gpus_in_jobs_of_one_base_each():
    """40 Table-1 configs on each of Qwen2.5-0.5B, Llama-3.2-1B and Qwen2.5-7B, on 8 GPUs: every
    trial in one job of its own base, within memory and without two jobs on a GPU at once,
    and the makespan within 1.15x of the lower bound."""
    names = ("qwen2.5-0.5b", "llama-3.2-1b", QWEN_7B)
    bases = {name: (CostModel.from_model(name, gpu="h100-sxm", max_seq_len=512), plora_table1(40, seed=k))
             for k, name in enumerate(names)}
    p = plan_bases(bases, num_gpus=8)
    assert not p.failed and set(p.cost_models) == set(names)
    for name, (cm, trials) in bases.items():
        jobs = [j for j in p.jobs if j.base == name]
        assert sorted(id(t) for j in jobs for t in j.trials) == sorted(map(id, trials))  # one job each, its base's
        for j in jobs:
            assert cm.memory_per_gpu(j.trials, j.num_gpus) <= cm.capacity_bytes
            assert j.end - j.start == pytest.approx(cm.job_seconds(j.trials, j.num_gpus))
    for g in range(8):
        spans = sorted((j.start, j.end) for j in p.jobs if g in j.gpu_ids)
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert p.ratio <= 1.15
    assert all(name in p.table() for name in names)


def test_one_base_plans_as_plan_does(cm):
    trials = plora_table1(24, seed=3)
    one = plan(None, trials, num_gpus=4, cost_model=cm)
    same = plan_bases({"7b": (cm, trials)}, num_gpus=4)
    assert [(j.start, j.end, j.gpu_ids, [t.trial_id for t in j.trials]) for j in same.jobs] == \
        [(j.start, j.end, j.gpu_ids, [t.trial_id for t in j.trials]) for j in one.jobs]
    assert {j.base for j in same.jobs} == {"7b"} and {j.base for j in one.jobs} == {None}


def test_plan_120_table1_configs_qwen7b_8_gpus(cm):
    trials = plora_table1(120, seed=0)
    started = time.perf_counter()
    p = plan(QWEN_7B, trials, num_gpus=8, gpu_memory_gb=80, gpu="h100-sxm", max_seq_len=512)
    elapsed = time.perf_counter() - started
    assert elapsed < 10.0  # planning a sweep of this size stays interactive
    assert not p.failed
    _check_schedule(p, trials, p.cost_model)
    assert max(j.memory_per_gpu for j in p.jobs) <= 0.9 * 80e9
    assert p.ratio <= 1.15
    # packing pays: less GPU time than every trial alone on the fewest GPUs it fits
    alone = sum(cm.min_gpus(t, 8) * cm.job_seconds([t], cm.min_gpus(t, 8)) for t in trials)
    assert p.lower_bound * 8 < alone


@pytest.mark.parametrize("seed, num_gpus, checkpointing", [(1, 8, True), (2, 4, False), (3, 6, False)])
def test_plans_stay_compact(seed, num_gpus, checkpointing):
    trials = plora_table1(60, seed=seed, max_steps=100)
    p = plan(QWEN_7B, trials, num_gpus=num_gpus, max_seq_len=1024, gradient_checkpointing=checkpointing)
    _check_schedule(p, trials, p.cost_model)
    assert p.ratio <= 1.15


def test_plan_is_deterministic():
    trials = plora_table1(30, seed=4)
    a, b = (plan(QWEN_7B, trials, num_gpus=4, max_seq_len=512) for _ in range(2))
    assert [([t.trial_id for t in j.trials], j.gpu_ids, j.start) for j in a.jobs] == \
           [([t.trial_id for t in j.trials], j.gpu_ids, j.start) for j in b.jobs]


def test_a_trial_too_big_for_all_gpus_fails_alone():
    trials = plora_table1(20, seed=5) + [TrialConfig(rank=64, batch_size=1024, trial_id="huge")]
    with pytest.warns(UserWarning, match="Trial 'huge': needs"):
        p = plan(QWEN_7B, trials, num_gpus=8, max_seq_len=512)
    assert [f.trial.trial_id for f in p.failed] == ["huge"]
    failure = p.failed[0]
    assert isinstance(failure, FailedTrial) and isinstance(failure.error, ConfigError)
    assert failure.error.trial_id == "huge"
    assert "GB of GPU memory" in str(failure.error) and "8 x 80 GB" in str(failure.error)
    _check_schedule(p, trials, p.cost_model)
    assert len([t for j in p.jobs for t in j.trials]) == 20
    assert "failed: Trial 'huge'" in p.table()


def test_trials_needing_several_gpus_get_them(cm):
    trials = [TrialConfig(rank=16, batch_size=32, trial_id="b32"), TrialConfig(rank=16, batch_size=1, trial_id="b1")]
    p = plan(None, trials, num_gpus=4, cost_model=cm)
    by_id = {t.trial_id: j for j in p.jobs for t in j.trials}
    assert by_id["b32"].num_gpus >= 2
    _check_schedule(p, trials, cm)


def test_the_last_job_takes_the_gpus_that_finish_it_first(cm):
    trial = TrialConfig(rank=16, batch_size=8, trial_id="only")
    p = plan(None, [trial], num_gpus=8, cost_model=cm)
    (job,) = p.jobs
    assert job.num_gpus == min((1, 2, 4, 8), key=lambda d: cm.job_seconds([trial], d))
    assert job.num_gpus > 1  # alone on one GPU while seven idle would be the tail effect


def test_max_adapters_per_job():
    trials = [TrialConfig(rank=8, batch_size=1, trial_id=f"t{i}") for i in range(12)]
    p = plan(QWEN_7B, trials, num_gpus=2, max_seq_len=256, max_adapters_per_job=3)
    assert max(len(j.trials) for j in p.jobs) <= 3
    _check_schedule(p, trials, p.cost_model)


def test_table_and_gantt(tmp_path):
    p = plan(QWEN_7B, plora_table1(16, seed=6), num_gpus=4, max_seq_len=512)
    table = p.table()
    assert table.splitlines()[0].split()[:3] == ["job", "gpus", "start"]
    assert f"ratio {p.ratio:.3f}" in table and len(table.splitlines()) == len(p.jobs) + 2
    path = p.gantt(str(tmp_path / "plan.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_empty_plan():
    p = plan(QWEN_7B, [], num_gpus=2)
    assert p.jobs == [] and p.makespan == 0 and p.ratio == 1.0


# --------------------------------------------------------------------------- admission


def test_admit_in_arrival_order(cm):
    def fifo(running, pending, d):  # the longest prefix of `pending` that fits with `running`
        k = 0
        while k < len(pending) and cm.fits(running + pending[: k + 1], d):
            k += 1
        return pending[:k]

    running = [TrialConfig(rank=16, batch_size=8)]
    pending = [TrialConfig(rank=16, batch_size=4, trial_id="a"), TrialConfig(rank=16, batch_size=16, trial_id="b"),
               TrialConfig(rank=8, batch_size=1, trial_id="c")]
    assert [t.trial_id for t in admit(running, pending, cm, num_gpus=1)] == ["a"]
    assert cm.fits(running + [pending[0], pending[2]], 1)  # c would fit, but must not overtake b
    for d in (1, 2, 4):
        for run in ([], running):
            assert admit(run, pending, cm, num_gpus=d) == fifo(run, pending, d)
    assert len(admit(running, pending, cm, num_gpus=4)) == 3


def test_admit_caps_adapters_and_skips_trials_that_never_fit(cm):
    pending = [TrialConfig(rank=8, batch_size=1, trial_id=f"t{i}") for i in range(6)]
    assert len(admit(pending[:2], pending[2:], cm, max_adapters=4)) == 2
    huge = TrialConfig(rank=8, batch_size=4096, trial_id="huge")
    with pytest.warns(UserWarning, match="'huge'"):
        assert admit([], [huge] + pending[:2], cm) == pending[:2]


def test_admit_builds_its_cost_model(cm):
    running, pending = [TrialConfig(batch_size=4)], [TrialConfig(batch_size=4), TrialConfig(batch_size=4)]
    assert admit(running, pending, QWEN_7B, 80, max_seq_len=512) == admit(running, pending, cm) == pending
    assert admit(running, pending, QWEN_7B, 40, max_seq_len=512) == []  # 40 GB: room for the running one only


# --------------------------------------------------------------------------- microbatches


def _loads(batches, lengths):
    return [sum(lengths[i] for i in b) for b in batches]


def _greedy(lengths, capacity):
    fit = [i for i, n in enumerate(lengths) if n <= capacity]
    return _first_fit_decreasing(fit, lengths, capacity), len(lengths) - len(fit)


@pytest.mark.parametrize("seed", range(25))
def test_microbatches_never_worse_than_greedy_and_within_capacity(seed):
    rng = random.Random(seed)
    capacity = rng.choice([10, 16, 64, 512])
    lengths = [rng.randint(1, int(capacity * 1.3)) for _ in range(rng.randint(1, 10))]
    batches = pack_microbatches(lengths, capacity, time_limit=5.0)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every sample once
    for b, load in zip(batches, _loads(batches, lengths)):
        assert load <= capacity or len(b) == 1  # an oversized sample sits alone
    greedy, oversized = _greedy(lengths, capacity)
    assert len(batches) <= len(greedy) + oversized
    if len(batches) == len(greedy) + oversized and greedy:
        assert _loads(batches, lengths)[-1] <= min(_loads(greedy, lengths))
    assert _loads(batches, lengths) == sorted(_loads(batches, lengths), reverse=True)  # smallest last


def test_microbatch_milp_beats_greedy():
    # first-fit-decreasing: [7 + 1], [4 + 4]; the second stage finds [4 + 4 + 1], [7]
    assert pack_microbatches([4, 4, 1, 7], 10) == [[0, 1, 2], [3]]
    # first-fit-decreasing: [14 + 5], [10 + 5 + 3], [3]; the first stage finds [14 + 3 + 3], [10 + 5 + 5]
    lengths = [10, 3, 5, 14, 5, 3]
    assert len(_greedy(lengths, 20)[0]) == 3
    assert pack_microbatches(lengths, 20) in ([[1, 3, 5], [0, 2, 4]], [[0, 2, 4], [1, 3, 5]])


def test_microbatch_oversized_samples_get_their_own():
    assert pack_microbatches([900, 300, 700, 120, 2000], 1024) == [[4], [0, 3], [1, 2]]
    assert pack_microbatches([5, 30, 20], 10) == [[1], [2], [0]]
    assert pack_microbatches([], 8) == []
    with pytest.raises(ValueError, match="capacity_tokens"):
        pack_microbatches([1], 0)


def test_microbatch_time_limit_falls_back_to_greedy(caplog):
    rng = random.Random(0)
    lengths = [rng.randint(50, 700) for _ in range(60)]
    greedy, _ = _greedy(lengths, 1024)
    expected = sorted((sorted(b) for b in greedy), key=lambda b: -sum(lengths[i] for i in b))
    with caplog.at_level(logging.INFO, logger="lora_sweep.planner"):
        assert pack_microbatches(lengths, 1024, time_limit=0.0) == expected
        assert pack_microbatches(lengths, 1024, time_limit=1e-4) == expected
    assert sum("first-fit-decreasing" in r.getMessage() for r in caplog.records) == 2


def test_microbatch_solver_failure_falls_back_to_greedy(monkeypatch, caplog):
    def broken(self, *args, **kwargs):
        raise cp.error.SolverError("HiGHS crashed")

    monkeypatch.setattr(cp.Problem, "solve", broken)
    with caplog.at_level(logging.INFO, logger="lora_sweep.planner"):
        assert pack_microbatches([4, 4, 1, 7], 10) == [[2, 3], [0, 1]]  # first-fit-decreasing's answer
    assert any("HiGHS crashed" in r.getMessage() for r in caplog.records)
