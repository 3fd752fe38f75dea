"""Plain torch reference of the packed multi-LoRA linear layer.

This is the segmented loop: one base GEMM for all rows, then each adapter's LoRA term on
its own contiguous rows (mLoRA's BatchLoRA). The Triton kernels must compute the same
function; tests compare against this, and `MultiLoRALinear` runs it on CPU. Beside it, the
references of the other kernel files: transformers' RMSNorm (`rmsnorm.py`), its SiLU(gate) * up
(`swiglu.py`) and the token cross-entropy of a chunk of logits (`cross_entropy.py`).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .dropout import dropout_keep_mask

Seeds = Union[int, Sequence[int], torch.Tensor]
IGNORE_INDEX = -100  # target of a position that counts no loss, as in transformers


def per_adapter_seeds(seed: Seeds, n: int) -> list[int]:
    """One dropout seed per adapter: an int is shared by all, a sequence (or a 1-d integer
    tensor) gives each its own."""
    if isinstance(seed, int):
        return [seed] * n
    seeds = seed.tolist() if isinstance(seed, torch.Tensor) else [int(s) for s in seed]
    if len(seeds) != n:
        raise ValueError(f"`seed` has {len(seeds)} entries but there are {n} adapters.")
    return seeds


def reference_multi_lora_linear(
    x: torch.Tensor,  # [tokens, in], adapters' rows contiguous in adapter order
    weight: torch.Tensor,  # [out, in], frozen
    bias: Optional[torch.Tensor],  # [out] or None
    lora_a: Sequence[Optional[torch.Tensor]],  # each [r_i, in], or None: no LoRA on that segment
    lora_b: Sequence[Optional[torch.Tensor]],  # each [out, r_i], or None
    scales: Sequence[float],
    dropout_p: Sequence[float],
    seg_lens: Sequence[int],  # rows per adapter, sum == tokens, zeros allowed
    seed: Seeds = 0,
) -> torch.Tensor:
    """`x @ weight.T + bias`, plus `scale_i * dropout_i(x_i) @ A_i.T @ B_i.T` on segment i.

    As in PEFT, the LoRA branch runs in the adapter's dtype (fp32 adapters on a bf16 base
    upcast their input) and the sum is cast back to the base output's dtype. Dropout acts on
    the LoRA branch's input only; its mask comes from `dropout_keep_mask(seed_i, ...)`, so the
    fused kernels and this reference draw the same mask from the same seed.
    """
    n = len(seg_lens)
    if not (len(lora_a) == len(lora_b) == len(scales) == len(dropout_p) == n):
        raise ValueError("lora_a, lora_b, scales, dropout_p and seg_lens must have one entry per adapter.")
    if sum(seg_lens) != x.shape[0]:
        raise ValueError(f"seg_lens sum to {sum(seg_lens)} but x has {x.shape[0]} rows.")
    seeds = per_adapter_seeds(seed, n)

    base = F.linear(x, weight, bias)  # [tokens, out]
    deltas = []
    start = 0
    for a, b, scale, p, rows, s in zip(lora_a, lora_b, scales, dropout_p, seg_lens, seeds):
        xi = x[start : start + rows]
        start += rows
        if a is None or rows == 0:
            deltas.append(base.new_zeros(rows, base.shape[1], dtype=base.dtype if a is None else a.dtype))
            continue
        xi = xi.to(a.dtype)
        if p > 0:
            keep = dropout_keep_mask(s, rows, xi.shape[1], p, device=xi.device)
            xi = xi * keep.to(xi.dtype) / (1.0 - p)
        deltas.append((xi @ a.t()) @ b.t() * scale)  # [rows, r] -> [rows, out]
    if not deltas:
        return base
    delta = torch.cat([d.to(torch.promote_types(d.dtype, base.dtype)) for d in deltas])
    return (base + delta).to(base.dtype)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Llama, Qwen2, Mistral, ...), as its modelling files write it."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's middle, `act_fn(gate_proj(x)) * up_proj(x)` with SiLU, as transformers
    writes it (Llama, Qwen2, Mistral, ...)."""
    return F.silu(gate) * up


def reference_cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor, need_grad: bool):
    """(losses fp32 [rows], d(sum of losses)/d(logits) in the logits' dtype, or None): token
    cross-entropy of each row, computed in fp32 as transformers' loss upcasts the logits;
    rows whose target is IGNORE_INDEX count zero and get a zero gradient. With `need_grad`,
    fp32 logits are overwritten (as the kernel overwrites any): the caller gives them up."""
    dtype, logits = logits.dtype, logits.float()
    valid = targets != IGNORE_INDEX
    safe_targets = targets.clamp(min=0)
    lse = torch.logsumexp(logits, dim=-1)
    losses = torch.where(valid, lse - logits.gather(1, safe_targets[:, None])[:, 0], torch.zeros_like(lse))
    if not need_grad:
        return losses, None
    grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the fp32 logits
    grad.scatter_add_(1, safe_targets[:, None], -torch.ones_like(lse)[:, None])
    return losses, grad.mul_(valid[:, None]).to(dtype)
