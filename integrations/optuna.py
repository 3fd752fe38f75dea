"""Optuna integration: run a study's trials packed into shared LoRA jobs.

`PackedLoRASampler` wraps the study's own sampler (TPE unless you chose another), lets it
make every sampling decision, and adds `optimize`, which drives the study through Optuna's
ask-and-tell interface instead of an objective function:

1. Ask trials while the running `PackedJob` has room (`lora_sweep.planner.fits_running_job`:
   its memory model, capped at `max_concurrent` adapters); each trial's params become a
   `TrialConfig`, and a bad one is told FAIL alone, before any training.
2. The job trains them all in one forward/backward per step; the base model is loaded once
   per device and kept for the whole sweep (and for later `optimize` calls). A sweep over
   several bases keeps one job per base and device that has trials; their jobs take turns
   on the device, and a base's job is released after `base_idle_s` without trials.
3. Each engine `Report` becomes `trial.report(value, step)`; when the pruner says so, the
   adapter leaves the job and the trial is told PRUNED. `Finished` is told COMPLETE with
   the last value, `Failed` is told FAIL with the reason. Every ended trial frees a slot
   that a newly asked trial fills at the next step.

Workers sharing one storage (an RDB URL or a `JournalStorage` file) coordinate through
it: each records its id on the trials it runs and stamps a heartbeat into the study, and
the RUNNING trials of a worker that died (no heartbeat for three intervals, or a dead
process on this host) are told FAIL and their params enqueued again; with
`JobSpec.checkpoint_every` the rerun continues from the dead trial's last checkpoint.

    study = optuna.create_study(storage="sqlite:///sweep.db", study_name="lora", load_if_exists=True)
    sampler = PackedLoRASampler(study, spec, trial_defaults={"max_steps": 200})
    sampler.optimize(n_trials=64)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import math
import os
import socket
import threading
import time
import uuid
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

try:
    import optuna
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("lora_sweep.integrations.optuna needs Optuna: pip install 'lora-sweep[optuna]'") from err

import torch
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.exceptions import TrialPruned, UpdateFinishedTrialError
from optuna.samplers import BaseSampler
from optuna.storages import InMemoryStorage
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.study import MaxTrialsCallback, Study, StudyDirection
from optuna.trial import FrozenTrial, Trial, TrialState
from tqdm.auto import tqdm

from lora_sweep import distributed
from lora_sweep import space as _space
from lora_sweep.config import (MAX_TRIAL_ID_CHARS, ConfigError, JobSpec, TrialConfig, base_of, bounded_name,
                               check_against_model, named_bases)
from lora_sweep.costmodel import job_memory_model
from lora_sweep.engine import Failed, Finished, PackedJob, Report
from lora_sweep.planner import fits_running_job, memory_beside, new_job_fits
from lora_sweep.rank_group import RankGroupJob

__all__ = ["PackedLoRASampler"]

logger = logging.getLogger(__name__)
_trial_logger = optuna.logging.get_logger("optuna.study.study")  # each ended trial, in Optuna's words

SearchSpace = Union[None, Callable[[Trial], Union[TrialConfig, Mapping[str, Any]]], Mapping[str, Any]]

# Bookkeeping in the storage, shared by all workers of a study.
_WORKER = "lora_sweep:worker"  # trial system attr: id of the worker running it
_HEARTBEAT = "lora_sweep:heartbeat:"  # study system attr prefix: + worker id -> last time.time() it was alive
_STALE_AFTER_BEATS = 3  # a worker silent for this many heartbeat intervals is dead
_ORPHAN_AFTER_S = 10.0  # an unclaimed trial this old was created by a worker that died at once


class PackedLoRASampler(BaseSampler):
    """A sampler that runs a study's LoRA trials packed onto one shared base model.

    It delegates every sampling decision to the study's own sampler (TPE unless you chose
    another; an existing `PackedLoRASampler` is unwrapped) and installs itself as the
    study's sampler, so `study.optimize` keeps working as plain Optuna. `optimize` runs the
    LoRA sweep: trials are asked while the running packed job has room, trained together in
    one forward/backward per step, reported to the pruner at every evaluation, and replaced
    by new trials as soon as they finish, are pruned or fail (continuous packing). See the
    module docstring for the flow.

    Each trial records the user attrs ``config`` (the full `TrialConfig` as a dict),
    ``pack_id``, ``base_model``, ``tokens_per_second``, ``adapter_dir`` (the PEFT adapter, when finished)
    and ``fail_reason`` (when it failed). A trial whose config is invalid, whose loss stops
    being finite or that runs out of memory fails alone; its pack-mates carry on.

    The default search space is PLoRA's Table 1 (`lora_sweep.space.PLORA_SPACE`): learning
    rate 2e-5..4e-4, batch size 1..32 and rank 8..128 on a log scale (the ranks clipped to the
    model's smallest targeted layer, with a log line), and ``alpha_ratio`` 0.25..4 (log), from
    which ``alpha = alpha_ratio * rank``; the trial's params hold
    ``alpha_ratio`` and its ``config`` the resulting ``alpha``, so it is reproducible from
    either. Many trials are in flight at once, so `TPESampler(constant_liar=True)` helps
    TPE spread them out.

    Example:

        .. code::

            import optuna
            import lora_sweep as ls
            from lora_sweep.integrations.optuna import PackedLoRASampler

            spec = ls.JobSpec(base_model="Qwen/Qwen2.5-0.5B", train_data="train.jsonl",
                              eval_data="eval.jsonl", eval_every=50)
            study = optuna.create_study(
                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=50),
                storage="sqlite:///lora.db", study_name="lora", load_if_exists=True)
            sampler = PackedLoRASampler(study, spec, trial_defaults={"max_steps": 400})
            sampler.optimize(n_trials=64)
            print(study.best_trial.user_attrs["adapter_dir"])

    Args:
        study:
            The study to optimize; its direction applies to `metric`.
        spec:
            The base model, data and evaluation settings every trial shares; or several
            bases by name (``{"qwen-0.5b": spec_a, "qwen-1.5b": spec_b}``), each a full
            `JobSpec`. A trial picks its base with ``base_model`` (the first when it names
            none): ``trial.suggest_categorical("base_model", list(bases))`` in a search
            function, or a dimension of a dict space; the default space draws it. Each base
            gets its own packed job on each device, so packs never mix bases, and a trial's
            user attr ``base_model`` says which one it trained on. A trial may also set its
            own ``max_seq_len`` (at most its base's), which it shares a pack with others at.
        search_space:
            A define-by-run function ``(optuna.Trial) -> TrialConfig`` (or a dict of
            `TrialConfig` fields); a dict of field name (or ``alpha_ratio``) -> Optuna
            distribution or `lora_sweep.space` dimension; or None for PLoRA's Table 1 space
            minus the fields that `trial_defaults` fixes. `optimize(objective=...)` takes the
            function there instead.
        trial_defaults:
            `TrialConfig` fields shared by every trial, e.g. ``{"max_steps": 200}``. They
            fill in the fields the search space does not set (for a function returning a
            `TrialConfig`: the fields it leaves at their defaults). A field in both a dict
            search space and `trial_defaults` is an error.
        metric:
            The value reported to Optuna: a key of the engine's report metrics,
            ``"eval_loss"`` (needs ``spec.eval_data``) or ``"train_loss"``. A trial's
            final value is its last one.
        max_concurrent:
            Most trials packed into one job at a time. Within that, the planner's memory
            model admits only what fits the device.
        devices:
            The devices of this worker, e.g. ``["cuda:0", "cuda:1"]`` (ints mean CUDA
            indices): one packed job per device, fed from the same study. None: ``spec.device``.
            An entry that is a list is a device group: ``[[0, 1], [2, 3]]`` runs one job over
            GPUs 0 and 1 and another over 2 and 3, each in processes of its own (one rank per
            GPU, the base sharded, each trial on one rank; `lora_sweep.rank_group`); its
            `JobSpec.base_model` must be a hub id or a directory. Admission counts a group's
            memory as that of its first device.
            For more machines, run one worker per machine on a shared storage. A script run
            under ``torchrun --nproc-per-node d`` trains one job over the d ranks (the base
            sharded, each trial on one rank): rank 0 asks and tells the study, the other ranks
            only train, and `optimize` returns on all of them when rank 0's sweep ends.
        heartbeat_interval:
            Seconds between this worker's heartbeats in a shared storage; another worker
            restarts its trials after three missed beats.
        base_idle_s:
            With several bases: seconds a base's job keeps its model on a device without any
            trial before it is released (sooner when another base needs the memory).
    """

    def __init__(
        self,
        study: Study,
        spec: Union[JobSpec, Mapping[str, JobSpec]],
        search_space: SearchSpace = None,
        *,
        trial_defaults: Optional[Mapping[str, Any]] = None,
        metric: str = "eval_loss",
        max_concurrent: int = 8,
        devices: Optional[Sequence[Union[str, int, Sequence[Union[str, int]]]]] = None,
        heartbeat_interval: float = 30.0,
        base_idle_s: float = 60.0,
    ) -> None:
        if not isinstance(study, Study):
            raise TypeError(f"The value of `study` is a {type(study).__name__}, but must be an optuna.Study.")
        if len(study.directions) != 1:
            raise ValueError(f"The study has {len(study.directions)} objectives, but PackedLoRASampler "
                             "reports one value (`metric`) per trial.")
        bases = named_bases(spec)
        if metric == "eval_loss" and any(b.eval_data is None for b in bases.values()):
            raise ValueError("The value of `metric` is 'eval_loss', but a JobSpec has no `eval_data`: "
                             "give it eval data or use metric='train_loss'.")
        if not base_idle_s >= 0:
            raise ValueError(f"The value of `base_idle_s` is {base_idle_s!r}, but must be `base_idle_s >= 0`.")
        if not isinstance(max_concurrent, int) or max_concurrent < 1:
            raise ValueError(f"The value of `max_concurrent` is {max_concurrent!r}, but must be `max_concurrent >= 1`.")
        if not heartbeat_interval > 0:
            raise ValueError(f"The value of `heartbeat_interval` is {heartbeat_interval!r}, but must be "
                             "`heartbeat_interval > 0`.")
        if study.direction == StudyDirection.MAXIMIZE and metric.endswith("loss"):
            warnings.warn(f"The study maximizes `{metric}`; create it with direction='minimize' to "
                          "find the lowest loss.", stacklevel=2)

        self._study = study
        self._bases = bases
        self._spec = next(iter(bases.values()))  # the first base: a trial's default
        self._base_idle_s = float(base_idle_s)
        self._trial_defaults = dict(trial_defaults or {})
        self._search_space = self._default_space() if search_space is None else \
            _resolve_search_space(search_space, self._trial_defaults)
        self._space_given = search_space is not None
        self._ranks_fit_model = False  # the default space's ranks are clipped to the model once it is loaded
        self._metric = metric
        self._max_concurrent = max_concurrent
        self._devices = _resolve_devices(devices, self._spec)
        self._heartbeat_interval = float(heartbeat_interval)
        self._jobs: dict[tuple[int, str], PackedJob] = {}  # (device index, base) -> its packed job
        self._worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._claiming = threading.local()  # .active while `optimize` asks a trial on this thread

        sampler = study.sampler
        while isinstance(sampler, PackedLoRASampler):
            sampler = sampler._sampler
        self._sampler = sampler
        study.sampler = self

    @property
    def jobs(self) -> list[PackedJob]:
        """The packed jobs this sampler holds, one per device and base. With one base each job
        keeps its model for the sampler's lifetime, so a later `optimize` call does not load
        it again; with several, a base's job is released after `base_idle_s` without trials."""
        return list(self._jobs.values())

    def _default_space(self, max_rank: Optional[int] = None) -> dict[str, BaseDistribution]:
        """PLoRA's Table 1 space (ranks up to `max_rank`), and with several bases, a choice
        among them as ``base_model``."""
        space = _resolve_search_space(None, self._trial_defaults, max_rank=max_rank)
        if len(self._bases) > 1 and "base_model" not in self._trial_defaults:
            space["base_model"] = CategoricalDistribution(list(self._bases))
        return space

    def optimize(
        self,
        *positional: Any,
        objective: Optional[Callable[[Trial], Union[TrialConfig, Mapping[str, Any]]]] = None,
        n_trials: Optional[int] = None,
        timeout: Optional[float] = None,
        callbacks: Optional[Sequence[Callable[[Study, FrozenTrial], None]]] = None,
        show_progress_bar: bool = True,
    ) -> None:
        """Run the packed sweep until the study holds `n_trials` trials or `timeout` passes.

        The trials' configs come from `objective` when given, else from the sampler's search
        space. Unlike an objective of `Study.optimize`, it does not train: it calls
        ``trial.suggest_*`` and returns the trial's `TrialConfig` (or a dict of its fields);
        the sampler trains it packed and reports its value. An objective that raises, or
        returns anything else, fails that trial alone (FAIL with ``fail_reason``).

        Unlike `Study.optimize`, `n_trials` counts toward the study's total: trials already
        finished (COMPLETE, PRUNED or FAIL) and those other workers are running count, so
        running `optimize` again on a resumed study, or on several workers with the same
        `n_trials`, ends with that many trials. Trials that a dead worker left RUNNING are
        told FAIL with the user attr ``requeued`` (they do not count) and their params
        enqueued again as new trials (user attr ``restart_of``). They continue from the dead
        trial's last engine checkpoint when the spec sets ``checkpoint_every`` (and the
        workers share its ``output_dir``), else they train anew from step 0. Workers racing
        for the last trials may overshoot the total by one trial each, as with Optuna's
        `MaxTrialsCallback`.

        After `timeout` no new trial starts; running ones finish. `study.stop()` in a
        callback works as in `Study.optimize`; an `optuna.study.MaxTrialsCallback` is counted
        ahead (no trial is asked while the trials it counts and the running ones reach its
        limit), so that packed trials do not overshoot it. If the sweep is interrupted (Ctrl-C
        or an error), the trials it was running are told FAIL and re-enqueued, as a dead worker's.

        Each ended trial is logged as Optuna logs it ("Trial 3 finished with value: ..."); the
        progress bars show the study's trials toward `n_trials` and the steps of each running
        packed job.

        Example:

            .. code::

                def objective(trial):
                    return ls.TrialConfig(rank=trial.suggest_int("rank", 4, 32, log=True),
                                          learning_rate=trial.suggest_float("learning_rate", 1e-5, 1e-3, log=True))

                sampler = PackedLoRASampler(study, spec, trial_defaults={"max_steps": 100})
                sampler.optimize(objective=objective, n_trials=32, timeout=3600)

        Args:
            objective:
                ``(optuna.Trial) -> TrialConfig`` (or a dict of `TrialConfig` fields), completed
                by `trial_defaults`; None: the sampler's search space. Keyword only.
            n_trials:
                The study's total number of trials to reach; None: no limit.
            timeout:
                Seconds after which no new trial starts; None: no limit.
            callbacks:
                Called as ``callback(study, frozen_trial)`` after each trial ends.
            show_progress_bar:
                Show tqdm bars of ended trials (with the best value) and of each job's steps.
        """
        if positional:
            raise TypeError(f"PackedLoRASampler.optimize takes keyword arguments only, but got {len(positional)} "
                            "positional: call it as optimize(objective=objective, n_trials=...). The objective "
                            "returns a TrialConfig (or a dict of its fields) and the sampler trains it.")
        if objective is not None and not callable(objective):
            raise TypeError(f"The value of `objective` is a {type(objective).__name__}, but must be a function "
                            "(optuna.Trial) -> TrialConfig or None.")
        if objective is not None and self._space_given:
            raise ValueError("Both `objective` and the sampler's `search_space` are given, but the trials' configs "
                             "must come from one of them.")
        if n_trials is not None and (not isinstance(n_trials, int) or n_trials < 1):
            raise ValueError(f"The value of `n_trials` is {n_trials!r}, but must be None or `n_trials >= 1`.")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"The value of `timeout` is {timeout!r}, but must be None or `timeout > 0`.")
        _warn_if_pruner_waits(self._study, self._max_concurrent)
        ranks = self._ranks()
        if ranks is not None and ranks.rank != 0:  # rank 0 runs the sweep; this rank trains its share
            distributed.follow(self._job(0, next(iter(self._bases))))
            return
        space = _resolve_search_space(objective, self._trial_defaults) if objective is not None else None
        sweep = _Sweep(self, space, n_trials, timeout, callbacks, show_progress_bar)
        self._run(sweep, space)
        if ranks is not None:
            ranks.end_runs()  # the other ranks' `follow` returns (after an error: their next collective fails)

    def _run(self, sweep: _Sweep, space) -> None:
        with sweep.started():
            feeders = [_JobFeeder(self, sweep, index) for index in range(len(self._devices))]
            if sweep.may_ask():  # load the first base before the bars open: its loading bars end cleanly
                first = next(iter(self._bases))
                jobs = [feeder.job(first) for feeder in feeders]
                if space is None and not self._space_given and not self._ranks_fit_model:
                    self._fit_default_ranks(jobs[0])
            with sweep.progress_bar():
                if len(feeders) == 1:
                    feeders[0].run()
                else:
                    _run_in_threads([feeder.run for feeder in feeders], sweep)

    def _ranks(self):
        """The ranks of the sweep's job when this script runs under torchrun (or in a process
        group it made), else None. Its first base's job is loaded here: it attaches to them."""
        import torch.distributed as dist

        if not (dist.is_available() and (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1)):
            return None
        if len(self._bases) > 1 or len(self._devices) > 1:
            raise ValueError("Under torchrun the sweep is one job over the ranks: give `PackedLoRASampler` one base "
                             "and no `devices`.")
        return self._job(0, next(iter(self._bases))).ranks

    def _job(self, index: int, base: str) -> PackedJob:
        """The packed job of `base` on device `index`, created (the base model loaded) on first use."""
        key = (index, base)
        if key not in self._jobs:
            device = self._devices[index]
            if isinstance(device, tuple):  # a device group: a job over its ranks, in processes of their own
                job = RankGroupJob(self._bases[base], device)
            else:
                job = PackedJob(dataclasses.replace(self._bases[base], device=device), progress=False)
            job.memory_model = job_memory_model(job.spec, job.device)  # corrected by OOMs
            logger.info("device %s: loaded base %r for pack %s", device, base, job.pack_id)
            self._jobs[key] = job
        return self._jobs[key]

    def _fit_default_ranks(self, job: PackedJob) -> None:
        """Clip the default space's ranks to the smallest targeted layer of the model (once)."""
        self._ranks_fit_model = True
        modules = self._trial_defaults.get("target_modules") or job.spec.target_modules
        dims = [min(job.module_shapes[m]) for m in modules if m in job.module_shapes]
        if dims:
            self._search_space = self._default_space(max_rank=min(dims))

    # ------------------------------------------------------------------ sampling: all delegated

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._sampler.infer_relative_search_space(study, trial)

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self._sampler.sample_relative(study, trial, search_space)

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self._sampler.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        # Claim the trial for this worker first thing, so that if the process dies now the
        # other workers know whose trial it was (Optuna calls this right after creating it).
        if getattr(self._claiming, "active", False):
            self._study._storage.set_trial_system_attr(trial._trial_id, _WORKER, self._worker_id)
        self._sampler.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: TrialState,
                    values: Optional[Sequence[float]]) -> None:
        self._sampler.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._sampler.reseed_rng()


# --------------------------------------------------------------------------- one optimize call


class _Sweep:
    """The state of one `optimize` call, shared by its job feeders: the trial budget, the
    clock, callbacks, the progress bar and this worker's heartbeat. Every call into the study
    goes through here under one lock, so feeders on several devices can share it."""

    def __init__(self, sampler: PackedLoRASampler, space, n_trials, timeout, callbacks, show_progress_bar):
        self.sampler = sampler
        self.study = sampler._study
        self.space = space  # the objective of this call; None: the sampler's search space
        self.n_trials = n_trials
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.callbacks = list(callbacks or [])
        self.lock = threading.RLock()
        self.aborted = threading.Event()  # a feeder failed: the others stop too
        self.shared_storage = not isinstance(self.study._storage, InMemoryStorage)
        self.stale_after = _STALE_AFTER_BEATS * sampler._heartbeat_interval  # seconds of silence: a dead worker
        self._next_stale_check = 0.0
        self.show_progress_bar = show_progress_bar
        self.bar = None
        self.heartbeat = None

    @contextlib.contextmanager
    def started(self):
        self.study._stop_flag = False  # as Study.optimize does: a stop() of an earlier run is forgotten
        with _inside_optimize(self.study):
            if self.shared_storage:
                self.heartbeat = _Heartbeat(self.study, self.sampler._worker_id, self.sampler._heartbeat_interval)
                self.heartbeat.start()
            # A trial nobody claimed (its worker died between creating and claiming it) holds a
            # place in `n_trials` until it is failed, and is failed only once old enough to tell
            # from a live worker's new one: wait for that (at most _ORPHAN_AFTER_S, and only when
            # there is one), so that the sweep counts its budget without it.
            if self.shared_storage:
                time.sleep(_orphan_age_left(self.study, self.stale_after))
            self.restart_stale_trials(include_own=True)  # nothing of ours runs yet: any RUNNING one is stale
            try:
                yield
                self.restart_stale_trials()  # an orphan found too young at the start is old enough now
            finally:
                if self.heartbeat is not None:
                    self.heartbeat.stop()

    @contextlib.contextmanager
    def progress_bar(self):
        """The bar of the study's trials toward `n_trials` (other workers' too), while it is open."""
        done = _trials_toward_budget(self.study)
        self.bar = tqdm(total=self.n_trials, initial=min(done, self.n_trials or done), desc="trials",
                        unit="trial", disable=not self.show_progress_bar, dynamic_ncols=True)
        try:
            yield
        finally:
            self.bar.close()

    # ---- the budget

    def may_ask(self) -> bool:
        """Whether a new trial may start: not stopped, before the deadline, under `n_trials`."""
        with self.lock:
            if self.aborted.is_set() or self.study._stop_flag:
                return False
            if self.deadline is not None and time.monotonic() >= self.deadline:
                return False
            self.maybe_restart_stale_trials()
            if any(_max_trials_reached(self.study, c) for c in self.callbacks if isinstance(c, MaxTrialsCallback)):
                return False
            return self.n_trials is None or _trials_toward_budget(self.study) < self.n_trials

    def restart_stale_trials(self, include_own: bool = False) -> None:
        if not self.shared_storage and not include_own:
            return  # an in-memory study has no other workers
        with self.lock:
            _restart_stale_trials(self.study, self.sampler._worker_id, self.stale_after, include_own)
        self._next_stale_check = time.monotonic() + self.sampler._heartbeat_interval

    def maybe_restart_stale_trials(self) -> None:
        if time.monotonic() >= self._next_stale_check:
            self.restart_stale_trials()

    # ---- asking

    def ask(self, trial_id_of: Callable[[Trial], str]) -> Optional[tuple[Trial, TrialConfig]]:
        """A new trial and its `TrialConfig`. A trial whose config is invalid, or whose search
        function raises or returns something else than a config, is told FAIL here and None
        comes back; one the search function prunes is told PRUNED."""
        sampler = self.sampler
        with self.lock:
            space = self.space if self.space is not None else sampler._search_space
            sampler._claiming.active = True  # `before_trial` records this worker's id
            try:
                trial = self.study.ask(None if callable(space) else space)
            finally:
                sampler._claiming.active = False
            if self.heartbeat is not None:
                self.heartbeat.add(trial._trial_id)
            try:
                cfg = _trial_config(trial, space, sampler._trial_defaults, trial_id_of(trial))
            except ConfigError as err:
                self.tell_failed(trial, str(err), pack_id=None)
                return None
            except TrialPruned:
                self.tell(trial, state=TrialState.PRUNED)
                return None
            except Exception as err:  # the search function's own error: this trial fails, the sweep goes on
                self.tell_failed(trial, f"{type(err).__name__}: {err}", pack_id=None, exc_info=err)
                return None
            except BaseException as err:  # Ctrl-C: the trial runs again next time
                self.interrupt([trial], f"the sweep stopped: {type(err).__name__}")
                raise
            trial.set_user_attr("config", cfg.to_dict())
            return trial, cfg

    # ---- telling

    def tell(self, trial: Trial, value: Optional[float] = None, state: TrialState = TrialState.COMPLETE,
             **user_attrs: Any) -> None:
        with self.lock:
            for key, v in user_attrs.items():
                trial.set_user_attr(key, v)
            frozen = self.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
            if self.heartbeat is not None:
                self.heartbeat.discard(trial._trial_id)
            if state == TrialState.COMPLETE:
                _log_completed(self.study, frozen)
            elif state == TrialState.PRUNED:
                _trial_logger.info(f"Trial {frozen.number} pruned. ")
            self.update_bar()
            for callback in self.callbacks:
                callback(self.study, frozen)

    def tell_failed(self, trial: Trial, reason: str, exc_info: Optional[BaseException] = None,
                    **user_attrs: Any) -> None:
        _trial_logger.warning(f"Trial {trial.number} failed with parameters: {trial.params} because of the "
                              f"following error: {reason}.", exc_info=exc_info)
        self.tell(trial, state=TrialState.FAIL, fail_reason=reason, **user_attrs)

    def update_bar(self) -> None:
        if self.bar is None:
            return
        if self.n_trials is None:
            self.bar.update(1)
        else:
            self.bar.update(min(_trials_toward_budget(self.study), self.n_trials) - self.bar.n)
        if not self.bar.disable and _has_best(self.study):
            self.bar.set_postfix(best=f"{self.study.best_value:.4g}")

    def interrupt(self, trials: Sequence[Trial], reason: str) -> None:
        """Tell FAIL the trials a stopping sweep leaves unfinished and enqueue their params
        again, as for a dead worker, so that the next `optimize` runs them from the start."""
        with self.lock:
            for trial in trials:
                _requeue(self.study, trial, reason)
                if self.heartbeat is not None:
                    self.heartbeat.discard(trial._trial_id)


@dataclasses.dataclass
class _InFlight:
    trial: Trial
    cfg: TrialConfig
    base: str  # the name of the base whose job trains it
    metrics: dict = dataclasses.field(default_factory=dict)  # its last report's


class _JobFeeder:
    """Keeps one device's packed jobs full, one job per base model that has trials: asks
    trials while admission allows, turns the jobs' events into Optuna reports and tells, and
    refills each slot a trial leaves. The jobs of several bases take turns, one event each."""

    def __init__(self, sampler: PackedLoRASampler, sweep: _Sweep, index: int):
        self.sampler = sampler
        self.sweep = sweep
        self.index = index
        self.in_flight: dict[str, _InFlight] = {}  # engine trial_id -> trial, in join order
        self.waiting: Optional[tuple[Trial, TrialConfig]] = None  # asked, waiting for room in its job
        self.runs: dict[str, Any] = {}  # base -> its job's running `run()` generator
        self.idle_since: dict[str, float] = {}  # base -> when its job's last trial left, until released

    def job(self, base: str) -> PackedJob:
        """The device's packed job of `base`, created (the base model loaded) on first use."""
        return self.sampler._job(self.index, base)

    def run(self) -> None:
        with _inside_optimize(self.sweep.study):
            try:
                self._loop()
            except BaseException as err:
                self.sweep.aborted.set()
                self._interrupt(f"the sweep stopped: {type(err).__name__}: {err}")
                raise
            finally:
                for events in self.runs.values():
                    events.close()
                self.runs.clear()
            if self.in_flight or self.waiting:  # aborted because another device failed
                self._interrupt("the sweep stopped because another device's job failed")

    def _loop(self) -> None:
        while not self.sweep.aborted.is_set():
            self._fill()
            # the bases with trials, and those whose job is still winding down after its last one
            bases = list(dict.fromkeys([f.base for f in self.in_flight.values()] + list(self.runs)))
            if not bases:
                return
            for base in bases:
                self._next_event(base)
                if self.sweep.aborted.is_set():
                    return
            self._release_idle_jobs()

    def _next_event(self, base: str) -> None:
        """Run `base`'s job up to its next event and handle it."""
        job = self.job(base)
        if base not in self.runs:
            job.progress = self.sweep.show_progress_bar  # a bar of this job's steps
            if job.ranks is not None:  # the other ranks start this run with rank 0
                job.ranks.start_run()
            self.runs[base] = job.run()
        try:
            event = next(self.runs[base])
        except StopIteration:  # the job has no trial left
            del self.runs[base]
            self.idle_since[base] = time.monotonic()
            for trial_id in [t for t, f in self.in_flight.items() if f.base == base]:
                self._end(trial_id, "fail", reason="the packed job ended without finishing this trial")
            return
        except torch.cuda.OutOfMemoryError as err:
            # The engine shrinks its microbatches, moves the newest adapters out and fails a
            # trial that does not fit alone; an out-of-memory error that still escapes it
            # fails the newest trial, and the others go on.
            self.runs.pop(base).close()
            active = [tid for tid, f in self.in_flight.items() if f.base == base and tid in job.trials]
            if not active:
                raise
            job.remove_trial(active[-1])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._end(active[-1], "fail", reason=f"out of memory: {err}")
            return
        self._handle(event)

    def _release_idle_jobs(self, now: Optional[float] = None) -> None:
        """Drop the job (and the base model's memory) of a base without trials for
        `base_idle_s` (at `now`), when the sweep has several bases; a single base's job stays
        loaded for later `optimize` calls."""
        if len(self.sampler._bases) < 2:
            return
        now = time.monotonic() if now is None else now
        for base, since in list(self.idle_since.items()):
            if now - since < self.sampler._base_idle_s or any(f.base == base for f in self.in_flight.values()):
                continue
            del self.idle_since[base]
            job = self.sampler._jobs.pop((self.index, base), None)
            if job is not None:
                job.release_locks()
                if isinstance(job, RankGroupJob):
                    job.close()
                del job
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                logger.info("device %s: released base %r after %.0f s without trials",
                            self.sampler._devices[self.index], base, now - since)

    # ---- filling the jobs

    def _fill(self) -> None:
        """Ask trials and add each to its base's job while that job has room and the budget
        allows. A trial that must wait for room holds up the next ones (first come, first
        served)."""
        while not self.sweep.aborted.is_set():
            if self.waiting is None:
                if not self.sweep.may_ask():
                    return
                self.waiting = self.sweep.ask(self._trial_id)
                if self.waiting is None:  # its config was invalid: already told FAIL
                    continue
            trial, cfg = self.waiting
            try:  # a trial the model rejects is told FAIL here, before it reaches a job
                base = base_of(cfg, self.sampler._bases)
                if (self.index, base) not in self.sampler._jobs and not self._room_for_base(base, cfg):
                    return  # its base loads when the other bases' trials have made room
                job = self.job(base)
                running = [f.cfg for f in self.in_flight.values() if f.base == base]
                check_against_model(cfg, job.spec, job.module_shapes)
                joins = fits_running_job(running, cfg, job.memory_model, max_adapters=self.sampler._max_concurrent,
                                         moved_out=len(job.waiting), beside_bytes=self._beside(base) or 0.0)
            except ConfigError as err:
                self.waiting = None
                self.sweep.tell_failed(trial, str(err), pack_id=None)
                continue
            if not joins:
                return  # it waits for a trial to leave
            self.waiting = None
            self._join(trial, cfg, base)

    def _beside(self, base: str) -> Optional[float]:
        """Bytes the device's jobs of other bases hold (`memory_beside`)."""
        return memory_beside([(job.memory_model, [f.cfg for f in self.in_flight.values() if f.base == other])
                              for (index, other), job in self.sampler._jobs.items()
                              if index == self.index and other != base])

    def _room_for_base(self, base: str, cfg: TrialConfig) -> bool:
        """Whether `base`'s job, with `cfg` in it, fits beside the device's other jobs, after
        releasing the jobs of other bases that have no trials. Without memory models (a CPU,
        a model factory) every base loads."""
        device = self.sampler._devices[self.index]
        model = job_memory_model(dataclasses.replace(self.sampler._bases[base],
                                                     device=device[0] if isinstance(device, tuple) else device))
        if new_job_fits(cfg, model, self._beside(base)):
            return True
        self._release_idle_jobs(now=math.inf)  # make room: idle jobs of other bases go now
        return new_job_fits(cfg, model, self._beside(base))

    def _trial_id(self, trial: Trial) -> str:
        return _engine_trial_id(self.sweep.study.study_name, trial.number)

    def _join(self, trial: Trial, cfg: TrialConfig, base: str) -> None:
        job = self.job(base)
        with self.sweep.lock:
            trial.set_user_attr("pack_id", job.pack_id)
            trial.set_user_attr("base_model", base)
            restart_of = trial.user_attrs.get("restart_of")
        # A rerun of a dead worker's trial continues from that trial's last engine checkpoint
        # (JobSpec.checkpoint_every, in an output_dir both workers see), not from step 0.
        state = None
        if restart_of is not None and job.spec.checkpoint_every is not None:
            state = job.saved_state(_engine_trial_id(self.sweep.study.study_name, restart_of))
        self.in_flight[cfg.trial_id] = _InFlight(trial, cfg, base)
        self.idle_since.pop(base, None)
        job.add_trial(cfg, state=state)

    # ---- engine events -> Optuna

    def _handle(self, event) -> None:
        flight = self.in_flight.get(event.trial_id)
        if flight is None:  # already told (pruned or failed) and on its way out of the job
            return
        job = self.job(flight.base)
        if isinstance(event, Failed):
            self._end(event.trial_id, "fail", reason=event.reason)
            return
        flight.metrics = event.metrics
        value = self._value(event)
        if not math.isfinite(value):
            job.remove_trial(event.trial_id)
            self._end(event.trial_id, "fail", reason=f"non-finite {self.sampler._metric} ({value}) "
                                                      f"at step {event.step}")
            return
        if isinstance(event, Finished):
            self._end(event.trial_id, "complete", value=value, adapter_dir=os.path.abspath(event.adapter_dir))
            return
        with self.sweep.lock:
            flight.trial.report(value, event.step)
            # The last report is the trial's value: a trial that trained to the end completes.
            prune = event.step < flight.cfg.max_steps and flight.trial.should_prune()
        if prune:
            job.remove_trial(event.trial_id)
            self._end(event.trial_id, "prune")

    def _value(self, event: Union[Report, Finished]) -> float:
        metric = self.sampler._metric
        if metric not in event.metrics:
            raise ValueError(f"The value of `metric` is {metric!r}, but the engine reports only "
                             f"{sorted(event.metrics)}.")
        return float(event.metrics[metric])

    def _end(self, trial_id: str, outcome: str, value: Optional[float] = None, reason: str = "",
             **user_attrs: Any) -> None:
        """Tell Optuna how the trial ended, then refill its slot."""
        flight = self.in_flight.pop(trial_id)
        if "tokens_per_second" in flight.metrics:
            user_attrs["tokens_per_second"] = flight.metrics["tokens_per_second"]
        if outcome == "complete":
            self.sweep.tell(flight.trial, value, **user_attrs)
        elif outcome == "prune":
            self.sweep.tell(flight.trial, state=TrialState.PRUNED, **user_attrs)
        else:
            self.sweep.tell_failed(flight.trial, reason, **user_attrs)
        self._fill()

    def _interrupt(self, reason: str) -> None:
        trials = [f.trial for f in self.in_flight.values()] + ([self.waiting[0]] if self.waiting else [])
        for trial_id, flight in self.in_flight.items():
            self.job(flight.base).remove_trial(trial_id)  # outside run(): leaves at once, the job stays reusable
        self.in_flight.clear()
        self.waiting = None
        self.sweep.interrupt(trials, reason)


def _run_in_threads(targets: Sequence[Callable[[], None]], sweep: _Sweep) -> None:
    """Run each device's feeder in its own thread; the first error stops them all and is raised."""
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as err:  # noqa: BLE001 - handed to the caller below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(t,), name=f"lora_sweep-device-{i}", daemon=True)
               for i, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(timeout=0.5)
    except BaseException:  # Ctrl-C arrives here: stop the feeders, then let it through
        sweep.aborted.set()
        for thread in threads:
            thread.join()
        raise
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- search spaces


def _resolve_search_space(search_space: SearchSpace, trial_defaults: Mapping[str, Any],
                          max_rank: Optional[int] = None):
    """A define-by-run function as given, or a dict of Optuna distributions (validated); None:
    the default space, its ranks clipped to `max_rank`."""
    _space.check_space([], fixed=list(trial_defaults))
    if callable(search_space):
        return search_space
    if search_space is None:
        search_space = _space.default_space(fixed=list(trial_defaults), max_rank=max_rank)
    if not isinstance(search_space, Mapping):
        raise TypeError(f"The value of `search_space` is a {type(search_space).__name__}, but must be None, a "
                        "function (optuna.Trial) -> TrialConfig, or a dict of name -> distribution.")
    _space.check_space(list(search_space), fixed=list(trial_defaults))
    return {name: _to_distribution(name, dim) for name, dim in search_space.items()}


def _to_distribution(name: str, dim: Any) -> BaseDistribution:
    if isinstance(dim, BaseDistribution):
        return dim
    if isinstance(dim, _space.Float):
        return FloatDistribution(dim.low, dim.high, log=dim.log)
    if isinstance(dim, _space.Int):
        return IntDistribution(dim.low, dim.high, log=dim.log)
    if isinstance(dim, _space.Categorical):
        return CategoricalDistribution(dim.choices)
    raise TypeError(f"The search space's `{name}` is a {type(dim).__name__}, but must be an Optuna "
                    "distribution or a lora_sweep.space Float, Int or Categorical.")


_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrialConfig)}


def _engine_trial_id(study_name: str, number: int) -> str:
    """The engine's trial_id of an Optuna trial: its adapter and checkpoint are saved under it.
    A study name too long for a trial_id is shortened with a hash of the whole (`bounded_name`)."""
    suffix = f"-trial-{number}"
    return bounded_name(study_name, MAX_TRIAL_ID_CHARS - len(suffix)) + suffix


def _trial_config(trial: Trial, search_space, trial_defaults: Mapping[str, Any], trial_id: str) -> TrialConfig:
    """The trial's `TrialConfig`: its sampled params (or the define-by-run function's result),
    completed by `trial_defaults`. An invalid value raises `ConfigError`."""
    if callable(search_space):
        result = search_space(trial)
        if isinstance(result, TrialConfig):  # keep what the function set; defaults fill the rest
            params = {k: getattr(result, k) for k in _FIELD_DEFAULTS if getattr(result, k) != _FIELD_DEFAULTS[k]}
        elif isinstance(result, Mapping):
            params = dict(result)
        else:
            raise TypeError(f"The search function returned a {type(result).__name__}, but must return "
                            "a TrialConfig or a dict of its fields.")
    else:
        params = dict(trial.params)
    params.pop("trial_id", None)
    return _space.config_from_params(params, trial_defaults, trial_id=trial_id)


# --------------------------------------------------------------------------- workers and heartbeats


class _Heartbeat:
    """Tells other workers that this one is alive: every `interval` seconds, a thread stamps
    the time into the study's system attrs under this worker's id. On an RDB storage with
    Optuna's own heartbeat enabled it also records that heartbeat for each running trial,
    so Optuna's `fail_stale_trials` treats them as alive too."""

    def __init__(self, study: Study, worker_id: str, interval: float):
        self.storage, self.study_id = study._storage, study._study_id
        self.key = _HEARTBEAT + worker_id
        self.interval = interval
        self.optuna_heartbeat = is_heartbeat_enabled(self.storage)
        if self.optuna_heartbeat:
            self.interval = min(interval, self.storage.get_heartbeat_interval())
        self.trial_ids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lora_sweep-heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def add(self, trial_id: int) -> None:
        with self._lock:
            self.trial_ids.add(trial_id)
        if self.optuna_heartbeat:
            self.storage.record_heartbeat(trial_id)

    def discard(self, trial_id: int) -> None:
        with self._lock:
            self.trial_ids.discard(trial_id)

    def beat(self) -> None:
        self.storage.set_study_system_attr(self.study_id, self.key, time.time())
        if self.optuna_heartbeat:
            with self._lock:
                trial_ids = list(self.trial_ids)
            for trial_id in trial_ids:
                self.storage.record_heartbeat(trial_id)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a storage hiccup must not kill the sweep; beat again later
                logger.warning("lora_sweep heartbeat failed; retrying in %.0f s", self.interval, exc_info=True)


def _restart_stale_trials(study: Study, worker_id: str, stale_after: float, include_own: bool) -> None:
    """Tell FAIL the RUNNING trials of dead lora_sweep workers and enqueue their params again.

    A worker is dead if it runs on this host and its process is gone, or if its heartbeat is
    older than `stale_after` seconds. The caller (`worker_id`) is alive, but before its sweep
    starts (`include_own`) the trials it claimed earlier are stale too. When two workers find
    the same trial, the storage lets only one of them finish it, and only that one enqueues
    it again.

    A worker that dies within the instant between creating a trial and claiming it leaves an
    unowned trial without params; in a study whose trials all come from lora_sweep workers,
    such a trial older than `stale_after` (at most `_ORPHAN_AFTER_S`) is failed too (there is
    nothing to enqueue).
    """
    beats = study._storage.get_study_system_attrs(study._study_id)
    now = time.time()
    trials = study.get_trials(deepcopy=False)
    only_ours = _only_lora_sweep_trials(trials)
    for t in trials:
        if t.state != TrialState.RUNNING:
            continue
        owner = t.system_attrs.get(_WORKER)
        if owner is None:
            stale = only_ours and _orphaned(t, stale_after)
        elif owner == worker_id:
            stale = include_own
        else:
            stale = _is_dead(owner, beats.get(_HEARTBEAT + owner), now, stale_after)
        if stale:
            who = f"worker {owner}" if owner else "an unknown worker"
            with contextlib.suppress(UpdateFinishedTrialError, ValueError, RuntimeError):  # another worker was first
                _requeue(study, t, f"{who} stopped")
                logger.warning("Trial %d was left RUNNING: %s stopped.", t.number, who)
    if is_heartbeat_enabled(study._storage):  # trials of plain Optuna workers, failed by Optuna's own heartbeat
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)


def _requeue(study: Study, trial: Union[Trial, FrozenTrial], reason: str) -> None:
    """Tell the trial FAIL, marked ``requeued`` so that it does not count toward `n_trials`,
    and enqueue its params again: they train anew, from step 0, as a new trial."""
    storage = study._storage
    storage.set_trial_user_attr(trial._trial_id, "fail_reason", f"{reason}; its params are enqueued again")
    storage.set_trial_user_attr(trial._trial_id, "requeued", True)
    study.tell(trial.number, state=TrialState.FAIL)
    if trial.params:  # a trial that died before sampling has nothing to enqueue
        study.enqueue_trial(trial.params, user_attrs={"restart_of": trial.number})


def _orphaned(trial: FrozenTrial, stale_after: float) -> bool:
    """A RUNNING trial that nobody claimed, without params or reports, older than `stale_after`
    or `_ORPHAN_AFTER_S` (a live worker claims its trial in the call that creates it)."""
    return _unclaimed(trial) and _age_s(trial) > _orphan_after(stale_after)


def _orphan_age_left(study: Study, stale_after: float) -> float:
    """Seconds until every RUNNING trial that nobody claimed is old enough for `_orphaned`, a
    little past it (`_orphaned` wants strictly older); 0 if there is none, or if the study
    has trials of other workers, whose orphans `_restart_stale_trials` leaves alone."""
    trials = study.get_trials(deepcopy=False)
    if not _only_lora_sweep_trials(trials):
        return 0.0
    bound = _orphan_after(stale_after)
    return max([0.0, *(bound - _age_s(t) + 0.1 for t in trials if t.state == TrialState.RUNNING and _unclaimed(t))])


def _orphan_after(stale_after: float) -> float:
    """Age in seconds past which an unclaimed RUNNING trial is an orphan, not a live worker's
    trial about to be claimed."""
    return min(stale_after, _ORPHAN_AFTER_S)


def _only_lora_sweep_trials(trials: Sequence[FrozenTrial]) -> bool:
    """Whether every trial that sampled params came from a lora_sweep worker (claimed)."""
    return all(_WORKER in t.system_attrs for t in trials if t.params and t.state != TrialState.WAITING)


def _unclaimed(trial: FrozenTrial) -> bool:
    return _WORKER not in trial.system_attrs and not trial.params and not trial.intermediate_values


def _age_s(trial: FrozenTrial) -> float:
    return (datetime.datetime.now() - trial.datetime_start).total_seconds() if trial.datetime_start else 0.0


def _is_dead(worker_id: str, last_beat: Optional[float], now: float, stale_after: float) -> bool:
    host, pid, _ = (worker_id.rsplit(":", 2) + ["", "", ""])[:3]
    if host == socket.gethostname() and pid.isdigit() and not _process_alive(int(pid)):
        return True
    return last_beat is None or now - last_beat > stale_after


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child that nobody has waited for yet is a zombie: dead for us
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _trials_toward_budget(study: Study) -> int:
    """The trials `n_trials` counts: all but WAITING ones and the FAILed ones whose params were
    enqueued again (their worker died or the sweep was interrupted)."""
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state != TrialState.WAITING
               and not (t.state == TrialState.FAIL and t.user_attrs.get("requeued")))


# --------------------------------------------------------------------------- small helpers


@contextlib.contextmanager
def _inside_optimize(study: Study):
    """Mark this thread as inside an optimize loop, as `Study.optimize` does, so that
    `study.stop()` works from callbacks (Optuna allows it only there)."""
    local = study._thread_local
    before = local.in_optimize_loop
    local.in_optimize_loop = True
    try:
        yield
    finally:
        local.in_optimize_loop = before


def _resolve_devices(devices, spec: JobSpec) -> list[Union[str, tuple[str, ...]]]:
    """Device names; a device group (a list of two or more) as a tuple of names."""
    if devices is None:
        return [spec.device]

    def name(d):
        return f"cuda:{d}" if isinstance(d, int) and not isinstance(d, bool) else d

    resolved = [tuple(name(g) for g in d) if isinstance(d, (list, tuple)) else name(d) for d in devices or []]
    resolved = [d[0] if isinstance(d, tuple) and len(d) == 1 else d for d in resolved]
    if not resolved or not all(isinstance(d, str) and d or isinstance(d, tuple) and d and
                               all(isinstance(g, str) and g for g in d) for d in resolved):
        raise ValueError(f"The value of `devices` is {devices!r}, but must be None or a non-empty list of device "
                         "names ('cuda:0'), CUDA indices, or lists of them (device groups, [[0, 1], [2, 3]]).")
    return resolved


def _log_completed(study: Study, trial: FrozenTrial) -> None:
    """The line Optuna logs for a completed trial."""
    message = f"Trial {trial.number} finished with value: {trial.value} and parameters: {trial.params}."
    best = study.best_trial
    _trial_logger.info(f"{message} Best is trial {best.number} with value: {best.value}.")


def _max_trials_reached(study: Study, callback: MaxTrialsCallback) -> bool:
    """Whether `callback` would stop the study if every running trial ended in a state it
    counts: asking more trials then could overshoot its limit."""
    states = callback._states  # None: every state counts
    counted = sum(1 for t in study.get_trials(deepcopy=False)
                  if states is None or t.state in states or t.state == TrialState.RUNNING)
    return counted >= callback._n_trials


def _has_best(study: Study) -> bool:
    return any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False))


def _warn_if_pruner_waits(study: Study, max_concurrent: int) -> None:
    """Pruners that wait for completed trials prune nothing while the first packed trials,
    which start together, are still running."""
    pruner = study.pruner
    complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    if isinstance(pruner, optuna.pruners.PercentilePruner):  # MedianPruner too
        startup = getattr(pruner, "_n_startup_trials", 0)
        if complete < startup:
            warnings.warn(
                f"{type(pruner).__name__} prunes nothing until n_startup_trials={startup} trials complete, and "
                f"packed trials start together (up to {max_concurrent} at once): the first trials will not be "
                "pruned. SuccessiveHalvingPruner or HyperbandPruner compare trials while they run.", stacklevel=3)
    elif isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner) and pruner._min_resource is None:
        if complete == 0:
            warnings.warn("SuccessiveHalvingPruner(min_resource='auto') prunes nothing until a trial "
                          "completes; pass min_resource (e.g. the JobSpec's eval_every) to prune packed trials "
                          "from the start.", stacklevel=3)
    elif isinstance(pruner, optuna.pruners.HyperbandPruner) and pruner._max_resource == "auto":
        if complete == 0:
            warnings.warn("HyperbandPruner(max_resource='auto') prunes nothing until a trial completes; pass "
                          "max_resource=max_steps to prune packed trials from the start.", stacklevel=3)
