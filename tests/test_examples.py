"""The example scripts run as a user runs them, on the bundled tiny model, shortened by
their own options: each ends with its best trial's PEFT adapter on disk."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples")


def run_example(name: str, *args: str) -> str:
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, name), *args], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_optuna_example(tmp_path):
    out = run_example("optuna_sweep.py", "--trials", "3", "--max-steps", "4", "--eval-every", "2",
                      "--output-dir", str(tmp_path))
    assert re.search(r"^3 trials: [1-3] complete", out, re.M), out  # the pruner may stop the others
    adapter = re.search(r"^adapter: (.+)$", out, re.M).group(1)
    assert os.path.isfile(os.path.join(adapter, "adapter_model.safetensors"))


@pytest.mark.slow
def test_ray_tune_example(tmp_path):
    out = run_example("ray_tune_sweep.py", "--trials", "2", "--steps", "4", "--adapters-per-pack", "2",
                      "--output-dir", str(tmp_path))
    path = re.search(r"Its adapter \(PEFT format\): (\S+)", out).group(1)
    assert os.path.isfile(os.path.join(path, "adapter_model.safetensors")), out
