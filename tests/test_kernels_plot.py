"""The picture of the kernels' targets (`benchmarks/kernels.py --plot`), drawn from the committed results."""

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plot_draws_each_rows_ratios_against_the_targets(tmp_path):
    from benchmarks.kernels import plot_main

    files = [os.path.join(REPO, "benchmarks", "results", f"kernels_h200_v29_main_{n}.json") for n in (2048, 16384)]
    rows = [r for f in files for r in json.load(open(f))["main"]]
    fig = plot_main(rows, tmp_path / "main.png", "test")

    assert (tmp_path / "main.png").stat().st_size > 10_000
    (top_2048, top_16384), (bottom_2048, _) = fig.axes[:2], fig.axes[2:]
    for ax, tokens in ((top_2048, 2048), (top_16384, 16384)):
        sel = [r for r in rows if r["tokens"] == tokens]
        fused, dropout = ax.containers
        assert [b.get_height() for b in fused] == [r["fused_graphed"] / r["base_graphed"] for r in sel]
        assert [b.get_height() for b in dropout] == [r["fused_dropout_graphed"] / r["base_graphed"] for r in sel]
        assert [list(line.get_ydata()) for line in ax.lines].count([1.15, 1.15]) == 1  # the target
    many = [r for r in rows if r["tokens"] == 2048 and r["adapters"] >= 4]
    assert [b.get_height() for b in bottom_2048.containers[0]] == [r["segref"] / r["fused"] for r in many]


def test_plot_takes_the_graphed_reference_where_the_rows_have_it(tmp_path):
    from benchmarks.kernels import plot_main

    rows = json.load(open(os.path.join(REPO, "benchmarks", "results", "kernels_h200_v32_main.json")))["main"]
    fig = plot_main(rows, tmp_path / "main.png", "test")

    for ax, tokens in zip(fig.axes[2:], (2048, 16384)):
        many = [r["refs_graphed"] for r in rows if r["tokens"] == tokens and r["adapters"] >= 4]
        assert [b.get_height() for b in ax.containers[0]] == [t["segref"] / t["fused"] for t in many]
        assert "graphed" in ax.containers[0].get_label()
