"""`lora-sweep plan`: a sweep YAML in, a table on stdout and a Gantt PNG out."""

from __future__ import annotations

import os

import pytest
import yaml

from lora_sweep.cli import main, read_sweep, sweep_trials

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "sweep.yaml")


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plan_the_example_sweep(tmp_path, capsys):
    gantt = tmp_path / "plan.png"
    assert main(["plan", EXAMPLE, "--gantt", str(gantt)]) == 0
    out = capsys.readouterr().out
    assert _is_png(gantt)
    lines = out.splitlines()
    assert lines[0].startswith("120 trials of qwen2.5-7b") and "8 x h100-sxm" in lines[0]
    assert any(line.split()[:3] == ["job", "gpus", "start"] for line in lines)
    summary = next(line for line in lines if line.startswith("120 trials in"))
    assert "makespan" in summary and "lower bound" in summary and "0 failed" in summary
    assert lines[-1] == f"Gantt chart: {gantt}"


def test_example_sweep_is_plora_table1():
    sweep = read_sweep(EXAMPLE)
    trials = sweep_trials(sweep)
    assert len(trials) == 120 and len({t.trial_id for t in trials}) == 120
    assert all(2e-5 <= t.learning_rate <= 4e-4 and 1 <= t.batch_size <= 32 and 8 <= t.rank <= 128 for t in trials)
    assert all(t.rank / 4 - 1e-9 <= t.alpha <= 4 * t.rank + 1e-9 and t.max_steps == 200 for t in trials)
    assert sweep_trials(sweep) == trials  # seeded


def test_plan_explicit_trials_and_a_dict_model(tmp_path, capsys, monkeypatch):
    sweep = {
        "model": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                  "tie_word_embeddings": True},
        "gpus": 2, "gpu_memory_gb": 24, "gpu": "l4", "max_seq_len": 256, "steps": 50,
        "trials": [{"rank": 16, "alpha": 32, "learning_rate": "2e-4", "batch_size": 4, "trial_id": "small"},
                   {"rank": 64, "alpha": 16, "learning_rate": 1.0e-4, "batch_size": 2},
                   {"rank": 8, "alpha": 8, "batch_size": 4096, "trial_id": "huge"}],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    with pytest.warns(UserWarning, match="'huge'"):
        assert main(["plan", str(path), "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert _is_png(tmp_path / "lora_sweep_runs" / "sweep" / "plan.png")  # default: <output_dir>/plan.png
    assert "small(16/4)" in out and "t001(64/2)" in out and "failed: Trial 'huge': needs" in out
    assert "on 1 x l4 (24 GB" in out


def test_plan_reports_bad_sweep_files(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("model: qwen2.5-7b\nnum_gpus: 8\n")
    assert main(["plan", str(path)]) == 2
    assert "unknown key(s) ['num_gpus']" in capsys.readouterr().err
    path.write_text("model: qwen2.5-7b\nsearch_space: {rank: 16}\n")
    assert main(["plan", str(path)]) == 2
    assert "`rank`" in capsys.readouterr().err


def test_plan_with_a_saved_cost_model(tmp_path, capsys):
    from lora_sweep.costmodel import CostModel

    saved = tmp_path / "cm.json"
    CostModel.from_model("llama-3.2-1b", gpu="a10g", max_seq_len=256).save(saved)
    assert main(["plan", EXAMPLE, "--calibration", str(saved), "--gantt", str(tmp_path / "p.png")]) == 0
    assert "on 8 x a10g (24 GB" in capsys.readouterr().out


def test_subcommands():
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    with pytest.raises(SystemExit):
        main(["plan"])  # the sweep file is required


def test_the_tiny_example_sweep_plans_six_trials(tmp_path, capsys):
    tiny = os.path.join(os.path.dirname(EXAMPLE), "sweep_tiny.yaml")
    trials = sweep_trials(read_sweep(tiny))
    assert len(trials) == 6 and {t.rank for t in trials} <= {4, 8, 16}
    assert main(["plan", tiny, "--gantt", str(tmp_path / "plan.png")]) == 0
    summary = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("6 trials in"))
    assert "0 failed" in summary


def test_plan_a_sweep_over_three_bases(tmp_path, capsys):
    """`bases`: each with its own model and settings; a search space draws each trial's base,
    explicit trials name theirs, and without either every trial runs on every base."""
    sweep = {"bases": {"small": {"model": "qwen2.5-0.5b", "max_seq_len": 256},
                       "mid": {"model": "llama-3.2-1b", "quantization": "nf4"},
                       "large": {"model": "qwen2.5-7b"}},
             "gpus": 8, "n_trials": 30, "steps": 100,
             "search_space": {"base_model": ["small", "mid", "large"], "rank": [8, 16, 64], "batch_size": [1, 4, 16]},
             "output_dir": str(tmp_path)}
    path = tmp_path / "bases.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    assert main(["plan", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("30 trials of 3 base models on 8 x h100-sxm")
    assert any("small: qwen2.5-0.5b" in ln and "max_seq_len 256" in ln for ln in lines)
    assert any("mid: llama-3.2-1b" in ln and "nf4" in ln for ln in lines)
    jobs = [ln.split() for ln in lines if ln[:4].strip().isdigit()]
    assert jobs and {j[1] for j in jobs} <= {"small", "mid", "large"} and len({j[1] for j in jobs}) == 3
    assert "0 failed" in next(ln for ln in lines if ln.startswith("30 trials in"))

    from lora_sweep.cli import sweep_trials_by_base
    crossed = sweep_trials_by_base(read_sweep(str(path)) | {"search_space": {"rank": [8, 16]}, "n_trials": 4})
    assert [len(v) for v in crossed.values()] == [4, 4, 4] and crossed["mid"][0].trial_id.endswith("@mid")
    explicit = read_sweep(str(path)) | {"trials": [{"rank": 8, "base_model": "large"}, {"rank": 16}]}
    assert {k: [t.rank for t in v] for k, v in sweep_trials_by_base(explicit).items()} == \
        {"small": [16], "mid": [], "large": [8]}
    with pytest.raises(ValueError, match="must be one of the sweep's bases"):
        sweep_trials_by_base(explicit | {"trials": [{"rank": 8, "base_model": "huge"}]})
    path.write_text(yaml.safe_dump(sweep | {"bases": {"small": {"max_seq_len": 256}}}))
    assert main(["plan", str(path)]) != 0
    assert "must map names to mappings with a `model`" in capsys.readouterr().err
