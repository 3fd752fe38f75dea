"""Packed attention: samples back to back in one row attend to themselves only, exactly as a
dense block-diagonal causal mask would have them; without boundaries it is causal SDPA with the
padding mask honoured. On CUDA the variable-length FlashAttention kernel is checked against
the same reference in bf16 (skipped without a GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from lora_sweep.attention import packed_attention, varlen_attn


def qkv(lengths, heads=4, kv_heads=2, dim=16, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = sum(lengths)
    make = lambda h: torch.randn(1, h, n, dim, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def block_causal_reference(q, k, v, lengths):
    """Dense SDPA with a mask that is causal inside each sample and closed across samples."""
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(q.device)
    n = sample.numel()
    mask = (sample[:, None] == sample[None, :]) & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=0.3,
                                         enable_gqa=True)
    return out.transpose(1, 2)


def cu(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


@pytest.mark.parametrize("lengths", [[5], [3, 1, 7, 2], [1, 1, 1], [9, 4]])
def test_packed_samples_attend_only_to_themselves(lengths):
    q, k, v = qkv(lengths)
    out, _ = packed_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu(lengths), max_length_q=max(lengths))
    ref = block_causal_reference(q, k, v, lengths)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


def test_without_boundaries_it_is_causal_attention_with_the_padding_mask():
    q, k, v = qkv([6, 6])
    q, k, v = (t.detach().reshape(t.shape[1], 2, 6, t.shape[-1]).transpose(0, 1) for t in (q, k, v))  # 2 rows
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    out, _ = packed_attention(None, q, k, v, padding, scaling=0.3)
    for row, n in enumerate((6, 4)):  # each row's real tokens see exactly their own prefix
        ref = F.scaled_dot_product_attention(q[row:row + 1, :, :n], k[row:row + 1, :, :n], v[row:row + 1, :, :n],
                                             is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(out[row:row + 1, :n], ref)
    plain, _ = packed_attention(None, q, k, v, None, scaling=0.3)
    torch.testing.assert_close(plain[:1], out[:1])  # an all-ones mask changes nothing


def test_packed_attention_needs_one_row():
    q, k, v = qkv([4, 4])
    q2, k2, v2 = (t.detach().reshape(t.shape[1], 2, 4, t.shape[-1]).transpose(0, 1) for t in (q, k, v))
    with pytest.raises(ValueError, match="one row"):
        packed_attention(None, q2, k2, v2, None, cu_seq_lens_q=cu([4]), max_length_q=4)


@pytest.mark.skipif(not torch.cuda.is_available() or varlen_attn is None, reason="needs CUDA and varlen_attn")
def test_varlen_kernel_matches_the_dense_reference_in_bf16():
    lengths = [300, 1, 77, 512, 129, 64]
    q, k, v = qkv(lengths, heads=8, kv_heads=2, dim=64, device="cuda", dtype=torch.bfloat16, seed=1)
    out, _ = packed_attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu(lengths, "cuda"),
                              max_length_q=max(lengths))
    ref = block_causal_reference(q, k, v, lengths)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2


def test_sliding_windows_are_read_from_the_config():
    from transformers import AutoConfig

    from lora_sweep.attention import sliding_window

    assert sliding_window(AutoConfig.for_model("llama")) is None
    assert sliding_window(AutoConfig.for_model("qwen2")) is None  # use_sliding_window defaults to False
    assert sliding_window(AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16)) == 16
    assert sliding_window(AutoConfig.for_model("mistral", sliding_window=16)) == 16
    assert sliding_window(AutoConfig.for_model("mistral", sliding_window=None)) is None


def test_packed_padding_refuses_a_window_shorter_than_the_samples(tmp_path, char_tokenizer, toy_data):
    """packed_attention attends over whole samples: a model whose layers look back only 8
    tokens cannot be trained packed at max_seq_len 32, and says so before any training."""
    import lora_sweep as ls
    from lora_sweep.config import ConfigError
    from conftest import save_tiny_model

    model_dir = save_tiny_model("mistral", char_tokenizer, tmp_path / "mistral", seed=2, sliding_window=8)
    spec = ls.JobSpec(base_model=model_dir, train_data=toy_data[0], max_seq_len=32, padding="packed",
                      output_dir=str(tmp_path / "runs"))
    with pytest.raises(ConfigError, match="sliding attention window of 8.*max_seq_len=32") as err:
        ls.PackedJob(spec, [ls.TrialConfig(rank=4, max_steps=2)], progress=False)
    assert err.value.field == "padding"
    # a window that covers every sample is no obstacle
    wide = save_tiny_model("mistral", char_tokenizer, tmp_path / "wide", seed=2, sliding_window=32)
    job = ls.PackedJob(dataclasses.replace(spec, base_model=wide), [], progress=False)
    assert job.packed
