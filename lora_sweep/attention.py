"""Causal attention over samples packed back to back in one row.

A packed microbatch is a single row holding every sample of every adapter, one after another,
with no padding; each sample must attend to itself alone. On CUDA, FlashAttention's
variable-length kernel (`torch.nn.attention.varlen`) takes the samples' boundaries as cumulative
lengths and does no work across them: no padding waste and no [tokens, tokens] mask. Elsewhere
(CPU tests) each sample runs through SDPA on its own, which gives the same result.

transformers calls `packed_attention` as the model's attention function once it is registered
under `ATTENTION_NAME` (`use_packed_attention`), and hands it the boundaries from the keyword
arguments of the model's forward (`cu_seq_lens_q`, `max_length_q`, the names its FlashAttention
integration uses). Without them it is plain causal SDPA, so the same model still serves padded
batches (an optional 2D padding mask is honoured).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_NAME = "lora_sweep_packed"

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.10
    varlen_attn = None
_VARLEN_ARGS = inspect.signature(varlen_attn).parameters if varlen_attn is not None else {}
# causal within each sample: a flag in some torch versions, a (left, right) window in others
_VARLEN_CAUSAL = {"is_causal": True} if "is_causal" in _VARLEN_ARGS else {"window_size": (-1, 0)}


def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface: `query` is [batch, heads, tokens, head_dim],
    `key`/`value` [batch, kv_heads, tokens, head_dim]; returns [batch, tokens, heads, head_dim].

    With `cu_seq_lens_q` (int32, [samples + 1], the samples' start offsets in the single row and
    the row's length), attention is causal within each sample and zero across samples.
    """
    groups = query.shape[1] // key.shape[1]
    if cu_seq_lens_q is None:
        mask = None
        if attention_mask is not None:  # [batch, keys] padding mask -> causal and not padding
            if attention_mask.dim() == 2:
                n = query.shape[2]
                causal = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
                mask = causal & attention_mask.bool()[:, None, None, :]
            else:
                mask = attention_mask
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                             is_causal=mask is None, enable_gqa=groups > 1)
        return out.transpose(1, 2), None
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one row of samples, got a batch of {query.shape[0]} rows")
    if query.is_cuda and varlen_attn is not None and dropout == 0.0:
        out = _varlen(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                      cu_seq_lens_q, int(max_length_q), scaling, groups)
        return out.unsqueeze(0), None
    # one SDPA per sample: the reference, and the path on CPU
    bounds = cu_seq_lens_q.tolist()
    out = torch.cat([
        F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                       scale=scaling, is_causal=True, enable_gqa=groups > 1)
        for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
    return out.transpose(1, 2), None


def _varlen(q, k, v, cu_seq_lens, max_len, scale, groups):
    """FlashAttention over [tokens, heads, head_dim] tensors, causal within each sample."""
    gqa = {}
    if groups > 1:
        if "enable_gqa" in _VARLEN_ARGS:
            gqa = {"enable_gqa": True}
        else:  # no GQA flag: every query head gets its own copy of its key/value head
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return varlen_attn(q, k, v, cu_seq_lens, cu_seq_lens, max_len, max_len, scale=scale, **_VARLEN_CAUSAL, **gqa)


def _padding_mask(attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers' mask-function interface: hand the 2D padding mask (or None) through as it
    is; `packed_attention` builds what it needs from it."""
    return attention_mask


def sliding_window(config) -> Optional[int]:
    """The attention window of a transformers config's model, in tokens, if some of its layers
    attend only that far back (Mistral's `sliding_window`, Qwen2's with `use_sliding_window`);
    None if every layer attends to the whole sample. `packed_attention` does not keep a window."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return int(window)


def use_packed_attention(model: nn.Module) -> None:
    """Registers `packed_attention` with transformers and makes it `model`'s attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, packed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _padding_mask)
    model.config._attn_implementation = ATTENTION_NAME
