"""Ray Tune integration: every Tune trial trains a LoRA adapter packed with others on one base model.

Tune starts one small *proxy* per trial (the function trainable `PackedExecutor.trainable`);
the heavy work happens in *pack servers*, Ray actors that each hold a GPU (or the CPU) and one
`PackedJob` per base model of the sweep that has trials, each base loaded once. The proxy only
translates:

    Tune config --TrialConfig--> pack server: add_trial --PackedJob.run()--> Report / Finished / Failed
    tune.report(metrics, checkpoint) <------ proxy <------ messages <-----------------'

A pack server trains continuously: trials join and leave its running job between steps, and
when no trial is left it waits for the next one instead of returning. Pack servers are
spread over the cluster's nodes by Ray's own scheduler (their resources and the SPREAD
strategy), so a multi-node Ray cluster is used without any other set-up.

A trial's adapter leaves its pack, at the job's next step, in whichever of these comes first:
it finishes or fails (the engine's events); Tune stops, pauses or fails it (`executor.callback`,
in Tune's driver); its proxy ends (the proxy's `finally`); its proxy dies without a `finally`
(the process killed, the node lost), so its lease is not renewed and expires.

Every checkpoint holds the adapter in PEFT format plus the engine's training state (weights,
AdamW moments, data cursor), so a trial that Tune pauses and resumes, or that
`Tuner.restore` / `tune.run(resume=...)` brings back, continues exactly where it was.

Example:

    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    import lora_sweep as ls
    from lora_sweep.integrations.ray_tune import PackedExecutor

    spec = ls.JobSpec(base_model="Qwen/Qwen2.5-0.5B", train_data="train.jsonl", eval_data="eval.jsonl")
    executor = PackedExecutor(spec)                      # one pack server per GPU of the cluster
    analysis = executor.run(                             # = tune.run(executor.trainable, ...)
        config={"rank": tune.choice([8, 16, 32]), "learning_rate": tune.loguniform(2e-5, 4e-4)},
        num_samples=64, scheduler=ASHAScheduler(metric="eval_loss", mode="min"),
    )
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

try:
    import ray
    from ray import tune
    from ray.util.placement_group import placement_group, remove_placement_group
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "lora_sweep.integrations.ray_tune needs Ray Tune: pip install lora-sweep[ray]"
    ) from e

# Only the light config module here; the pack server imports the engine (torch) when it starts.
from ..config import ConfigError, JobSpec, TrialConfig, base_of, check_against_model, named_bases

logger = logging.getLogger(__name__)

__all__ = ["PackServer", "PackedExecutor", "TrialFailed", "NAMESPACE"]

NAMESPACE = "lora_sweep"  # Ray namespace of the named pack-server actors
STEP_FILE = "lora_sweep_step.json"  # beside the PEFT files in every checkpoint: the step it was taken at
STATE_FILE = "lora_sweep_state.pt"  # and the engine's training state of the adapter, to resume it exactly


class TrialFailed(RuntimeError):
    """The engine removed the trial without finishing it (its loss or gradient stopped being
    finite, or its pack server failed). Raised in the proxy, so Tune marks the trial ERROR."""


# --------------------------------------------------------------------------- pack server


@dataclass
class _Message:
    """What a pack server tells a trial's proxy: one per engine event of that trial."""

    kind: str  # "report", "finished" or "failed"
    step: int
    metrics: dict = field(default_factory=dict)
    adapter: Optional[dict[str, bytes]] = None  # PEFT adapter files, name -> content
    reason: str = ""  # for "failed"


@dataclass
class _Slot:
    """One stay of a trial in a pack, from its join until its proxy has its last message.

    A trial that Tune pauses and resumes has two stays; each has its own `ticket`, which is
    also the adapter's name in the engine (Tune's trial id, then `<id>-resumed1`, ...).
    """

    cfg: TrialConfig  # cfg.trial_id is the ticket
    tune_id: str  # Tune's trial id
    base: str  # the base whose job trains it
    deadline: float  # monotonic time at which the lease expires
    resume_step: int = 0  # reports up to this step were already given to Tune (a resumed trial)
    in_job: bool = True  # False once it finished or failed (the message may still wait for pickup)
    outbox: deque = field(default_factory=deque)

    @property
    def ticket(self) -> str:
        return self.cfg.trial_id


class PackServer:
    """The packed jobs of one device in a Ray actor: each base model loaded once, trained
    continuously.

    `PackedExecutor` starts these as threaded Ray actors (`max_concurrency` > 1): proxies call
    `try_join`, `next_messages`, `heartbeat` and `leave` from Tune's trial actors, and Tune's
    driver calls `drop`, while the jobs' `run()` loops turn in a background thread. A second
    thread, the lease watchdog, drops trials whose proxy stopped calling. Every join and leave
    is recorded (`history`).

    With several bases a server holds one job per base that has trials: a trial of a base
    without a job starts one when the device's memory allows (by the memory models of its
    jobs), the jobs take turns (one engine event each), and a base's job is released after
    `base_idle_s` without trials.

    Args:
        spec:
            The shared base model and data (paths must be reachable on this node), or several
            bases by name; the first is loaded at once, the others when a trial needs them.
        pack_id:
            The server's name; its jobs' packs are named after it (and their base).
        max_adapters:
            Most trials in one job at once.
        lease_seconds:
            A trial whose proxy has not called for this long is dropped.
        checkpoint_every_report:
            Send the current adapter with every report (else only with the final one).
        base_idle_s:
            With several bases: seconds a base's job keeps its model without trials.
        ranks:
            ``(address, d)``: the server is rank 0 of a job over d ranks that meet at
            ``address`` (the others are `_RankFollower` actors); None: one device.
    """

    def __init__(self, spec: Union[JobSpec, dict[str, JobSpec]], pack_id: str, max_adapters: int = 8,
                 lease_seconds: float = 60.0, checkpoint_every_report: bool = True, base_idle_s: float = 60.0,
                 ranks: Optional[tuple[str, int]] = None):
        self.bases = named_bases(spec)
        if ranks is not None:
            _join_ranks(next(iter(self.bases.values())), ranks[0], 0, ranks[1])
        self.pack_id = pack_id
        self.max_adapters = max_adapters
        self.lease_seconds = lease_seconds
        self.checkpoint_every_report = checkpoint_every_report
        self.base_idle_s = base_idle_s
        self.jobs: dict = {}  # base -> its PackedJob
        self.model_loads: dict[str, int] = {}  # base -> times its model was loaded
        self._runs: dict = {}  # base -> its job's running `run()` generator (training thread only)
        self._idle_since: dict[str, float] = {}  # base -> when its job's last trial left
        self._slots: dict[str, _Slot] = {}  # ticket -> slot
        self._tickets: dict[str, str] = {}  # Tune's trial id -> the ticket of its current stay
        self._joins: dict[str, int] = {}  # Tune's trial id -> how often it joined
        self._left: dict[str, str] = {}  # ticket -> why it left, for late callers
        self._history: list[dict] = []
        self._cond = threading.Condition()  # guards everything above; notified on any change
        self._stopping = False
        self._job(next(iter(self.bases)))  # the first base loads now: a server that cannot load it fails to start
        threading.Thread(target=self._train_forever, name="pack-train", daemon=True).start()
        threading.Thread(target=self._expire_leases, name="pack-leases", daemon=True).start()

    # ------------------------------------------------------------------ called by proxies and Tune

    def try_join(self, config: dict, proxy: Optional[dict] = None, resume_step: int = 0,
                 state: Optional[bytes] = None) -> tuple[str, str]:
        """Admit a trial if its base's job has room: ("joined", ticket), ("full", "") or
        ("invalid", message) when the config cannot work with this model or names no base
        of the sweep.

        A trial that Tune paused (or `Tuner.restore` brings back) joins again with `resume_step`,
        the step of the checkpoint Tune resumes it from, and that checkpoint's engine `state`:
        it continues exactly from there. Without a state it retrains deterministically from
        step 0, and only the reports after `resume_step` go to Tune.

        The state may come from another config: Population Based Training resumes an exploited
        trial from its donor's checkpoint with mutated hyperparameters. The adapter then continues
        from the donor's weights, AdamW moments and data cursor, and the new learning rate,
        schedule, weight decay and the like apply from that step on
        (`lora_sweep.engine.with_new_hyperparameters`); a new rank or batch size is "invalid"."""
        from ..engine import changed_fields, with_new_hyperparameters
        from ..planner import fits_running_job

        cfg = TrialConfig.from_dict(config)
        tune_id = cfg.trial_id
        with self._cond:
            if tune_id in self._tickets:
                return "invalid", f"Trial {tune_id!r} is already in pack server {self.pack_id!r}."
            joins = self._joins.get(tune_id, 0)
            if joins:  # its earlier stay may still be leaving the job, or have finished in it
                cfg.trial_id = f"{tune_id}-resumed{joins}"
            new_hyperparameters: list[str] = []
            try:
                base = base_of(cfg, self.bases)
                if base not in self.jobs and not self._room_for_base(base, cfg):
                    return "full", ""
                job = self._job(base)
                check_against_model(cfg, job.spec, job.module_shapes)
                if state is not None:
                    state = _load_state(state)
                    new_hyperparameters = changed_fields(state["config"], cfg)
                    if new_hyperparameters:
                        state = with_new_hyperparameters(state, cfg)
                running = [self._slots[t].cfg for t in self._in_job(base)]
                if not fits_running_job(running, cfg, job.memory_model, max_adapters=self.max_adapters,
                                        moved_out=len(job.waiting), beside_bytes=self._beside(base) or 0.0):
                    return "full", ""
            except ConfigError as e:
                return "invalid", str(e)
            pack_mates = len(self._in_job(base))
            self._slots[cfg.trial_id] = _Slot(cfg, tune_id, base, time.monotonic() + self.lease_seconds,
                                              resume_step)
            self._tickets[tune_id] = cfg.trial_id
            self._joins[tune_id] = joins + 1
            self._idle_since.pop(base, None)
            job.add_trial(cfg, state=state)
            self._record("join", tune_id, base, pack_mates=pack_mates, config={**cfg.to_dict(), "trial_id": tune_id},
                         resume_step=resume_step, from_state=state is not None,
                         new_hyperparameters=new_hyperparameters, proxy=proxy or {})
            self._cond.notify_all()
        return "joined", cfg.trial_id

    def next_messages(self, ticket: str, timeout: float) -> list[_Message]:
        """The stay's messages, waiting up to `timeout` seconds for one. Renews its lease."""
        with self._cond:
            slot = self._slots.get(ticket)
            if slot is None:
                why = self._left.get(ticket, "it never joined")
                return [_Message("failed", 0, reason=f"the trial is not in pack server {self.pack_id!r}: {why}")]
            slot.deadline = time.monotonic() + self.lease_seconds
            self._cond.wait_for(lambda: slot.outbox or self._slots.get(ticket) is not slot, timeout)
            messages = list(slot.outbox)
            slot.outbox.clear()
            if any(m.kind != "report" for m in messages):
                self._forget(ticket, "")  # its proxy has the last word
            return messages

    def heartbeat(self, ticket: str) -> bool:
        """Renew the stay's lease; False if the server no longer knows it."""
        with self._cond:
            slot = self._slots.get(ticket)
            if slot is not None:
                slot.deadline = time.monotonic() + self.lease_seconds
            return slot is not None

    def leave(self, ticket: str, reason: str = "stopped") -> None:
        """The proxy is done with this stay: drop the adapter at the job's next step. Idempotent."""
        with self._cond:
            self._forget(ticket, reason)

    def drop(self, tune_id: str, reason: str) -> None:
        """Tune's driver is done with this trial (stopped, paused or errored): drop its
        adapter at the job's next step, whatever its proxy is doing. Idempotent."""
        with self._cond:
            if tune_id in self._tickets:
                self._forget(self._tickets[tune_id], reason)

    # ------------------------------------------------------------------ records

    def stats(self) -> dict:
        """Where this server runs and what it holds: ``model_loads`` counts every base's
        loads (``base_loads`` by base), ``packs`` the pack_id of each loaded base's job."""
        with self._cond:
            first = self.jobs.get(next(iter(self.bases)))
            return {"pack_id": self.pack_id, "node_id": ray.get_runtime_context().get_node_id(),
                    "device": str(first.device) if first is not None else None,
                    "model_loads": sum(self.model_loads.values()), "base_loads": dict(self.model_loads),
                    "packs": {base: job.pack_id for base, job in self.jobs.items()},
                    "active": len(self._in_job()), "max_adapters": self.max_adapters,
                    "job_steps": sum(len(job.step_stats) for job in self.jobs.values()),
                    "ranks": first.ranks.size if first is not None and first.ranks is not None else 1,
                    "trial_ranks": sorted(set(first.ranks.owners.values())) if first is not None
                    and first.ranks is not None else [0]}

    def load(self) -> tuple[int, int]:
        """(trials in the jobs, most trials allowed in one)."""
        with self._cond:
            return len(self._in_job()), self.max_adapters

    def history(self) -> list[dict]:
        """Every join and leave: time, event, trial_id (Tune's), pack_id, base, `active`
        (trials in the base's job after it); joins add `pack_mates` (trials already training
        there), `config`, `resume_step`, `from_state`, `new_hyperparameters` (the config fields
        that differ from the state it continues, as after a PBT exploit) and `proxy` (its pid
        and node); leaves add the `reason` (finished, failed, stopped, paused, errored, lease
        expired)."""
        with self._cond:
            return list(self._history)

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ the training thread

    def _train_forever(self) -> None:
        """Run the jobs that have trials, each up to its next event in turn; wait for the next
        trial when none has any."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._in_job() or self._runs)
                if self._stopping:
                    return
                bases = list(dict.fromkeys([self._slots[t].base for t in self._in_job()] + list(self._runs)))
            for base in bases:
                self._next_event(base)
            with self._cond:
                self._release_idle_jobs()

    def _next_event(self, base: str) -> None:
        """Run `base`'s job up to its next event and dispatch it; a crashed step fails that
        job's trials, not the server."""
        job = self.jobs[base]
        if base not in self._runs:
            if job.ranks is not None:  # the other ranks start this run with rank 0
                job.ranks.start_run()
            self._runs[base] = job.run()
        try:
            event = next(self._runs[base])
        except StopIteration:  # its last trial has left
            with self._cond:
                del self._runs[base]
                self._idle_since[base] = time.monotonic()
            return
        except Exception as e:
            logger.exception("pack %s: the training loop failed", job.pack_id)
            with self._cond:
                self._runs.pop(base, None)
                for ticket in self._in_job(base):
                    job.remove_trial(ticket)
                    self._finish(ticket, _Message("failed", 0, reason=f"the pack server failed: {e!r}"))
            return
        self._dispatch(event, job)

    def _dispatch(self, event, job) -> None:
        """Turn one engine event of `job` into a message for the trial's proxy."""
        from ..engine import Failed, Finished, Report

        with self._cond:
            slot = self._slots.get(event.trial_id)
            if slot is None or not slot.in_job:
                return  # it left already; the engine drops it at this step
        metrics = _tune_metrics(getattr(event, "metrics", {}), job.pack_id, slot.base)
        if isinstance(event, Report):
            if event.step >= slot.cfg.max_steps or event.step <= slot.resume_step:
                return  # Finished follows with the same metrics / Tune had it before a pause
            adapter = self._current_adapter(slot.ticket, job) if self.checkpoint_every_report else None
            message = _Message("report", event.step, metrics, adapter)
        elif isinstance(event, Finished):
            message = _Message("finished", event.step, metrics, _read_dir(event.adapter_dir))
        else:
            assert isinstance(event, Failed), event
            message = _Message("failed", event.step, reason=f"{event.reason} (pack {job.pack_id!r})")
        with self._cond:
            if self._slots.get(slot.ticket) is not slot or not slot.in_job:
                return  # it left while we saved the adapter
            if message.kind == "report":
                # Every queued report keeps its adapter, even when Tune is behind: a scheduler that
                # pauses a trial at this result resumes it from this result's checkpoint (Tune saves
                # the last result's), so a report without one would roll the trial back.
                slot.outbox.append(message)
                self._cond.notify_all()
            else:
                self._finish(slot.ticket, message)

    def _current_adapter(self, ticket: str, job) -> dict[str, bytes]:
        # Runs between steps in the training thread, so the weights are not moving.
        path = tempfile.mkdtemp(prefix="lora_sweep_ckpt_")
        try:
            files = _read_dir(job.save_adapter(ticket, path))
        finally:
            shutil.rmtree(path, ignore_errors=True)
        import torch  # pack servers hold the engine; proxies never import torch

        state = io.BytesIO()
        torch.save(job.trial_state(ticket), state)
        return {**files, STATE_FILE: state.getvalue()}

    # ------------------------------------------------------------------ leases

    def _expire_leases(self) -> None:
        """Drop stays whose proxy has not called within `lease_seconds` (it died)."""
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._stopping, timeout=min(1.0, self.lease_seconds / 4)):
                    return
                now = time.monotonic()
                for ticket in [t for t, s in self._slots.items() if s.deadline < now]:
                    logger.warning("pack server %s: trial %s lost its proxy; dropping it", self.pack_id, ticket)
                    self._forget(ticket, "lease expired")

    # ------------------------------------------------------------------ bases (hold self._cond)

    def _job(self, base: str):
        """`base`'s packed job, created (its model loaded) on first use."""
        from ..costmodel import job_memory_model
        from ..engine import PackedJob

        if base not in self.jobs:
            pack_id = self.pack_id if len(self.bases) == 1 else f"{self.pack_id}-{base}"
            job = PackedJob(self.bases[base], progress=False, pack_id=pack_id)
            job.memory_model = job_memory_model(job.spec, job.device)  # the engine corrects it on OOM
            self.jobs[base] = job
            self.model_loads[base] = self.model_loads.get(base, 0) + 1
        return self.jobs[base]

    def _beside(self, base: str) -> Optional[float]:
        """Bytes the jobs of other bases hold on the device (`memory_beside`)."""
        from ..planner import memory_beside

        return memory_beside([(job.memory_model, [self._slots[t].cfg for t in self._in_job(other)])
                              for other, job in self.jobs.items() if other != base])

    def _room_for_base(self, base: str, cfg: TrialConfig) -> bool:
        """Whether `base`'s job, with `cfg` in it, fits beside the other bases' jobs, after
        releasing those without trials. Without memory models every base loads."""
        from ..costmodel import job_memory_model
        from ..planner import new_job_fits

        first = next(iter(self.jobs.values()), None)
        model = job_memory_model(self.bases[base], first.device if first is not None else None)
        if new_job_fits(cfg, model, self._beside(base)):
            return True
        self._release_idle_jobs(now=math.inf)  # make room: idle jobs of other bases go now
        return new_job_fits(cfg, model, self._beside(base))

    def _release_idle_jobs(self, now: Optional[float] = None) -> None:
        """Drop the job (and the model's memory) of a base without trials for `base_idle_s`
        (at `now`), when the server has several bases."""
        if len(self.bases) < 2:
            return
        now = time.monotonic() if now is None else now
        for base, since in list(self._idle_since.items()):
            if now - since < self.base_idle_s or self._in_job(base) or base in self._runs:
                continue
            del self._idle_since[base]
            job = self.jobs.pop(base)
            job.release_locks()
            del job
            _empty_cuda_cache()
            logger.info("pack server %s: released base %r after %.0f s without trials", self.pack_id, base,
                        now - since)

    # ------------------------------------------------------------------ helpers (hold self._cond)

    def _in_job(self, base: Optional[str] = None) -> list[str]:
        return [t for t, s in self._slots.items() if s.in_job and (base is None or s.base == base)]

    def _finish(self, ticket: str, message: _Message) -> None:
        """The stay's last message: the adapter left the job (finished or failed)."""
        slot = self._slots[ticket]
        slot.in_job = False
        slot.outbox.append(message)
        reason = "finished" if message.kind == "finished" else "failed"
        self._left[ticket] = reason
        self._record("leave", slot.tune_id, slot.base, reason=reason)
        self._cond.notify_all()

    def _forget(self, ticket: str, reason: str) -> None:
        """End the stay; if its adapter is still training, it leaves the job at the next step."""
        slot = self._slots.pop(ticket, None)
        if slot is None:
            return
        if self._tickets.get(slot.tune_id) == ticket:
            del self._tickets[slot.tune_id]
        if slot.in_job:
            self.jobs[slot.base].remove_trial(ticket)
            self._left[ticket] = reason
            self._record("leave", slot.tune_id, slot.base, reason=reason)
        self._cond.notify_all()

    def _record(self, event: str, tune_id: str, base: str, **details) -> None:
        job = self.jobs.get(base)
        self._history.append({"time": time.time(), "event": event, "trial_id": tune_id,
                              "pack_id": job.pack_id if job is not None else None, "base": base,
                              "active": len(self._in_job(base)), **details})


class _RankFollower:
    """Rank r > 0 of a pack server's job over d ranks (`PackedExecutor(gpus_per_server=d)`):
    it holds its shard of the base and trains the trials given to it, running the job each
    time the server (rank 0) starts a run. It talks to nobody else."""

    def follow(self, spec: JobSpec, address: str, rank: int, world_size: int) -> None:
        from ..distributed import follow
        from ..engine import PackedJob

        _join_ranks(spec, address, rank, world_size)
        follow(PackedJob(spec, progress=False))


def _join_ranks(spec: JobSpec, address: str, rank: int, world_size: int) -> None:
    """This actor as `rank` of a server's d ranks, on its one device (Ray gives each rank one GPU)."""
    from ..distributed import join
    from ..model import resolve_device

    join(address, rank, world_size, resolve_device(spec))


@ray.remote(num_cpus=0)
class _RendezvousHost:
    """The `distributed.Rendezvous` where a pack server's d ranks meet, served from an actor
    on rank 0's bundle for as long as the executor keeps it."""

    def __init__(self):
        from ..distributed import Rendezvous

        self.rendezvous = Rendezvous()

    def address(self) -> str:
        return self.rendezvous.address


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tune_metrics(metrics: dict, pack_id: str, base: str) -> dict:
    """An engine report's metrics as Tune gets them: `eval_loss` first (Tune's progress table
    shows the first four numbers of a result), the current learning rate as `lr` (the config's
    `learning_rate` is the peak rate), the pack and the base it trains on."""
    ordered = {k: metrics[k] for k in ("eval_loss", "train_loss", "step") if k in metrics}
    if "learning_rate" in metrics:
        ordered["lr"] = metrics["learning_rate"]
    ordered.update((k, v) for k, v in metrics.items() if k not in ordered and k != "learning_rate")
    return {**ordered, "pack_id": pack_id, "base_model": base}


def _read_dir(path: str) -> dict[str, bytes]:
    """A saved adapter's files, to ship to a proxy that may be on another node."""
    files = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            files[name] = f.read()
    return files


# --------------------------------------------------------------------------- the proxy (one per Tune trial)


@dataclass(frozen=True)
class _ProxySettings:
    server_names: tuple[str, ...]
    poll_seconds: float  # longest wait in one `next_messages` call
    heartbeat_seconds: float  # lease renewal period while blocked in tune.report


def _run_trial(config: dict, settings: _ProxySettings) -> None:
    """The body of every Tune trial: join a pack, relay its messages to Tune, leave."""
    trial_id = tune.get_context().get_trial_id()
    cfg = TrialConfig.from_dict(config, trial_id=trial_id)  # a bad value: ConfigError, the trial is ERROR
    resume_step, state = _resume_point(tune.get_checkpoint())
    if resume_step >= cfg.max_steps:
        return  # paused at its last report (synchronous PBT does that): it is done, Tune keeps that result
    servers = [ray.get_actor(name, namespace=NAMESPACE) for name in settings.server_names]
    server, ticket = _join_a_pack(servers, cfg, resume_step, state, settings.poll_seconds)
    heartbeat = _Heartbeat(server, ticket, settings.heartbeat_seconds)
    try:
        while True:
            for message in ray.get(server.next_messages.remote(ticket, settings.poll_seconds)):
                if message.kind == "failed":
                    raise TrialFailed(f"Trial {trial_id!r} failed: {message.reason}")
                _report(message)  # raises SystemExit when Tune stops or pauses the trial
                if message.kind == "finished":
                    return
    finally:  # finished, failed, or stopped by Tune: free the slot at the job's next step
        heartbeat.stop()
        try:
            ray.get(server.leave.remote(ticket), timeout=30)
        except Exception:  # noqa: BLE001 - Tune's callback or the lease frees it anyway
            logger.warning("trial %s could not leave its pack; its lease will expire", trial_id)


def _join_a_pack(servers: list, cfg: TrialConfig, resume_step: int, state: Optional[bytes],
                 poll_seconds: float) -> tuple[Any, str]:
    """Register the trial with the least loaded pack server that admits it; wait while all
    are full. Returns the server and the ticket of this stay."""
    proxy = {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}
    while True:
        loads = ray.get([s.load.remote() for s in servers])
        order = sorted(range(len(servers)), key=lambda i: (loads[i][0] / loads[i][1], random.random()))
        for i in order:
            status, detail = ray.get(servers[i].try_join.remote(cfg.to_dict(), proxy, resume_step, state))
            if status == "joined":
                return servers[i], detail
            if status == "invalid":
                raise ConfigError(detail, trial_id=cfg.trial_id)
        time.sleep(poll_seconds)  # every pack is full: a slot frees when a trial leaves


def _report(message: _Message) -> None:
    """tune.report with the adapter (PEFT format) as the checkpoint, plus the step it is at."""
    if message.adapter is None:
        tune.report(message.metrics)
        return
    path = tempfile.mkdtemp(prefix="lora_sweep_adapter_")
    try:
        for name, content in {**message.adapter, STEP_FILE: json.dumps({"step": message.step}).encode()}.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(content)
        tune.report(message.metrics, checkpoint=tune.Checkpoint.from_directory(path))  # copied to storage
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _load_state(data: bytes) -> dict:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _resume_point(checkpoint) -> tuple[int, Optional[bytes]]:
    """The step of the checkpoint Tune resumes a trial from and the engine state saved in it
    ((0, None) for a new trial). A checkpoint without a state (``checkpoint_every_report=False``
    gives only final ones) means retraining from step 0, deterministically."""
    if checkpoint is None:
        return 0, None
    with checkpoint.as_directory() as path:
        step_file, state_file = os.path.join(path, STEP_FILE), os.path.join(path, STATE_FILE)
        if not os.path.exists(step_file):
            return 0, None
        with open(step_file) as f:
            step = int(json.load(f)["step"])
        if not os.path.exists(state_file):
            return step, None
        with open(state_file, "rb") as f:
            return step, f.read()


class _Heartbeat:
    """Renews a stay's lease from a background thread while the proxy lives, so time spent
    blocked in `tune.report` never counts as a dead proxy."""

    def __init__(self, server, ticket: str, every: float):
        self._stopped = threading.Event()

        def beat():
            while not self._stopped.wait(every):
                server.heartbeat.remote(ticket)

        threading.Thread(target=beat, name=f"heartbeat-{ticket}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()


# --------------------------------------------------------------------------- Tune's side of leaving


class _LeaveWhenTuneIsDone(tune.Callback):
    """Drops a trial's adapter from its pack the moment Tune stops, pauses or fails it.

    A proxy's `finally` does the same, but only when Tune ends the proxy's thread, which
    with `reuse_actors=True` may be much later: a stopped or paused trial's actor can wait
    in Tune's cache, its thread blocked in `tune.report`. This runs in Tune's driver at
    the end of every step of its loop.

    It also copies a paused trial's result files to its storage folder: when the trial
    starts again (resumed, or exploited by Population Based Training), Tune's loggers replace
    the driver's result.json and progress.csv with the stored copies, which are only as new
    as Tune's last sync, and the reports since then would be lost.
    """

    _REASONS = {"TERMINATED": "stopped", "PAUSED": "paused", "ERROR": "errored"}

    def __init__(self, server_names: tuple[str, ...]):
        self.server_names = server_names
        self._dropped: set[str] = set()  # trials told about, until they run again (resumed)

    def on_step_end(self, iteration, trials, **info):
        for trial in trials:
            reason = self._REASONS.get(trial.status)
            if reason is None:
                self._dropped.discard(trial.trial_id)
            elif trial.trial_id not in self._dropped:
                self._dropped.add(trial.trial_id)
                self._drop(trial.trial_id, reason)
                if reason == "paused":
                    _store_results(trial)

    def _drop(self, trial_id: str, reason: str) -> None:
        try:
            ray.get([s.drop.remote(trial_id, reason) for s in self._servers()], timeout=30)
        except Exception as e:  # noqa: BLE001 - the proxy's `finally` or the lease frees the slot
            logger.warning("could not tell the pack servers that trial %s is done: %r", trial_id, e)

    def _servers(self) -> list:
        """The pack servers of this callback's executor or, when they are gone, those running now:
        `Tuner.restore` brings back the callback of the run it restores, whose executor has ended."""
        servers = [s for s in map(_named_actor, self.server_names) if s is not None]
        if not servers:
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]
            servers = [s for s in map(_named_actor, names) if s is not None]
        return servers


def _store_results(trial) -> None:
    """Copy the trial's result.json and progress.csv from the driver to its storage folder; a
    failure is a warning (Tune's own sync then is all there is), never the run's error."""
    try:
        import pyarrow.fs
        from ray.tune.result import EXPR_PROGRESS_FILE, EXPR_RESULT_FILE

        filesystem = trial.storage.storage_filesystem
        for name in (EXPR_RESULT_FILE, EXPR_PROGRESS_FILE):
            local, stored = os.path.join(trial.local_path, name), f"{trial.path}/{name}"
            if not os.path.exists(local):
                continue
            if isinstance(filesystem, pyarrow.fs.LocalFileSystem) and os.path.abspath(stored) == os.path.abspath(local):
                continue  # the driver writes to the storage itself
            pyarrow.fs.copy_files(local, stored, destination_filesystem=filesystem)
    except Exception as e:  # noqa: BLE001 - a best-effort copy inside a Tune callback
        logger.warning("could not store the results of paused trial %s: %r", getattr(trial, "trial_id", "?"), e)


def _named_actor(name: str):
    """The actor of that name in our namespace, or None if there is none (any more)."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


# --------------------------------------------------------------------------- the executor


class PackedExecutor:
    """Start pack servers on a Ray cluster and give Tune a trainable that trains on them.

    By default there is one pack server per GPU of the cluster (one on the CPU when the
    cluster has none), spread over the nodes by Ray. Every Tune trial of `trainable` is a
    light proxy (0.1 CPU) that joins the least loaded pack with room and relays the adapter's
    `eval_loss`, `train_loss`, `step`, `lr` (the current learning rate; the config's
    `learning_rate` is the peak), `tokens_per_second` and `pack_id` with a checkpoint that
    holds the adapter in PEFT format and its training state. A trial Tune stops leaves its
    pack at the next step and its slot goes to the next trial Tune starts.

    Every scheduler works packed, Population Based Training included: an exploited trial
    continues from its donor's adapter and optimizer state with the mutated learning rate,
    weight decay, schedule, alpha or dropout from that step on; mutating `rank`, `batch_size`,
    `gradient_accumulation_steps`, `target_modules`, `max_seq_len` or `base_model` fails that
    trial with a message saying so.

    `run` calls `tune.run` with the right settings. With `tune.run` or `tune.Tuner` called
    directly, pass `executor.callback` (it frees a stopped trial's slot at once; without it
    the proxy's exit or its lease does), `max_concurrent_trials=executor.capacity`
    (without it, trials beyond the capacity wait in their proxy for a free slot) and a
    `CheckpointConfig(num_to_keep=2)` (without it, Tune keeps every report's checkpoint;
    leave it out under Population Based Training, see `run`).

    Example:

        executor = PackedExecutor(spec, max_adapters_per_server=16)
        analysis = executor.run(config={"rank": tune.choice([8, 16])}, num_samples=32,
                                scheduler=ASHAScheduler(metric="eval_loss", mode="min"))
        # or:
        tuner = tune.Tuner(
            executor.trainable, param_space={"rank": tune.choice([8, 16])},
            tune_config=tune.TuneConfig(num_samples=32, max_concurrent_trials=executor.capacity,
                                        reuse_actors=True, scheduler=ASHAScheduler(metric="eval_loss", mode="min")),
            run_config=tune.RunConfig(callbacks=[executor.callback],
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=2)),
        )
        results = tuner.fit()

    Args:
        spec:
            The shared base model and data. Data files are read here and shipped to the pack
            servers; the base model (a hub id or a directory) must be reachable on every node.
            Or several bases by name (``{"small": spec_a, "large": spec_b}``): a trial picks
            one with its config's ``base_model`` (``tune.choice(list(bases))``; the first when
            it names none) and may set its own ``max_seq_len``; every pack server keeps one job
            per base that has trials, so packs never mix bases, and each report carries the
            ``base_model`` it trained on.
        num_servers:
            Pack servers to start; None: the cluster's GPUs divided by the GPUs per server,
            or 1 without GPUs.
        resources_per_server:
            Ray resources of one pack server (of each of its ranks), e.g.
            ``{"CPU": 4, "GPU": 1}`` or a custom resource that pins servers to nodes; None:
            ``{"CPU": 1, "GPU": 1}`` on a GPU cluster, ``{"CPU": 1}`` otherwise.
        max_adapters_per_server:
            Most trials packed in one job; the memory model may admit fewer
            (`lora_sweep.planner.fits_running_job`).
        proxy_resources:
            Ray resources of one trial's proxy.
        lease_seconds:
            A pack server drops a trial whose proxy has not been heard from for this long.
        checkpoint_every_report:
            Attach the adapter to every report (lets Tune keep the best checkpoint); False:
            only the final report has one, which saves a save per evaluation.
        poll_seconds:
            Longest wait of a proxy's call for news (also how often a waiting proxy retries).
        name:
            Prefix of the pack servers' actor names in the ``"lora_sweep"`` namespace.
        startup_timeout_s:
            How long to wait for all pack servers to load the model; None: forever (an
            autoscaling cluster may need to add nodes first).
        base_idle_s:
            With several bases: seconds a pack server keeps a base's job (and its model)
            without trials before it releases it (sooner when another base needs the memory).
        gpus_per_server:
            GPUs of one node that each pack server's job spans (one rank each, with
            `resources_per_server` per rank, in a Ray placement group): the base is sharded
            over them and each trial trains on one of them (`lora_sweep.distributed`). With
            more than one, reports carry no adapter (`checkpoint_every_report` is off: only
            the rank that trains a trial holds it) and the final report's does; a paused
            trial then resumes by retraining from step 0. One base only.
    """

    def __init__(
        self,
        spec: Union[JobSpec, dict[str, JobSpec]],
        *,
        num_servers: Optional[int] = None,
        resources_per_server: Optional[dict[str, float]] = None,
        max_adapters_per_server: int = 8,
        proxy_resources: Optional[dict[str, float]] = None,
        lease_seconds: float = 60.0,
        checkpoint_every_report: bool = True,
        poll_seconds: float = 1.0,
        name: Optional[str] = None,
        startup_timeout_s: Optional[float] = 600.0,
        base_idle_s: float = 60.0,
        gpus_per_server: int = 1,
    ):
        if not isinstance(max_adapters_per_server, int) or max_adapters_per_server < 1:
            raise ValueError(f"The value of `max_adapters_per_server` is {max_adapters_per_server!r}, "
                             "but must be an integer >= 1.")
        if not lease_seconds > poll_seconds > 0:
            raise ValueError(f"The values of `lease_seconds` ({lease_seconds}) and `poll_seconds` "
                             f"({poll_seconds}) must satisfy `lease_seconds > poll_seconds > 0`.")
        if not isinstance(gpus_per_server, int) or gpus_per_server < 1:
            raise ValueError(f"The value of `gpus_per_server` is {gpus_per_server!r}, but must be an integer >= 1.")
        if not ray.is_initialized():
            ray.init()
        self.bases = {name: _portable(base) for name, base in named_bases(spec).items()}
        if gpus_per_server > 1 and len(self.bases) > 1:
            raise ValueError(f"`gpus_per_server={gpus_per_server}` spans one base over the GPUs; give one base.")
        self.spec = next(iter(self.bases.values()))  # the first base: a trial's default
        self.name = name or f"lora_sweep-{uuid.uuid4().hex[:8]}"
        resources = dict(resources_per_server or _default_server_resources())
        if num_servers is None:
            num_servers = _default_num_servers(resources, gpus_per_server)
        if not isinstance(num_servers, int) or num_servers < 1:
            raise ValueError(f"The value of `num_servers` is {num_servers!r}, but must be an integer >= 1.")
        self.max_adapters_per_server = max_adapters_per_server

        # One actor per pack server; SPREAD puts them on different nodes where resources allow.
        # A server on d GPUs is d actors in a placement group on one node: the server is rank 0
        # of their job, the others follow it; only rank 0 has adapters to send with reports.
        self.server_names = tuple(f"{self.name}-{i}" for i in range(num_servers))
        self.servers, self._followers, self._groups, self._rendezvous = [], [], [], []
        settings = dict(max_adapters=max_adapters_per_server, lease_seconds=lease_seconds,
                        checkpoint_every_report=checkpoint_every_report and gpus_per_server == 1,
                        base_idle_s=base_idle_s)
        for server_name in self.server_names:
            options = dict(name=server_name, namespace=NAMESPACE, max_concurrency=2 * max_adapters_per_server + 16,
                           scheduling_strategy="SPREAD", **_actor_resources(resources))
            if gpus_per_server == 1:
                self.servers.append(ray.remote(PackServer).options(**options).remote(
                    self.bases, pack_id=server_name, **settings))
                continue
            group = placement_group([_bundle(resources)] * gpus_per_server, strategy="STRICT_PACK")
            self._groups.append(group)
            try:
                ray.get(group.ready(), timeout=startup_timeout_s)
            except ray.exceptions.GetTimeoutError:
                self.shutdown()
                raise RuntimeError(f"{gpus_per_server} x {resources} on one node (`gpus_per_server` ranks of "
                                   f"`resources_per_server`) were not free within {startup_timeout_s} s; the "
                                   f"cluster has {ray.cluster_resources()}.") from None
            self._rendezvous.append(_RendezvousHost.options(scheduling_strategy=_in_bundle(group, 0)).remote())
            address = ray.get(self._rendezvous[-1].address.remote())
            for rank in range(1, gpus_per_server):
                follower = ray.remote(_RankFollower).options(scheduling_strategy=_in_bundle(group, rank),
                                                             **_actor_resources(resources)).remote()
                follower.follow.remote(self.spec, address, rank, gpus_per_server)
                self._followers.append(follower)
            options["scheduling_strategy"] = _in_bundle(group, 0)
            self.servers.append(ray.remote(PackServer).options(**options).remote(
                self.bases, pack_id=server_name, ranks=(address, gpus_per_server), **settings))
        try:
            ray.get([s.stats.remote() for s in self.servers], timeout=startup_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(f"{num_servers} pack server(s) with resources {resources} did not start within "
                               f"{startup_timeout_s} s; the cluster has {ray.cluster_resources()}.") from None

        settings = _ProxySettings(self.server_names, poll_seconds, heartbeat_seconds=lease_seconds / 5)

        def lora_sweep_trial(config):
            return _run_trial(config, settings)

        self.trainable: Callable = tune.with_resources(lora_sweep_trial, proxy_resources or {"CPU": 0.1})
        self.callback = _LeaveWhenTuneIsDone(self.server_names)

    @property
    def capacity(self) -> int:
        """Trials that can train at once: Tune's `max_concurrent_trials`."""
        return len(self.servers) * self.max_adapters_per_server

    def run(self, **tune_run_kwargs):
        """`tune.run(self.trainable, **tune_run_kwargs)` with `self.callback` added and, by
        default, `max_concurrent_trials` set to the packs' capacity, `reuse_actors=True` (a
        freed slot is refilled in milliseconds instead of waiting for a new proxy process) and
        ``checkpoint_config=tune.CheckpointConfig(num_to_keep=2)``: each trial keeps its two
        latest checkpoints (a paused trial resumes from the latest) instead of one per report.
        Under Population Based Training (and PB2) Tune keeps them all, as Ray advises: PBT
        restores exploited trials from their donors' checkpoints, and registers each of a
        function trainable's checkpoints twice, so deleting old ones breaks its runs."""
        from ray.tune.schedulers import PopulationBasedTraining

        tune_run_kwargs.setdefault("max_concurrent_trials", self.capacity)
        tune_run_kwargs.setdefault("reuse_actors", True)
        if not ("keep_checkpoints_num" in tune_run_kwargs
                or isinstance(tune_run_kwargs.get("scheduler"), PopulationBasedTraining)):
            tune_run_kwargs.setdefault("checkpoint_config", tune.CheckpointConfig(num_to_keep=2))
        tune_run_kwargs["callbacks"] = [*(tune_run_kwargs.get("callbacks") or []), self.callback]
        return tune.run(self.trainable, **tune_run_kwargs)

    def stats(self) -> list[dict]:
        """Each pack server's `PackServer.stats()`: pack_id, node_id, device, model_loads, ..."""
        return ray.get([s.stats.remote() for s in self.servers])

    def history(self) -> list[dict]:
        """All pack servers' joins and leaves, in time order."""
        return sorted((e for h in ray.get([s.history.remote() for s in self.servers]) for e in h),
                      key=lambda e: e["time"])

    def shutdown(self) -> None:
        """Stop the pack servers (and their other ranks) and free their GPUs."""
        for actor in self.servers + self._followers + self._rendezvous:
            ray.kill(actor)
        for group in self._groups:
            remove_placement_group(group)
        self.servers, self._followers, self._groups, self._rendezvous = [], [], [], []

    def __enter__(self) -> "PackedExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _portable(spec: JobSpec) -> JobSpec:
    """The spec as pack servers on any node can use it: data rows instead of file paths,
    absolute local paths."""
    from ..data import load_rows

    changes: dict[str, Any] = {"output_dir": os.path.abspath(spec.output_dir)}
    for name in ("train_data", "eval_data"):
        value = getattr(spec, name)
        if isinstance(value, (str, os.PathLike)):
            changes[name] = load_rows(value, name)
    if isinstance(spec.base_model, str) and os.path.isdir(spec.base_model):
        changes["base_model"] = os.path.abspath(spec.base_model)
    return dataclasses.replace(spec, **changes)


def _default_server_resources() -> dict[str, float]:
    return {"CPU": 1, "GPU": 1} if ray.cluster_resources().get("GPU", 0) >= 1 else {"CPU": 1}


def _default_num_servers(resources: dict[str, float], ranks: int = 1) -> int:
    gpus_per_rank = resources.get("GPU", 0)
    if not gpus_per_rank:
        return 1
    return max(1, int(ray.cluster_resources().get("GPU", 0) // (gpus_per_rank * ranks)))


def _bundle(resources: dict[str, float]) -> dict[str, float]:
    """One rank's placement-group bundle: `resources` in Ray's bundle keys."""
    return {{"cpu": "CPU", "gpu": "GPU"}.get(k, k): v for k, v in resources.items() if v}


def _in_bundle(group, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)


def _actor_resources(resources: dict[str, float]) -> dict:
    """{"CPU": 1, "GPU": 1, "node_a": 1} -> .options(num_cpus=1, num_gpus=1, resources={"node_a": 1})."""
    custom = {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "cpu", "gpu")}
    return {"num_cpus": resources.get("CPU", resources.get("cpu", 0)),
            "num_gpus": resources.get("GPU", resources.get("gpu", 0)),
            **({"resources": custom} if custom else {})}
