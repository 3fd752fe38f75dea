"""Framed tables (`kernels.frame.TableFrame`) under TRITON_INTERPRET=1: tables built for one
layout and refilled in place for others (empty segments, other scales and dropout rates
included) give, layout after layout, what the reference gives on each, output and every
gradient. The calls after the first reuse the first call's tables and launch choices, as a
replayed CUDA graph does."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import use_triton_interpreter

use_triton_interpreter("_triton_common", "pack", "shrink", "lora_gemm", "row_reduce", "ds_db", "multi_lora")

from lora_sweep.kernels import reference_multi_lora_linear, triton_multi_lora_linear  # noqa: E402
from lora_sweep.kernels.frame import TableFrame  # noqa: E402
from test_kernels import CONFIGS, assert_close  # noqa: E402


def layouts(caps: list[int], tokens: int, n: int, seed: int) -> list[list[int]]:
    """`n` layouts of `tokens` rows: segment i has 0 to caps[i] rows, the padding the rest."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        rows = [rng.randint(0, c) for c in caps]
        if sum(rows) <= tokens:
            out.append(rows + [tokens - sum(rows)])
    return out


def run(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens, seeds, config, frame=None):
    y = (triton_multi_lora_linear(x, weight, None, lora_a, lora_b, scales, dropout_p, seg_lens, seeds,
                                  config=config, frame=frame) if frame is not None or config is not None
         else reference_multi_lora_linear(x, weight, None, lora_a, lora_b, scales, dropout_p, seg_lens, seeds))
    params = [x] + [t for pair in zip(lora_a, lora_b) for t in pair if t is not None]
    # an empty segment's adapter gets no gradient in the reference; a frame's leaves it unwritten
    return y, torch.autograd.grad(y, params, torch.ones_like(y) + y.detach() / 7, allow_unused=True)


# chunks of several tiles and partial sums; every gradient written directly; two passes over dY
@pytest.mark.parametrize("config", ["split_chunks", "direct", "two_pass_dy"])
def test_a_frame_refilled_for_each_layout_matches_the_reference(config):
    torch.manual_seed(0)
    in_f, out_f, caps = 40, 56, [30, 9, 50, 17, 1]
    tokens = 100
    ranks = [8, 16, 3, None, 33]
    lora_a = [None if r is None else torch.randn(r, in_f, requires_grad=True) for r in ranks] + [None]
    lora_b = [None if r is None else torch.randn(out_f, r, requires_grad=True) for r in ranks] + [None]
    scales = [2.0, 0.5, 1.0, 1.0, 0.25, 1.0]
    dropout_p = [0.1, 0.0, 0.5, 0.0, 0.0, 0.0]
    seeds = [11, 12, 13, 14, 15, 0]
    weight = torch.randn(out_f, in_f)
    first, *others = layouts(caps, tokens, 4, seed=1)
    frame = TableFrame(first, caps + [tokens])
    for k, seg_lens in enumerate([first, *others]):
        if k:  # other scales and dropout rates in the same tables (which draw masks: segment 0 has dropout)
            scales = [s * (k + 1) / 2 for s in scales]
            dropout_p = [0.3 / k, 0.0, 0.0, 0.0, 0.2, 0.0]
        frame.fill(seg_lens, scales, dropout_p)
        x = torch.randn(tokens, in_f, requires_grad=True)
        y, grads = run(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens, seeds, CONFIGS[config], frame)
        y_ref, grads_ref = run(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens, seeds, None)
        assert_close(y, y_ref, what=f"output of {seg_lens}")
        for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
            if g_ref is not None:
                assert_close(g, g_ref, what=f"gradient {i} of {seg_lens}")


def test_a_frame_takes_only_its_layouts():
    frame = TableFrame([3, 4, 1], [5, 5, 8])
    with pytest.raises(ValueError, match="2 segments|3 segments of 8 rows"):
        frame.fill([3, 5])
    with pytest.raises(ValueError, match="Segment 1 of a frame must have 0 to 5 rows, got 6"):
        frame.fill([1, 6, 1])
    with pytest.raises(ValueError, match="Segment 0 of a frame must have 0 to 5 rows, got -1"):
        frame.fill([-1, 5, 4])
    frame.fill([0, 5, 3])  # an empty segment
    frame.fill([3, 4, 1])
    a, b = torch.randn(2, 4), torch.randn(4, 2)
    with pytest.raises(ValueError, match="last segment of a frame is its padding"):
        triton_multi_lora_linear(torch.randn(8, 4), torch.randn(4, 4), None, [a, a, a], [b, b, b], [1.0] * 3,
                                 [0.0] * 3, [3, 4, 1], 0, config=CONFIGS["fused"], frame=frame)
    # tables built without dropout draw no masks: no rate above zero later, nor another scale in a call
    triton_multi_lora_linear(torch.randn(8, 4), torch.randn(4, 4), None, [a, a, None], [b, b, None], [1.0] * 3,
                             [0.0] * 3, [3, 4, 1], 0, config=CONFIGS["fused"], frame=frame)
    with pytest.raises(ValueError, match="built without dropout take no dropout rate above zero"):
        frame.fill([3, 4, 1], [1.0, 1.0, 0.0], [0.1, 0.0, 0.0])
    assert frame.dropout_p[0] == 0.0  # a refused fill changes nothing
    frame.fill([2, 5, 1], [2.0, 0.5, 0.0], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="holds scale 2.0 and dropout 0.0 for segment 0, the call has 1.0"):
        triton_multi_lora_linear(torch.randn(8, 4), torch.randn(4, 4), None, [a, a, None], [b, b, None], [1.0] * 3,
                                 [0.0] * 3, [2, 5, 1], 0, config=CONFIGS["fused"], frame=frame)
