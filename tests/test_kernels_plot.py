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

    rows = json.load(open(os.path.join(REPO, "benchmarks", "results", "kernels_h200_v33_main.json")))["main"]
    fig = plot_main(rows, tmp_path / "main.png", "test")

    for ax, tokens in zip(fig.axes[2:], (2048, 16384)):
        many = [r["refs_graphed"] for r in rows if r["tokens"] == tokens and r["adapters"] >= 4]
        assert [b.get_height() for b in ax.containers[0]] == [t["segref"] / t["fused"] for t in many]
        assert "graphed" in ax.containers[0].get_label()


def test_layer_rates_count_the_base_gemms_and_the_six_lora_products():
    from benchmarks.kernels import layer_rates

    # 2048 tokens over two adapters of ranks 16 and 64 (1024 rows each), 4096 -> 14336, 1 ms each
    row = dict(adapters=2, tokens=2048, in_f=4096, out_f=14336, ranks=[16, 64], fused_graphed=1.0, base_graphed=1.0)
    rates = layer_rates(row, dict(bf16_matmul_TFLOPs=800.0, copy_GBps=4000.0))
    base = 2 * (2 * 2048 * 4096 * 14336)  # Y and dX
    # S, S B^T, dS, dB, dA and dS A: each 2 x rows x rank x (in or out) flops, three of each width
    lora = 2 * 1024 * (16 + 64) * 3 * (4096 + 14336)
    assert abs(rates["base_TFLOPs"] - base / 1e-3 / 1e12) < 1e-9
    assert abs(rates["fused_TFLOPs"] - (base + lora) / 1e-3 / 1e12) < 1e-9
    assert abs(rates["fused_TFLOPs_of_matmul_ceiling"] - rates["fused_TFLOPs"] / 800.0) < 1e-12
    assert row["graphed_rates"] is rates


def test_target_status_tells_unreachable_rows_from_open_ones():
    from benchmarks.kernels import target_status

    def row(adapters, rank, fused, floor_ms, refs=None):  # the base takes 1 ms, graphed
        return dict(tokens=2048, in_f=4096, out_f=4096, adapters=adapters, rank=rank, base_graphed=1.0,
                    fused_graphed=fused, adapter_traffic_per_pass_floor_ms=floor_ms, refs_graphed=refs)

    rows = [row(1, "16", 1.10, 0.01),  # met
            row(32, "64", 1.30, 0.20),  # misses, but the adapters' bytes alone take 1.20x: unreachable
            row(4, "16", 1.20, 0.15,  # misses with a floor of exactly 1.15x: open, by 50 us
                refs=dict(base=1.0, fused=1.2, segref=2.9)),  # the reference under 3x the base: unreachable
            row(16, "mixed", 1.12, 0.05, refs=dict(base=1.0, fused=1.12, segref=3.3)),  # 2.95x: open
            row(32, "16", 1.08, 0.05, refs=dict(base=1.0, fused=1.08, segref=3.3))]  # 3.06x: met
    status = target_status(rows)

    first = status["within_1_15_of_base"]
    assert (first["of"], first["met"]) == (5, 3)
    assert first["unreachable"] == {"2048 x 4096->4096 x 32 64": 1.2}
    assert first["open"] == {"2048 x 4096->4096 x 4 16": dict(over_base=1.2, floor=1.15, misses_by_us=50.0)}
    second = status["3x_over_segref_4plus"]  # rows of 4 or more adapters with the reference timed
    assert (second["of"], second["met"]) == (3, 1)
    assert second["unreachable"] == {"2048 x 4096->4096 x 4 16": 2.9}
    assert second["open"] == {"2048 x 4096->4096 x 16 mixed": dict(speedup=2.946, needs_layer_over_base=1.1,
                                                                    layer_over_base=1.12)}
