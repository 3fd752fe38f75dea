"""The training step on a CUDA GPU: captured once in a CUDA graph, then replayed.

Launched from Python, a packed micro-step of a 1B model issues about 900 kernels and spends
several times their GPU time on the host preparing them, while the GPU waits. A CUDA graph
records the step's kernels once and replays all of them with one call.

A replay repeats exactly what was recorded: the same kernels, grids and addresses. So the step
here depends on its *frame* only, never on its samples:

* tokens: the step's samples back to back in one row, adapter after adapter (the eager step's
  packed layout), then padding up to the step's token bucket (`token_bucket`: four sizes per
  power of two). The padding is a segment with no adapter and no targets, cut into pieces of
  at most max_seq_len that attend only to themselves.
* tables: the kernels' routing tables are a `kernels.frame.TableFrame`, sized for any layout
  of the bucket over the same adapters and sample counts; the samples' offsets, position ids,
  targets and each row's adapter are static buffers. The host refills all of them before
  each replay.

One graph per frame (bucket, adapters, samples of each) holds the whole micro-step: forward,
per-adapter loss, backward, gradient accumulation, clipping and AdamW
(`PackedAdamW.step_on_device`). Before a replay the host writes the step's values into the
graph's static buffers (token ids, positions, targets, sample offsets, every layer's dropout
seeds; each adapter's loss weight, lr, step count and whether it steps; the kernels' tables)
from pinned memory, a copy per buffer; after it, one copy brings back each adapter's loss
sum and gradient norm. A join or leave changes the frame: the graphs are dropped and the next
step captures again (a warm-up forward/backward, then the capture: about two eager steps).
The graphs of all buckets share one memory pool, since one runs at a time. A smaller bucket's
capture reuses a larger one's blocks, but not the other way round: a capture that runs out of
memory beside other buckets' graphs drops them and captures its bucket alone, once.

With `cuda_graphs="auto"` a job times `TRIAL_STEPS` eager and `TRIAL_STEPS` replayed steps
for each size of pack (adapters in [2^k, 2^(k+1))), leaving out steps that compile or capture,
and keeps the one that trains more real tokens per second.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .data import IGNORE_INDEX
from .kernels.frame import TableFrame
from .kernels.lm_loss import lm_loss_rows
from .layers import PADDING_SEGMENT, layer_seed_table
from .optim import DEVICE_COLS

logger = logging.getLogger(__name__)

BUCKET_STEPS = 4  # token buckets per power of two: a step pads at most a quarter of the power below it
MIN_BUCKET_STEP = 64  # tokens between the smallest buckets
TRIAL_STEPS = 3  # steps of each kind `cuda_graphs="auto"` times before it chooses
TABLE_COLS = ("loss_weight", *DEVICE_COLS)  # per-adapter values written before every replay


def token_bucket(tokens: int) -> int:
    """The tokens a step of `tokens` real ones runs at: the next multiple of a quarter of the
    power of two below it (at least `MIN_BUCKET_STEP`), with room for one padding token."""
    step = max(MIN_BUCKET_STEP, (1 << max(0, tokens.bit_length() - 1)) // BUCKET_STEPS)
    return -(-(tokens + 1) // step) * step


class GraphCaptureError(RuntimeError):
    """Capturing the step failed; the job goes on with the eager step."""


@dataclass
class _Layout:
    """One frame's static buffers (device, and pinned host twins to fill them from) and graph."""

    adapters: list  # the job's adapter records the frame was made for, in order
    rows: list[int]  # samples of each adapter
    tokens: int  # the bucket
    pieces: int  # pieces of the padding: as many as a row of `tokens` padding needs
    ints: torch.Tensor  # int64: ids, positions, targets, each row's adapter, sample offsets, seeds (`_int_views`)
    table: torch.Tensor  # fp32 [adapters, len(TABLE_COLS)]
    out: torch.Tensor  # fp32 [2, adapters]: loss sums, gradient norms
    adapter_index: torch.Tensor  # int64 [adapters]: 0, 1, ..
    host: dict[str, torch.Tensor]  # pinned twins of ints, table, out
    frame: TableFrame
    graph: Optional[torch.cuda.CUDAGraph] = None

    def views(self, ints: torch.Tensor, num_layers: int) -> dict[str, torch.Tensor]:
        """`ints` (this layout's int64 buffer, device or host) cut into its named parts."""
        t, samples = self.tokens, sum(self.rows) + self.pieces
        sizes = {"ids": t, "positions": t, "targets": t, "segment": t, "offsets": samples + 1,
                 "seeds": num_layers * (len(self.adapters) + 1)}
        parts = dict(zip(sizes, ints.split(list(sizes.values()))))
        parts["ids"], parts["positions"] = parts["ids"].view(1, t), parts["positions"].view(1, t)
        parts["seeds"] = parts["seeds"].view(num_layers, len(self.adapters) + 1)
        return parts

    def matches(self, adapters, groups) -> bool:
        return (len(adapters) == len(self.adapters) and all(a is b for a, b in zip(adapters, self.adapters))
                and self.rows == [len(g) for g in groups])


class GraphedStep:
    """The micro-step of `job` (a `PackedJob`) packed into a token bucket, replayed from CUDA graphs.

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
        self.layouts: dict[int, _Layout] = {}  # by bucket; all of one set of adapters
        self.pool = None  # the graphs' shared memory pool, made at the first capture
        self.captures = 0  # graphs captured so far
        self.wait_s = 0.0  # how long the host waited for the last step's replay to finish
        # by bucket: the seconds its steps have spent on padding, run in a larger captured one
        self.padding_s: dict[int, float] = {}
        self.capture_s = 0.0  # the last capture's step, in seconds
        self.asked = 0  # the bucket of the last step's own tokens
        self.last_tokens = 0  # the bucket the last step ran at

    def bucket(self, groups) -> int:
        """The token bucket of a step whose adapters draw `groups` of samples."""
        return token_bucket(sum(len(s) for g in groups for s in g))

    def _bucket_to_run(self, groups) -> int:
        """The step's bucket, or the smallest larger one already captured until the steps of
        the bucket have lost as much time to that padding as a capture takes (then it gets a
        graph of its own): no bucket costs more than twice what the best choice in hindsight
        would have."""
        tokens = self.asked = self.bucket(groups)
        larger = [n for n in self.layouts if n > tokens and self._fits(n)]
        if tokens in self.layouts or not larger or self.padding_s.get(tokens, 0.0) >= self.capture_s:
            return tokens
        return min(larger)

    def _fits(self, tokens: int) -> bool:
        """Whether a step of `tokens` fits the job's cap on tokens per forward, if it has one."""
        cap = self.job.microbatch_tokens
        return cap is None or tokens <= cap

    def wants(self, n_adapters: int) -> bool:
        """Whether a step of `n_adapters` should be replayed: always, unless choosing, where a
        pack size first times eager steps, then replayed ones, then keeps its choice."""
        if not self.choose:
            return True
        size = n_adapters.bit_length()
        if size in self.chosen:
            return self.chosen[size]
        return len(self.timings.get(size, {}).get(False, ())) >= TRIAL_STEPS

    def choosing(self, n_adapters: int) -> bool:
        """Whether steps of `n_adapters` are still timed for the choice between eager and
        replayed steps (`cuda_graphs="auto"`), so that neither kind is yet the job's own."""
        return self.choose and n_adapters.bit_length() not in self.chosen

    def record(self, n_adapters: int, replayed: bool, seconds: float, tokens: int, timed: bool) -> None:
        """A finished step: a capture's time and a padded step's waste (`_bucket_to_run`), and,
        when choosing, its rate; `timed` is False for a step that compiled kernels or captured a
        graph, which says nothing of the steady state."""
        if replayed and self.captured:
            self.capture_s = seconds
        elif replayed and self.last_tokens > self.asked:
            waste = seconds * (1 - self.asked / self.last_tokens)
            self.padding_s[self.asked] = self.padding_s.get(self.asked, 0.0) + waste
        size = n_adapters.bit_length()
        if not (self.choose and timed) or size in self.chosen:
            return
        timings = self.timings.setdefault(size, {False: [], True: []})
        timings[replayed].append((seconds, tokens))
        if min(len(timings[False]), len(timings[True])) >= TRIAL_STEPS:
            rate = {k: sum(n for _, n in v) / max(sum(t for t, _ in v), 1e-9) for k, v in timings.items()}
            self.chosen[size] = rate[True] >= rate[False]
            if not self.chosen[size]:  # eager from now on: the graphs' memory goes to eager steps
                self._drop_graphs()
            torch.cuda.empty_cache()  # what the other kind of step cached
            logger.info("packs of %d-%d adapters train %.0f real tokens/s replayed from CUDA graphs and %.0f "
                        "eagerly: they run %s", 2 ** (size - 1), 2 ** size - 1, rate[True], rate[False],
                        "replayed" if self.chosen[size] else "eagerly")

    def takes(self, groups) -> bool:
        """Whether this step runs here: its own bucket fits the job's cap (else it runs eagerly,
        in microbatches)."""
        return self._fits(self.bucket(groups))

    def run(self, adapters, groups, stepping: list[bool]) -> tuple[list[float], list[float]]:
        """One micro-step of `adapters` on their `groups` of samples, with the optimizer step of
        those `stepping`: (each adapter's loss sum, each one's gradient norm before clipping).
        Raises `GraphCaptureError` if a new layout cannot be captured (nothing trained then)."""
        if self.layouts and not next(iter(self.layouts.values())).matches(adapters, groups):
            self._drop_graphs()  # the adapters changed: every graph is stale
        tokens = self.last_tokens = self._bucket_to_run(groups)
        layout = self.layouts.get(tokens)
        new = layout is None
        if new:
            layout = self._new_layout(adapters, groups, tokens)
        self._stage(layout, groups, stepping)
        self.captured = new and self.capture
        if self.captured:
            error = self._capture_or_error(layout)
            if self.layouts and any(isinstance(e, torch.OutOfMemoryError) for e in _chain(error)):
                # The pool keeps the other buckets' blocks, and a larger bucket's tensors do not
                # fit in them: drop those graphs (later captures of smaller buckets reuse this
                # one's blocks) and capture this bucket alone.
                self._drop_graphs()
                self.pool = None
                torch.cuda.empty_cache()
                error = self._capture_or_error(layout)
            if error is not None:  # whatever stops a capture sends the job back to eager steps
                self._drop_graphs()
                raise GraphCaptureError(f"capturing the training step in a CUDA graph failed: {error}") from error
            self.captures += 1
        self.layouts[tokens] = layout
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

    def _new_layout(self, adapters, groups, tokens: int) -> _Layout:
        job, device = self.job, self.job.device
        rows = [len(g) for g in groups]
        n = len(adapters)
        max_len = job.spec.max_seq_len
        pieces = -(-tokens // max_len)
        n_ints = 4 * tokens + sum(rows) + pieces + 1 + job.segments.num_layers * (n + 1)
        host = {"ints": torch.empty(n_ints, dtype=torch.int64),
                "table": torch.empty(n, len(TABLE_COLS), dtype=torch.float32),
                "out": torch.empty(2, n, dtype=torch.float32)}
        if device.type == "cuda":
            host = {k: v.pin_memory() for k, v in host.items()}
        dev = {k: torch.zeros_like(v, device=device) for k, v in host.items()}
        # the first step's layout; `_stage` fills the frame with each step's own
        seg_lens = [sum(len(s) for s in g) for g in groups]
        frame = TableFrame(seg_lens + [tokens - sum(seg_lens)], [r * max_len for r in rows] + [tokens])
        return _Layout(adapters=list(adapters), rows=rows, tokens=tokens, pieces=pieces, ints=dev["ints"],
                       table=dev["table"], out=dev["out"], adapter_index=torch.arange(n, device=device), host=host,
                       frame=frame)

    def _stage(self, layout: _Layout, groups, stepping: list[bool]) -> None:
        """Write the step's values into the pinned buffers and queue their copies to the device.
        The previous step's copies are done: `run` waits for the replay after them."""
        job, tokens = self.job, layout.tokens
        host = {k: v.numpy() for k, v in layout.views(layout.host["ints"], job.segments.num_layers).items()}
        ids, positions, targets, segment, offsets = (host[k].reshape(-1) for k in
                                                     ("ids", "positions", "targets", "segment", "offsets"))
        at = sample = 0
        for i, group in enumerate(groups):
            for s in group:
                n = len(s)
                ids[at:at + n] = s.input_ids
                positions[at:at + n] = np.arange(n)
                targets[at:at + n - 1] = s.labels[1:]
                targets[at + n - 1] = IGNORE_INDEX
                segment[at:at + n] = i
                offsets[sample] = at
                at, sample = at + n, sample + 1
        # the padding: pieces of at most max_seq_len tokens (the last ones may be empty)
        ids[at:], positions[at:], targets[at:], segment[at:] = job.pad_id, 0, IGNORE_INDEX, len(groups)
        piece = -(-(tokens - at) // layout.pieces)
        offsets[sample:] = np.minimum(at + piece * np.arange(layout.pieces + 1), tokens)
        table = layout.host["table"].numpy()
        for i, (a, group, steps) in enumerate(zip(layout.adapters, groups, stepping)):
            count = sum(s.loss_tokens for s in group)
            table[i, 0] = 1.0 / (max(count, 1) * a.cfg.gradient_accumulation_steps)
            job.optimizer.fill_device_row(a.trial_id, steps, table[i, 1:])
        host["seeds"][:] = layer_seed_table([a.cfg.seed for a in layout.adapters] + [0],
                                            [a.micro_steps for a in layout.adapters] + [0],
                                            job.segments.num_layers)
        layout.frame.fill([sum(len(s) for s in g) for g in groups] + [tokens - at])
        layout.ints.copy_(layout.host["ints"], non_blocking=True)
        layout.table.copy_(layout.host["table"], non_blocking=True)

    def _forward_backward(self, layout: _Layout):
        """(loss sums [adapters], gradients of every adapter parameter, those parameters): the
        adapters' summed losses weighted by `loss_weight`, differentiated."""
        job = self.job
        params = [p for a in layout.adapters for p in job.optimizer.adapters[a.trial_id].params]
        parts = layout.views(layout.ints, job.segments.num_layers)
        job.segments.set([a.key for a in layout.adapters] + [PADDING_SEGMENT], layout.frame.seg_lens,
                         [a.micro_steps for a in layout.adapters] + [0], [a.cfg.seed for a in layout.adapters] + [0],
                         frame=layout.frame)
        job.segments.read_seeds_from(parts["seeds"])  # the Triton path's seeds, from the static buffer
        try:
            offsets, max_len = parts["offsets"].to(torch.int32), job.spec.max_seq_len
            hidden = job.body(input_ids=parts["ids"], position_ids=parts["positions"], cu_seq_lens_q=offsets,
                              cu_seq_lens_k=offsets, max_length_q=max_len, max_length_k=max_len,
                              use_cache=False).last_hidden_state
            losses = lm_loss_rows(hidden[0], job.lm_head_weight, parts["targets"])
            # each adapter's sum over its own rows; `where`, not a product, so that a non-finite
            # loss of one adapter reaches no other's
            mine = parts["segment"][None, :] == layout.adapter_index[:, None]
            sums = torch.where(mine, losses[None, :], 0.0).sum(dim=1)
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

    def _drop_graphs(self) -> None:
        """Forget every layout and its graph, and what padding into them has cost."""
        self.layouts.clear()
        self.padding_s.clear()

    def _capture_or_error(self, layout: _Layout) -> Optional[Exception]:
        """`_capture(layout)`; what stopped it, if anything, without tracebacks (theirs and those
        of the errors it was raised in), whose frames would keep the failed capture's tensors."""
        try:
            self._capture(layout)
        except Exception as e:  # noqa: BLE001 - the caller decides
            for error in _chain(e):
                error.__traceback__ = None
            return e
        return None

    def _capture(self, layout: _Layout) -> None:
        """Warm up (a forward and backward on a side stream, gradients dropped: it compiles what
        is not compiled yet), then capture `_step`. Memory cached for other streams (eager steps,
        the warm-up) goes back to the device first: the warm-up and the graphs' pool each need a
        step's activations, and at long sequences two copies of them do not fit."""
        device = self.job.device
        torch.cuda.empty_cache()
        main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        with warnings.catch_warnings():
            # the adapters' AccumulateGrad nodes were made by eager steps on another stream; the
            # gradients are taken with autograd.grad, which never runs them
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._forward_backward(layout)
            main.wait_stream(side)
            torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                self._step(layout)
        layout.graph = graph


def _chain(error: Optional[BaseException]):
    """`error` and the errors it was raised while handling, innermost last."""
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def graphs_supported(job) -> bool:
    """Whether `job`'s steps can be captured: on CUDA, with the Triton kernels and packed
    samples (the model attends within each sample without a mask)."""
    from .kernels import uses_triton

    return job.device.type == "cuda" and job.packed and uses_triton(job.lm_head_weight)
