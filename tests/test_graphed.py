"""The step a CUDA graph replays (`graphed.py`), run eagerly on CPU: it trains what the job's
own step trains, and its optimizer update is `PackedAdamW.step`'s."""

from __future__ import annotations

import dataclasses
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

import lora_sweep as ls
from lora_sweep.data import Sample
from lora_sweep.engine import Failed, PackedJob
from lora_sweep.graphed import TRIAL_STEPS, GraphedStep, token_bucket
from lora_sweep.layers import SegmentTable, layer_seed_table
from lora_sweep.optim import DEVICE_COLS, PackedAdamW, lr_lambda

from test_engine_equivalence import four_trials, make_spec, rel


def _optimizers(seed):
    """Two PackedAdamW holding the same four adapters (as tensors of 5 and 7 weights)."""
    g = torch.Generator().manual_seed(seed)
    weights = [[torch.randn(5, generator=g), torch.randn(7, generator=g)] for _ in range(4)]
    settings = [(1e-2, "linear", 0.0, 1.0), (3e-3, "cosine", 0.1, None), (5e-3, "constant", 0.0, 0.01),
                (2e-2, "linear", 0.05, 0.5)]
    pair = []
    for _ in range(2):
        opt = PackedAdamW()
        for i, (w, (lr, kind, wd, clip)) in enumerate(zip(weights, settings)):
            opt.add(f"t{i}", [x.clone() for x in w], lr, lr_lambda(kind, 2, 10), wd, clip)
        pair.append(opt)
    return pair


def _packed_job(tiny_llama_dir, toy_data, path, trials) -> PackedJob:
    """A job of `trials` on the tiny Llama, its samples packed in one row as graphs need."""
    return PackedJob(make_spec(tiny_llama_dir, toy_data, path, eval_every=100, padding="packed"), trials,
                     progress=False)


def test_step_on_device_is_the_host_step():
    """Per-adapter lr schedules, weight decay, clipping by each adapter's own norm, an adapter
    inside its accumulation window and one with a non-finite loss: the table-driven update
    leaves every adapter where the host-scalar one does."""
    host, device = _optimizers(0)
    names = list(host.adapters)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        stepping = [True, True, step % 2 == 1, True]
        losses = torch.tensor([1.0, 2.0, 3.0, math.nan if step == 4 else 4.0])
        for opt in (host, device):
            torch.manual_seed(step)
        grads = {n: torch.randn(host.adapters[n].grad.shape, generator=g) for n in names}
        for opt in (host, device):
            for n in names:
                opt.adapters[n].grad.add_(grads[n])
        # the host's step: only finite stepping adapters, as the engine calls it
        ok = [n for n, s, v in zip(names, stepping, losses.tolist()) if s and math.isfinite(v)]
        norms = host.grad_norms(ok).tolist()
        host.step(ok, norms)
        host.zero_grad(ok)
        table = torch.empty(len(names), len(DEVICE_COLS))
        for i, (n, s) in enumerate(zip(names, stepping)):
            device.fill_device_row(device.adapters[n], s, table[i].numpy())
        device_norms = device.step_on_device([device.adapters[n] for n in names], table, losses)
        device.count_step(ok)
        assert device_norms[0].item() == pytest.approx(norms[0], rel=1e-6)
        nan_adapter = names[3]
        if step == 4:  # its gradient is kept out of the update; the host step never saw it
            host.zero_grad([nan_adapter])
        for n in names:
            assert host.adapters[n].step == device.adapters[n].step
            torch.testing.assert_close(device.adapters[n].flat, host.adapters[n].flat, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(device.adapters[n].exp_avg_sq, host.adapters[n].exp_avg_sq, rtol=1e-5,
                                       atol=1e-10)
            torch.testing.assert_close(device.adapters[n].grad, host.adapters[n].grad)


def test_an_adapter_takes_over_the_buffers_of_one_that_left():
    """`PackedAdamW.add(storage=)`: the new adapter's weights, gradient and moments are the old
    one's buffers, refilled as a fresh adapter's would be; other shapes are refused."""
    opt = PackedAdamW()
    opt.add("old", [torch.randn(3, 4), torch.randn(5, 3)], 1e-2, lr_lambda("constant", 0, 10), 0.1, 1.0)
    old = opt.adapters["old"]
    old.grad.normal_()
    old.exp_avg.normal_()
    old.exp_avg_sq.uniform_()
    gone = opt.remove("old")
    new_params = [torch.randn(3, 4), torch.randn(5, 3)]
    values = [p.clone() for p in new_params]
    opt.add("new", new_params, 3e-3, lr_lambda("linear", 2, 10), 0.0, None, storage=gone)
    new = opt.adapters["new"]
    assert new.flat is gone.flat and new.grad is gone.grad and new.exp_avg_sq is gone.exp_avg_sq
    assert all(torch.equal(p, v) for p, v in zip(new_params, values)) and new.step == 0
    assert not new.grad.any() and not new.exp_avg.any() and not new.exp_avg_sq.any()
    assert new_params[1].data_ptr() == gone.flat[12:].data_ptr()
    opt.remove("new")
    with pytest.raises(ValueError, match="same parameter shapes"):
        opt.add("other", [torch.randn(2, 4), torch.randn(5, 2)], 1e-3, lr_lambda("constant", 0, 10), 0.0, None,
                storage=new)


def test_layer_seed_table_is_what_layers_compute():
    table = SegmentTable()
    table.num_layers = 5
    table.set(["a", "b", "c"], [3, 4, 5], steps=[0, 7, 2], seeds=[11, 12, 2**40])
    rows = layer_seed_table([11, 12, 2**40], [0, 7, 2], 5)
    assert rows.shape == (5, 3)
    assert [table.dropout_seeds(layer) for layer in range(5)] == rows.tolist()
    assert len({int(v) for v in rows.reshape(-1)}) == 15  # every (layer, adapter) its own stream


def test_token_buckets(tiny_llama_dir, toy_data, tmp_path):
    assert [token_bucket(n) for n in (1, 63, 64, 100, 3466, 3583, 3584)] == [64, 64, 128, 128, 3584, 3584, 4096]
    assert all(n < token_bucket(n) <= 1.25 * n + 64 for n in range(1, 20000, 7))
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path, max_seq_len=100), [], progress=False)
    step = GraphedStep(job, capture=False)

    def sample(n):
        return Sample(tuple(range(n)), tuple(range(n)))

    assert step.bucket([[sample(30), sample(40)], [sample(60)]]) == token_bucket(130)
    # a bucket runs padded in a larger captured one until that padding has cost as much as a
    # capture: here its step's 2 s, less a replay's 1 s (the job's first capture compiled: not counted)
    step.layouts[256] = SimpleNamespace(captured=True)
    step.capture_steps = [(30.0, 256), (2.0, 256)]

    def run_once():
        step.last_tokens = step._bucket_to_run([[sample(20)]])
        step.record(1, True, 1.0 * step.last_tokens / 256, 20, timed=True)  # a replay: 1 s per 256 tokens
        return step.last_tokens

    assert [run_once() for _ in range(4)] == [256, 256, 64, 64]  # each step padded to 256 loses 0.75 s
    assert step.lost_s == {64: 1.5}
    job.microbatch_tokens = 128  # and never past the job's cap on tokens per forward
    assert step.takes([[sample(70), sample(1)]]) and not step.takes([[sample(70)], [sample(60)]])
    assert step._bucket_to_run([[sample(50)], [sample(50)]]) == 128


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_graphed_step_trains_as_the_job_step(tiny_llama_dir, toy_data, tmp_path, dropout):
    """Four trials (ranks 4-16, batches 1-3, an accumulation window of 2, cosine and constant
    schedules, clipping, rsLoRA, attention-only targets, dropout), eight steps: the graphed
    step (padding to the bucket, the layout in static buffers, the optimizer from its device
    table) trains the same adapters as the job's own step, to fp32 rounding."""
    trials = four_trials(dropout)
    weights, losses = [], []
    for graphed in (False, True):
        job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / str(graphed), eval_every=100,
                                  padding="packed"), trials, progress=False)
        if graphed:
            job.graphed_step = GraphedStep(job, capture=False)
        for _ in range(8):
            job.step()
            assert job.step_stats[-1]["graphed"] is graphed
        losses.append({t: a.report_losses for t, a in job.active.items()})  # one per optimizer step
        weights.append({t: job.optimizer.adapters[t].flat.clone() for t in job.active})
    assert [len(v) for v in losses[0].values()] == [8, 8, 8, 4]
    for t in losses[0]:
        assert losses[1][t] == pytest.approx(losses[0][t], rel=1e-5)
    for t in weights[0]:  # Adam's first steps amplify rounding in the smallest gradients: a norm-wise check
        assert rel(weights[1][t], weights[0][t]) < 1e-5


def test_graphed_step_isolates_a_failing_adapter(tiny_llama_dir, toy_data, tmp_path):
    """An adapter whose weights turn non-finite fails alone in the graphed step, and its
    pack-mates' weights after that step are bit-identical to a run where it stays healthy."""
    results = []
    for poison in (False, True):
        job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / str(poison), eval_every=100,
                                  padding="packed"), four_trials()[:3], progress=False)
        job.graphed_step = GraphedStep(job, capture=False)
        events = []
        for k in range(4):
            if poison and k == 2:
                job.optimizer.adapters["b"].flat[0] = math.inf
            events += job.step()
            if k == 2:
                results.append({t: job.optimizer.adapters[t].flat.clone() for t in ("a", "c")})
        if poison:
            assert [e.trial_id for e in events if isinstance(e, Failed)] == ["b"]
            assert set(job.active) == {"a", "c"}
    for t in ("a", "c"):
        assert torch.equal(results[0][t], results[1][t])


def test_cuda_graphs_takes_a_bool_or_auto(tiny_llama_dir, toy_data, tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(ls.ConfigError, match="cuda_graphs"):
            make_spec(tiny_llama_dir, toy_data, tmp_path, cuda_graphs=bad)
    assert make_spec(tiny_llama_dir, toy_data, tmp_path).cuda_graphs == "auto"


def test_auto_keeps_the_step_that_trains_faster(tiny_llama_dir, toy_data, tmp_path):
    """`cuda_graphs="auto"`: per pack size, TRIAL_STEPS timed eager steps, then TRIAL_STEPS timed
    replayed ones (steps that compile or capture are not timed), then the faster one."""
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path), [], progress=False)
    step = GraphedStep(job, capture=False, choose=True)
    wanted = []
    for seconds in (9.0, 1.0, 1.0, 1.0, 9.0, 0.5, 0.5, 0.5, 0.1):  # 16 adapters; 100 tokens a step
        replayed = step.wants(16)
        wanted.append(replayed)
        step.record(16, replayed, seconds, 100, timed=seconds != 9.0)
    assert wanted == [False] * 4 + [True] * 5 and step.chosen == {5: True}
    assert not step.wants(3)  # another pack size times its own
    for replayed, seconds in [(False, 1.0)] * TRIAL_STEPS + [(True, 2.0)] * TRIAL_STEPS:
        step.record(3, replayed, seconds, 100, timed=True)
    assert step.chosen[2] is False and not step.wants(3) and step.wants(31)

    # a job's steps follow it: eager, then replayed, then whichever it chose
    job = _packed_job(tiny_llama_dir, toy_data, tmp_path / "job", four_trials()[:2])
    job.graphed_step = GraphedStep(job, capture=False, choose=True)
    for _ in range(2 * TRIAL_STEPS + 3):
        job.step()
    graphed = [s["graphed"] for s in job.step_stats]
    choice = job.graphed_step.chosen[2]
    assert graphed == [False] * (TRIAL_STEPS + 1) + [True] * TRIAL_STEPS + [choice] * 2
    # the steps timed for the choice say so (`profile_job` and `calibrate` leave them out)
    assert [s["choosing"] for s in job.step_stats] == [True] * (2 * TRIAL_STEPS + 1) + [False] * 2


@pytest.mark.parametrize("fails", ["capture", "step"])
def test_a_failure_to_capture_sends_the_job_back_to_eager_steps(tiny_llama_dir, toy_data, tmp_path, monkeypatch,
                                                                fails):
    """A capture that raises (out of memory, an op a graph cannot hold) comes after its step has
    trained on the graph's buffers; a new bucket's step that raises before its capture has
    trained nothing. Either way the job warns, drops its graphs and takes the next steps
    eagerly, and has trained every step once: as a job without graphs, to fp32 rounding where
    the first step trained padded on the graph's buffers, bit for bit where it did not."""
    def out_of_memory(self, layout):
        raise torch.OutOfMemoryError(f"CUDA out of memory in the {fails}")

    monkeypatch.setattr(GraphedStep, "_capture" if fails == "capture" else "_forward_backward", out_of_memory)
    message = {"capture": "capturing the training step in a CUDA graph failed",
               "step": "the training step on a CUDA graph's buffers failed"}[fails]
    weights = []
    for graphs in (False, True):
        job = _packed_job(tiny_llama_dir, toy_data, tmp_path / str(graphs), four_trials()[:2])
        if graphs:
            job.graphed_step = GraphedStep(job)
            with pytest.warns(UserWarning, match=f"{message}: CUDA out of memory in the {fails}"):
                job.step()
            assert job.graphed_step is None and job.step_stats[-1]["graphed"] == (fails == "capture")
        while len(job.step_stats) < 4:
            job.step()
        assert not any(s["graphed"] for s in job.step_stats[1:])
        weights.append([job.optimizer.adapters[t].flat.clone() for t in ("a", "b")])
    same = (lambda x, y: rel(x, y) < 1e-5) if fails == "capture" else torch.equal
    assert all(same(x, y) for x, y in zip(*weights))


@pytest.mark.parametrize("trials, spent_runs", [(2, "padded"), (4, "eagerly")])
def test_a_capture_out_of_memory_beside_other_graphs_drops_them_for_good(tiny_llama_dir, toy_data, tmp_path,
                                                                         monkeypatch, trials, spent_runs):
    """A capture that runs out of memory while other buckets' graphs hold the pool: those graphs
    are dropped and the bucket is captured alone. The buckets dropped are not captured again
    for these slots (no bucket is captured twice): their steps run padded in a larger graph
    (two trials: 64 tokens dropped for 128), or eagerly on their buffers where no graph is
    larger (four trials: 192 dropped for 128). The job keeps its graphs, no warning, and trains
    what the eager job trains (to fp32 rounding: the graphed step pads)."""
    captured, runs = [], []

    def capture_fails_beside_others(self, layout):
        if any(other.captured for other in self.layouts.values()):
            raise torch.OutOfMemoryError("CUDA out of memory while capturing")
        captured.append(layout.tokens)  # an eager step on the static buffers stands for the graph

    monkeypatch.setattr(GraphedStep, "_capture", capture_fails_beside_others)
    weights = []
    for graphs in (False, True):
        job = _packed_job(tiny_llama_dir, toy_data, tmp_path / str(graphs), four_trials()[:trials])
        if graphs:
            job.graphed_step = step = GraphedStep(job)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no capture failure reaches the job
            for _ in range(9):
                job.step()
                if graphs and step.asked in step.spent:
                    runs.append("padded" if step.last_tokens > step.asked else "eagerly" if step.ran_eagerly else "?")
        if graphs:
            assert all(s["graphed"] for s in job.step_stats)
            assert len(step.spent) == 1 and len(captured) == len(set(captured)) == step.captures == 2
            assert [n for n in step.layouts if step.layouts[n].captured] == [captured[-1]]  # captured alone
            assert runs and set(runs) == {spent_runs}
        weights.append([job.optimizer.adapters[t].flat.clone() for t in "abcd"[:trials]])
    assert all(rel(x, y) < 1e-5 for x, y in zip(*weights))


def test_a_spent_bucket_runs_padded_or_eagerly_whichever_has_been_faster():
    """A bucket whose graph made room for another's runs padded in the smallest larger graph
    until eager steps have been timed faster than that graph's replays, then eagerly; with no
    larger graph, eagerly."""
    step = GraphedStep(SimpleNamespace(microbatch_tokens=None))
    step.layouts = {256: SimpleNamespace(captured=True), 512: SimpleNamespace(captured=True)}
    step.spent = {128}
    groups = [[range(100)]]  # one adapter's one sample of 100 tokens
    assert token_bucket(100) == 128
    assert step._bucket_to_run(groups) == 256  # no eager step timed yet
    step.replays = [2.0, 512]  # 1 s a replay of 256 tokens
    step.eagers = [0.9, 128]
    assert step._bucket_to_run(groups) == 128
    step.eagers = [1.1, 128]
    assert step._bucket_to_run(groups) == 256
    step.layouts = {64: SimpleNamespace(captured=True)}
    assert step._bucket_to_run(groups) == 128


def test_a_trial_of_the_same_shape_takes_over_a_leavers_slot(tiny_llama_dir, toy_data, tmp_path, monkeypatch):
    """A trial that leaves keeps its slot: the graphs go on with it empty, and a trial of its
    shape (rank, layers, samples a step, dropout or not) that joins later takes over its
    buffers, whatever its learning rate, alpha or weight decay. A trial of another shape gets
    a slot of its own, at the end, the vacant ones kept. No (bucket, slot count) is captured
    twice, and every trial trains as in a job without graphs."""
    captured = []
    monkeypatch.setattr(GraphedStep, "_capture", lambda self, layout: captured.append((layout.tokens, len(self.slots))))
    monkeypatch.setattr(GraphedStep, "_capture_cost_s", lambda self: None)  # no step pads into a larger bucket
    a, b, c, d = four_trials()
    like_b = ls.TrialConfig(rank=8, alpha=32, learning_rate=4e-3, batch_size=2, dropout=0.0, max_steps=10,
                            weight_decay=0.3, lr_scheduler="constant", seed=9, trial_id="e")
    like_none = ls.TrialConfig(rank=4, alpha=4, learning_rate=1e-3, batch_size=3, dropout=0.0, max_steps=10,
                               seed=5, trial_id="f")
    # d: rank 8 on attention only; f: a's rank, three samples a step
    schedule = {3: ((), ("b",)), 5: ((like_b,), ()), 7: ((d,), ()), 8: ((like_none,), ("a",))}
    runs = []
    for graphs in (False, True):
        job = _packed_job(tiny_llama_dir, toy_data, tmp_path / str(graphs), [a, b, c])
        if graphs:
            job.graphed_step = GraphedStep(job)
        buffers, losses = {}, {}
        for k in range(10):
            adds, removes = schedule.get(k, ((), ()))
            for tid in removes:
                job.remove_trial(tid)
            for cfg in adds:
                job.add_trial(dataclasses.replace(cfg))
            if graphs and k == 6:
                assert len(captured) == len(set(captured)) and max(n for _, n in captured) == 3
            job.step()
            for tid, adapter in job.active.items():
                window = adapter.window_losses  # the micro-step's loss, until its optimizer step averages them
                losses.setdefault(tid, []).append(window[-1] if window else adapter.report_losses[-1])
                buffers.setdefault(tid, job.optimizer.adapters[tid].flat.data_ptr())
        runs.append((losses, {t: job.optimizer.adapters[t].flat.clone() for t in job.active}, buffers))
        slots = job.graphed_step.slots if graphs else None
    (eager_losses, eager_weights, _), (losses, weights, buffers) = runs
    assert buffers["e"] == buffers["b"] and buffers["d"] not in (buffers["a"], buffers["c"], buffers["e"])
    assert buffers["f"] != buffers["a"] and [slot.adapter and slot.adapter.cfg.trial_id for slot in slots] == \
        [None, "e", None, "d", "f"]  # a removed, c finished
    assert len(captured) == len(set(captured)) and {n for _, n in captured} == {3, 4, 5}
    assert losses.keys() == eager_losses.keys() == {"a", "b", "c", "d", "e", "f"}
    for t in losses:
        assert losses[t] == pytest.approx(eager_losses[t], rel=1e-5), t
    for t in weights:
        assert rel(weights[t], eager_weights[t]) < 1e-5, t
