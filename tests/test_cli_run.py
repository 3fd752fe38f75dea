"""`lora-sweep run` and `lora-sweep demo` on the bundled tiny model: trained adapters, the
results table, the loss curves PNG, and the loading snippet the demo prints."""

from __future__ import annotations

import os

import pytest
import yaml

import lora_sweep.planner
from lora_sweep.cli import main


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def _sweep_file(tmp_path, **keys) -> str:
    sweep = {"model": "tiny", "max_seq_len": 24, "steps": 4, "eval_every": 2, "output_dir": str(tmp_path / "runs"),
             "trials": [{"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 2, "trial_id": "a"},
                        {"rank": 8, "alpha": 8, "learning_rate": 1e-4, "batch_size": 2, "trial_id": "b"}],
             **keys}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return str(path)


def test_run_trains_the_planned_sweep(tmp_path, capsys):
    assert main(["run", _sweep_file(tmp_path)]) == 0
    out = capsys.readouterr().out
    runs = tmp_path / "runs"
    assert "2 trials of" in out and "on the CPU, 1 packed job(s)" in out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["trial", "rank"])
    assert header.split()[-3:] == ["loss", "tokens/s", "adapter"]
    for trial_id in ("a", "b"):
        adapter = runs / "adapters" / trial_id
        assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
        assert any(line.split()[0] == trial_id and line.endswith(str(adapter)) for line in out.splitlines())
    assert f"Loss curves: {runs / 'loss_curves.png'}" in out
    assert _is_png(runs / "loss_curves.png")


def test_run_refuses_what_it_cannot_train(tmp_path, capsys, monkeypatch):
    assert main(["run", _sweep_file(tmp_path, model="qwen2.5-7b")]) == 2
    assert "`run` needs its weights" in capsys.readouterr().err

    assert not (tmp_path / "runs" / "adapters").exists()  # refused before any training


def test_run_trains_a_job_planned_on_two_gpus_over_two_ranks(tmp_path, capsys, monkeypatch):
    """A job the plan puts on two GPUs runs under torchrun over two ranks (here gloo ranks on
    the CPU): its trials finish, their adapters are saved, and the results table lists them."""
    plan = lora_sweep.planner.plan

    def plan_on_two_gpus(*args, **kwargs):
        result = plan(*args, **kwargs)
        result.jobs[0].num_gpus, result.jobs[0].gpu_ids = 2, (0, 1)
        return result

    monkeypatch.setattr(lora_sweep.planner, "plan", plan_on_two_gpus)
    assert main(["run", _sweep_file(tmp_path)]) == 0
    out = capsys.readouterr().out
    for trial_id in ("a", "b"):
        adapter = tmp_path / "runs" / "adapters" / trial_id
        assert (adapter / "adapter_model.safetensors").is_file()
        assert any(line.split()[0] == trial_id and line.endswith(str(adapter)) for line in out.splitlines())


@pytest.mark.filterwarnings("ignore")
def test_demo_draws_loss_curves_and_its_snippet_runs_as_printed(tmp_path, capsys):
    output_dir = tmp_path / "demo"
    assert main(["demo", "--trials", "2", "--steps", "2", "--output-dir", str(output_dir)]) == 0
    out = capsys.readouterr().out
    assert _is_png(output_dir / "loss_curves.png") and f"Loss curves: {output_dir / 'loss_curves.png'}" in out
    snippet = out.split("Its PEFT adapter is in")[1].split(":\n", 1)[1]
    namespace: dict = {}
    exec("\n".join(line.strip() for line in snippet.strip().splitlines()), namespace)
    from peft import PeftModel

    assert isinstance(namespace["model"], PeftModel)


def test_run_trains_a_sweep_over_two_bases(tmp_path, capsys):
    """`bases`: each planned job trains one base's trials, with that base's settings; a trial
    may also set its own max_seq_len, at most its base's."""
    trials = [{"rank": 4, "learning_rate": 3e-3, "batch_size": 2, "trial_id": "a", "base_model": "short"},
              {"rank": 4, "learning_rate": 3e-3, "batch_size": 2, "trial_id": "b", "base_model": "long"},
              {"rank": 8, "learning_rate": 1e-3, "batch_size": 2, "trial_id": "c", "base_model": "long",
               "max_seq_len": 16}]
    path = tmp_path / "bases.yaml"
    path.write_text(yaml.safe_dump({"bases": {"short": {"model": "tiny", "max_seq_len": 16},
                                              "long": {"model": "tiny", "max_seq_len": 32}},
                                    "steps": 4, "eval_every": 2, "output_dir": str(tmp_path / "runs"),
                                    "trials": trials}, sort_keys=False))
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "3 trials of 2 base models (short, long) on the CPU" in out
    jobs = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert sorted(j[1] for j in jobs) == ["long", "short"]  # a job per base, never mixed
    for trial_id in "abc":
        assert (tmp_path / "runs" / "adapters" / trial_id / "adapter_model.safetensors").is_file()
