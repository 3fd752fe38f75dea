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
