"""On two CUDA GPUs: Qwen2.5-7B (random weights) with 16 adapters trains the same on d = 2 as
on d = 1, every trial's loss at every one of 20 steps within bf16 rounding, with the base
whole on each GPU (replayed CUDA graphs) and sharded over both (FSDP2). Each d is a
torchrun of `benchmarks.multi_gpu`'s worker. Skipped without two GPUs; run it on a machine
with them with `TRITON_INTERPRET=0 pytest tests/test_distributed_gpu.py`."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from benchmarks.multi_gpu import loss_agreement, run_on

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs two CUDA GPUs (and Triton compiled, not interpreted)")


@pytest.mark.parametrize("shard_base", ["auto", "true"])
def test_qwen_7b_on_two_gpus_trains_what_one_gpu_trains(tmp_path, shard_base):
    args = argparse.Namespace(model="qwen2.5-7b", seq=1024, k=16, warmup=0, steps=20, dry=False,
                              shard_base=shard_base)
    one, two = (run_on(d, args, str(tmp_path)) for d in (1, 2))
    assert two["sharded"] == (shard_base == "true")  # auto: 15 GB of a GPU's 141 (or 80) stays whole
    assert sorted(set(two["owners"].values())) == [0, 1]  # each GPU trains its own trials
    assert set(one["losses"]) == set(two["losses"]) == {f"t{i}" for i in range(16)}
    assert all(len(losses) == 20 for losses in two["losses"].values())
    first = loss_agreement({"losses": {t: v[:1] for t, v in two["losses"].items()}},
                           {"losses": {t: v[:1] for t, v in one["losses"].items()}})
    assert first < 5e-3  # step 1: the same base and initial adapters, rows in other packs
    assert loss_agreement(two, one) < 2e-2  # 20 steps of bf16 rounding
