"""The cold PEFT baseline's worker: one trial in a process of its own, on the bundled tiny model."""

import json
import os
import subprocess
import sys

from peft import PeftConfig
from safetensors.torch import load_file

from lora_sweep.tiny import tiny_model_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_worker_trains_saves_and_reports_its_own_times(tmp_path):
    cfg = {"rank": 4, "alpha": 8, "batch_size": 2, "max_steps": 3, "trial_id": "t0"}
    out = tmp_path / "adapter"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.peft_process", "--model", tiny_model_path(), "--device", "cpu",
         "--seq", "64", "--rows", "32", "--config", json.dumps(cfg), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert len(report["tokens"]) == 3 and all(n > 0 for n in report["tokens"])
    assert len(report["step_s"]) == 2 and all(s > 0 for s in report["step_s"])
    assert report["trial_s"] > sum(report["step_s"])  # it also wrapped the model, ran step 1 and saved
    assert PeftConfig.from_pretrained(str(out)).r == 4
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B left zero init: it trained


def test_peft_cost_model_fits_the_steps_and_leaves_out_host_stalls():
    """The makespan's PEFT fit: each probe's steps are points of a least-squares fit, so a
    trial's predicted time is its steps' sum; a step over 3x the median is a stall, not a step."""
    import random

    from benchmarks.sweep_gpu import peft_cost_model, table1_configs
    from lora_sweep.costmodel import CostModel

    rng = random.Random(0)
    runs = []
    for k in range(4):  # host-bound: about 0.2 s a step whatever the tokens, 1 s outside steps
        steps = [0.2 + rng.uniform(-0.02, 0.02) for _ in range(10)]
        if k == 1:
            steps[4:8] = [1.4, 1.3, 1.5, 1.4]  # a stall of the host
        runs.append({"step_s": steps, "tokens": [rng.randint(50, 900) for _ in range(11)],
                     "trial_s": 1.0 + 0.25 + sum(steps)})  # wrap and save, a first step, the intervals
    base = CostModel.from_model("llama-3.2-1b", gpu="h200", max_seq_len=256, dtype="bfloat16", mean_sample_tokens=108)

    cm, stats = peft_cost_model(base, runs)
    assert len(stats) == 4 * 8 - 4 and max(s["seconds"] for s in stats) < 0.3
    assert abs(cm.calibration.trial_seconds - 1.05) < 0.05  # outside steps: 1.25 s less one typical step
    trial = 1.05 + 20 * 0.2  # every config, whatever its batch: the steps are host-bound
    predicted = [cm.job_seconds([cfg]) for cfg in table1_configs(16, steps=20)]
    assert abs(sum(predicted) / (16 * trial) - 1) < 0.05
    assert all(abs(p / trial - 1) < 0.15 for p in predicted), predicted  # batches up to 32: the fit extrapolates

    cm_given, _ = peft_cost_model(base, runs, trial_s=3.0)  # in-process runs measure it apart
    assert cm_given.calibration.trial_seconds == 3.0


def test_refit_of_the_committed_cold_runs_predicts_within_15_percent():
    """`sweep_gpu --refit` applies the fit above to the saved makespan runs (cold PEFT processes)."""
    import glob

    from benchmarks.sweep_gpu import refit

    paths = sorted(glob.glob(os.path.join(REPO, "benchmarks", "results", "sweep_gpu_*_makespan.json")))
    assert paths
    for path in paths:
        row = refit(path)
        with open(path) as f:
            assert row["measured_peft_16"] == json.load(f)["makespan"]["measured"]["peft_16"]
        assert abs(row["refit_error"]) < 0.15, row
