"""Chunked per-adapter LM loss vs full logits + F.cross_entropy: sums, counts, the gradient
of hidden, and each adapter's sum bit-identical whatever else is packed with it."""

from __future__ import annotations

import pytest
import torch

from lora_sweep.kernels import per_adapter_lm_loss, reference_per_adapter_lm_loss
from lora_sweep.kernels.lm_loss import IGNORE_INDEX, default_chunk_rows

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def make_case(seg_lens, hidden_size=24, vocab=50, dtype=torch.float32, seed=0, ignore_frac=0.1):
    g = torch.Generator().manual_seed(seed)
    n = sum(seg_lens)
    hidden = torch.randn(n, hidden_size, generator=g).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignore_frac] = IGNORE_INDEX
    return hidden, weight, targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 3, 7, None])
def test_matches_full_logits(dtype, chunk_rows):
    seg_lens = [5, 0, 17, 1, 9]
    hidden, weight, targets = make_case(seg_lens, dtype=dtype)
    hidden.requires_grad_(True)
    sums, counts = per_adapter_lm_loss(hidden, weight, targets, seg_lens, chunk_rows=chunk_rows)
    ref_sums, ref_counts = reference_per_adapter_lm_loss(hidden, weight, targets, seg_lens)
    assert sums.dtype == torch.float32 and sums.shape == (len(seg_lens),)
    assert torch.equal(counts, ref_counts)
    torch.testing.assert_close(sums, ref_sums, **TOL[dtype])

    # the engine's loss: sum over adapters of their mean token loss
    w = torch.rand(len(seg_lens))
    (grad,) = torch.autograd.grad((sums * w / counts.clamp(min=1)).sum(), [hidden])
    (ref_grad,) = torch.autograd.grad((ref_sums * w / ref_counts.clamp(min=1)).sum(), [hidden])
    assert grad.dtype == hidden.dtype
    torch.testing.assert_close(grad.float(), ref_grad.float(), **TOL[dtype])


def test_sums_bit_identical_when_another_segment_is_removed():
    seg_lens = [11, 7, 23]
    hidden, weight, targets = make_case(seg_lens, hidden_size=20, seed=3)  # 80-byte rows: starts move alignment
    full, _ = per_adapter_lm_loss(hidden, weight, targets, seg_lens, chunk_rows=4)
    # drop adapter 1: adapter 2's rows move to another offset
    keep = torch.cat([torch.arange(0, 11), torch.arange(18, 41)])
    part, _ = per_adapter_lm_loss(hidden[keep], weight, targets[keep], [11, 23], chunk_rows=4)
    alone, _ = per_adapter_lm_loss(hidden[18:].clone(), weight, targets[18:].clone(), [23], chunk_rows=4)
    assert torch.equal(part, full[[0, 2]])
    assert torch.equal(alone[0], full[2])


def test_no_grad_needed_and_empty():
    hidden, weight, targets = make_case([4, 3])
    sums, counts = per_adapter_lm_loss(hidden, weight, targets, [4, 3])
    assert not sums.requires_grad
    sums, counts = per_adapter_lm_loss(hidden[:0], weight, targets[:0], [0, 0])
    assert sums.tolist() == [0.0, 0.0] and counts.tolist() == [0, 0]


def test_lm_head_gets_no_gradient():
    hidden, weight, targets = make_case([6])
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    sums, _ = per_adapter_lm_loss(hidden, weight, targets, [6])
    sums.sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_default_chunk_rows_bounds_logits_memory():
    assert default_chunk_rows(151936) * 151936 * 4 <= 256 * 2**20
    assert default_chunk_rows(50) == 4096


def test_bad_inputs_raise():
    hidden, weight, targets = make_case([4, 3])
    with pytest.raises(ValueError, match="seg_lens"):
        per_adapter_lm_loss(hidden, weight, targets, [4, 4])
    with pytest.raises(ValueError, match="targets"):
        per_adapter_lm_loss(hidden, weight, targets[:-1], [4, 3])
    with pytest.raises(ValueError, match="chunk_rows"):
        per_adapter_lm_loss(hidden, weight, targets, [4, 3], chunk_rows=0)
