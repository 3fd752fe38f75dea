"""`PackedJob`: train many LoRA adapters in one forward/backward over a shared frozen base.

Each job step, every active adapter draws its own samples; their rows are stacked adapter by
adapter into one microbatch, and `MultiLoRALinear` adds each adapter's LoRA term to its own
rows. The loss is the sum of per-adapter mean token losses, so a single backward gives every
adapter exactly the gradient it would get alone. Each adapter then clips and steps with its
own hyperparameters (`PackedAdamW`). Trials join and leave between steps; the base model is
loaded once.

    job = PackedJob(spec, [TrialConfig(rank=8), TrialConfig(rank=16, learning_rate=1e-3)])
    for event in job.run():     # Report / Finished / Failed
        print(event)
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import torch
from tqdm.auto import tqdm

from . import distributed
from .attention import sliding_window, use_packed_attention
from .config import (ConfigError, JobSpec, TrialConfig, check_against_model, check_trial_id, shards_base,
                     trial_file_name)
from .data import Sample, SampleStream, collate, load_rows, to_device, tokenize_rows
from .graphed import GraphCaptureError, GraphedStep, graphs_supported
from .export import atomic_write, file_sha256, peft_key, write_peft_adapter
from .kernels.lm_loss import per_adapter_lm_loss
from .layers import MultiLoRALinear, SegmentTable
from .model import fuse_gated_mlps, fuse_rms_norms, inject_multi_lora, linear_layer_names, load_base_model, \
    resolve_device, resolve_dtype, split_causal_lm
from .optim import PackedAdamW, lr_lambda

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- events


@dataclass
class Report:
    """An evaluation of one adapter: `metrics` has `eval_loss` (if the job has eval data),
    `train_loss`, `tokens_per_second` and `learning_rate`."""

    trial_id: str
    step: int
    metrics: dict


@dataclass
class Finished:
    """The adapter reached `max_steps`; it is saved in PEFT format at `adapter_dir`."""

    trial_id: str
    step: int
    metrics: dict
    adapter_dir: str


@dataclass
class Failed:
    """The trial left without finishing: an invalid config, a non-finite loss or gradient, or
    any error raised on its behalf (its pack-mates carry on). `rejected` is True when the trial
    never joined (an invalid config, or its trial_id already in the job): then a trial running
    under that id is not affected."""

    trial_id: str
    step: int
    reason: str
    rejected: bool = False


Event = Union[Report, Finished, Failed]

RESULT_FILE = "lora_sweep_result.json"  # beside a finished adapter: its config, metrics and files' SHA-256
CHECKPOINT_MAGIC = b"lora_sweep checkpoint sha256 "  # a checkpoint file: this, the payload's hex digest, a
# newline, then the payload (`torch.save` of the trial's snapshot)


def _out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation failure: CUDA's, or the CPU allocator's (a RuntimeError
    from torch, or Python's MemoryError)."""
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError))
            or (isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error)))


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _prepare_output_dir(output_dir: str) -> None:
    """Create `output_dir` and check that files can be written in it, before anything is loaded."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        probe = os.path.join(output_dir, f".write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"The value of `output_dir` is {output_dir!r}, but must be a directory this process can "
                          f"create and write to ({_describe(e)}).", field="output_dir") from None


class _TrialLock:
    """An exclusive lock (`filelock`) on one trial's files under output_dir, held while the trial
    is in a job, so that two jobs never train the same trial id into the same directory. The
    holder's host and pid sit in a file beside the lock, for the other job's message."""

    def __init__(self, output_dir: str, trial_id: str):
        from filelock import FileLock, Timeout

        directory = os.path.join(output_dir, "locks")
        path = os.path.join(directory, trial_file_name(trial_id) + ".lock")
        self._owner = path + ".owner"
        try:
            os.makedirs(directory, exist_ok=True)
            self._lock = FileLock(path, timeout=0)
            self._lock.acquire()
        except Timeout:  # a subclass of OSError, so before it
            try:
                with open(self._owner) as f:
                    holder = json.load(f)
                who = f"host {holder['host']!r}, pid {holder['pid']}"
            except (OSError, ValueError, KeyError, TypeError):
                who = "a holder whose host and pid are not recorded"
            raise ConfigError(f"Trial {trial_id!r}: output_dir {output_dir!r} is in use for this trial by another "
                              f"job ({who}; lock {path!r}); give each job its own output_dir or distinct trial ids.",
                              field="output_dir", trial_id=trial_id) from None
        except OSError as e:
            raise ConfigError(f"Trial {trial_id!r}: cannot lock its files in output_dir {output_dir!r}: {e}",
                              field="output_dir", trial_id=trial_id) from None
        try:
            atomic_write(self._owner, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode())
        except OSError as e:
            self._lock.release()
            raise ConfigError(f"Trial {trial_id!r}: cannot write its lock's owner file in output_dir "
                              f"{output_dir!r}: {e}", field="output_dir", trial_id=trial_id) from None

    def release(self) -> None:
        try:
            os.remove(self._owner)
        except OSError:
            pass
        self._lock.release()


def changed_fields(saved: dict, cfg: TrialConfig) -> list[str]:
    """The fields in which a saved state's config differs from `cfg`, whatever the trial_id (a
    tuner may rerun a trial under a new id); none when the state is `cfg`'s own."""
    wanted = cfg.to_dict()
    return sorted(k for k in saved.keys() | wanted.keys() if k != "trial_id" and saved.get(k) != wanted.get(k))


# What a trial's state fixes besides its values: the adapter's shapes (rank, the layers it
# adapts), what one step consumes (batch size, accumulation window), the samples its data
# cursor points into (their length) and the base its weights were trained on.
FIXED_BY_STATE = ("rank", "target_modules", "batch_size", "gradient_accumulation_steps", "max_seq_len", "base_model")


def with_new_hyperparameters(state: dict, cfg: TrialConfig) -> dict:
    """A trial's state (from `PackedJob.trial_state`) made to continue under `cfg`: the same
    weights, AdamW moments, data cursor and step count, with `cfg`'s learning rate, schedule,
    weight decay, alpha, dropout, max_steps and the like applying from that step on, as
    Population Based Training's exploit-and-explore wants. Give it to
    ``add_trial(cfg, state=...)``.

    Raises:
        ConfigError: `cfg` changes a field the state fixes (`FIXED_BY_STATE`).
    """
    saved, wanted = state["config"], cfg.to_dict()
    for name in FIXED_BY_STATE:
        if saved.get(name) != wanted[name]:  # a state saved before a field existed has its default
            raise ConfigError(f"{'Trial %r: ' % cfg.trial_id if cfg.trial_id else ''}the state to continue from "
                              f"has `{name}` = {saved.get(name)!r}, but the new config has {wanted[name]!r}; a trial "
                              f"continues with new hyperparameters only if {', '.join(FIXED_BY_STATE)} stay the "
                              "same: change those in a new trial.", field=name, trial_id=cfg.trial_id)
    return {**state, "config": wanted}


def _json_sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _load_checkpoint(path: str) -> dict:
    """A checkpoint's snapshot, after checking its SHA-256; raises on any damage."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(CHECKPOINT_MAGIC):
        raise ValueError("not a lora_sweep checkpoint")
    digest, _, payload = data[len(CHECKPOINT_MAGIC):].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError("its contents do not match its checksum")
    snapshot = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("config"), dict):
        raise ValueError("it holds no trial state")
    return snapshot


class _DoesNotFit(Exception):
    """A step ran out of memory with a single sample in every microbatch."""


def _remove_path(path: str) -> None:
    """Delete a file, or a directory standing where a file belongs; a missing one is fine."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


# --------------------------------------------------------------------------- per-trial state


@dataclass
class _Adapter:
    cfg: TrialConfig
    key: str  # module-dict key inside every MultiLoRALinear
    stream: SampleStream
    modules: list[str]  # full names of the layers it adapts
    train_samples: list[Sample]  # the job's samples at the trial's max_seq_len (`PackedJob.samples_for`)
    eval_samples: list[Sample]
    micro_steps: int = 0  # forward/backward passes done (seeds its dropout)
    step: int = 0  # optimizer steps done
    window_losses: list[float] = field(default_factory=list)  # micro losses of this accumulation
    report_losses: list[float] = field(default_factory=list)  # step losses since the last report
    tokens: int = 0  # loss tokens trained on
    seconds: float = 0.0  # wall time of the job steps it took part in

    @property
    def trial_id(self) -> str:
        return self.cfg.trial_id


class PackedJob:
    """A training job that holds the base model once and trains any number of LoRA adapters
    packed into the same forward and backward pass.

    Each adapter trains exactly as it would alone: its own samples in its own seeded order,
    its own batch size and gradient accumulation, its own AdamW, schedule and clipping.
    Trials may be added or removed while `run()` is iterating; changes take effect at the
    next step. A trial with an invalid config, or whose loss or gradient stops being finite,
    is removed with a `Failed` event and its pack-mates carry on unchanged.

    Under ``torchrun --nproc-per-node d`` the same script makes one job over the d ranks:
    the frozen base is sharded with FSDP2 or kept whole on each rank (`JobSpec.shard_base`),
    each trial is trained by one rank, trials are added and removed through rank 0 (calls on
    other ranks are ignored) at the next step boundary, and rank 0 yields every rank's events
    (`lora_sweep.distributed`).

    Example:

        spec = ls.JobSpec(base_model=ls.tiny_model_path(), train_data=train, eval_data=dev,
                          max_seq_len=64, eval_every=10)
        job = ls.PackedJob(spec, [ls.TrialConfig(rank=r, max_steps=30) for r in (4, 8, 16)])
        for event in job.run():
            print(event)

    Args:
        spec:
            The shared base model, data and evaluation settings.
        trials:
            Trials to start with; more can join with `add_trial`.
        progress:
            Show a tqdm bar (steps, active adapters, tokens/s).
    """

    def __init__(self, spec: JobSpec, trials=(), *, progress: bool = True, pack_id: Optional[str] = None):
        self.spec = spec
        self.pack_id = pack_id or f"pack-{uuid.uuid4().hex[:8]}"
        self.device = resolve_device(spec)
        # under torchrun (or in a process group the script made): one job over the group's ranks,
        # each training its own trials (distributed.py); None on a single process
        self.ranks = distributed.attach(self.device)
        if self.ranks is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = resolve_dtype(spec, self.device)
        self.adapter_dtype = torch.float32  # adapters train in fp32 on a bf16 base, as PEFT does
        # output_dir and rows are checked before the (slow) model load, so bad settings fail fast
        _prepare_output_dir(spec.output_dir)
        train_rows = load_rows(spec.train_data, "train_data")
        eval_rows = load_rows(spec.eval_data, "eval_data") if spec.eval_data is not None else []
        # a d-rank job reads a base from its files shard by shard, never whole (distributed.materialize)
        on_meta = self.ranks is not None and isinstance(spec.base_model, str)
        if on_meta and spec.quantization is not None:
            raise ConfigError("A job over several ranks takes a bf16 or fp32 base; `quantization` is for a job on "
                              "one device.", field="quantization")
        self.model, self.tokenizer = load_base_model(spec, self.device, self.dtype, on_meta=on_meta)
        self.module_shapes = {k: v for k, v in linear_layer_names(self.model).items()
                              if k in spec.target_modules}  # read before the layers are wrapped
        self.segments = SegmentTable()
        self.layers = inject_multi_lora(self.model, spec.target_modules, self.segments)
        fuse_rms_norms(self.model)
        fuse_gated_mlps(self.model)
        self.body, self.lm_head_weight = split_causal_lm(self.model)
        # a d-rank job's base: sharded (FSDP2, the ranks run every forward in lockstep) or whole on each rank
        self.sharded = self.ranks is not None and shards_base(
            spec.shard_base, sum(p.numel() * p.element_size() for p in self.model.parameters()),
            torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None)
        if self.sharded:
            distributed.shard_base(self.body)
        if on_meta:
            self.lm_head_weight = distributed.materialize(self.model, spec.base_model, self.device, self.dtype)
        # Microbatch layout. On CUDA samples are packed back to back in one row, no padding
        # waste, with an attention that keeps them apart (attention.packed_attention); a step
        # replayed from a CUDA graph packs them so too, then pads the row to a token bucket
        # (graphed.py). On CPU each sample gets a row padded to the microbatch's longest
        # sample. padding="max_seq_len" pads every row to max_seq_len: then the backward's
        # reductions over the sequence run in the same order whoever the pack-mates are
        # (bit-identical isolation), at the cost of computing the padding.
        padding = spec.padding if spec.padding != "auto" else ("packed" if self.device.type == "cuda"
                                                               else "longest")
        window = sliding_window(self.model.config)
        if padding == "packed" and window is not None and window < spec.max_seq_len:
            # packed_attention attends over whole samples; the model's own attention keeps the window
            if spec.padding == "packed":
                raise ConfigError(f"padding='packed' cannot keep this model's sliding attention window of {window} "
                                  f"tokens with max_seq_len={spec.max_seq_len}: use padding='max_seq_len' or "
                                  f"max_seq_len <= {window}.", field="padding")
            padding = "max_seq_len"
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if isinstance(positions, int) and spec.max_seq_len > positions:
            warnings.warn(f"max_seq_len={spec.max_seq_len} exceeds the model's {positions} positions "
                          "(max_position_embeddings); samples longer than that go beyond what it was trained on.",
                          stacklevel=2)
        self.pad_length = spec.max_seq_len if padding == "max_seq_len" else None
        self.packed = padding == "packed"
        if self.packed:
            use_packed_attention(self.model)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:  # documented: the EOS token pads; padding is masked anyway
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

        self._rows = (train_rows, eval_rows)
        self._samples_by_length: dict[int, tuple[list[Sample], list[Sample]]] = {}
        self.train_samples, self.eval_samples = self.samples_for(spec.max_seq_len)
        # Microbatch cap in padded tokens; lowered when a step runs out of memory.
        self.microbatch_tokens: Optional[int] = spec.max_tokens_per_microbatch
        # The planner's memory model of this job, if a tuner integration admits trials with it;
        # an out-of-memory step corrects it (CostModel.after_out_of_memory).
        self.memory_model = None

        self.optimizer = PackedAdamW()
        # the step replayed from CUDA graphs (graphed.py), where it can be; else None: eager steps
        self.graphed_step = GraphedStep(self, choose=spec.cuda_graphs == "auto") \
            if spec.cuda_graphs and graphs_supported(self) and not self.sharded else None
        self.active: dict[str, _Adapter] = {}  # trial_id -> state, in join order
        self.finished: dict[str, str] = {}  # trial_id -> adapter dir
        self.waiting: deque[dict] = deque()  # snapshots of adapters moved out after an OOM
        self.evictions = 0
        # membership changes in the order they were asked: ("add", config, state) or ("remove", trial_id, None)
        self._pending: deque[tuple[str, Union[TrialConfig, dict, str], Optional[dict]]] = deque()
        self._trial_locks: dict[str, _TrialLock] = {}  # trial_id -> lock on its files, while it is in the job
        self._events: deque[Event] = deque()
        self._next_id = 0
        self.step_stats: list[dict] = []  # one dict per job step, for the cost model
        self.progress = progress and (self.ranks is None or self.ranks.rank == 0)
        self._global_active = 0  # trials active on all ranks and whether rank 0 has changes queued,
        self._global_pending = False  # as of the last step boundary (a d-rank job)
        self._running = False
        self._lock = threading.RLock()  # add/remove may come from another thread (Ray actor calls)
        self._bar: Optional[tqdm] = None  # the progress bar while run() iterates
        for cfg in trials:
            self.add_trial(cfg)

    # ------------------------------------------------------------------ membership

    @property
    def trials(self) -> dict[str, TrialConfig]:
        """The active trials, trial_id -> config."""
        return {tid: a.cfg for tid, a in self.active.items()}

    def add_trial(self, cfg: Union[TrialConfig, dict], state: Optional[dict] = None) -> Optional[str]:
        """Queue a trial (a TrialConfig or a dict of its fields); it joins at the next step.
        Returns its trial_id (assigned here if it has none). An invalid config becomes a
        `Failed` event, not an exception, so a bad trial never stops the job. `state` (from
        `trial_state` or `saved_state`, of the same config under any trial_id) makes it continue
        exactly where that one was."""
        if isinstance(cfg, TrialConfig):
            if cfg.trial_id is None:
                cfg.trial_id = self._new_id()
            tid = cfg.trial_id
        elif isinstance(cfg, dict):
            if cfg.get("trial_id") is None:
                cfg = {**cfg, "trial_id": self._new_id()}
            try:
                tid = check_trial_id(cfg["trial_id"])
            except ConfigError:
                tid = str(cfg["trial_id"])  # rejected with a Failed event when it is applied
        else:
            tid = None
        if self.ranks is not None and self.ranks.rank != 0:  # rank 0 speaks for every rank
            return tid
        with self._lock:  # one lock with run()'s start and end: no step can begin in between
            self._pending.append(("add", cfg, state))
            if not self._running and self.ranks is None:  # outside run() there is no step to wait for
                self._apply_membership_locked()
        return tid

    def remove_trial(self, trial_id: str) -> None:
        """Drop a trial at the next step boundary (pruned or stopped by the tuner). Unknown or
        already finished trials are ignored. Removes and adds apply in the order they were
        asked: removing `x` then adding a new `x` trains the new one."""
        if self.ranks is not None and self.ranks.rank != 0:
            return
        with self._lock:
            self._pending.append(("remove", str(trial_id), None))
            if not self._running and self.ranks is None:
                self._apply_membership_locked()

    def _new_id(self) -> str:
        owners = self.ranks.owners if self.ranks is not None else {}
        while any(f"trial-{self._next_id}" in ids for ids in (self.active, self.finished, owners)):
            self._next_id += 1
        self._next_id += 1
        return f"trial-{self._next_id - 1}"

    def _apply_membership(self) -> None:
        if self.ranks is None:
            with self._lock:
                self._apply_membership_locked()
            return
        # a d-rank job: rank 0's queued changes go to every rank, each applies those of its own trials
        with self._lock:
            ops = list(self._pending)
            self._pending.clear()
        gathered = self.ranks.all_gather((ops, len(self.active)))
        mine = self.ranks.route(gathered[0][0], [load for _, load in gathered])
        with self._lock:
            # changes queued on rank 0 since the gather wait for the next boundary
            later, self._pending = self._pending, deque(mine)
            self._apply_membership_locked()
            self._pending = later

    def _apply_membership_locked(self) -> None:
        pending = list(self._pending)
        self._pending.clear()
        for op, item, state in pending:
            if op == "remove":
                if item in self.active:
                    self._drop(item, keep_checkpoint=self.spec.keep_checkpoints)
                elif any(w["config"]["trial_id"] == item for w in self.waiting):  # moved out after an OOM
                    self.waiting = deque(w for w in self.waiting if w["config"]["trial_id"] != item)
                    self._release(item, keep_checkpoint=self.spec.keep_checkpoints)
                continue
            raw = item
            raw_id = raw.trial_id if isinstance(raw, TrialConfig) else raw.get("trial_id") if isinstance(raw, dict) \
                else None
            try:
                if not isinstance(raw, (TrialConfig, dict)):
                    raise ConfigError(f"A trial must be a TrialConfig or a dict of its fields, got "
                                      f"{type(raw).__name__}.", field="trial_id")
                cfg = raw if isinstance(raw, TrialConfig) else TrialConfig.from_dict(raw)
                if cfg.trial_id in self.active or cfg.trial_id in self.finished or \
                        any(w["config"]["trial_id"] == cfg.trial_id for w in self.waiting):
                    raise ConfigError(f"Trial {cfg.trial_id!r} is already in this job; this second trial of that "
                                      "id is rejected.", field="trial_id", trial_id=cfg.trial_id)
                check_against_model(cfg, self.spec, self.module_shapes)
                if state is not None and not (isinstance(state, dict) and isinstance(state.get("config"), dict)
                                              and not changed_fields(state["config"], cfg)):
                    raise ConfigError(f"Trial {cfg.trial_id!r}: the `state` given was saved from another "
                                      "config.", field="state", trial_id=cfg.trial_id)
                if cfg.trial_id not in self._trial_locks:
                    self._trial_locks[cfg.trial_id] = _TrialLock(self.spec.output_dir, cfg.trial_id)
            except ConfigError as e:
                tid = e.trial_id or raw_id
                logger.warning("trial %s rejected: %s", tid, e)
                self._events.append(Failed(str(tid), 0, str(e), rejected=True))
                continue
            try:
                self._join(cfg, state)
            except Exception as e:  # noqa: BLE001 - whatever a trial's join raises fails that trial alone
                self._fail_trial(cfg.trial_id, 0, e, during="joining")

    def _fail_trial(self, trial_id: str, step: int, error: BaseException, during: str) -> None:
        """The per-trial failure boundary: an error raised on behalf of one trial takes that trial
        out of the job with a `Failed` event; its pack-mates carry on untouched."""
        logger.warning("trial %s failed while %s: %s", trial_id, during, _describe(error),
                       exc_info=logger.isEnabledFor(logging.DEBUG))
        try:
            if trial_id in self.active:
                self._drop(trial_id, keep_checkpoint=self.spec.keep_checkpoints)
            else:
                self._release(trial_id, keep_checkpoint=self.spec.keep_checkpoints)
        except Exception as cleanup:  # noqa: BLE001 - the Failed event is what matters
            logger.warning("trial %s: cleaning up after its failure raised %s", trial_id, _describe(cleanup))
        self._events.append(Failed(trial_id, step, f"{during}: {_describe(error)}"))

    def _join(self, cfg: TrialConfig, state: Optional[dict] = None, use_checkpoint: bool = True) -> None:
        """Add a trial's adapter to every layer it targets, or resume it: a finished trial
        (saved result on disk, its adapter files intact) is reported as finished; one with a
        `state`, or a sound checkpoint of its own, continues from there. A checkpoint that
        cannot be restored is deleted and the trial starts over, with a warning naming it."""
        result = self._read_result(cfg)
        if result is not None:
            self.finished[cfg.trial_id] = result["adapter_dir"]
            self._release(cfg.trial_id, keep_checkpoint=True)
            self._events.append(Finished(cfg.trial_id, result["step"], result["metrics"], result["adapter_dir"]))
            return
        key = re.sub(r"\W", "_", cfg.trial_id)
        while any(a.key == key for a in self.active.values()):
            key += "_"
        wanted = set(cfg.target_modules or self.spec.target_modules)
        modules, params = [], []
        try:
            generator = torch.Generator(self.device).manual_seed(cfg.seed)  # on the GPU: drawing there is fast
            for name, layer in self.layers.items():
                if name.rsplit(".", 1)[-1] in wanted:
                    modules.append(name)
                    layer.add_adapter(key, cfg.rank, cfg.scaling, cfg.dropout, generator, self.adapter_dtype)
                    params += [layer.lora_A[key].weight, layer.lora_B[key].weight]
            # the buffers of a slot of the CUDA graphs that a trial of this shape left, if any
            slot = self.graphed_step.vacancy(cfg, modules) if self.graphed_step is not None else None
            self.optimizer.add(cfg.trial_id, params, cfg.learning_rate,
                               lr_lambda(cfg.lr_scheduler, cfg.warmup_steps, cfg.max_steps),
                               cfg.weight_decay, cfg.max_grad_norm, storage=slot.state if slot else None)
        except BaseException:
            self._undo_join(cfg.trial_id, key, modules)
            raise
        train, evals = self.samples_for(cfg.max_seq_len or self.spec.max_seq_len)
        adapter = _Adapter(cfg, key, SampleStream(len(train), cfg.seed), modules, train, evals)
        self.active[cfg.trial_id] = adapter
        if slot is not None:
            self.graphed_step.occupy(slot, adapter)
        from_disk = state is None and use_checkpoint
        state = state if state is not None else self._read_checkpoint(cfg) if use_checkpoint else None
        if state is not None:
            try:
                self._restore(adapter, state)
            except Exception as e:  # noqa: BLE001
                if not from_disk:
                    raise
                path = self._checkpoint_path(cfg.trial_id)
                warnings.warn(f"Trial {cfg.trial_id!r}: its checkpoint {path!r} does not fit its config "
                              f"({_describe(e)}); it is deleted and the trial starts over.", stacklevel=2)
                self._detach(cfg.trial_id)
                _remove_path(path)
                self._join(cfg, None, use_checkpoint=False)
                return
            logger.info("trial %s resumed at step %d", cfg.trial_id, adapter.step)
        if self._bar is not None:
            self._bar.total += cfg.max_steps - adapter.step
            self._bar.refresh()

    def _undo_join(self, trial_id: str, key: str, modules: list[str]) -> None:
        """Take out whatever a failed join had added, so the job is as before it."""
        for name in modules:
            self.layers[name].delete_adapter(key)  # ignores a layer it never reached
        if trial_id in self.optimizer.adapters:
            self.optimizer.remove(trial_id)

    def _detach(self, trial_id: str) -> None:
        """Take a trial's adapter out of every layer and the optimizer, unless its slot in the
        CUDA graphs keeps its buffers for a trial of its shape (`GraphedStep.vacate`)."""
        adapter = self.active.pop(trial_id)
        state = self.optimizer.remove(trial_id)
        if self.graphed_step is None or not self.graphed_step.vacate(adapter, state):
            for name in adapter.modules:
                self.layers[name].delete_adapter(adapter.key)

    def _release(self, trial_id: str, keep_checkpoint: bool) -> None:
        """A trial is out of the job: unlock its files and, unless kept, delete its checkpoint."""
        if not keep_checkpoint:
            try:
                _remove_path(self._checkpoint_path(trial_id))
            except OSError as e:
                logger.warning("trial %s: could not delete its checkpoint: %s", trial_id, _describe(e))
        lock = self._trial_locks.pop(trial_id, None)
        if lock is not None:
            lock.release()

    def _drop(self, trial_id: str, keep_checkpoint: bool = False) -> None:
        """A trial leaves for good (finished, failed, removed); a waiting one takes its room.
        Its checkpoint is deleted unless `keep_checkpoint`."""
        self._detach(trial_id)
        self._release(trial_id, keep_checkpoint)
        if self.waiting:  # memory was freed: an adapter moved out after an OOM comes back
            snapshot = self.waiting.popleft()
            cfg = TrialConfig.from_dict(snapshot["config"])
            try:
                self._join(cfg, snapshot)
            except Exception as e:  # noqa: BLE001
                self._fail_trial(cfg.trial_id, snapshot["counters"]["step"], e, during="rejoining after an eviction")

    # ------------------------------------------------------------------ the step loop

    def samples_for(self, max_seq_len: int) -> tuple[list[Sample], list[Sample]]:
        """The train and eval samples at `max_seq_len` tokens, tokenized once per length: a
        trial with its own `max_seq_len` trains and evaluates on them, as it would in a job of
        that length alone."""
        if max_seq_len not in self._samples_by_length:
            train_rows, eval_rows = self._rows
            train = tokenize_rows(train_rows, self.tokenizer, max_seq_len, "train_data")
            evals = tokenize_rows(eval_rows, self.tokenizer, max_seq_len, "eval_data")[: self.spec.max_eval_samples] \
                if eval_rows else []
            self._samples_by_length[max_seq_len] = (train, evals)
        return self._samples_by_length[max_seq_len]

    def run(self) -> Iterator[Event]:
        """Train until no trial is left, yielding `Report`, `Finished` and `Failed` events.
        Between events the caller may `add_trial` / `remove_trial`."""
        self._bar = tqdm(total=sum(a.cfg.max_steps - a.step for a in self.active.values()),
                         desc="lora_sweep", unit="step", disable=not self.progress, dynamic_ncols=True)
        with self._lock:
            self._running = True
        self._sigterm = False
        previous = self._install_sigterm_handler()
        for trial_id in [t for t in self.active if t not in self._trial_locks]:  # unlocked by an earlier stop
            try:
                self._trial_locks[trial_id] = _TrialLock(self.spec.output_dir, trial_id)
            except ConfigError as e:
                self._fail_trial(trial_id, self.active[trial_id].step, e, "locking its files again")
        try:
            while True:
                self._apply_membership()
                yield from self._drain_events()
                if self._sigterm:
                    self._checkpoint_all()
                    signal.signal(signal.SIGTERM, previous)
                    os.kill(os.getpid(), signal.SIGTERM)
                with self._lock:  # leave only if no trial was added since the membership update
                    if not self._any_active() and not self._any_pending():
                        self._running = False
                        return
                if not self._any_active():
                    continue
                self._step_all_ranks()
                yield from self._drain_events()
        finally:
            self._running = False
            self._bar.close()
            self._bar = None
            if self.active or self._pending:  # stopped early (an error, Ctrl-C, the caller): another job may go on
                self.release_locks()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def release_locks(self) -> None:
        """Unlock the files of every trial still in the job, so that another job (in this process
        too) may train them; `run()` does this when it stops before its trials are done, and
        locks them again when it resumes."""
        for trial_id in list(self._trial_locks):
            self._trial_locks.pop(trial_id).release()

    def step(self) -> list[Event]:
        """One job step without `run()`: apply pending joins and leaves, train every active
        adapter one micro-step, and return the events that produced. For callers that drive
        the loop themselves (benchmarks, custom schedulers)."""
        self._apply_membership()
        if self.ranks is not None:
            self._share_events()
        if self._any_active():
            self._step_all_ranks()
        if self.ranks is not None:
            self._share_events()
        events = list(self._events)
        self._events.clear()
        return events

    def _drain_events(self) -> Iterator[Event]:
        if self.ranks is not None:
            self._share_events()
        while self._events:
            yield self._events.popleft()

    def _step_all_ranks(self) -> None:
        """`_train_step`; in a d-rank job, a failed collective inside it (FSDP's, in the forward)
        becomes the job's `PeerFailure`."""
        try:
            self._train_step()
        except Exception as e:
            if self.ranks is not None and distributed.from_collective(e):
                raise self.ranks.failure(e) from e
            raise

    def _any_active(self) -> bool:
        """Whether a trial is active on any rank (as of the last step boundary, in a d-rank job)."""
        return bool(self.active) if self.ranks is None else self._global_active > 0

    def _any_pending(self) -> bool:
        return bool(self._pending) if self.ranks is None else self._global_pending

    def _share_events(self) -> None:
        """A d-rank job's step boundary: every rank's events go to rank 0 (rank 0 records the
        others' finished adapters), and every rank learns how many trials are active in all,
        whether rank 0 has membership changes queued and whether any rank got a SIGTERM (then
        all of them checkpoint and stop at the same boundary)."""
        with self._lock:
            pending = bool(self._pending)
        events = list(self._events)
        self._events.clear()
        gathered = self.ranks.all_gather((events, len(self.active), pending, getattr(self, "_sigterm", False)))
        self._global_active = sum(active for _, active, _, _ in gathered)
        self._global_pending = gathered[0][2]
        self._sigterm = any(sigterm for *_, sigterm in gathered)
        if self.ranks.rank == 0:
            for rank, (rank_events, *_) in enumerate(gathered):
                self._events.extend(rank_events)
                for e in rank_events:
                    if rank != 0 and isinstance(e, Finished):
                        self.finished[e.trial_id] = e.adapter_dir

    def _install_sigterm_handler(self):
        """On SIGTERM, checkpoint every adapter at the next step boundary, then exit as asked.
        Only the main thread may own signal handlers; elsewhere (a Ray actor's thread) this is off."""
        if self.spec.checkpoint_every is None or threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum, frame):
            self._sigterm = True

        return signal.signal(signal.SIGTERM, on_sigterm)

    def _train_step(self) -> None:
        """One forward/backward over every active adapter's next micro-batch, then an optimizer
        step for each adapter whose gradient accumulation is complete."""
        t0 = time.perf_counter()
        adapters = list(self.active.values())
        if not self.model.training:  # train() visits every module: thousands with many adapters
            self.model.train()
        if not adapters:  # a rank of a d-rank job with no trial of its own: it keeps the others' pace
            if self.sharded:
                self._idle_step()
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # step_stats report this step's peak

        # data: each adapter's own samples for this micro-step
        cursors = [a.stream.state() for a in adapters]
        groups = [[a.train_samples[i] for i in a.stream.take(a.cfg.batch_size)] for a in adapters]

        # adapters at the end of their accumulation window take an optimizer step
        steps_now = [(a.micro_steps + 1) % a.cfg.gradient_accumulation_steps == 0 for a in adapters]
        graphed = self._graphed_micro_step(adapters, groups, steps_now)
        if graphed is not None:  # forward, backward and the stepping adapters' update, replayed
            sums, norm_values, padded_tokens, gpu_wait_s = graphed
            counts = [sum(s.loss_tokens for s in g) for g in groups]
            mean_values = [s / c if c else math.nan for s, c in zip(sums, counts)]
            norm_values = [n for n, s in zip(norm_values, steps_now) if s]
            microbatches = 1
        else:
            # forward / backward, in microbatches under the memory cap
            try:
                sums, counts_t, plan = self._forward_backward(adapters, groups)
            except _DoesNotFit:
                # Even one sample per microbatch is too much: rewind the data, move the newest
                # adapter out until another one leaves (it is not failed, and resumes exactly).
                for a, cursor in zip(adapters, cursors):
                    a.stream.load_state(cursor)
                self._evict(adapters[-1])
                return
            means = sums / counts_t
            names = [a.trial_id for a, s in zip(adapters, steps_now) if s]
            norms = self.optimizer.grad_norms(names) if names else means.new_zeros(0)
            t_sync = time.perf_counter()
            mean_values, norm_values = means.tolist(), norms.tolist()  # the step's one host sync
            gpu_wait_s = time.perf_counter() - t_sync
            padded_tokens, microbatches = sum(self._padded_tokens(parts) for parts in plan), len(plan)

        # optimizer: the stepping adapters clip and step together; a non-finite one fails
        stepping = [a for a, s in zip(adapters, steps_now) if s]
        bad = {a.trial_id: f"non-finite training loss ({v}) at step {a.step + 1}"
               for a, v in zip(adapters, mean_values) if not math.isfinite(v)}
        for a, n in zip(stepping, norm_values):
            if not math.isfinite(n) and a.trial_id not in bad:
                bad[a.trial_id] = f"non-finite gradient norm ({n}) at step {a.step + 1}"
        ok = [a for a in stepping if a.trial_id not in bad]
        if graphed is not None:  # the graph stepped them, and left the others' weights alone
            self.optimizer.count_step([a.trial_id for a in ok])
        else:
            self.optimizer.step([a.trial_id for a in ok],
                                [n for a, n in zip(stepping, norm_values) if a.trial_id not in bad])
            self.optimizer.zero_grad([a.trial_id for a in ok])

        seconds = time.perf_counter() - t0
        timed, choosing = True, False
        if self.graphed_step is not None:  # the job's first step and a capture compile: not timed
            timed = not self.graphed_step.captured if graphed is not None else bool(self.step_stats)
            choosing = self.graphed_step.choosing(len(adapters))
            self.graphed_step.record(len(adapters), graphed is not None, seconds,
                                     sum(len(s) for g in groups for s in g), timed)
        self._record_stats(adapters, groups, padded_tokens, microbatches, seconds, gpu_wait_s, graphed is not None,
                           one_off=not timed, choosing=choosing)
        for a, group, v in zip(adapters, groups, mean_values):
            a.micro_steps += 1
            a.tokens += sum(len(s) for s in group)
            a.seconds += seconds
            a.window_losses.append(v)
        for tid, reason in bad.items():
            step = self.active[tid].step
            self._drop(tid, keep_checkpoint=self.spec.keep_checkpoints)
            self._events.append(Failed(tid, step, reason))
        self._after_optimizer_step(ok)

    def _idle_step(self) -> None:
        """A d-rank job's step on a rank without trials: as many dummy forward/backwards as the
        busiest rank runs, then as many dummy eval forwards."""
        for _ in range(self.ranks.max(0)):
            self.ranks.dummy_pass(self, backward=True)
        if self.eval_samples:
            self.evaluate([])

    def _graphed_micro_step(self, adapters, groups, stepping):
        """The micro-step through `graphed_step` where it takes it: (loss sums, gradient norms,
        padded tokens, the host's wait for the GPU), with the stepping adapters' optimizer
        update done; else None. A layout that cannot be captured turns the graphs off for the
        job, with a warning: after its step if that step trained, else before it."""
        step = self.graphed_step
        if step is None or not (step.wants(len(adapters)) and step.takes(groups)):
            return None
        try:
            sums, norms = step.run(adapters, groups, stepping)
        except GraphCaptureError as e:
            self._stop_graphs(e)
            return None
        if step.failure is not None:
            self._stop_graphs(step.failure)
        return sums, norms, step.last_tokens, step.wait_s

    def _stop_graphs(self, error: Exception) -> None:
        """Go on without CUDA graphs after `error`, with a warning, and free their memory."""
        warnings.warn(f"{error}; this job goes on without CUDA graphs.", stacklevel=4)
        self.graphed_step.release()
        self.graphed_step = None
        torch.cuda.empty_cache()  # the graphs' memory, once the error and what it held are gone

    def _forward_backward(self, adapters: list[_Adapter], groups: list[list[Sample]]):
        """Per-adapter loss sums and loss-token counts of this micro-step, with each adapter's
        gradient of (mean loss / accumulation steps) added to its `.grad`.

        The samples are split into microbatches under `microbatch_tokens`; gradients are taken
        with `torch.autograd.grad` and only added to `.grad` once every microbatch succeeded,
        so an out-of-memory error leaves nothing half-accumulated and the step is retried with
        a smaller cap."""
        counts = to_device([float(sum(s.loss_tokens for s in g)) for g in groups], torch.float32, self.device)
        accum = to_device([float(a.cfg.gradient_accumulation_steps) for a in adapters], torch.float32, self.device)
        while True:
            plan = self._microbatches(groups)
            try:
                sums, grads = self._run_microbatches(adapters, plan, counts, accum)
                break
            except (torch.OutOfMemoryError, MemoryError, RuntimeError) as e:
                if not _out_of_memory(e):
                    raise
                self.segments.clear()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                if self.memory_model is not None and len(self.active) > 1:  # the pack was too big
                    self.memory_model = self.memory_model.after_out_of_memory(list(self.trials.values()))
                largest = max(self._padded_tokens(parts) for parts in plan)
                if max(len(parts) for parts in plan) == 1 and all(len(p[0][1]) == 1 for p in plan):
                    raise _DoesNotFit from None
                self.microbatch_tokens = max(1, largest // 2)
                logger.warning("out of memory at %d padded tokens per microbatch; retrying the step with "
                               "microbatches of at most %d", largest, self.microbatch_tokens)
        for i, adapter_grads in grads.items():
            self.optimizer.add_grads(adapters[i].trial_id, adapter_grads)
        return sums, counts, plan

    def _run_microbatches(self, adapters, plan, counts, accum):
        sums = torch.zeros(len(adapters), device=self.device)
        grads: dict[int, list[torch.Tensor]] = {}
        extra = self.ranks.max(len(plan)) - len(plan) if self.sharded else 0  # keep the ranks' pace
        for parts in plan:  # parts: [(adapter index, samples)], adapters in job order
            index = [i for i, _ in parts]
            groups = [samples for _, samples in parts]
            try:
                part_sums, _ = self._adapter_losses([adapters[i] for i in index], groups, train=True)
                idx = to_device(index, torch.long, self.device)
                loss = (part_sums / counts[idx] / accum[idx]).sum()
                params = [p for i in index for p in self.optimizer.adapters[adapters[i].trial_id].params]
                flat = torch.autograd.grad(loss, params)
            finally:
                self.segments.clear()
            for i in index:
                n = len(self.optimizer.adapters[adapters[i].trial_id].params)
                mine, flat = list(flat[:n]), flat[n:]
                grads[i] = mine if i not in grads else torch._foreach_add(grads[i], mine)
            sums = sums.index_add(0, idx, part_sums.detach())
        for _ in range(extra):
            self.ranks.dummy_pass(self, backward=True)
        return sums, grads

    def _padded_tokens(self, parts) -> int:
        """Tokens the model computes for these samples, padding included, in this job's layout."""
        lengths = [len(s) for _, samples in parts for s in samples]
        if self.packed:
            return sum(lengths)
        return len(lengths) * (self.pad_length or max(lengths))

    def _microbatches(self, groups: list[list[Sample]]) -> list[list[tuple[int, list[Sample]]]]:
        """Split a step's samples into microbatches of at most `microbatch_tokens` padded tokens.
        Whole adapters are kept together when they fit (then an adapter's arithmetic is the
        same as unsplit, bit for bit); larger ones are cut into runs of consecutive samples."""
        everything = [[(i, g) for i, g in enumerate(groups)]]
        if self.microbatch_tokens is None or self._padded_tokens(everything[0]) <= self.microbatch_tokens:
            return everything
        from .planner import pack_microbatches  # the planner (cvxpy) loads only when a cap is hit

        length = self.pad_length or max(len(s) for g in groups for s in g)
        per_item = max(1, self.microbatch_tokens // length)
        items = [(i, g[k:k + per_item]) for i, g in enumerate(groups) for k in range(0, len(g), per_item)]
        bins = pack_microbatches([self._padded_tokens([item]) for item in items], self.microbatch_tokens,
                                 time_limit=0.2)
        plan = []
        for b in bins:  # keep job order inside a microbatch; a split adapter's runs stay in order
            parts: list[tuple[int, list[Sample]]] = []
            for i, samples in (items[k] for k in sorted(b)):
                if parts and parts[-1][0] == i:
                    parts[-1] = (i, parts[-1][1] + samples)
                else:
                    parts.append((i, samples))
            plan.append(parts)
        return plan

    def _adapter_losses(self, adapters: list[_Adapter], groups: list[list[Sample]], train: bool):
        """Per-adapter (sum of token losses, number of loss tokens) of one microbatch, with the
        LM head and cross-entropy computed in row chunks instead of full logits."""
        batch = collate(groups, self.pad_id, self.device, self.pad_length, self.packed)
        # The table stays set until the caller's backward is done: gradient checkpointing
        # recomputes the layers' forward inside the backward and must see the same adapters.
        self.segments.set([a.key for a in adapters], batch["seg_tokens"],
                          [a.micro_steps for a in adapters] if train else None, [a.cfg.seed for a in adapters])
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
        if self.packed:  # the samples' boundaries, under the names transformers passes to attention
            inputs.update(cu_seq_lens_q=batch["cu_seq_lens"], cu_seq_lens_k=batch["cu_seq_lens"],
                          max_length_q=batch["max_length"], max_length_k=batch["max_length"])
        hidden = self.body(**inputs, use_cache=False).last_hidden_state
        # keep only positions whose next token carries a label, adapter by adapter
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch["keep_index"])
        targets = batch["targets"].reshape(-1).index_select(0, batch["keep_index"])
        seg_lens = [sum(s.loss_tokens for s in g) for g in groups]
        return per_adapter_lm_loss(hidden, self.lm_head_weight, targets, seg_lens)

    def _evict(self, adapter: _Adapter) -> None:
        if len(self.active) == 1:  # nothing left to make room: this trial alone cannot fit
            self._drop(adapter.trial_id, keep_checkpoint=self.spec.keep_checkpoints)
            self._events.append(Failed(adapter.trial_id, adapter.step, f"out of memory: trial {adapter.trial_id!r} "
                                       "does not fit even alone with one sample per microbatch"))
            return
        logger.warning("out of memory with one sample per microbatch: trial %s moves out of the job until "
                       "another trial leaves", adapter.trial_id)
        self.waiting.append(self._snapshot(adapter))
        self._detach(adapter.trial_id)
        self.evictions += 1

    def _after_optimizer_step(self, stepped: list[_Adapter]) -> None:
        to_eval = []
        for a in stepped:
            a.step += 1
            a.report_losses.append(sum(a.window_losses) / len(a.window_losses))
            a.window_losses.clear()
            if self._bar is not None:
                self._bar.update(1)
            if a.step % self.spec.eval_every == 0 or a.step >= a.cfg.max_steps:
                to_eval.append(a)
            elif self.spec.checkpoint_every and a.step % self.spec.checkpoint_every == 0:
                self._guarded(a, "writing its checkpoint", self._write_checkpoint, a)
        to_eval = [a for a in to_eval if a.trial_id in self.active]
        if to_eval or self.sharded:  # every rank of a sharded job takes part in every evaluation
            eval_losses = self._evaluate_each_alone_on_error(to_eval) if self.eval_samples else {}
            for a in to_eval:
                if a.trial_id not in self.active:
                    continue
                self._guarded(a, "reporting or saving", self._report, a, eval_losses)
        self._update_bar()

    def _guarded(self, a: _Adapter, during: str, fn, *args) -> None:
        """Run `fn(*args)` on behalf of trial `a`: an error fails that trial alone."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the per-trial failure boundary
            self._fail_trial(a.trial_id, a.step, e, during)

    def _report(self, a: _Adapter, eval_losses: dict[str, float]) -> None:
        metrics = {"train_loss": sum(a.report_losses) / len(a.report_losses),
                   "tokens_per_second": a.tokens / max(a.seconds, 1e-9),
                   "learning_rate": self.optimizer.adapters[a.trial_id].current_lr,
                   "step": a.step}
        a.report_losses.clear()
        if a.trial_id in eval_losses:
            metrics["eval_loss"] = eval_losses[a.trial_id]
        if a.step >= a.cfg.max_steps:
            self._finish(a, metrics)  # its Report goes out with the Finished, once the adapter is saved
        else:
            self._events.append(Report(a.trial_id, a.step, metrics))
            if self.spec.checkpoint_every and a.step % self.spec.checkpoint_every == 0:
                self._write_checkpoint(a)

    def _evaluate_each_alone_on_error(self, adapters: list[_Adapter]) -> dict[str, float]:
        """`evaluate` for all of `adapters` at once; if that raises, each alone, so that an error
        fails only the trial it came from. In a job over ranks with a sharded base an evaluation is
        a collective: it runs once, all adapters together."""
        if self.sharded:
            return self.evaluate([a.trial_id for a in adapters])
        if len(adapters) > 1:
            try:
                return self.evaluate([a.trial_id for a in adapters])
            except Exception:  # noqa: BLE001 - retried adapter by adapter below
                pass
        losses = {}
        for a in adapters:
            try:
                losses.update(self.evaluate([a.trial_id]))
            except Exception as e:  # noqa: BLE001
                self._fail_trial(a.trial_id, a.step, e, "evaluating")
        return losses

    def _finish(self, a: _Adapter, metrics: dict) -> None:
        """Save the adapter, then its result file (the files' SHA-256 in it), both atomically;
        only then is the trial finished. Non-finite weights fail it instead."""
        if not bool(torch.isfinite(self.optimizer.adapters[a.trial_id].flat).all()):  # every weight, one read
            raise FloatingPointError(f"non-finite adapter weights after step {a.step}")
        path = self._adapter_dir(a.trial_id)
        checksums = self._write_adapter(a, path)
        result = {"config": a.cfg.to_dict(), "step": a.step, "metrics": metrics, "adapter_dir": path,
                  "sha256": checksums}
        atomic_write(os.path.join(path, RESULT_FILE), json.dumps(
            {**result, "result_sha256": _json_sha256(result)}).encode())
        self.finished[a.trial_id] = path
        self._drop(a.trial_id)
        self._events.append(Report(a.trial_id, a.step, metrics))
        self._events.append(Finished(a.trial_id, a.step, metrics, path))

    def _record_stats(self, adapters, groups, padded_tokens, microbatches, seconds, gpu_wait_s, graphed,
                      one_off=False, choosing=False) -> None:
        self.step_stats.append({
            "tokens": sum(len(s) for g in groups for s in g),  # real (non-padding) tokens
            "padded_tokens": padded_tokens,
            "rank_tokens": sum(a.cfg.rank * sum(len(s) for s in g) for a, g in zip(adapters, groups)),
            "num_adapters": len(adapters),
            "rank_sum": sum(a.cfg.rank for a in adapters),
            "microbatches": microbatches,
            "graphed": graphed,  # replayed from a CUDA graph
            "one_off": one_off,  # the step captured a CUDA graph (or compiled the job's first): not typical
            "choosing": choosing,  # cuda_graphs="auto" still timing eager and replayed steps of this pack size
            "gpu_wait_s": gpu_wait_s,  # of `seconds`, what the host waited for the GPU at the step's end
            "seconds": seconds,
            "peak_memory_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
        })

    def _update_bar(self) -> None:
        if self._bar is not None and self.step_stats:
            recent = self.step_stats[-20:]
            tps = sum(s["tokens"] for s in recent) / max(sum(s["seconds"] for s in recent), 1e-9)
            self._bar.set_postfix(adapters=len(self.active), tok_s=f"{tps:,.0f}", refresh=False)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, trial_ids: Optional[list[str]] = None) -> dict[str, float]:
        """Mean token loss on the eval set for each of `trial_ids` (default: all active),
        all adapters packed into the same eval forwards.

        In a d-rank job each rank evaluates those of `trial_ids` it trains and returns their
        losses; with a sharded base every rank must call it (it runs the base's forwards in lockstep)."""
        if self.ranks is None:
            adapters = [self.active[t] for t in (trial_ids if trial_ids is not None else list(self.active))]
            if not adapters or not self.eval_samples:
                return {}
        else:
            adapters = [self.active[t] for t in (trial_ids if trial_ids is not None else self.active)
                        if t in self.active]
            if not self.eval_samples:
                return {}
        self.model.eval()
        sums = torch.zeros(len(adapters), dtype=torch.float64)
        counts = torch.zeros(len(adapters), dtype=torch.float64)
        size = self.spec.eval_batch_size
        plan = []  # microbatches of (adapter index, samples); adapters of one max_seq_len share their rows
        for samples in {id(a.eval_samples): a.eval_samples for a in adapters}.values():
            members = [i for i, a in enumerate(adapters) if a.eval_samples is samples]
            for chunk in (samples[start : start + size] for start in range(0, len(samples), size)):
                plan += [[(members[i], g) for i, g in parts] for parts in self._microbatches([chunk] * len(members))]
        extra = self.ranks.max(len(plan)) - len(plan) if self.sharded else 0  # the busiest rank's count
        for parts in plan:
            index = [i for i, _ in parts]
            try:
                s, c = self._adapter_losses([adapters[i] for i in index], [g for _, g in parts], train=False)
            finally:
                self.segments.clear()
            sums.index_add_(0, torch.tensor(index), s.double().cpu())
            counts.index_add_(0, torch.tensor(index), c.double().cpu())
        for _ in range(extra):
            self.ranks.dummy_pass(self, backward=False)
        return {a.trial_id: float(s / c) for a, s, c in zip(adapters, sums, counts)}

    @torch.no_grad()
    def adapter_logits(self, trial_id: str, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """Logits of the base model with adapter `trial_id` on every row (eval mode)."""
        self.model.eval()
        self.segments.set([self.active[trial_id].key], [input_ids.numel()])
        try:
            return self.model(input_ids=input_ids.to(self.device), attention_mask=None if attention_mask is None
                              else attention_mask.to(self.device)).logits
        finally:
            self.segments.clear()

    # ------------------------------------------------------------------ saving

    def _adapter_dir(self, trial_id: str) -> str:
        return os.path.join(self.spec.output_dir, "adapters", trial_file_name(trial_id))

    def _checkpoint_path(self, trial_id: str) -> str:
        return os.path.join(self.spec.output_dir, "checkpoints", trial_file_name(trial_id) + ".pt")

    def _snapshot(self, a: _Adapter) -> dict:
        """Everything an adapter needs to continue exactly: weights, AdamW moments, data cursor
        and counters (dropout masks and data order are functions of those, so no RNG state)."""
        return {
            "config": a.cfg.to_dict(),
            "weights": {name: {"lora_A": self.layers[name].lora_A[a.key].weight.detach().cpu().clone(),
                               "lora_B": self.layers[name].lora_B[a.key].weight.detach().cpu().clone()}
                        for name in a.modules},
            "grad": self.optimizer.adapters[a.trial_id].grad.detach().cpu().clone(),
            "optimizer": self.optimizer.state_dict(a.trial_id),
            "stream": a.stream.state(),
            "counters": {"micro_steps": a.micro_steps, "step": a.step, "tokens": a.tokens, "seconds": a.seconds,
                         "window_losses": list(a.window_losses), "report_losses": list(a.report_losses)},
        }

    def _restore(self, a: _Adapter, snapshot: dict) -> None:
        with torch.no_grad():
            for name, w in snapshot["weights"].items():
                self.layers[name].lora_A[a.key].weight.copy_(w["lora_A"])
                self.layers[name].lora_B[a.key].weight.copy_(w["lora_B"])
            self.optimizer.adapters[a.trial_id].grad.copy_(snapshot["grad"])
        self.optimizer.load_state_dict(a.trial_id, snapshot["optimizer"])
        a.stream.load_state(snapshot["stream"])
        c = snapshot["counters"]
        a.micro_steps, a.step, a.tokens, a.seconds = c["micro_steps"], c["step"], c["tokens"], c["seconds"]
        a.window_losses, a.report_losses = list(c["window_losses"]), list(c["report_losses"])

    def trial_state(self, trial_id: str) -> dict:
        """An active trial's full training state (weights, AdamW moments, data cursor, counters),
        on the CPU. `add_trial(cfg, state=...)` continues it exactly, in this job or another."""
        return self._snapshot(self.active[trial_id])

    def saved_state(self, trial_id: str) -> Optional[dict]:
        """The state of `trial_id`'s last checkpoint in this job's output_dir, if it has a sound
        one (a damaged checkpoint gives None, with a warning naming it)."""
        path = self._checkpoint_path(trial_id)
        if not os.path.lexists(path):
            return None
        try:
            return _load_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - any damage: truncated, garbled, foreign, a directory
            warnings.warn(f"Trial {trial_id!r}: its checkpoint {path!r} is damaged ({_describe(e)}); it is "
                          "ignored and the trial starts over.", stacklevel=2)
            return None

    def _write_checkpoint(self, a: _Adapter) -> None:
        buffer = io.BytesIO()
        torch.save(self._snapshot(a), buffer)
        payload = buffer.getvalue()
        path = self._checkpoint_path(a.trial_id)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)  # a directory where the file belongs would block the rename
        atomic_write(path, [CHECKPOINT_MAGIC, hashlib.sha256(payload).hexdigest().encode(), b"\n", payload])

    def _checkpoint_all(self) -> None:
        """Checkpoint every adapter between accumulation windows (the others keep their last one)."""
        for a in list(self.active.values()):
            if a.micro_steps % a.cfg.gradient_accumulation_steps == 0:
                self._guarded(a, "writing its checkpoint", self._write_checkpoint, a)

    def _read_checkpoint(self, cfg: TrialConfig) -> Optional[dict]:
        """The trial's own checkpoint, if checkpointing is on and a sound one exists for this very
        config. A damaged one is deleted (warned, naming the trial): the trial starts over."""
        if self.spec.checkpoint_every is None:
            return None
        path = self._checkpoint_path(cfg.trial_id)
        snapshot = self.saved_state(cfg.trial_id)
        if snapshot is None:
            if os.path.lexists(path):
                _remove_path(path)
            return None
        if snapshot["config"] != cfg.to_dict():
            logger.warning("ignoring the checkpoint of trial %s: it belongs to another config", cfg.trial_id)
            return None
        return snapshot

    def _read_result(self, cfg: TrialConfig) -> Optional[dict]:
        """A finished trial's saved result, if checkpointing is on, it is this very config and its
        adapter files match their recorded SHA-256. A damaged result or adapter is warned about
        (naming the trial) and the trial is trained again."""
        directory = self._adapter_dir(cfg.trial_id)
        path = os.path.join(directory, RESULT_FILE)
        if self.spec.checkpoint_every is None or not os.path.lexists(path):
            return None
        try:
            with open(path, "rb") as f:
                result = json.loads(f.read().decode("utf-8"))
            recorded = result.pop("result_sha256")
            if recorded != _json_sha256(result):
                raise ValueError("the result file does not match its checksum")
            if result["config"] != cfg.to_dict():
                return None
            for name, digest in result["sha256"].items():
                if file_sha256(os.path.join(directory, name)) != digest:
                    raise ValueError(f"{name} does not match its checksum")
            result["adapter_dir"] = directory
            return result
        except Exception as e:  # noqa: BLE001 - any damage: truncated, garbled, missing files, a directory
            warnings.warn(f"Trial {cfg.trial_id!r}: its finished adapter in {directory!r} is damaged or incomplete "
                          f"({_describe(e)}); the trial is trained again.", stacklevel=2)
            _remove_path(path)
            return None

    def save_adapter(self, trial_id: str, path: str) -> str:
        """Save an active trial's adapter in PEFT format; a finished trial's saved directory
        is copied. Loads with `peft.PeftModel.from_pretrained(base_model, path)`."""
        if trial_id not in self.active:
            if trial_id in self.finished:
                if os.path.abspath(self.finished[trial_id]) != os.path.abspath(path):
                    import shutil
                    shutil.copytree(self.finished[trial_id], path, dirs_exist_ok=True)
                return path
            raise KeyError(f"Trial {trial_id!r} is not in this job.")
        self._write_adapter(self.active[trial_id], path)
        return path

    def _write_adapter(self, a: _Adapter, path: str) -> dict[str, str]:
        """Save `a` in PEFT format at `path`; returns each file's SHA-256."""
        weights = {}
        for name in a.modules:
            layer: MultiLoRALinear = self.layers[name]
            weights[peft_key(name, "lora_A")] = layer.lora_A[a.key].weight
            weights[peft_key(name, "lora_B")] = layer.lora_B[a.key].weight
        wanted = list(a.cfg.target_modules or [m for m in self.spec.target_modules if m in self.module_shapes])
        return write_peft_adapter(path, a.cfg, weights, wanted, self.spec.model_name)
