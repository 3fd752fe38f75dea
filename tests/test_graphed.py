"""The step a CUDA graph replays (`graphed.py`), run eagerly on CPU: it trains what the job's
own step trains, and its optimizer update is `PackedAdamW.step`'s."""

from __future__ import annotations

import math
import warnings

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
            device.fill_device_row(n, s, table[i].numpy())
        device_norms = device.step_on_device(names, table, losses)
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
    # a bucket runs padded in a larger captured one until that padding has cost a capture's time
    step.layouts[256], step.capture_s = None, 1.0

    def run_once():
        step.last_tokens = step._bucket_to_run([[sample(20)]])
        step.record(1, True, 1.0, 20, timed=True)  # each step padded to 256 loses 0.75 s of its 1 s
        return step.last_tokens

    assert [run_once() for _ in range(4)] == [256, 256, 64, 64]
    assert step.padding_s == {64: 1.5}
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
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "job", eval_every=100, padding="packed"),
                    four_trials()[:2], progress=False)
    job.graphed_step = GraphedStep(job, capture=False, choose=True)
    for _ in range(2 * TRIAL_STEPS + 3):
        job.step()
    graphed = [s["graphed"] for s in job.step_stats]
    choice = job.graphed_step.chosen[2]
    assert graphed == [False] * (TRIAL_STEPS + 1) + [True] * TRIAL_STEPS + [choice] * 2
    # the steps timed for the choice say so (`profile_job` and `calibrate` leave them out)
    assert [s["choosing"] for s in job.step_stats] == [True] * (2 * TRIAL_STEPS + 1) + [False] * 2


def _two_trials(tiny_llama_dir, toy_data, path) -> PackedJob:
    return PackedJob(make_spec(tiny_llama_dir, toy_data, path, eval_every=100, padding="packed"), four_trials()[:2],
                     progress=False)


def test_a_failed_capture_sends_the_job_back_to_eager_steps(tiny_llama_dir, toy_data, tmp_path, monkeypatch):
    """A capture that raises (out of memory, an op a graph cannot hold) trains nothing: the job
    warns, drops its graphs and takes that step and the next ones eagerly, as a job without them."""
    def capture_fails(self, layout):
        raise torch.OutOfMemoryError("CUDA out of memory while capturing")

    monkeypatch.setattr(GraphedStep, "_capture", capture_fails)
    weights = []
    for graphs in (False, True):
        job = _two_trials(tiny_llama_dir, toy_data, tmp_path / str(graphs))
        if graphs:
            job.graphed_step = GraphedStep(job)
            with pytest.warns(UserWarning, match="capturing the training step in a CUDA graph failed: CUDA out of"):
                job.step()
            assert job.graphed_step is None and not job.step_stats[-1]["graphed"]
        while len(job.step_stats) < 4:
            job.step()
        weights.append([job.optimizer.adapters[t].flat.clone() for t in ("a", "b")])
    assert all(torch.equal(x, y) for x, y in zip(*weights))


def test_a_capture_out_of_memory_beside_other_graphs_drops_them_and_captures_alone(tiny_llama_dir, toy_data,
                                                                                   tmp_path, monkeypatch):
    """A capture that runs out of memory while other buckets' graphs hold the pool: those graphs
    are dropped and the bucket is captured alone, once; the job keeps its graphs, no warning,
    and trains what the eager job trains (to fp32 rounding: the graphed step pads)."""
    captured = []

    def capture_fails_beside_others(self, layout):
        if self.layouts:
            raise torch.OutOfMemoryError("CUDA out of memory while capturing")
        captured.append(layout.tokens)  # an eager step on the static buffers stands for the graph

    monkeypatch.setattr(GraphedStep, "_capture", capture_fails_beside_others)
    weights = []
    for graphs in (False, True):
        job = _two_trials(tiny_llama_dir, toy_data, tmp_path / str(graphs))
        if graphs:
            job.graphed_step = GraphedStep(job)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no capture failure reaches the job
            for _ in range(6):
                job.step()
        if graphs:
            assert all(s["graphed"] for s in job.step_stats)
            assert len(captured) >= 2 and job.graphed_step.captures == len(captured)
            assert list(job.graphed_step.layouts) == [captured[-1]]  # each capture alone in the pool
        weights.append([job.optimizer.adapters[t].flat.clone() for t in ("a", "b")])
    assert all(rel(x, y) < 1e-5 for x, y in zip(*weights))
