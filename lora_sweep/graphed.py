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
* slots: each place in the pack reads one adapter's weights, gradient and AdamW moments at
  their addresses (its optimizer state's buffers); a trial that leaves keeps its slot,
  vacant (no rows, no update), and one of the same shape that joins takes its buffers over
  (`_Slot`), so that neither changes the frame.
* tables: the kernels' routing tables are a `kernels.frame.TableFrame`, sized for any layout
  of the bucket over the same slots; the samples' offsets, position ids, targets and each
  row's slot are static buffers. The host refills all of them before each replay, and each
  slot's scale, dropout rate and optimizer settings.

One graph per frame (bucket, slots) holds the whole micro-step: forward, per-slot loss,
backward, gradient accumulation, clipping and AdamW (`PackedAdamW.step_on_device`). Before a
replay the host writes the step's values into the graph's static buffers (token ids,
positions, targets, sample offsets, every layer's dropout seeds; each slot's loss weight,
lr, step count, weight decay and whether it steps; the kernels' tables) from pinned memory,
a copy per buffer; after it, one copy brings back each slot's loss sum and gradient norm.

A step of a bucket without a graph trains eagerly on the bucket's buffers (which also warms
up what it launches), then is recorded without being run again: a capture costs about one
eager step more than a replay. Once a capture's cost is known, a step of a bucket smaller
than a captured one runs padded in that one until the padding has lost as much time as a
capture costs; then its bucket is captured. A join without a vacant slot of its shape gets
a slot at the end: the graphs are dropped and captured again, at most once per bucket and
slot count. The graphs of all buckets share one memory pool, since one runs at a time. A
smaller bucket's capture reuses a larger one's blocks, but not the other way round: a
capture that runs out of memory beside other buckets' graphs drops them and captures its
bucket alone, once. The buckets dropped are not captured again for these slots: their steps
run padded in a larger graph, or eagerly where that has been faster. So no bucket is
captured twice for one set of slots.

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
from .optim import DEVICE_COLS, AdapterOptState

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
class _Slot:
    """A place in the graphs' pack: the buffers an adapter's weights, gradient and AdamW moments
    live in (`state`), whose addresses every graph reads, and what else they were recorded
    with: the samples it draws a step, its rank and layers, whether it draws dropout masks.
    Scale, dropout rate and optimizer settings are refilled before every replay. A slot whose
    adapter left is vacant: no rows, no update, a gradient no kernel writes, and its layers
    keep its weights under `key` (a name no trial can have) until an adapter of the same shape
    takes it over (`occupy`), its gradient and moments zeroed (`PackedAdamW.add`)."""

    adapter: Optional[object]  # the job's adapter record in it; None: vacant
    state: AdapterOptState
    key: str  # its layers' name for it
    modules: tuple[str, ...]
    cfg: object  # the config of the adapter in it, or of the last one: its shape, scale and dropout rate

    @staticmethod
    def of(adapter, state: AdapterOptState) -> "_Slot":
        return _Slot(adapter, state, adapter.key, tuple(adapter.modules), adapter.cfg)

    @property
    def rows(self) -> int:
        """Samples a step."""
        return self.cfg.batch_size

    def fits(self, cfg, modules) -> bool:
        """Whether a trial of `cfg` on `modules` could take this slot over: vacant, and of its
        shape (samples a step, rank, layers, and dropout masks drawn or not)."""
        def shape(c, layers):
            return c.batch_size, c.rank, tuple(layers), c.dropout > 0

        return self.adapter is None and shape(self.cfg, self.modules) == shape(cfg, modules)


@dataclass
class _Layout:
    """One frame's static buffers (device, and pinned host twins to fill them from) and graph."""

    rows: list[int]  # samples of each slot
    tokens: int  # the bucket
    pieces: int  # pieces of the padding: as many as a row of `tokens` padding needs
    ints: torch.Tensor  # int64: ids, positions, targets, each row's slot, sample offsets, seeds (`views`)
    table: torch.Tensor  # fp32 [slots, len(TABLE_COLS)]
    out: torch.Tensor  # fp32 [2, slots]: loss sums, gradient norms
    slot_index: torch.Tensor  # int64 [slots]: 0, 1, ..
    host: dict[str, torch.Tensor]  # pinned twins of ints, table, out
    frame: TableFrame
    graph: Optional[torch.cuda.CUDAGraph] = None
    captured: bool = False  # whether `graph` holds the step (the CPU tests stand in for it)

    def views(self, ints: torch.Tensor, num_layers: int) -> dict[str, torch.Tensor]:
        """`ints` (this layout's int64 buffer, device or host) cut into its named parts."""
        t, samples, n = self.tokens, sum(self.rows) + self.pieces, len(self.rows)
        sizes = {"ids": t, "positions": t, "targets": t, "segment": t, "offsets": samples + 1,
                 "seeds": num_layers * (n + 1)}
        parts = dict(zip(sizes, ints.split(list(sizes.values()))))
        parts["ids"], parts["positions"] = parts["ids"].view(1, t), parts["positions"].view(1, t)
        parts["seeds"] = parts["seeds"].view(num_layers, n + 1)
        return parts


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
        self.ran_eagerly = False  # whether the last step ran eagerly on the buffers of a `spent` bucket
        self.failure: Optional[GraphCaptureError] = None  # why the last step's capture failed, after it trained
        self.slots: list[_Slot] = []  # the places of the pack every layout and graph is made for
        self.vacancies = 0  # slots vacated so far
        self.layouts: dict[int, _Layout] = {}  # by bucket, of `slots`
        self.pool = None  # the graphs' shared memory pool, made at the first capture
        self.captures = 0  # graphs captured so far
        self.eager_steps = 0  # steps run eagerly on the buffers of a `spent` bucket
        self.side_stream: Optional[torch.cuda.Stream] = None  # of every eager step here (`_train_eagerly`)
        self.wait_s = 0.0  # how long the host waited for the last step's replay to finish
        # by bucket: the seconds its steps have lost padded into a larger captured bucket, against
        # replays of a graph of their own (`_bucket_to_run`)
        self.lost_s: dict[int, float] = {}
        self.capture_steps: list[tuple[float, int]] = []  # every capture's step: seconds, bucket
        self.replays = [0.0, 0]  # replayed steps so far: seconds, tokens (their buckets')
        self.eagers = [0.0, 0]  # eager steps of `spent` buckets so far: seconds, tokens
        # buckets whose graphs were dropped to make room for another bucket's: not captured
        # again for these slots
        self.spent: set[int] = set()
        self.asked = 0  # the bucket of the last step's own tokens
        self.last_tokens = 0  # the bucket the last step ran at

    def bucket(self, groups) -> int:
        """The token bucket of a step whose adapters draw `groups` of samples."""
        return token_bucket(sum(len(s) for g in groups for s in g))

    def _replay_s(self, tokens: int) -> Optional[float]:
        """What a replay of `tokens` takes, at the replays' mean rate so far; None before any."""
        seconds, replayed = self.replays
        return seconds * tokens / replayed if replayed else None

    def _eager_s(self, tokens: int) -> Optional[float]:
        """What an eager step of `tokens` takes on a bucket's buffers, at the mean rate of those
        so far; None before any."""
        seconds, stepped = self.eagers
        return seconds * tokens / stepped if stepped else None

    def _capture_cost_s(self) -> Optional[float]:
        """What a capture costs beyond a replay of its step: its step's seconds, less a replay's,
        the least of the captures so far but the job's first (whose step compiles the kernels),
        or None before a second one."""
        costs = [seconds - (self._replay_s(tokens) or 0.0) for seconds, tokens in self.capture_steps[1:]]
        return min(costs, default=None)

    def _bucket_to_run(self, groups) -> int:
        """The step's bucket, or the smallest larger one already captured until the steps of
        the bucket have lost as much time to that padding as a capture costs (then it gets a
        graph of its own): no bucket costs more than twice what the best choice in hindsight
        would have. A `spent` bucket is never captured: it runs padded in the smallest larger
        graph, or eagerly where there is none or eager steps run faster (at their rates so far)."""
        tokens = self.asked = self.bucket(groups)
        larger = [n for n, layout in self.layouts.items() if n > tokens and layout.captured and self._fits(n)]
        if tokens in self.spent:
            if not larger:
                return tokens
            eager, padded = self._eager_s(tokens), self._replay_s(min(larger))
            return tokens if eager is not None and padded is not None and eager < padded else min(larger)
        cost = self._capture_cost_s()
        if self._captured(tokens) or not larger or cost is None or self.lost_s.get(tokens, 0.0) >= cost:
            return tokens
        return min(larger)

    def _captured(self, tokens: int) -> bool:
        return tokens in self.layouts and self.layouts[tokens].captured

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
        """A finished step, `replayed` if it ran here: a capture's time, a replay's, an eager
        step's, what a bucket lost padded (`_bucket_to_run`), and, when choosing,
        its rate; `timed` is False for a step that compiled kernels or captured a graph, which
        says nothing of the steady state."""
        if replayed and self.captured:
            self.capture_steps.append((seconds, self.last_tokens))
        elif replayed and self.ran_eagerly:
            self.eagers[0] += seconds
            self.eagers[1] += self.last_tokens
        elif replayed:
            self.replays[0] += seconds
            self.replays[1] += self.last_tokens
            if self.last_tokens > self.asked:  # padded into a larger bucket: the padding's share lost
                lost = seconds * (1 - self.asked / self.last_tokens)
                self.lost_s[self.asked] = self.lost_s.get(self.asked, 0.0) + lost
        size = n_adapters.bit_length()
        if not (self.choose and timed) or size in self.chosen or (replayed and self.ran_eagerly):
            return
        timings = self.timings.setdefault(size, {False: [], True: []})
        timings[replayed].append((seconds, tokens))
        if min(len(timings[False]), len(timings[True])) >= TRIAL_STEPS:
            rate = {k: sum(n for _, n in v) / max(sum(t for t, _ in v), 1e-9) for k, v in timings.items()}
            self.chosen[size] = rate[True] >= rate[False]
            if not self.chosen[size]:  # eager from now on: the graphs' memory goes to eager steps
                self.release()
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

        A step of a bucket without a graph runs eagerly on the bucket's buffers, and is then
        captured for the steps after it, unless the bucket is `spent`. Raises
        `GraphCaptureError` if that eager step fails (nothing trained then); if only the
        capture fails, the step has trained and `failure` holds the error."""
        seats = self._seat(adapters, groups)
        slot_groups, slot_stepping = [[] for _ in self.slots], [False] * len(self.slots)
        for i, group, steps in zip(seats, groups, stepping):
            slot_groups[i], slot_stepping[i] = group, steps
        tokens = self.last_tokens = self._bucket_to_run(groups)
        layout = self.layouts.get(tokens) or self._new_layout(tokens)
        self.layouts[tokens] = layout
        self._stage(layout, slot_groups, slot_stepping)
        self.captured = self.ran_eagerly = False
        self.failure = None
        if layout.graph is not None:
            layout.graph.replay()
        elif layout.captured or not self.capture:  # (the CPU tests' stand-in for a graph)
            self._step(layout)
        elif tokens in self.spent:
            self._eager_step(layout)
        else:
            self._train_and_capture(layout)
        out = layout.host["out"]
        out.copy_(layout.out, non_blocking=True)
        t = time.perf_counter()
        if layout.out.is_cuda:
            torch.cuda.current_stream(layout.out.device).synchronize()
        self.wait_s = time.perf_counter() - t  # the host's wait for the replay
        sums, norms = out.tolist()
        return [sums[i] for i in seats], [norms[i] for i in seats]

    # --- slots: which adapter's buffers each place of the graphs' pack reads

    def _seat(self, adapters, groups) -> list[int]:
        """Each adapter's slot. One without a slot (it joined, and no vacant slot had its shape)
        gets a new one at the end, and the graphs, made for fewer slots, go: each bucket is
        captured at most once per slot count. Where more than a quarter of the slots would then
        be vacant (their buffers hold memory the job's admission does not count), or an adapter
        draws another number of samples than its slot, the slots are made anew: one per
        adapter, in their order."""
        where = {id(slot.adapter): i for i, slot in enumerate(self.slots) if slot.adapter is not None}
        seats = [where.get(id(a)) for a in adapters]
        if None not in seats and all(len(g) == self.slots[i].rows for i, g in zip(seats, groups)):
            return seats
        vacant = sum(slot.adapter is None for slot in self.slots)
        mismatched = any(i is not None and len(g) != self.slots[i].rows for i, g in zip(seats, groups))
        if mismatched or 4 * vacant > len(self.slots) + seats.count(None):
            self.release()
            seats = [None] * len(adapters)
        self._drop_graphs()
        self.spent.clear()
        optimizer = self.job.optimizer
        for k, a in enumerate(adapters):
            if seats[k] is None:
                seats[k] = len(self.slots)
                self.slots.append(_Slot.of(a, optimizer.adapters[a.trial_id]))
        return seats

    def vacate(self, adapter, state: AdapterOptState) -> bool:
        """`adapter` leaves the job, its optimizer state `state`: whether its slot keeps its
        buffers (and its layers its weights, renamed) for an adapter of its shape to take over,
        so that the graphs stay as they are. False where it has no slot: it goes for good."""
        slot = next((s for s in self.slots if s.adapter is adapter), None)
        if slot is None:
            return False
        self.vacancies += 1
        key = f"<vacant {self.vacancies}>"  # not a word: no trial's key
        for name in slot.modules:
            self.job.layers[name].rename_adapter(slot.key, key)
        slot.adapter, slot.state, slot.key = None, state, key
        return True

    def vacancy(self, cfg, modules) -> Optional[_Slot]:
        """A vacant slot a trial of `cfg` on `modules` can take over, if there is one: same
        samples a step, rank and layers, and dropout masks drawn or not alike."""
        return next((s for s in self.slots if s.fits(cfg, modules)), None)

    def occupy(self, slot: _Slot, adapter) -> None:
        """`adapter`, whose optimizer state took over `slot`'s buffers, takes the slot: the
        vacant weights go from its layers."""
        for name in slot.modules:
            self.job.layers[name].delete_adapter(slot.key)
        slot.adapter, slot.state, slot.key = adapter, self.job.optimizer.adapters[adapter.trial_id], adapter.key
        slot.cfg = adapter.cfg

    def release(self) -> None:
        """Drop every graph and slot; the vacant slots' weights go from their layers."""
        self._drop_graphs()
        self.spent.clear()
        for slot in self.slots:
            if slot.adapter is None:
                for name in slot.modules:
                    self.job.layers[name].delete_adapter(slot.key)
        self.slots = []

    def _new_layout(self, tokens: int) -> _Layout:
        job, device = self.job, self.job.device
        rows = [slot.rows for slot in self.slots]
        n = len(rows)
        max_len = job.spec.max_seq_len
        pieces = -(-tokens // max_len)
        n_ints = 4 * tokens + sum(rows) + pieces + 1 + job.segments.num_layers * (n + 1)
        host = {"ints": torch.empty(n_ints, dtype=torch.int64),
                "table": torch.empty(n, len(TABLE_COLS), dtype=torch.float32),
                "out": torch.empty(2, n, dtype=torch.float32)}
        if device.type == "cuda":
            host = {k: v.pin_memory() for k, v in host.items()}
        dev = {k: torch.zeros_like(v, device=device) for k, v in host.items()}
        # a layout of every slot empty; `_stage` fills the frame with each step's own
        frame = TableFrame([0] * n + [tokens], [r * max_len for r in rows] + [tokens])
        return _Layout(rows=rows, tokens=tokens, pieces=pieces, ints=dev["ints"], table=dev["table"], out=dev["out"],
                       slot_index=torch.arange(n, device=device), host=host, frame=frame)

    def _stage(self, layout: _Layout, groups, stepping: list[bool]) -> None:
        """Write the step's values into the pinned buffers and queue their copies to the device:
        `groups` and `stepping` by slot, a vacant one's empty. The previous step's copies are
        done: `run` waits for the replay after them."""
        job, tokens = self.job, layout.tokens
        host = {k: v.numpy() for k, v in layout.views(layout.host["ints"], job.segments.num_layers).items()}
        ids, positions, targets, segment, offsets = (host[k].reshape(-1) for k in
                                                     ("ids", "positions", "targets", "segment", "offsets"))
        at = sample = 0
        for i, (slot, group) in enumerate(zip(self.slots, groups)):
            for s in group:
                n = len(s)
                ids[at:at + n] = s.input_ids
                positions[at:at + n] = np.arange(n)
                targets[at:at + n - 1] = s.labels[1:]
                targets[at + n - 1] = IGNORE_INDEX
                segment[at:at + n] = i
                offsets[sample] = at
                at, sample = at + n, sample + 1
            offsets[sample:sample + slot.rows - len(group)] = at  # a vacant slot's samples: empty
            sample += slot.rows - len(group)
        # the padding: pieces of at most max_seq_len tokens (the last ones may be empty)
        ids[at:], positions[at:], targets[at:], segment[at:] = job.pad_id, 0, IGNORE_INDEX, len(groups)
        piece = -(-(tokens - at) // layout.pieces)
        offsets[sample:] = np.minimum(at + piece * np.arange(layout.pieces + 1), tokens)
        table = layout.host["table"].numpy()
        for i, (slot, group, steps) in enumerate(zip(self.slots, groups, stepping)):
            count = sum(s.loss_tokens for s in group)  # none in a vacant slot: its weight multiplies nothing
            table[i, 0] = 1.0 / (max(count, 1) * slot.cfg.gradient_accumulation_steps)
            job.optimizer.fill_device_row(slot.state, steps, table[i, 1:])
        host["seeds"][:] = layer_seed_table(*self._seeds_and_steps(), job.segments.num_layers)
        layout.frame.fill([sum(len(s) for s in g) for g in groups] + [tokens - at],
                          [slot.cfg.scaling for slot in self.slots] + [0.0],
                          [slot.cfg.dropout for slot in self.slots] + [0.0])
        layout.ints.copy_(layout.host["ints"], non_blocking=True)
        layout.table.copy_(layout.host["table"], non_blocking=True)

    def _seeds_and_steps(self) -> tuple[list[int], list[int]]:
        """Each slot's dropout seed and micro-step count (its adapter's; 0 where vacant), then
        the padding's (0, 0): what `layer_seed_table` mixes into each layer's dropout seeds."""
        occupants = [slot.adapter for slot in self.slots] + [None]
        return [a.cfg.seed if a else 0 for a in occupants], [a.micro_steps if a else 0 for a in occupants]

    def _forward_backward(self, layout: _Layout):
        """(loss sums [slots], gradients of every slot's parameters, those parameters): the
        slots' summed losses weighted by `loss_weight`, differentiated (None for a parameter
        the step did not use)."""
        job = self.job
        params = [p for slot in self.slots for p in slot.state.params]
        parts = layout.views(layout.ints, job.segments.num_layers)
        seeds, steps = self._seeds_and_steps()
        job.segments.set([slot.key for slot in self.slots] + [PADDING_SEGMENT], layout.frame.seg_lens, steps, seeds,
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
            mine = parts["segment"][None, :] == layout.slot_index[:, None]
            sums = torch.where(mine, losses[None, :], 0.0).sum(dim=1)
            loss = (sums * layout.table[:, 0]).sum()
            # a vacant slot's rows are none: on the reference path its weights take no part
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        finally:
            job.segments.clear()
        return sums, grads, params

    def _step(self, layout: _Layout) -> None:
        """The whole micro-step on the static buffers: what a graph captures."""
        sums, grads, params = self._forward_backward(layout)
        used = [(p.grad, g) for p, g in zip(params, grads) if g is not None]
        torch._foreach_add_([p for p, _ in used], [g for _, g in used])
        norms = self.job.optimizer.step_on_device([slot.state for slot in self.slots], layout.table[:, 1:], sums)
        layout.out[0].copy_(sums)
        layout.out[1].copy_(norms)

    def _drop_graphs(self) -> None:
        """Forget every layout and its graph, and what each bucket has lost without one. The
        next capture takes a new pool: the allocator frees this one once its graphs are gone,
        and does not take captures into a pool whose graphs were all destroyed."""
        self.layouts.clear()
        self.lost_s.clear()
        self.pool = None

    def _eager_step(self, layout: _Layout) -> None:
        """`_step` on `layout`'s buffers, eagerly (`_train_eagerly`). Raises `GraphCaptureError`
        if it fails: then it has trained nothing."""
        error = _error_of(self._train_eagerly, layout)
        if error is not None:
            self._drop_graphs()
            raise GraphCaptureError(f"the training step on a CUDA graph's buffers failed: {error}") from error
        self.ran_eagerly = True
        self.eager_steps += 1

    def _train_and_capture(self, layout: _Layout) -> None:
        """Train the step eagerly on `layout`'s buffers, then capture it for the next steps of
        its bucket (`_train_eagerly`, `_capture`). Either, out of memory beside other
        buckets' graphs, drops them and tries alone, once."""
        error = self._alone_if_out_of_memory(self._train_eagerly, layout)
        if error is not None:  # nothing trained: the job takes the step eagerly
            self._drop_graphs()
            raise GraphCaptureError(f"the training step on a CUDA graph's buffers failed: {error}") from error
        error = self._alone_if_out_of_memory(self._capture, layout)
        self.layouts[layout.tokens] = layout
        if error is None:
            layout.captured = self.captured = True
            self.captures += 1
        else:  # the step has trained; the job goes back to eager steps after it
            self._drop_graphs()
            self.failure = GraphCaptureError(f"capturing the training step in a CUDA graph failed: {error}")
            self.failure.__cause__ = error

    def _alone_if_out_of_memory(self, attempt, layout: _Layout) -> Optional[Exception]:
        """`attempt(layout)`'s error, if any (`_error_of`). If it ran out of memory while other
        buckets' graphs hold the pool, those are dropped, `spent`, and it is attempted once
        more, alone: the pool keeps their blocks, and a larger bucket's tensors do not fit in
        them (later captures of smaller buckets reuse this one's)."""
        error = _error_of(attempt, layout)
        others = [n for n, other in self.layouts.items() if other.captured and other is not layout]
        if others and _out_of_memory(error):
            self.spent.update(others)
            self._drop_graphs()
            torch.cuda.empty_cache()
            error = _error_of(attempt, layout)
        return error

    def _train_eagerly(self, layout: _Layout) -> None:
        """`_step` run eagerly on `layout`'s buffers, on a side stream on CUDA: a step of a
        bucket without a graph trains this way, and one about to be captured compiles and
        warms up all that its capture records. Not on the default stream: autograd keeps the
        stream a parameter was first used on with it, and a capture fails where that is the
        default (legacy) stream. If it fails it has trained nothing: gradients reach the
        adapters only after the whole forward and backward."""
        if not layout.ints.is_cuda:
            self._step(layout)
            return
        # one side stream for all: the allocator caches blocks by stream, and a new stream each
        # step would keep a step's worth of them for each
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(layout.ints.device)
        main, side = torch.cuda.current_stream(layout.ints.device), self.side_stream
        with warnings.catch_warnings():
            # the adapters' AccumulateGrad nodes were made by eager steps on another stream; the
            # gradients are taken with autograd.grad, which never runs them
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._step(layout)
            main.wait_stream(side)

    def _capture(self, layout: _Layout) -> None:
        """Record `_step` into `layout`'s graph, without running it. Memory cached for other
        streams (eager steps, the step before the capture) goes back to the device first: that
        step and the graphs' pool each need a step's activations, and at long sequences two
        copies of them do not fit."""
        torch.cuda.empty_cache()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream")
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                self._step(layout)
        layout.graph = graph


def _error_of(attempt, layout: _Layout) -> Optional[Exception]:
    """What stopped `attempt(layout)`, if anything, without tracebacks (its own and those of the
    errors it was raised in), whose frames would keep the failed attempt's tensors."""
    try:
        attempt(layout)
    except Exception as e:  # noqa: BLE001 - the caller decides
        for error in _chain(e):
            error.__traceback__ = None
        return e
    return None


def _out_of_memory(error: Optional[BaseException]) -> bool:
    """Whether CUDA ran out of memory in `error` or in an error it was raised while handling."""
    return any(isinstance(e, torch.OutOfMemoryError) for e in _chain(error))


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
