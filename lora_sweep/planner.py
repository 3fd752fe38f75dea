"""Plan a sweep: which trials share a packed job, on how many GPUs, and when each job runs.

Four tools, from the biggest to the smallest:

* `plan` schedules a whole known sweep offline (PLoRA's planner): an event-driven loop
  launches the best job whenever GPUs free up. For every free GPU count d in {1, 2, 4, ...}
  a MILP (`best_job`, PLoRA's job throughput problem) picks the trials that maximise the
  job's throughput within memory, and the GPU count with the best throughput per GPU wins
  (PLoRA's DTM). Jobs are anchored on the longest pending trial and capped so that the last
  ones end together (the tail effect).
* `best_job` is that MILP on its own.
* `admit` decides which waiting trials join a running job now: greedy, in arrival order;
  `fits_running_job` is its answer for one trial, the rule of both tuner integrations'
  continuous packing.
* `pack_microbatches` splits one step's samples into microbatches under a token capacity
  (LoRAFusion's two-stage bin-packing MILP with a greedy fallback).

Memory and time come from `lora_sweep.costmodel.CostModel`; MILPs are written with cvxpy
and solved by HiGHS.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, NamedTuple, Optional, Sequence, Union

import numpy as np

from .config import ConfigError, TrialConfig
from .costmodel import GB, CostModel, gpu_counts

if TYPE_CHECKING:  # cvxpy loads only when a MILP is built: importing lora_sweep stays quick
    import cvxpy as cp

logger = logging.getLogger(__name__)

__all__ = ["FailedTrial", "Plan", "PlannedJob", "admit", "best_job", "fits_running_job", "pack_microbatches", "plan",
           "plan_bases"]


# --------------------------------------------------------------------------- results


@dataclass
class PlannedJob:
    """One packed job of a `Plan`: these trials start together on these GPUs."""

    trials: list[TrialConfig]
    num_gpus: int
    start: float  # seconds from the start of the sweep
    end: float
    gpu_ids: tuple[int, ...] = ()
    memory_per_gpu: float = 0.0  # predicted peak bytes on each of its GPUs
    step_seconds: float = 0.0  # predicted time of its first step (all trials active)
    base: Optional[str] = None  # the base model's name in a plan of several (`plan_bases`)

    @property
    def duration(self) -> float:
        return self.end - self.start


class FailedTrial(NamedTuple):
    """A trial the planner could not place, and why."""

    trial: TrialConfig
    error: ConfigError


@dataclass
class Plan:
    """A schedule of packed jobs on `num_gpus` GPUs; every trial is in one job or in `failed`.

    `lower_bound` is the jobs' total GPU time spread evenly over all GPUs: no schedule of
    these jobs ends sooner, so `ratio` = makespan / lower bound measures the idle GPU time.
    """

    jobs: list[PlannedJob]
    num_gpus: int
    failed: list[FailedTrial] = field(default_factory=list)
    cost_model: Optional[CostModel] = field(default=None, repr=False)  # of a plan of one base
    cost_models: dict[str, CostModel] = field(default_factory=dict, repr=False)  # of each base (`plan_bases`)

    @property
    def makespan(self) -> float:
        return max((j.end for j in self.jobs), default=0.0)

    @property
    def lower_bound(self) -> float:
        return sum(j.num_gpus * j.duration for j in self.jobs) / self.num_gpus

    @property
    def ratio(self) -> float:
        return self.makespan / self.lower_bound if self.lower_bound > 0 else 1.0

    def table(self) -> str:
        """The plan as a text table, one job per line, with a summary line."""
        bases = any(j.base is not None for j in self.jobs)
        width = max((len(str(j.base)) for j in self.jobs), default=4) if bases else 0
        head = f"{'base':<{width}} " if bases else ""
        lines = [f"{'job':>4} {head}{'gpus':<12} {'start':>9} {'end':>9} {'mem/GPU':>9} {'step':>8}  "
                 "trials (rank/batch)"]
        for k, j in enumerate(self.jobs):
            trials = " ".join(f"{_name(t, i)}({t.rank}/{t.batch_size})" for i, t in enumerate(j.trials))
            base = f"{str(j.base):<{width}} " if bases else ""
            lines.append(f"{k:>4} {base}{','.join(map(str, j.gpu_ids)):<12} {_hms(j.start):>9} {_hms(j.end):>9} "
                         f"{j.memory_per_gpu / GB:>6.1f} GB {j.step_seconds:>7.2f}s  {trials}")
        for f in self.failed:
            lines.append(f"failed: {f.error}")
        n = sum(len(j.trials) for j in self.jobs)
        lines.append(f"{n} trials in {len(self.jobs)} jobs on {self.num_gpus} GPUs, {len(self.failed)} failed: "
                     f"makespan {_hms(self.makespan)}, lower bound {_hms(self.lower_bound)} "
                     f"(ratio {self.ratio:.3f})")
        return "\n".join(lines)

    def gantt(self, path: str) -> str:
        """Draw the jobs over GPUs and time and save the chart as a PNG.

        Args:
            path:
                Where to write the image.

        Returns:
            `path`.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        unit, scale = ("h", 3600.0) if self.makespan > 2 * 3600 else ("min", 60.0)
        fig, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * self.num_gpus))
        colors = plt.get_cmap("tab20").colors
        for k, j in enumerate(self.jobs):
            for first, last in _runs(j.gpu_ids):  # one bar per block of adjacent GPUs
                ax.barh((first + last) / 2, j.duration / scale, left=j.start / scale, height=last - first + 0.8,
                        color=colors[k % len(colors)], edgecolor="black", linewidth=0.5)
            if j.duration / max(self.makespan, 1e-9) > 0.04:
                first, last = _runs(j.gpu_ids)[0]
                ax.text((j.start + j.duration / 2) / scale, (first + last) / 2, f"{k}: {len(j.trials)}",
                        ha="center", va="center", fontsize=7)
        ax.axvline(self.lower_bound / scale, color="red", linestyle="--", linewidth=1, label="lower bound")
        ax.set_yticks(range(self.num_gpus), [f"GPU {g}" for g in range(self.num_gpus)])
        ax.invert_yaxis()
        ax.set_xlabel(f"time ({unit})")
        ax.set_title(f"{sum(len(j.trials) for j in self.jobs)} trials in {len(self.jobs)} jobs (label: job: trials); "
                     f"makespan {_hms(self.makespan)}, ratio to lower bound {self.ratio:.3f}", fontsize=9)
        ax.legend(loc="lower right", fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first, last) of each block of consecutive numbers in `ids`."""
    runs: list[tuple[int, int]] = []
    for g in sorted(ids):
        if runs and runs[-1][1] == g - 1:
            runs[-1] = (runs[-1][0], g)
        else:
            runs.append((g, g))
    return runs


def _name(trial: TrialConfig, index: int) -> str:
    return trial.trial_id if trial.trial_id is not None else f"#{index}"


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


# --------------------------------------------------------------------------- one job: the throughput MILP

Objective = Literal["time", "tokens", "rank"]
JOB_MILP_RATIO_TOLERANCE = 1e-3  # a job within 0.1% of the best throughput is taken as the best
JOB_MILP_TIME_LIMIT_S = 2.0  # a safety net per solve (they take milliseconds): the best job so far stands


def packed_seconds(cm: CostModel, trial: TrialConfig, num_gpus: int, max_adapters: Optional[int] = None) -> float:
    """GPU-seconds `trial` is expected to cost once packed on `num_gpus` GPUs: its own step
    time, plus its share of the fixed step time with as many such trials as fit in one job."""
    d = num_gpus
    peers = max(1, min(int(cm.trial_budget(d) // max(cm.trial_memory(trial), 1.0)), max_adapters or 10**9))
    return d * (cm.trial_job_seconds(trial, d) + trial.max_steps * cm.fixed_step_seconds(d) / peers)


def _value(cm: CostModel, trial: TrialConfig, objective: Objective, num_gpus: int,
           max_adapters: Optional[int]) -> float:
    """What training `trial` counts for in a job's throughput, over all its steps: the GPU
    time it costs in a full pack (`packed_seconds`), its tokens (PLoRA's training
    throughput), or its rank (adapter ranks per step time)."""
    if objective == "time":
        return packed_seconds(cm, trial, num_gpus, max_adapters)
    if objective == "rank":
        return float(trial.rank * trial.max_steps)
    if objective == "tokens":
        return float(trial.batch_size * trial.gradient_accumulation_steps * cm.max_seq_len * trial.max_steps)
    raise ValueError(f"The value of `objective` is {objective!r}, but must be 'time', 'tokens' or 'rank'.")


class _JobMILP:
    """PLoRA's job throughput problem for one GPU count d, built once and re-solved.

    A job of trials x (binary) runs ``max(steps)`` steps of a fixed time plus each trial's own
    step time for each of its steps (`CostModel.job_seconds`), so its duration D(x) is linear
    once the job's step count is a variable ``S >= steps_i x_i``. Its throughput is
    ``w.x / D(x)`` with w_i the trial's worth over its steps (`_value`). Dinkelbach's method turns the ratio into a few
    linear MILPs: for a lambda reached by a feasible job, solve ``max w.x - lambda D(x)``;
    if the best value is 0 the job with ratio lambda is optimal, else its solution has a
    higher ratio and becomes the next lambda. Each MILP stops once its bound is within
    `JOB_MILP_RATIO_TOLERANCE` of the current job's worth, so the job found has a throughput
    within about 0.1% of the best (proving exact optimality costs most of the solve time
    when many trials are worth nearly their cost).

    Constraints: memory per GPU within the cost model's capacity, D(x) <= `max_seconds`,
    at most `max_adapters` trials, and parameters marking which trials are available and
    which one must be in the job.
    """

    def __init__(self, cm: CostModel, trials: Sequence[TrialConfig], num_gpus: int, max_adapters: Optional[int],
                 objective: str):
        import cvxpy as cp
        n, d = len(trials), num_gpus
        self.weight = np.array([_value(cm, t, objective, d, max_adapters) for t in trials])
        self.steps = np.array([t.max_steps for t in trials], dtype=float)
        self.seconds = np.array([cm.trial_job_seconds(t, d) for t in trials])
        self.fixed = cm.fixed_step_seconds(d)
        self.memory = np.array([cm.trial_memory(t) for t in trials]) / GB
        self.budget = cm.trial_budget(d) / GB
        self.max_adapters = max_adapters

        self.x = cp.Variable(n, boolean=True)
        job_steps = cp.Variable(nonneg=True)
        self.lam = cp.Parameter(nonneg=True)
        self.available = cp.Parameter(n, nonneg=True)
        self.required = cp.Parameter(n, nonneg=True)
        self.max_seconds = cp.Parameter(nonneg=True)
        duration = self.fixed * job_steps + self.seconds @ self.x
        constraints = [
            self.memory @ self.x <= self.budget,
            duration <= self.max_seconds,
            job_steps >= cp.multiply(self.steps, self.x),
            self.x <= self.available,
            self.x >= self.required,
        ]
        if max_adapters is not None:
            constraints.append(cp.sum(self.x) <= max_adapters)
        self.problem = cp.Problem(cp.Maximize(self.weight @ self.x - self.lam * duration), constraints)

    def duration(self, x: np.ndarray) -> float:
        return self.fixed * self.steps[x].max(initial=0) + self.seconds[x].sum()

    def feasible(self, x: np.ndarray, max_seconds: float) -> bool:
        return (self.memory[x].sum() <= self.budget + 1e-9 and self.duration(x) <= max_seconds * (1 + 1e-9)
                and (self.max_adapters is None or x.sum() <= self.max_adapters))

    def greedy(self, available: np.ndarray, required: Optional[int], max_seconds: float) -> np.ndarray:
        """A good feasible start: add trials by weight per second while the ratio improves."""
        x = np.zeros(len(self.weight), dtype=bool)
        if required is not None:
            x[required] = True
        for i in np.argsort(-self.weight / np.maximum(self.seconds, 1e-12)):
            if available[i] and not x[i]:
                y = x.copy()
                y[i] = True
                if self.feasible(y, max_seconds) and (not x.any() or self.ratio(y) >= self.ratio(x)):
                    x = y
        return x

    def ratio(self, x: np.ndarray) -> float:
        return self.weight[x].sum() / self.duration(x) if x.any() else 0.0

    def solve(self, available: np.ndarray, required: Optional[int] = None,
              max_seconds: float = math.inf) -> np.ndarray:
        """The available trials (a boolean mask) of the highest-throughput job; empty if none fits."""
        import cvxpy as cp
        x = self.greedy(available, required, max_seconds)
        if not x.any():
            return x
        self.available.value = available.astype(float)
        self.required.value = np.zeros(len(x))
        if required is not None:
            self.required.value[required] = 1.0
        # no limit: the longest job of the available trials, so the bound stays on the problem's scale
        self.max_seconds.value = min(max_seconds, 2 * self.duration(available) + 1.0)
        for _ in range(50):  # Dinkelbach converges superlinearly; a handful of rounds in practice
            lam = self.ratio(x)
            self.lam.value = lam
            # stop once no job can beat lambda by more than JOB_MILP_RATIO_TOLERANCE of this job's worth
            self.problem.solve(solver=cp.HIGHS, mip_abs_gap=JOB_MILP_RATIO_TOLERANCE * self.weight[x].sum(),
                               mip_rel_gap=0.0, time_limit=JOB_MILP_TIME_LIMIT_S)
            if self.x.value is None:
                logger.info("The job MILP ended with status %s; keeping the best job so far.", self.problem.status)
                break
            y = self.x.value > 0.5
            if not y.any() or not self.feasible(y, max_seconds) or self.ratio(y) <= lam * (1 + 1e-9):
                break
            x = y
        return x


def best_job(
    cost_model: CostModel,
    trials: Sequence[TrialConfig],
    num_gpus: int = 1,
    *,
    required: Optional[TrialConfig] = None,
    max_seconds: float = math.inf,
    max_adapters: Optional[int] = None,
    objective: Objective = "time",
) -> tuple[list[TrialConfig], float]:
    """The subset of `trials` whose packed job on `num_gpus` GPUs has the highest throughput.

    Throughput is what the trials are worth, summed over their steps, per second of the
    job's predicted duration. With ``objective="time"`` (the default) a trial is worth the GPU
    time it costs in a full pack (`packed_seconds`: its own step time plus its share of the
    fixed step time), so every trial that fits raises the throughput until memory is full:
    the job that packs the most work per second, which is what shortens a sweep. The other
    objectives are PLoRA's: tokens (``"tokens"``, training throughput) or adapter ranks
    (``"rank"``; with equal ``max_steps``, the sum of ranks per step time). Both undervalue
    small trials: one of batch 1 trains few tokens, so the best job leaves it out, and it
    then runs in a job of its own, paying the fixed step time alone.

    The job must fit in memory, last at most `max_seconds` and hold at most
    `max_adapters` trials. This 0-1 linear-fractional program is solved to within 0.1% of the best
    throughput by Dinkelbach's method: a short sequence of linear MILPs (cvxpy, HiGHS), see `_JobMILP`.

    Example:

        .. code::

            cm = CostModel.from_model("qwen2.5-7b", gpu="h100-sxm", max_seq_len=512)
            trials = [TrialConfig(rank=r, batch_size=b) for r in (8, 64) for b in (1, 4, 16)]
            chosen, throughput = best_job(cm, trials, num_gpus=1)

    Args:
        cost_model:
            Memory and step-time model of the base model and GPU.
        trials:
            The candidates.
        num_gpus:
            GPUs of the job.
        required:
            A trial (one of `trials`) that must be in the job.
        max_seconds:
            Longest allowed job duration.
        max_adapters:
            Most trials in the job.
        objective:
            ``"time"``, ``"tokens"`` or ``"rank"``: what a trial's training counts for.

    Returns:
        The chosen trials (empty if none fits) and the job's throughput (packed GPU-seconds,
        tokens or rank-steps per second).
    """
    trials = list(trials)
    if not trials:
        return [], 0.0
    milp = _JobMILP(cost_model, trials, num_gpus, max_adapters, objective)
    index = None if required is None else next(i for i, t in enumerate(trials) if t is required)
    x = milp.solve(np.ones(len(trials), dtype=bool), index, max_seconds)
    return [t for t, keep in zip(trials, x) if keep], milp.ratio(x)


# --------------------------------------------------------------------------- the whole sweep


def plan(
    spec_or_model_config: Any,
    trials: Sequence[TrialConfig],
    num_gpus: int = 8,
    gpu_memory_gb: Optional[float] = 80,
    *,
    gpu: Union[str, Any] = "h100-sxm",
    cost_model: Optional[CostModel] = None,
    max_adapters_per_job: Optional[int] = None,
    objective: Objective = "time",
    **cost_model_kwargs: Any,
) -> Plan:
    """Schedule every trial of a sweep into packed jobs on `num_gpus` GPUs.

    All trials share the base model, sequence length and dtype of `spec_or_model_config`, so
    any of them may share a job (`plan_bases` plans trials of several base models together).
    The planner follows PLoRA: an event loop starts jobs whenever GPUs are free, until every
    trial is placed. For each launch:

    1. The anchor is the pending trial that would take longest alone (longest processing
       time first, so that long trials do not end up last); a trial that needs more GPUs
       than are free reserves them, and jobs started meanwhile must end before that.
    2. For every GPU count d (1, 2, 4, ... up to the free GPUs) `best_job` packs the
       highest-throughput job around the anchor (a MILP, linearised by Dinkelbach's method),
       and the d with the best throughput per GPU wins (PLoRA's DTM). Pack-mates on d GPUs
       are only trials that cost no more GPU time there than in jobs of their own size, so
       an anchor that needs many GPUs does not drag small trials onto slower, wider jobs.
    3. Tail effect: a job may not run past the time at which all GPUs would be done if the
       remaining work were spread evenly (unless its anchor alone takes longer), so the last
       jobs get fewer trials and end together (on one GPU there is no tail to balance); and a
       job that takes the last pending trials uses the number of free GPUs that finishes it
       soonest.

    A trial that does not fit in memory even alone on all `num_gpus` GPUs is not planned: its
    `ConfigError` (naming it and the memory it needs) goes to `Plan.failed`, with a warning.

    Example:

        .. code::

            trials = [TrialConfig(rank=r, batch_size=b, trial_id=f"r{r}b{b}")
                      for r in (8, 16, 32, 64, 128) for b in (1, 2, 4, 8, 16, 32)]
            p = plan("qwen2.5-7b", trials, num_gpus=8, gpu_memory_gb=80, max_seq_len=512)
            print(p.table())
            p.gantt("plan.png")

    Args:
        spec_or_model_config:
            A `JobSpec`, or the model's config in any form `CostModel.from_model` takes (a
            transformers config, a dict, a preset name such as ``"qwen2.5-7b"``, a local
            directory). Ignored when `cost_model` is given.
        trials:
            The trials to schedule.
        num_gpus:
            GPUs available to the sweep.
        gpu_memory_gb:
            Memory of each GPU; overrides the `gpu` profile's (None keeps it).
        gpu:
            The GPU profile for step times (a name in ``costmodel.GPUS`` or a ``GPU``).
        cost_model:
            A ready (e.g. calibrated) cost model; then `gpu`, `gpu_memory_gb` and the
            keyword arguments are not used.
        max_adapters_per_job:
            Most trials in one job (None: memory decides).
        objective:
            What a job's throughput counts (see `best_job`): ``"time"``, the GPU time its
            trials would cost in full packs (the default: jobs fill up, which minimises the
            makespan), ``"tokens"`` trained (PLoRA's) or ``"rank"``, adapter ranks.
        cost_model_kwargs:
            Passed to `CostModel.from_model`: ``max_seq_len``, ``dtype``,
            ``gradient_checkpointing``, ``target_modules``, ``load_factor``, ...

    Returns:
        The `Plan`.
    """
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"The value of `num_gpus` is {num_gpus!r}, but must be an integer >= 1.")
    if cost_model is None:
        cost_model = CostModel.from_model(spec_or_model_config, gpu, gpu_memory_gb=gpu_memory_gb,
                                          **cost_model_kwargs)
    jobs, failed = _schedule({None: (cost_model, trials)}, num_gpus, max_adapters_per_job, objective)
    return Plan(jobs, num_gpus, failed, cost_model)


def plan_bases(
    bases: Mapping[str, tuple[CostModel, Sequence[TrialConfig]]],
    num_gpus: int = 8,
    *,
    max_adapters_per_job: Optional[int] = None,
    objective: Objective = "time",
) -> Plan:
    """Schedule the trials of several base models into packed jobs on the same `num_gpus` GPUs:
    `plan`'s event loop over all of them at once. A job holds trials of one base only (they
    share its weights); the anchor of each launch is the pending trial of any base that would
    take longest alone, and its pack-mates come from its base, with that base's cost model.

    Example:

        .. code::

            small = CostModel.from_model("qwen2.5-0.5b", "h100-sxm", max_seq_len=512)
            large = CostModel.from_model("qwen2.5-7b", "h100-sxm", max_seq_len=512)
            p = plan_bases({"0.5b": (small, trials_small), "7b": (large, trials_large)}, num_gpus=8)
            print(p.table())  # each job names its base

    Args:
        bases:
            Each base's name -> (its `CostModel`, its trials). Trial ids need not differ
            between bases.
        num_gpus, max_adapters_per_job, objective:
            As in `plan`.

    Returns:
        The `Plan`; each job's `base` names its base, and `cost_models` holds every base's.
    """
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"The value of `num_gpus` is {num_gpus!r}, but must be an integer >= 1.")
    jobs, failed = _schedule(dict(bases), num_gpus, max_adapters_per_job, objective)
    return Plan(jobs, num_gpus, failed, cost_models={name: cm for name, (cm, _) in bases.items()})


def _schedule(bases: dict, num_gpus: int, max_adapters: Optional[int], objective: str):
    """(jobs, failed trials) of `_Scheduler` over `bases` (name -> (cost model, trials)), the
    trials that fit in memory even alone on all the GPUs; the others fail with a warning."""
    groups, failed = [], []
    for name, (cm, trials) in bases.items():
        placeable = []
        for trial in trials:
            try:
                cm.check_trial(trial, num_gpus)
                placeable.append(trial)
            except ConfigError as err:
                warnings.warn(str(err))
                failed.append(FailedTrial(trial, err))
        groups.append((name, cm, placeable))
    started = time.perf_counter()
    jobs = _Scheduler(groups, num_gpus, max_adapters, objective).run()
    logger.info("Planned %d trials in %d jobs in %.2f s.", sum(len(t) for _, _, t in groups), len(jobs),
                time.perf_counter() - started)
    return jobs, failed


class _Scheduler:
    """The event loop of `plan`: state is which trials wait and when each GPU is free. Trials
    come in groups of one base each (name, cost model, trials); a job takes one group's."""

    def __init__(self, groups: list[tuple[Optional[str], CostModel, list[TrialConfig]]], num_gpus: int,
                 max_adapters: Optional[int], objective: str):
        self.groups, self.num_gpus = groups, num_gpus
        self.max_adapters, self.objective = max_adapters, objective
        self.trials = [t for _, _, trials in groups for t in trials]
        self.group_of = np.array([g for g, (_, _, trials) in enumerate(groups) for _ in trials], dtype=int)
        self.members = [np.flatnonzero(self.group_of == g) for g in range(len(groups))]  # each group's trials
        cms = [groups[g][1] for g in self.group_of]
        self.pending = np.ones(len(self.trials), dtype=bool)
        self.free_at = np.zeros(num_gpus)  # when each GPU finishes its current job
        self.milps: dict[tuple[int, int], _JobMILP] = {}  # one per (group, GPU count), built on first use
        self.eligible: dict[tuple[int, int], np.ndarray] = {}  # per (group, GPU count): trials that may fill its jobs
        self.min_gpus = np.array([cm.min_gpus(t, num_gpus) for cm, t in zip(cms, self.trials)], dtype=int)
        self.alone = np.array([cm.job_seconds([t], d) for cm, t, d in zip(cms, self.trials, self.min_gpus)])
        self.work = np.array([packed_seconds(cm, t, d, max_adapters)
                              for cm, t, d in zip(cms, self.trials, self.min_gpus)])
        self.lpt_order = np.argsort(-self.alone, kind="stable")

    def milp(self, g: int, d: int) -> _JobMILP:
        if (g, d) not in self.milps:
            _, cm, trials = self.groups[g]
            self.milps[g, d] = _JobMILP(cm, trials, d, self.max_adapters, self.objective)
            # A trial joins a job on d GPUs only if it costs no more GPU time there than its
            # estimate (`work`): an anchor that needs many GPUs should not drag pack-mates
            # onto them that run cheaper in smaller jobs.
            own = np.array([d * cm.trial_job_seconds(t, d) for t in trials])
            self.eligible[g, d] = own <= self.work[self.members[g]] * (1 + 1e-9)
        return self.milps[g, d]

    def run(self) -> list[PlannedJob]:
        jobs, now = [], 0.0
        while self.pending.any():
            free = [g for g in range(self.num_gpus) if self.free_at[g] <= now]
            job = self._next_job(now, free)
            if job is None:  # nothing can start on the free GPUs: wait for the next job to end
                now = float(self.free_at[self.free_at > now].min())
                continue
            chosen, d = job
            name, cm, _ = self.groups[self.group_of[chosen[0]]]
            members = [self.trials[i] for i in chosen]
            duration = cm.job_seconds(members, d)
            gpu_ids = _pick_gpus(free, d)
            self.free_at[list(gpu_ids)] = now + duration
            self.pending[chosen] = False
            jobs.append(PlannedJob(members, d, now, now + duration, gpu_ids, cm.memory_per_gpu(members, d),
                                   cm.job_step_seconds(members, d), name))
        return jobs

    def _next_job(self, now: float, free: list[int]) -> Optional[tuple[np.ndarray, int]]:
        """(trial indices, GPU count) of the job to start now on the `free` GPUs, or None."""
        if not free:
            return None
        # 1. reserve GPUs for the longest pending trial if it needs more than are free
        first = next(i for i in self.lpt_order if self.pending[i])
        deadline = math.inf
        if self.min_gpus[first] > len(free):
            deadline = float(np.sort(np.maximum(self.free_at, now))[self.min_gpus[first] - 1])
        # the water level: when all GPUs would be done if the pending work were spread evenly
        level = (np.maximum(self.free_at, now).sum() + self.work[self.pending].sum()) / self.num_gpus

        # 2. the anchor: the longest pending trial that can start (and end before a reservation)
        for anchor in self.lpt_order:
            if self.pending[anchor] and self.min_gpus[anchor] <= len(free) \
                    and now + self.alone[anchor] <= deadline:
                break
        else:
            return None
        g = self.group_of[anchor]
        _, cm, trials = self.groups[g]
        local = self.members[g]
        anchor_local = int(np.searchsorted(local, anchor))

        # 3. DTM: the best job of the anchor's base around it for each GPU count, by throughput per GPU
        best = None
        for d in gpu_counts(self.num_gpus):
            if not self.min_gpus[anchor] <= d <= len(free):
                continue
            alone = cm.job_seconds([self.trials[anchor]], d)
            if now + alone > deadline:
                continue
            # one GPU has no tail to balance: nothing else could run while this job runs
            cap = deadline - now if self.num_gpus == 1 else min(max(level - now, alone), deadline - now)
            milp = self.milp(g, d)
            available = self.pending[local] & self.eligible[g, d]
            available[anchor_local] = True
            x = milp.solve(available, anchor_local, cap)
            if best is None or milp.ratio(x) / d > best[0]:
                best = (milp.ratio(x) / d, x, d)
        _, x, d = best
        chosen = local[np.flatnonzero(x)]

        # 4. tail: the last pending trials take the free GPU count that ends them soonest
        if len(chosen) == self.pending.sum():
            members = [self.trials[i] for i in chosen]
            d = min((k for k in gpu_counts(self.num_gpus) if k <= len(free) and cm.fits(members, k)),
                    key=lambda k: cm.job_seconds(members, k))
        return chosen, d


def _pick_gpus(free: list[int], d: int) -> tuple[int, ...]:
    """`d` of the `free` GPUs: an aligned block (2k, 2k+1 for d = 2, ...) if one is free, as
    such GPUs usually share the fastest links; else the lowest numbers."""
    for start in range(0, max(free) + 1, d):
        if set(range(start, start + d)) <= set(free):
            return tuple(range(start, start + d))
    return tuple(free[:d])


# --------------------------------------------------------------------------- continuous packing


def admit(
    running_trials: Sequence[TrialConfig],
    pending_trials: Sequence[TrialConfig],
    model_config: Any,
    gpu_memory_gb: Optional[float] = None,
    num_gpus: int = 1,
    *,
    max_adapters: Optional[int] = None,
    **cost_model_kwargs: Any,
) -> list[TrialConfig]:
    """The pending trials to add to a running job now without exceeding its memory.

    Greedy in arrival order, so that tuners stay fair: trials join while they fit, and the
    first one that does not fit stops the admission (later, smaller trials do not overtake
    it). A pending trial that could not fit even into an empty job never will; it is skipped
    with a warning instead of blocking the queue (`CostModel.check_trial` gives its error).

    Example:

        .. code::

            cm = CostModel.from_model(spec, gpu="h100-sxm")
            for trial in admit(job.trials.values(), waiting, cm, max_adapters=32):
                job.add_trial(trial)
                waiting.remove(trial)

    Args:
        running_trials:
            Trials already in the job.
        pending_trials:
            Waiting trials, oldest first.
        model_config:
            A `CostModel` (fastest: nothing is rebuilt), or anything `CostModel.from_model`
            takes (a `JobSpec`, a transformers config, a dict, a preset name).
        gpu_memory_gb:
            Memory of each GPU (None: the cost model's GPU's).
        num_gpus:
            GPUs of the job.
        max_adapters:
            Most trials in the job (running ones included); None: memory decides.
        cost_model_kwargs:
            Passed to `CostModel.from_model` when `model_config` is not a `CostModel`
            (``gpu``, ``max_seq_len``, ``load_factor``, ...).

    Returns:
        The admitted trials, a prefix of `pending_trials` minus the never-fitting ones.
    """
    cm = model_config
    if not isinstance(cm, CostModel):
        cost_model_kwargs.setdefault("gpu", "h100-sxm")
        cm = CostModel.from_model(model_config, cost_model_kwargs.pop("gpu"), **cost_model_kwargs)
    if gpu_memory_gb is not None and gpu_memory_gb != cm.gpu.memory_gb:
        cm = dataclasses.replace(cm, gpu=dataclasses.replace(cm.gpu, memory_gb=gpu_memory_gb))
    budget = cm.trial_budget(num_gpus) - sum(cm.trial_memory(t) for t in running_trials)
    slots = math.inf if max_adapters is None else max_adapters - len(running_trials)
    admitted = []
    for trial in pending_trials:
        if len(admitted) >= slots:
            break
        need = cm.trial_memory(trial)
        if need > budget:
            if cm.fits([trial], num_gpus):
                break  # it will fit once some running trials leave: keep the order
            warnings.warn(f"{'Trial ' + repr(trial.trial_id) if trial.trial_id is not None else 'A trial'} "
                          f"does not fit even alone on {num_gpus} GPU(s); skipped.")
            continue
        admitted.append(trial)
        budget -= need
    return admitted


def fits_running_job(
    running_trials: Sequence[TrialConfig],
    trial: TrialConfig,
    memory_model: Optional[CostModel],
    *,
    max_adapters: int,
    moved_out: int = 0,
    beside_bytes: float = 0.0,
) -> bool:
    """Whether `trial` may join a running job now: the one admission rule of the tuner
    integrations, on any device.

    It joins if the job holds fewer than `max_adapters` trials, no trial waits outside the
    job after an out-of-memory step (`moved_out`), and the memory model (the job's, as
    corrected by its out-of-memory steps) admits it beside the running ones (`admit`).
    Otherwise it waits for a trial to leave, unless it cannot fit even alone: then it never
    will, and a `ConfigError` says how much memory it needs.

    Example:

        .. code::

            memory_model = job_memory_model(spec, "cuda:0")
            job.memory_model = memory_model                   # the job corrects it on out-of-memory
            if fits_running_job(running, cfg, job.memory_model, max_adapters=8,
                                moved_out=len(job.waiting)):
                job.add_trial(cfg)

    Args:
        running_trials:
            The trials in the job, those moved out after an out-of-memory step included.
        trial:
            The trial that asks to join.
        memory_model:
            The job's memory model (`lora_sweep.costmodel.job_memory_model`, then the job's
            `memory_model`); None: the adapter cap alone decides.
        max_adapters:
            Most trials in the job at once.
        moved_out:
            Trials the job moved out after running out of memory (``len(job.waiting)``).
        beside_bytes:
            Memory that jobs of other bases hold on the same device (`memory_beside`): the
            trial joins only within what they leave.

    Returns:
        True if it joins now, False if it waits.

    Raises:
        ConfigError: if the trial does not fit even alone in the job's memory.
    """
    if memory_model is not None:
        memory_model.check_trial(trial, 1)
    if len(running_trials) >= max_adapters or (running_trials and moved_out):
        return False
    if memory_model is None:
        return True
    if beside_bytes:
        gpu = memory_model.gpu
        memory_model = dataclasses.replace(memory_model, gpu=dataclasses.replace(
            gpu, memory_gb=gpu.memory_gb - beside_bytes / (memory_model.load_factor * GB)))
    return bool(admit(running_trials, [trial], memory_model, max_adapters=max_adapters))


def new_job_fits(trial: TrialConfig, memory_model: Optional[CostModel], beside_bytes: Optional[float]) -> bool:
    """Whether a job of a base not loaded on a device yet, holding `trial`, fits beside what the
    device's other jobs hold (`memory_beside`; None: unknown, then it loads, as on a CPU).
    Raises `ConfigError` if `trial` does not fit even alone."""
    return beside_bytes is None or fits_running_job([], trial, memory_model, max_adapters=1,
                                                    beside_bytes=beside_bytes)


def memory_beside(jobs: Sequence[tuple[Optional[CostModel], Sequence[TrialConfig]]]) -> Optional[float]:
    """Bytes that `jobs` (each a memory model and its running trials) hold on one device,
    for `fits_running_job`'s `beside_bytes`; None if one of them has no memory model (then
    nothing can be said, and every job is left to its own adapter cap, as on a CPU)."""
    if any(model is None for model, _ in jobs):
        return None
    return sum(model.memory_per_gpu(list(trials)) for model, trials in jobs)


# --------------------------------------------------------------------------- microbatches


def pack_microbatches(
    sample_lengths: Sequence[int],
    capacity_tokens: int,
    time_limit: float = 1.0,
) -> list[list[int]]:
    """Split one step's samples into microbatches of at most `capacity_tokens` tokens.

    LoRAFusion's data batching: a two-stage MILP (cvxpy, HiGHS) first minimises the number
    of microbatches, then, with that number fixed, the size of the last one (the smallest,
    whose compute is hardest to overlap). First-fit-decreasing is computed first; the MILP
    only replaces it with something strictly better, so the answer is never worse than the
    greedy one, and when the solver runs out of `time_limit` or fails, the greedy answer
    stands. A sample longer than the capacity gets a microbatch of its own.

    Example:

        .. code::

            batches = pack_microbatches([900, 300, 700, 120, 2000], capacity_tokens=1024)
            # [[4], [0, 3], [1, 2]]: the oversized sample alone, then two that fit

    Args:
        sample_lengths:
            Tokens of each sample.
        capacity_tokens:
            Most tokens in one microbatch.
        time_limit:
            Seconds the MILP may take in all; 0 means greedy only.

    Returns:
        Lists of sample indices, one per microbatch, largest first (so the last is smallest).
    """
    if capacity_tokens <= 0:
        raise ValueError(f"The value of `capacity_tokens` is {capacity_tokens}, but must be `capacity_tokens > 0`.")
    lengths = [int(n) for n in sample_lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("The values of `sample_lengths` must be >= 0.")
    oversized = [[i] for i, n in enumerate(lengths) if n > capacity_tokens]
    items = [i for i, n in enumerate(lengths) if n <= capacity_tokens]
    bins = _first_fit_decreasing(items, lengths, capacity_tokens)
    deadline = time.perf_counter() + time_limit
    if time_limit > 0 and not _provably_optimal(bins, lengths, capacity_tokens):
        try:
            better = _two_stage_milp(items, lengths, capacity_tokens, len(bins), deadline)
        except Exception as err:  # cvxpy's SolverError, or no cvxpy where the engine runs
            logger.info("pack_microbatches: the MILP failed (%r); using first-fit-decreasing.", err)
            better = None
        if better is not None and _valid(better, items, lengths, capacity_tokens) \
                and _key(better, lengths) < _key(bins, lengths):
            bins = better
    elif time_limit <= 0:
        logger.info("pack_microbatches: no time for the MILP; using first-fit-decreasing.")
    return _largest_first(oversized + bins, lengths)


def _first_fit_decreasing(items: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(items, key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _largest_first(bins: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return sorted((sorted(b) for b in bins), key=lambda b: -sum(lengths[i] for i in b))


def _key(bins: list[list[int]], lengths: list[int]) -> tuple[int, int]:
    """What the two stages minimise, in order: the number of bins, then the smallest load."""
    return len(bins), min((sum(lengths[i] for i in b) for b in bins), default=0)


def _valid(bins: list[list[int]], items: list[int], lengths: list[int], capacity: int) -> bool:
    """Every item exactly once and no bin over capacity (a solver's answer is checked, not trusted)."""
    return sorted(i for b in bins for i in b) == sorted(items) and all(
        sum(lengths[i] for i in b) <= capacity for b in bins)


def _provably_optimal(bins: list[list[int]], lengths: list[int], capacity: int) -> bool:
    """True when no packing can beat `bins`: it meets both stages' lower bounds."""
    total = sum(lengths[i] for b in bins for i in b)
    fewest = math.ceil(total / capacity)
    return len(bins) == fewest and _key(bins, lengths)[1] <= max(0, total - (fewest - 1) * capacity)


def _two_stage_milp(items: list[int], lengths: list[int], capacity: int, max_bins: int,
                    deadline: float) -> Optional[list[list[int]]]:
    """Stage 1: fewest bins (at most `max_bins`, the greedy count; skipped when that already
    meets the volume bound); stage 2: with that many bins, the smallest last bin. None when
    neither stage proves a solution within the time left."""
    import cvxpy as cp
    size = np.array([lengths[i] for i in items], dtype=float)
    n, num_bins, found = len(items), max_bins, None

    def bins_of(assign: cp.Variable) -> list[list[int]]:
        chosen = np.asarray(assign.value) > 0.5
        return [[items[i] for i in np.flatnonzero(chosen[:, b])] for b in range(chosen.shape[1]) if chosen[:, b].any()]

    if max_bins > math.ceil(size.sum() / capacity):
        # stage 1: x[i, b] puts item i in bin b; used bins come first (breaks the bins' symmetry)
        x = cp.Variable((n, max_bins), boolean=True)
        used = cp.Variable(max_bins, boolean=True)
        stage1 = cp.Problem(cp.Minimize(cp.sum(used)), [
            cp.sum(x, axis=1) == 1,
            size @ x <= capacity * used,
            used[1:] <= used[:-1],
        ])
        if not _solve_until(stage1, deadline):
            return None
        found = bins_of(x)
        num_bins = len(found)

    # stage 2: exactly num_bins bins, the last one as small as possible
    y = cp.Variable((n, num_bins), boolean=True)
    loads = size @ y
    stage2 = cp.Problem(cp.Minimize(loads[num_bins - 1]), [cp.sum(y, axis=1) == 1, loads <= capacity])
    return bins_of(y) if _solve_until(stage2, deadline) else found


def _solve_until(problem: cp.Problem, deadline: float) -> bool:
    """Solve with HiGHS within the time left; True if it proved a solution optimal."""
    import cvxpy as cp
    left = deadline - time.perf_counter()
    if left <= 0:
        logger.info("pack_microbatches: the MILP ran out of time; using first-fit-decreasing.")
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cvxpy warns on a time-limited solve; the status says it all
        problem.solve(solver=cp.HIGHS, time_limit=left)
    if problem.status != cp.OPTIMAL:
        logger.info("pack_microbatches: the MILP ended with status %s (time limit %.3g s); using "
                    "first-fit-decreasing.", problem.status, left)
        return False
    return True
