"""benchmarks.peers on the CPU: co-located PEFT processes and the packed job, on the bundled tiny model."""

import json
import os
import subprocess
import sys

from benchmarks.peers import window_throughput

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_common_window_counts_each_process_inside_it():
    # process 0 runs 0..4 s (two steps of 100 tokens), process 1 runs 1..5 s (one step of 300)
    reports = [{"status": "ok", "start": 0.0, "ends": [2.0, 4.0], "tokens": [100, 100]},
               {"status": "ok", "start": 1.0, "ends": [5.0], "tokens": [300]},
               {"status": "out of memory in build or warm-up"}]
    out = window_throughput(reports)
    assert out["window_s"] == 3.0  # from 1 s (last start) to 4 s (first end)
    # process 0: half its first step and all its second (150 tokens); process 1: 3/4 of its step (225)
    assert abs(out["tokens_per_s"] - 375 / 3) < 1e-9
    assert abs(out["union_tokens_per_s"] - 500 / 5) < 1e-9
    assert window_throughput(reports[2:])["tokens_per_s"] is None


def test_dry_run_trains_peers_and_packed_job_and_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.peers", "--dry", "--peers", "peft,unsloth,packed", "--dropout", "0.05",
         "--out", str(out), "--plot", str(png)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert result["versions"]["torch"] and result["versions"]["peft"] and result["gpu"] == "cpu"

    runs = {(r["method"], r["dropout"]): r for r in result["runs"]}
    assert set(runs) == {("peft", 0.05), ("unsloth", 0.0), ("packed", 0.05)}  # Unsloth's fast path: dropout 0
    for key in [("peft", 0.05), ("packed", 0.05)]:
        run = runs[key]
        assert run["status"] == "ok" and run["k"] == 2, run
        assert run["tokens_per_s"] > 0 and run["median_step_s"] > 0
        assert all(sum(r["tokens"]) > 0 and len(r["tokens"]) == 2 for r in run["reports"])
    assert runs[("peft", 0.05)]["processes"] == 2 and runs[("packed", 0.05)]["processes"] == 1
    assert runs[("unsloth", 0.0)]["status"].startswith("unavailable: ") or runs[("unsloth", 0.0)]["status"] == "ok"
    assert done.stdout.strip().splitlines()[-1].startswith("packed ")  # the table comes last
