"""On CUDA: the step replayed from CUDA graphs trains like the eager step, to bf16 tolerance,
over 20 steps, with trials joining and leaving, and a failing trial costs its pack-mates
nothing. Skipped without a GPU; run it on one with `pytest tests/test_graphed_gpu.py`."""

from __future__ import annotations

import math
import os

import pytest
import torch

import lora_sweep as ls
from lora_sweep.engine import Failed
from lora_sweep.graphed import GraphedStep
from lora_sweep.tiny import tiny_model_path

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA GPU (and Triton compiled, not interpreted)")

STEPS = 20


def small_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def rows():
    """Samples of 4 to 60 words, so that steps fall in different length buckets."""
    words = ["fox", "lake", "red", "big", "moo", "the", "sees", "a"]
    return [{"prompt": " ".join(words[(i * 7 + k) % 8] for k in range(3 + (i * 13) % 57)),
             "completion": f" {words[i % 8]} ."} for i in range(300)]


def trials():
    """t0-t3 start; t4 joins later in a shape of its own, t5 in t1's (other lr, alpha and weight decay)."""
    return [ls.TrialConfig(rank=r, alpha=a, learning_rate=lr, batch_size=b, dropout=p, weight_decay=wd,
                           max_steps=10**6, seed=i, trial_id=f"t{i}")
            for i, (r, a, lr, b, p, wd) in enumerate([(8, 16, 1e-3, 2, 0.0, 0.0), (16, 32, 3e-4, 4, 0.0, 0.0),
                                                      (64, 128, 5e-4, 1, 0.05, 0.0), (3, 6, 1e-3, 3, 0.1, 0.0),
                                                      (16, 32, 5e-4, 1, 0.1, 0.0), (16, 8, 2e-3, 4, 0.0, 0.1)])]


def train(tmp_path, graphs: bool, schedule=None, poison=None, run="run"):
    """Per-trial train loss of every step, the job, and its events. `schedule`: {step: (adds,
    removes)} applied before that step; `poison`: (step, trial_id) whose weights turn inf."""
    spec = ls.JobSpec(base_model=small_llama, tokenizer=tiny_model_path(), train_data=rows(), max_seq_len=64,
                      eval_every=10**6, output_dir=str(tmp_path / f"{run}-graphs{graphs}"), device="cuda",
                      cuda_graphs=graphs)
    all_trials = {t.trial_id: t for t in trials()}
    first = [t for t in all_trials.values() if t.trial_id not in ("t4", "t5")]
    job = ls.PackedJob(spec, first, progress=False)
    losses: dict[str, list[float]] = {}
    events = []
    for step in range(STEPS):
        adds, removes = (schedule or {}).get(step, ((), ()))
        for tid in adds:
            job.add_trial(all_trials[tid])
        for tid in removes:
            job.remove_trial(tid)
        if poison and poison[0] == step and poison[1] in job.active:
            job.optimizer.adapters[poison[1]].flat[0] = math.inf
        events += job.step()
        for tid, a in job.active.items():
            losses.setdefault(tid, []).append(a.report_losses[-1])
    return losses, job, events


def close(runs: dict, reference: dict, first: float, drift: float) -> None:
    """Every trial's loss within `first` (relative) of the reference at step 1, `drift` after."""
    assert runs.keys() == reference.keys()
    diffs = {t: [abs(x - y) / abs(y) for x, y in zip(runs[t], reference[t])] for t in reference}
    table = "\n".join(f"{t}: " + " ".join(f"{d:.3f}" for d in v) for t, v in diffs.items())
    assert all(len(runs[t]) == len(reference[t]) for t in reference), table
    assert all(v[0] <= first and max(v) <= drift for v in diffs.values()), table


def test_graphed_step_trains_like_the_eager_step(tmp_path):
    graphed, job, _ = train(tmp_path, graphs=True)
    eager, eager_job, _ = train(tmp_path, graphs=False)
    assert all(s["graphed"] for s in job.step_stats) and not any(s["graphed"] for s in eager_job.step_stats)
    buckets = {s["padded_tokens"] for s in job.step_stats}
    assert 1 <= job.graphed_step.captures <= len(buckets)  # at most one per bucket run; some may run eagerly
    close(graphed, eager, first=1e-2, drift=3e-2)
    for tid in eager:
        assert graphed[tid][-1] < graphed[tid][0]
        w, w_eager = (j.optimizer.adapters[tid].flat for j in (job, eager_job))
        assert ((w - w_eager).norm() / w_eager.norm()).item() < 2e-2


def captures_recorded(monkeypatch) -> list:
    """Every capture's (bucket, slots), from here on."""
    captured, capture = [], GraphedStep._capture

    def recorded(self, layout):
        captured.append((layout.tokens, len(self.slots)))
        capture(self, layout)

    monkeypatch.setattr(GraphedStep, "_capture", recorded)
    return captured


def test_join_and_leave_under_graphs(tmp_path, monkeypatch):
    """A join in a shape of its own takes a slot of its own (new graphs); a leave keeps its
    slot, vacant, and a join in its shape takes that over: no (bucket, slots) is captured twice."""
    captured = captures_recorded(monkeypatch)
    schedule = {5: (("t4",), ()), 9: ((), ("t1",)), 12: (("t5",), ())}
    graphed, job, _ = train(tmp_path, graphs=True, schedule=schedule)
    eager, _, _ = train(tmp_path, graphs=False, schedule=schedule)
    assert set(job.active) == {"t0", "t2", "t3", "t4", "t5"}
    assert len(graphed["t4"]) == STEPS - 5 and len(graphed["t1"]) == 9 and len(graphed["t5"]) == STEPS - 12
    assert [slot.adapter.cfg.trial_id for slot in job.graphed_step.slots] == ["t0", "t5", "t2", "t3", "t4"]
    assert len(captured) == len(set(captured)) and {n for _, n in captured} == {4, 5}, captured
    close(graphed, eager, first=1e-2, drift=3e-2)


def test_a_capture_out_of_memory_beside_other_graphs(tmp_path, monkeypatch):
    """A capture that runs out of memory beside other buckets' graphs (made to, once) drops
    them and captures alone, in a new pool; the buckets dropped are never captured again: they
    run padded in a larger graph or eagerly on their buffers, and the job trains as the eager
    job does, every step graphed."""
    captured, refused, capture = [], [], GraphedStep._capture

    def out_of_memory_once_beside_others(self, layout):
        if not refused and any(other.captured for other in self.layouts.values() if other is not layout):
            refused.append(layout.tokens)
            raise torch.OutOfMemoryError("CUDA out of memory beside the graphs (made by the test)")
        captured.append(layout.tokens)
        capture(self, layout)

    monkeypatch.setattr(GraphedStep, "_capture", out_of_memory_once_beside_others)
    graphed, job, _ = train(tmp_path, graphs=True)
    eager, _, _ = train(tmp_path, graphs=False)
    step = job.graphed_step
    assert refused and step is not None and step.spent and all(s["graphed"] for s in job.step_stats)
    assert len(captured) == len(set(captured)) and refused[0] in captured, captured
    close(graphed, eager, first=1e-2, drift=3e-2)


def test_a_failing_trial_costs_its_pack_mates_nothing_under_graphs(tmp_path):
    healthy, _, _ = train(tmp_path, graphs=True, run="healthy")
    poisoned, job, events = train(tmp_path, graphs=True, poison=(6, "t2"), run="poisoned")
    failed = [e for e in events if isinstance(e, Failed)]
    assert [e.trial_id for e in failed] == ["t2"] and "non-finite" in failed[0].reason
    assert set(job.active) == {"t0", "t1", "t3"}
    mates = ("t0", "t1", "t3")
    for tid in mates:
        assert poisoned[tid][:7] == healthy[tid][:7]  # the same graphs up to and through the failing step
    close({t: poisoned[t] for t in mates}, {t: healthy[t] for t in mates}, first=0.0, drift=3e-2)  # then without it
