"""`benchmarks/kernels.py` on the CPU: the dry run end to end, the comparison of two runs and
the picture, read from the committed runs' format."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")


def old_row(tokens, in_f, out_f, adapters, rank, base, fused, fused_dropout, refs=None):
    """A `main` row as the committed runs hold it (their other keys left out)."""
    row = dict(in_f=in_f, out_f=out_f, tokens=tokens, adapters=adapters, rank=rank, base_graphed=base,
               fused_graphed=fused, fused_dropout_graphed=fused_dropout)
    return dict(row, refs_graphed=refs) if refs else row


def test_dry_run_checks_times_summarises_and_compares(tmp_path):
    old = dict(gpu="old", date="then", main=[old_row(64, 64, 48, 2, "16", 1.0, 2.0, 3.0,
                                                     refs=dict(base=1.0, fused=2.0, segref=4.0, peft_loop=5.0))])
    (tmp_path / "old.json").write_text(json.dumps(old))
    plot = ["--plot", str(tmp_path / "run.png")] if importlib.util.find_spec("matplotlib") else []
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--dry", "--out", str(tmp_path / "run.json"),
                          "--compare", str(tmp_path / "old.json"), *plot],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "run.json").read_text())

    assert {"gpu", "torch", "triton", "cuda", "date", "config", "check", "ceilings", "main", "summary",
            "section_seconds", "compare"} <= set(res)
    assert "errors" not in res
    assert res["check"] and all(c["ok"] for c in res["check"]) and res["summary"]["check_all_ok"]
    (row,) = res["main"]
    assert (row["in_f"], row["out_f"], row["tokens"], row["adapters"], row["rank"], row["ranks"]) == \
        (64, 48, 64, 2, "16", [16, 16])
    for key in ("base_graphed", "fused_graphed", "fused_dropout_graphed"):
        assert row[key] > 0
    assert set(row["refs_graphed"]) == {"base", "fused", "segref", "peft_loop"}
    assert all(v > 0 for v in row["refs_graphed"].values())
    assert res["summary"]["graphed_fused_over_base"]["median"] == row["fused_graphed"] / row["base_graphed"]
    medians = res["compare"]["median_new_over_old"]
    assert medians["fused_over_base"]["median"] == pytest.approx(row["fused_graphed"] / row["base_graphed"] / 2.0)
    assert medians["segref_over_fused"]["median"] == pytest.approx(
        row["refs_graphed"]["segref"] / row["refs_graphed"]["fused"] / 2.0)
    if plot:
        assert (tmp_path / "run.png").stat().st_size > 5_000


def test_compare_matches_rows_and_takes_the_median_of_new_over_old():
    from benchmarks.kernels import compare

    refs = dict(base=1.0, fused=1.2, segref=3.6, peft_loop=4.0)
    old = dict(main=[old_row(2048, 4096, 4096, 4, "16", 1.0, 1.2, 1.3, refs),
                     old_row(2048, 4096, 4096, 32, "mixed", 1.0, 1.5, 1.6),  # no graphed reference
                     old_row(16384, 4096, 4096, 4, "16", 2.0, 2.2, 2.4, refs)])
    new = dict(main=[old_row(16384, 4096, 4096, 4, "16", 2.0, 2.42, 2.6, dict(refs, segref=2.4)),
                     old_row(2048, 4096, 4096, 32, "mixed", 1.0, 1.35, 1.5, refs),
                     old_row(2048, 4096, 4096, 1, "16", 1.0, 1.1, 1.2)])  # not in the old run
    result = compare(new, old)

    rows = {r["row"]: r for r in result["rows"]}
    assert rows["16384 x 4096->4096 x 4 16"]["fused_over_base"] == pytest.approx((1.21, 1.1))
    assert rows["16384 x 4096->4096 x 4 16"]["segref_over_fused"] == pytest.approx((2.0, 3.0))
    assert rows["2048 x 4096->4096 x 32 mixed"]["segref_over_fused"] == pytest.approx((3.0, None))
    assert rows["2048 x 4096->4096 x 1 16"]["fused_over_base"][1] is None
    medians = result["median_new_over_old"]
    assert medians["fused_over_base"] == dict(median=pytest.approx((1.1 + 0.9) / 2), of=2)
    assert medians["segref_over_fused"] == dict(median=pytest.approx(2 / 3), of=1)


def test_compare_reads_the_committed_runs(capsys):
    from benchmarks.kernels import main

    main(["--compare", os.path.join(RESULTS, "kernels_h200.json"), os.path.join(RESULTS, "kernels_h100.json")])
    printed = capsys.readouterr().out
    assert "median new/old of fused_over_base:" in printed and "over 42 rows" in printed


def test_the_grid_and_its_rank_draws_are_the_committed_runs():
    from benchmarks.kernels import PACKS, SHAPES, TOKENS, ranks_for

    for name in ("kernels_h100.json", "kernels_h200.json"):
        rows = json.load(open(os.path.join(RESULTS, name)))["main"]
        assert [(r["in_f"], r["out_f"], r["tokens"], r["adapters"], r["rank"]) for r in rows] == \
            [(i, o, t, n, k) for i, o in SHAPES for t in TOKENS for n, k in PACKS]
        assert all(ranks_for(r["adapters"], r["rank"], r["tokens"]) == r["ranks"] for r in rows)


def test_plot_draws_fused_over_base_per_row_a_panel_per_token_count(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.kernels import main, plot_main

    path = os.path.join(RESULTS, "kernels_h100.json")
    rows = json.load(open(path))["main"]
    fig = plot_main(rows, tmp_path / "main.png", "test")

    for ax, tokens in zip(fig.axes, (2048, 16384)):
        sel = [r for r in rows if r["tokens"] == tokens]
        fused, dropout = ax.containers
        assert [b.get_height() for b in fused] == [r["fused_graphed"] / r["base_graphed"] for r in sel]
        assert [b.get_height() for b in dropout] == [r["fused_dropout_graphed"] / r["base_graphed"] for r in sel]
    main(["--plot-from", path, "--plot", str(tmp_path / "from.png")])
    assert (tmp_path / "from.png").stat().st_size > 10_000
