"""The training step on a CUDA GPU: captured once in a CUDA graph, then replayed.

Launched from Python, a packed micro-step of a 1B model issues about 900 kernels and spends
several times their GPU time on the host preparing them, while the GPU waits. A CUDA graph
records the step's kernels once and replays all of them with one call.

A replay repeats exactly what was recorded: the same kernels, grids and addresses. So the step
here depends on its *layout* only, never on its samples:

* slots: every active adapter, in job order, owns one row per sample of its batch, each row
  `length` tokens, the sample right-padded. Under causal attention a real token never sees the
  padding after it, and padding has no target, so each adapter's loss and gradient are those
  of its own samples.
* `length`: the step's bucket, the smallest of `BUCKETS` (fractions of max_seq_len, rounded up
  to 16) that holds its longest sample.

One graph per layout (length, adapters) holds the whole micro-step: forward, per-adapter loss,
backward, gradient accumulation, clipping and AdamW (`PackedAdamW.step_on_device`). Before a
replay the host writes the step's values into the graph's static buffers (token ids, targets,
each adapter's loss weight, lr, step count and whether it steps, every layer's dropout seeds)
with four copies from pinned memory; after it, one copy brings back each adapter's loss sum
and gradient norm. A join or leave changes the layout: the graphs are dropped and the next
step captures again (a warm-up forward/backward, then the capture: about two eager steps).
The graphs of all buckets share one memory pool, since one runs at a time.

Padding costs the GPU what the host saves: a 1B model at sequence 256 gains several times,
a 7B model at 1024, whose eager step already keeps the GPU busy, could lose. So with
`cuda_graphs="auto"` a job times `TRIAL_STEPS` eager and `TRIAL_STEPS` replayed steps for
each size of pack (adapters in [2^k, 2^(k+1))), leaving out steps that compile or capture,
and keeps the one that trains more real tokens per second.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from .data import IGNORE_INDEX
from .kernels.lm_loss import per_adapter_lm_loss
from .kernels.metadata import retain_tables
from .layers import layer_seed_table
from .optim import DEVICE_COLS

logger = logging.getLogger(__name__)

BUCKETS = (0.25, 0.5, 0.75, 1.0)  # token lengths a step is padded to, as fractions of max_seq_len
CAPTURE_AFTER = 3  # steps asking for a bucket before it gets a graph of its own, if a longer one has one
TRIAL_STEPS = 3  # steps of each kind `cuda_graphs="auto"` times before it chooses
TABLE_COLS = ("loss_weight", *DEVICE_COLS)  # per-adapter values written before every replay


class GraphCaptureError(RuntimeError):
    """Capturing the step failed; the job goes on with the eager step."""


@dataclass
class _Layout:
    """One layout's static buffers (device, and pinned host twins to fill them from) and graph."""

    adapters: list  # the job's adapter records the layout was made for, in order
    rows: list[int]  # samples (rows) of each adapter
    length: int
    ids: torch.Tensor  # int64 [rows, length]
    targets: torch.Tensor  # int64 [rows * length]: the next token, IGNORE_INDEX on padding and prompts
    table: torch.Tensor  # fp32 [adapters, len(TABLE_COLS)]
    seeds: torch.Tensor  # int64 [layers, adapters]
    out: torch.Tensor  # fp32 [2, adapters]: loss sums, gradient norms
    lens: torch.Tensor  # int64 [adapters]: rows * length each, for the loss's backward
    host: dict[str, torch.Tensor]  # pinned twins of ids, targets, table, seeds, out
    tables: list = field(default_factory=list)  # the kernels' routing tables the graph reads
    graph: Optional[torch.cuda.CUDAGraph] = None

    @property
    def seg_tokens(self) -> list[int]:
        return [r * self.length for r in self.rows]

    def matches(self, adapters, groups) -> bool:
        return (len(adapters) == len(self.adapters) and all(a is b for a, b in zip(adapters, self.adapters))
                and self.rows == [len(g) for g in groups])


class GraphedStep:
    """The micro-step of `job` (a `PackedJob`) in the slot layout, replayed from CUDA graphs.

    With `capture=False` the same step runs eagerly on the same static buffers: the CPU tests
    check it against the job's own step. With `choose`, the job asks `wants` before each step
    and reports each step to `record` (`cuda_graphs="auto"`)."""

    def __init__(self, job, capture: bool = True, choose: bool = False):
        self.job = job
        self.capture = capture
        self.choose = choose
        # by pack size (adapters' bit length): (seconds, real tokens) of the timed steps, eager
        # (False) and replayed (True); then the choice
        self.timings: dict[int, dict[bool, list[tuple[float, int]]]] = {}
        self.chosen: dict[int, bool] = {}
        self.captured = False  # whether the last step captured a graph
        self.layouts: dict[int, _Layout] = {}  # by length; all of one set of adapters
        self.pool = None  # the graphs' shared memory pool, made at the first capture
        self.captures = 0  # graphs captured so far
        self.wait_s = 0.0  # how long the host waited for the last step's replay to finish
        self.asked: dict[int, int] = {}  # steps that fell in each bucket
        self.last_length = 0  # the length the last step ran at

    def length(self, groups) -> int:
        """The bucket of a step whose adapters draw `groups` of samples."""
        longest = max(len(s) for g in groups for s in g)
        max_len = self.job.spec.max_seq_len
        for fraction in BUCKETS:
            bucket = min(max_len, -(-int(max_len * fraction) // 16) * 16)
            if longest <= bucket:
                return bucket
        return max_len

    def _length_to_run(self, groups) -> int:
        """The step's bucket, or a longer one already captured while the step's own has been
        asked for fewer than `CAPTURE_AFTER` times: a rare bucket (a short step among many
        adapters) pads further rather than stall the job for a capture."""
        length = self.length(groups)
        self.asked[length] = self.asked.get(length, 0) + 1
        if length in self.layouts or self.asked[length] >= CAPTURE_AFTER:
            return length
        return min((n for n in self.layouts if n > length and self._fits(groups, n)), default=length)

    def _fits(self, groups, length: int) -> bool:
        """Whether the step at `length` fits the job's cap on tokens per forward, if it has one."""
        cap = self.job.microbatch_tokens
        return cap is None or sum(len(g) for g in groups) * length <= cap

    def wants(self, n_adapters: int) -> bool:
        """Whether a step of `n_adapters` should be replayed: always, unless choosing, where a
        pack size first times eager steps, then replayed ones, then keeps its choice."""
        if not self.choose:
            return True
        size = n_adapters.bit_length()
        if size in self.chosen:
            return self.chosen[size]
        return len(self.timings.get(size, {}).get(False, ())) >= TRIAL_STEPS

    def record(self, n_adapters: int, replayed: bool, seconds: float, tokens: int, timed: bool) -> None:
        """A finished step, for the choice: `timed` is False for a step that compiled kernels
        or captured a graph, which says nothing of the steady state."""
        size = n_adapters.bit_length()
        if not (self.choose and timed) or size in self.chosen:
            return
        timings = self.timings.setdefault(size, {False: [], True: []})
        timings[replayed].append((seconds, tokens))
        if min(len(timings[False]), len(timings[True])) >= TRIAL_STEPS:
            rate = {k: sum(n for _, n in v) / max(sum(t for t, _ in v), 1e-9) for k, v in timings.items()}
            self.chosen[size] = rate[True] >= rate[False]
            logger.info("packs of %d-%d adapters train %.0f real tokens/s replayed from CUDA graphs and %.0f "
                        "eagerly: they run %s", 2 ** (size - 1), 2 ** size - 1, rate[True], rate[False],
                        "replayed" if self.chosen[size] else "eagerly")

    def takes(self, groups) -> bool:
        """Whether this step runs here: its own bucket fits the job's cap (else it runs eagerly,
        in microbatches)."""
        return self._fits(groups, self.length(groups))

    def run(self, adapters, groups, stepping: list[bool]) -> tuple[list[float], list[float]]:
        """One micro-step of `adapters` on their `groups` of samples, with the optimizer step of
        those `stepping`: (each adapter's loss sum, each one's gradient norm before clipping).
        Raises `GraphCaptureError` if a new layout cannot be captured (nothing trained then)."""
        if self.layouts and not next(iter(self.layouts.values())).matches(adapters, groups):
            self.layouts.clear()  # the adapters changed: every graph is stale
        length = self.last_length = self._length_to_run(groups)
        layout = self.layouts.get(length)
        new = layout is None
        if new:
            layout = self._new_layout(adapters, groups, length)
        self._stage(layout, groups, stepping)
        self.captured = new and self.capture
        if self.captured:
            try:
                self._capture(layout)
            except Exception as e:  # noqa: BLE001 - whatever stops a capture sends the job back to eager steps
                self.layouts.clear()
                raise GraphCaptureError(f"capturing the training step in a CUDA graph failed: {e}") from e
            self.captures += 1
        self.layouts[length] = layout
        if layout.graph is not None:
            layout.graph.replay()
        else:
            self._step(layout)
        out = layout.host["out"]
        out.copy_(layout.out, non_blocking=True)
        t = time.perf_counter()
        if layout.out.is_cuda:
            torch.cuda.current_stream(layout.out.device).synchronize()
        self.wait_s = time.perf_counter() - t  # the host's wait for the replay
        sums, norms = out.tolist()
        return sums, norms

    def _new_layout(self, adapters, groups, length: int) -> _Layout:
        job, device = self.job, self.job.device
        rows = [len(g) for g in groups]
        n = len(adapters)
        host = {"ids": torch.empty(sum(rows), length, dtype=torch.int64),
                "targets": torch.empty(sum(rows) * length, dtype=torch.int64),
                "table": torch.empty(n, len(TABLE_COLS), dtype=torch.float32),
                "seeds": torch.empty(job.segments.num_layers, n, dtype=torch.int64),
                "out": torch.empty(2, n, dtype=torch.float32)}
        if device.type == "cuda":
            host = {k: v.pin_memory() for k, v in host.items()}
        dev = {k: torch.zeros_like(v, device=device) for k, v in host.items()}
        return _Layout(adapters=list(adapters), rows=rows, length=length, ids=dev["ids"], targets=dev["targets"],
                       table=dev["table"], seeds=dev["seeds"], out=dev["out"],
                       lens=torch.tensor([r * length for r in rows], dtype=torch.int64, device=device), host=host)

    def _stage(self, layout: _Layout, groups, stepping: list[bool]) -> None:
        """Write the step's values into the pinned buffers and queue their copies to the device.
        The previous step's copies are done: `run` waits for the replay after them."""
        job, length = self.job, layout.length
        ids, targets = layout.host["ids"].numpy(), layout.host["targets"].numpy()
        ids.fill(job.pad_id)
        targets.fill(IGNORE_INDEX)
        row = 0
        for group in groups:
            for s in group:
                ids[row, :len(s)] = s.input_ids
                targets[row * length: row * length + len(s) - 1] = s.labels[1:]
                row += 1
        table = layout.host["table"].numpy()
        for i, (a, group, steps) in enumerate(zip(layout.adapters, groups, stepping)):
            count = sum(s.loss_tokens for s in group)
            table[i, 0] = 1.0 / (max(count, 1) * a.cfg.gradient_accumulation_steps)
            job.optimizer.fill_device_row(a.trial_id, steps, table[i, 1:])
        layout.host["seeds"].numpy()[:] = layer_seed_table([a.cfg.seed for a in layout.adapters],
                                                           [a.micro_steps for a in layout.adapters],
                                                           job.segments.num_layers)
        for name in ("ids", "targets", "table", "seeds"):
            getattr(layout, name).copy_(layout.host[name], non_blocking=True)

    def _forward_backward(self, layout: _Layout):
        """(loss sums [adapters], gradients of every adapter parameter, those parameters): the
        adapters' summed losses weighted by `loss_weight`, differentiated."""
        job = self.job
        params = [p for a in layout.adapters for p in job.optimizer.adapters[a.trial_id].params]
        job.segments.set([a.key for a in layout.adapters], layout.seg_tokens,
                         [a.micro_steps for a in layout.adapters], [a.cfg.seed for a in layout.adapters])
        job.segments.read_seeds_from(layout.seeds)  # the Triton path's seeds, from the static buffer
        try:
            hidden = job.body(input_ids=layout.ids, use_cache=False).last_hidden_state
            sums, _ = per_adapter_lm_loss(hidden.reshape(-1, hidden.shape[-1]), job.lm_head_weight, layout.targets,
                                          layout.seg_tokens, lens_on_device=layout.lens)
            loss = (sums * layout.table[:, 0]).sum()
            grads = torch.autograd.grad(loss, params)
        finally:
            job.segments.clear()
        return sums, grads, params

    def _step(self, layout: _Layout) -> None:
        """The whole micro-step on the static buffers: what a graph captures."""
        sums, grads, params = self._forward_backward(layout)
        torch._foreach_add_([p.grad for p in params], list(grads))
        norms = self.job.optimizer.step_on_device([a.trial_id for a in layout.adapters], layout.table[:, 1:], sums)
        layout.out[0].copy_(sums)
        layout.out[1].copy_(norms)

    def _capture(self, layout: _Layout) -> None:
        """Warm up (a forward and backward on a side stream, gradients dropped: it compiles what
        is not compiled yet and fills the kernels' table caches), then capture `_step`."""
        device = self.job.device
        main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        with warnings.catch_warnings():
            # the adapters' AccumulateGrad nodes were made by eager steps on another stream; the
            # gradients are taken with autograd.grad, which never runs them
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
            side.wait_stream(main)
            with torch.cuda.stream(side), retain_tables(layout.tables):
                self._forward_backward(layout)
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with retain_tables(layout.tables), torch.cuda.graph(graph, pool=self.pool):
                self._step(layout)
        layout.graph = graph


def graphs_supported(job) -> bool:
    """Whether `job`'s steps can be captured: on CUDA, with the Triton kernels and packed
    samples (the model attends within each sample without a mask)."""
    from .kernels import uses_triton

    return job.device.type == "cuda" and job.packed and uses_triton(job.lm_head_weight)
