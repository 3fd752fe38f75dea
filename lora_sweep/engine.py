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

import logging
import math
import os
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import torch
from tqdm.auto import tqdm

from .config import ConfigError, JobSpec, TrialConfig, check_against_model
from .data import IGNORE_INDEX, Sample, SampleStream, collate, load_rows, tokenize_rows
from .export import peft_key, save_peft_adapter
from .kernels.lm_loss import per_adapter_lm_loss
from .layers import MultiLoRALinear, SegmentTable
from .model import inject_multi_lora, linear_layer_names, load_base_model, resolve_device, resolve_dtype, \
    split_causal_lm
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
    """The trial was removed without finishing: an invalid config or a non-finite loss or gradient."""

    trial_id: str
    step: int
    reason: str


Event = Union[Report, Finished, Failed]


# --------------------------------------------------------------------------- per-trial state


@dataclass
class _Adapter:
    cfg: TrialConfig
    key: str  # module-dict key inside every MultiLoRALinear
    stream: SampleStream
    modules: list[str]  # full names of the layers it adapts
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
        self.dtype = resolve_dtype(spec, self.device)
        self.adapter_dtype = torch.float32  # adapters train in fp32 on a bf16 base, as PEFT does
        self.model, self.tokenizer = load_base_model(spec, self.device, self.dtype)
        self.module_shapes = {k: v for k, v in linear_layer_names(self.model).items()
                              if k in spec.target_modules}  # read before the layers are wrapped
        self.segments = SegmentTable()
        self.layers = inject_multi_lora(self.model, spec.target_modules, self.segments)
        self.body, self.lm_head_weight = split_causal_lm(self.model)
        # Padded length: fixed on CPU so that backward reductions over the sequence run in the same
        # order whoever the pack-mates are (bit-identical isolation); the longest sample on GPU.
        fixed = spec.padding == "max_seq_len" or (spec.padding == "auto" and self.device.type == "cpu")
        self.pad_length = spec.max_seq_len if fixed else None
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:  # documented: the EOS token pads; padding is masked anyway
            self.pad_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else 0

        self.train_samples = tokenize_rows(load_rows(spec.train_data, "train_data"), self.tokenizer,
                                           spec.max_seq_len, "train_data")
        self.eval_samples: list[Sample] = []
        if spec.eval_data is not None:
            self.eval_samples = tokenize_rows(load_rows(spec.eval_data, "eval_data"), self.tokenizer,
                                              spec.max_seq_len, "eval_data")[: spec.max_eval_samples]

        self.optimizer = PackedAdamW()
        self.active: dict[str, _Adapter] = {}  # trial_id -> state, in join order
        self.finished: dict[str, str] = {}  # trial_id -> adapter dir
        self._pending_add: deque[Union[TrialConfig, dict]] = deque()
        self._pending_remove: set[str] = set()
        self._events: deque[Event] = deque()
        self._next_id = 0
        self.step_stats: list[dict] = []  # one dict per job step, for the cost model
        self.progress = progress
        self._running = False
        self._lock = threading.RLock()  # add/remove may come from another thread (Ray actor calls)
        for cfg in trials:
            self.add_trial(cfg)

    # ------------------------------------------------------------------ membership

    @property
    def trials(self) -> dict[str, TrialConfig]:
        """The active trials, trial_id -> config."""
        return {tid: a.cfg for tid, a in self.active.items()}

    def add_trial(self, cfg: Union[TrialConfig, dict]) -> Optional[str]:
        """Queue a trial (a TrialConfig or a dict of its fields); it joins at the next step.
        Returns its trial_id. An invalid config becomes a `Failed` event, not an exception,
        so a bad trial never stops the job."""
        if isinstance(cfg, TrialConfig) and cfg.trial_id is None:
            cfg.trial_id = self._new_id()
        with self._lock:
            self._pending_add.append(cfg)
        if not self._running:  # outside run() there is no step to wait for
            self._apply_membership()
        return cfg.trial_id if isinstance(cfg, TrialConfig) else (cfg.get("trial_id") or None)

    def remove_trial(self, trial_id: str) -> None:
        """Drop a trial at the next step boundary (pruned or stopped by the tuner). Unknown or
        already finished trials are ignored."""
        with self._lock:
            self._pending_remove.add(str(trial_id))
        if not self._running:
            self._apply_membership()

    def _new_id(self) -> str:
        while f"trial-{self._next_id}" in self.active or f"trial-{self._next_id}" in self.finished:
            self._next_id += 1
        self._next_id += 1
        return f"trial-{self._next_id - 1}"

    def _apply_membership(self) -> None:
        with self._lock:
            self._apply_membership_locked()

    def _apply_membership_locked(self) -> None:
        removes, adds = set(self._pending_remove), list(self._pending_add)
        self._pending_remove.clear()
        self._pending_add.clear()
        for tid in removes:
            if tid in self.active:
                self._drop(tid)
        for raw in adds:
            if (raw.trial_id if isinstance(raw, TrialConfig) else raw.get("trial_id")) in removes:
                continue
            try:
                cfg = raw if isinstance(raw, TrialConfig) else TrialConfig.from_dict(
                    {"trial_id": self._new_id(), **raw} if raw.get("trial_id") is None else raw)
                if cfg.trial_id in self.active or cfg.trial_id in self.finished:
                    raise ConfigError(f"Trial {cfg.trial_id!r} is already in this job.", field="trial_id",
                                      trial_id=cfg.trial_id)
                check_against_model(cfg, self.spec, self.module_shapes)
            except ConfigError as e:
                tid = e.trial_id or (raw.trial_id if isinstance(raw, TrialConfig) else raw.get("trial_id"))
                logger.warning("trial %s rejected: %s", tid, e)
                self._events.append(Failed(str(tid), 0, str(e)))
                continue
            self._join(cfg)

    def _join(self, cfg: TrialConfig) -> None:
        key = re.sub(r"\W", "_", cfg.trial_id)
        while any(a.key == key for a in self.active.values()):
            key += "_"
        wanted = set(cfg.target_modules or self.spec.target_modules)
        generator = torch.Generator().manual_seed(cfg.seed)
        modules, params = [], []
        for name, layer in self.layers.items():
            if name.rsplit(".", 1)[-1] in wanted:
                layer.add_adapter(key, cfg.rank, cfg.scaling, cfg.dropout, cfg.seed, generator, self.adapter_dtype)
                modules.append(name)
                params += [layer.lora_A[key].weight, layer.lora_B[key].weight]
        self.optimizer.add(cfg.trial_id, params, cfg.learning_rate,
                           lr_lambda(cfg.lr_scheduler, cfg.warmup_steps, cfg.max_steps),
                           cfg.weight_decay, cfg.max_grad_norm)
        self.active[cfg.trial_id] = _Adapter(cfg, key, SampleStream(len(self.train_samples), cfg.seed), modules)
        if self._bar is not None:
            self._bar.total += cfg.max_steps
            self._bar.refresh()

    def _drop(self, trial_id: str) -> None:
        adapter = self.active.pop(trial_id)
        for name in adapter.modules:
            self.layers[name].delete_adapter(adapter.key)
        self.optimizer.remove(trial_id)

    # ------------------------------------------------------------------ the step loop

    _bar = None

    def run(self) -> Iterator[Event]:
        """Train until no trial is left, yielding `Report`, `Finished` and `Failed` events.
        Between events the caller may `add_trial` / `remove_trial`."""
        self._bar = tqdm(total=sum(a.cfg.max_steps - a.step for a in self.active.values()),
                         desc="lora_sweep", unit="step", disable=not self.progress, dynamic_ncols=True)
        self._running = True
        try:
            while True:
                self._apply_membership()
                yield from self._drain_events()
                if not self.active:
                    if self._pending_add:
                        continue
                    return
                self._train_step()
                yield from self._drain_events()
        finally:
            self._running = False
            self._bar.close()
            self._bar = None

    def _drain_events(self) -> Iterator[Event]:
        while self._events:
            yield self._events.popleft()

    def _train_step(self) -> None:
        """One forward/backward over every active adapter's next micro-batch, then an optimizer
        step for each adapter whose gradient accumulation is complete."""
        t0 = time.perf_counter()
        adapters = list(self.active.values())
        self.model.train()

        # data: each adapter's own samples, stacked adapter by adapter
        groups = [[self.train_samples[i] for i in a.stream.take(a.cfg.batch_size)] for a in adapters]
        batch = collate(groups, self.pad_id, self.device, self.pad_length)
        self.segments.set([a.key for a in adapters], [a.cfg.batch_size for a in adapters],
                          [a.micro_steps for a in adapters])

        # forward / backward: sum of per-adapter mean losses, each scaled for its accumulation
        loss_sums, counts = self._adapter_losses(batch, groups)
        means = loss_sums / counts
        accum = torch.tensor([a.cfg.gradient_accumulation_steps for a in adapters], device=means.device)
        (means / accum).sum().backward()
        self.segments.clear()

        # optimizer: adapters at the end of their accumulation window clip and step together
        stepping = [a for a in adapters if (a.micro_steps + 1) % a.cfg.gradient_accumulation_steps == 0]
        norms = self.optimizer.grad_norms([a.trial_id for a in stepping]) if stepping else means.new_zeros(0)
        mean_values, norm_values = means.tolist(), norms.tolist()  # the step's one host sync
        bad = {a.trial_id: f"non-finite training loss ({v}) at step {a.step + 1}"
               for a, v in zip(adapters, mean_values) if not math.isfinite(v)}
        for a, n in zip(stepping, norm_values):
            if not math.isfinite(n) and a.trial_id not in bad:
                bad[a.trial_id] = f"non-finite gradient norm ({n}) at step {a.step + 1}"
        ok = [a for a in stepping if a.trial_id not in bad]
        ok_index = [i for i, a in enumerate(stepping) if a.trial_id not in bad]
        self.optimizer.step([a.trial_id for a in ok], norms[ok_index] if ok_index else norms[:0])
        self.optimizer.zero_grad([a.trial_id for a in ok])

        seconds = time.perf_counter() - t0
        self._record_stats(adapters, groups, batch, seconds)
        for a, group, v in zip(adapters, groups, mean_values):
            a.micro_steps += 1
            a.tokens += sum(len(s) for s in group)
            a.seconds += seconds
            a.window_losses.append(v)
        for tid, reason in bad.items():
            step = self.active[tid].step
            self._drop(tid)
            self._events.append(Failed(tid, step, reason))
        self._after_optimizer_step([a for a in ok])

    def _adapter_losses(self, batch: dict, groups: list[list[Sample]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-adapter (sum of token losses, number of loss tokens), without full logits."""
        hidden = self.body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        # position t predicts token t + 1; keep only positions with a label, adapter by adapter
        targets = batch["labels"][:, 1:]
        keep = batch["keep_index"]
        hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, keep)  # (loss tokens, hidden)
        targets = targets.reshape(-1).index_select(0, keep)
        seg_lens = [sum(s.loss_tokens for s in g) for g in groups]
        return per_adapter_lm_loss(hidden, self.lm_head_weight, targets, seg_lens)

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
        if not to_eval:
            self._update_bar()
            return
        eval_losses = self.evaluate([a.trial_id for a in to_eval]) if self.eval_samples else {}
        for a in to_eval:
            metrics = {"train_loss": sum(a.report_losses) / len(a.report_losses),
                       "tokens_per_second": a.tokens / max(a.seconds, 1e-9),
                       "learning_rate": self.optimizer.adapters[a.trial_id].current_lr,
                       "step": a.step}
            a.report_losses.clear()
            if a.trial_id in eval_losses:
                metrics["eval_loss"] = eval_losses[a.trial_id]
            self._events.append(Report(a.trial_id, a.step, metrics))
            if a.step >= a.cfg.max_steps:
                path = self.save_adapter(a.trial_id, self._adapter_dir(a.trial_id))
                self.finished[a.trial_id] = path
                self._drop(a.trial_id)
                self._events.append(Finished(a.trial_id, a.step, metrics, path))
        self._update_bar()

    def _record_stats(self, adapters, groups, batch, seconds) -> None:
        self.step_stats.append({
            "tokens": sum(len(s) for g in groups for s in g),  # real (non-padding) tokens
            "padded_tokens": int(batch["input_ids"].numel()),
            "rank_tokens": sum(a.cfg.rank * sum(len(s) for s in g) for a, g in zip(adapters, groups)),
            "num_adapters": len(adapters),
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
        all adapters packed into the same eval forwards."""
        adapters = [self.active[t] for t in (trial_ids if trial_ids is not None else list(self.active))]
        if not adapters or not self.eval_samples:
            return {}
        self.model.eval()
        sums = torch.zeros(len(adapters), dtype=torch.float64)
        counts = torch.zeros(len(adapters), dtype=torch.float64)
        size = self.spec.eval_batch_size
        for start in range(0, len(self.eval_samples), size):
            chunk = self.eval_samples[start : start + size]
            groups = [chunk] * len(adapters)
            batch = collate(groups, self.pad_id, self.device, self.pad_length)
            self.segments.set([a.key for a in adapters], [len(chunk)] * len(adapters))
            s, c = self._adapter_losses(batch, groups)
            sums += s.double().cpu()
            counts += c.double().cpu()
        self.segments.clear()
        return {a.trial_id: float(s / c) for a, s, c in zip(adapters, sums, counts)}

    @torch.no_grad()
    def adapter_logits(self, trial_id: str, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """Logits of the base model with adapter `trial_id` on every row (eval mode)."""
        self.model.eval()
        self.segments.set([self.active[trial_id].key], [input_ids.shape[0]])
        try:
            return self.model(input_ids=input_ids.to(self.device), attention_mask=None if attention_mask is None
                              else attention_mask.to(self.device)).logits
        finally:
            self.segments.clear()

    # ------------------------------------------------------------------ saving

    def _adapter_dir(self, trial_id: str) -> str:
        return os.path.join(self.spec.output_dir, "adapters", re.sub(r"[^\w.-]", "_", trial_id))

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
        a = self.active[trial_id]
        weights = {}
        for name in a.modules:
            layer: MultiLoRALinear = self.layers[name]
            weights[peft_key(name, "lora_A")] = layer.lora_A[a.key].weight
            weights[peft_key(name, "lora_B")] = layer.lora_B[a.key].weight
        wanted = list(a.cfg.target_modules or [m for m in self.spec.target_modules if m in self.module_shapes])
        return save_peft_adapter(path, a.cfg, weights, wanted, self.spec.model_name)
