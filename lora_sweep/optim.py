"""AdamW and gradient clipping over every adapter's tensors at once.

Each adapter keeps its own learning rate, schedule, weight decay, step count and clipping
norm, but the update runs as a handful of `torch._foreach_*` calls over all adapters'
tensors together (per-tensor scalar lists carry the per-adapter values), not a Python loop
over adapters. The arithmetic is `torch.optim.AdamW`'s foreach path, term for term, so an
adapter updated here matches one updated alone by torch's AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch


def lr_lambda(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak lr at optimizer step `k` (0-based), as transformers'
    get_{linear,cosine,constant}_schedule_with_warmup compute it."""

    def factor(k: int) -> float:
        if k < warmup_steps:
            return k / max(1, warmup_steps)
        if kind == "constant":
            return 1.0
        progress = (k - warmup_steps) / max(1, total_steps - warmup_steps)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine, half a cycle

    return factor


@dataclass
class AdapterOptState:
    params: list[torch.Tensor]
    lr: float
    schedule: Callable[[int], float]
    weight_decay: float
    max_grad_norm: float | None
    exp_avg: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sq: list[torch.Tensor] = field(default_factory=list)
    step: int = 0  # optimizer steps taken

    def __post_init__(self):
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    @property
    def current_lr(self) -> float:
        return self.lr * self.schedule(self.step)


class PackedAdamW:
    """AdamW (decoupled weight decay) for many adapters, stepped together."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.adapters: dict[str, AdapterOptState] = {}

    def add(self, name: str, params: list[torch.Tensor], lr: float, schedule: Callable[[int], float],
            weight_decay: float, max_grad_norm: float | None) -> None:
        self.adapters[name] = AdapterOptState(list(params), lr, schedule, weight_decay, max_grad_norm or None)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def grad_norms(self, names: list[str]) -> torch.Tensor:
        """Each adapter's total gradient L2 norm, [len(names)], one foreach pass."""
        grads, owner = [], []
        for i, name in enumerate(names):
            for p in self.adapters[name].params:
                grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
                owner.append(i)
        norms = torch.stack(torch._foreach_norm(grads)).float()  # (tensors,)
        index = torch.tensor(owner, device=norms.device)
        return torch.zeros(len(names), device=norms.device).index_add_(0, index, norms.square()).sqrt()

    def step(self, names: list[str], norms: list[float]) -> None:
        """Clip each adapter by its own norm (host values of `grad_norms`, which the engine
        reads anyway to catch non-finite gradients), then one AdamW update for all."""
        if not names:
            return
        states = [self.adapters[n] for n in names]
        params, grads, exp_avg, exp_avg_sq = [], [], [], []
        clip, decay, step_size, bc2_sqrt = [], [], [], []
        for s, norm in zip(states, norms):
            # as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), at most 1
            coef = min(1.0, s.max_grad_norm / (norm + 1e-6)) if s.max_grad_norm else 1.0
            lr = s.current_lr
            s.step += 1
            bias_correction1 = 1 - self.beta1 ** s.step
            bias_correction2 = 1 - self.beta2 ** s.step
            for p, m, v in zip(s.params, s.exp_avg, s.exp_avg_sq):
                params.append(p)
                grads.append(p.grad if p.grad is not None else torch.zeros_like(p))
                exp_avg.append(m)
                exp_avg_sq.append(v)
                clip.append(coef)
                decay.append(1 - lr * s.weight_decay)
                step_size.append(-(lr / bias_correction1))
                bc2_sqrt.append(math.sqrt(bias_correction2))

        with torch.no_grad():
            if any(c != 1.0 for c in clip):
                torch._foreach_mul_(grads, clip)
            if any(d != 1.0 for d in decay):
                torch._foreach_mul_(params, decay)
            torch._foreach_lerp_(exp_avg, grads, 1 - self.beta1)
            torch._foreach_mul_(exp_avg_sq, self.beta2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, 1 - self.beta2)
            denom = torch._foreach_sqrt(exp_avg_sq)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(params, exp_avg, denom, step_size)

    def zero_grad(self, names: list[str]) -> None:
        for n in names:
            for p in self.adapters[n].params:
                p.grad = None

    def state_dict(self, name: str) -> dict:
        s = self.adapters[name]
        return {"step": s.step, "exp_avg": [t.detach().cpu() for t in s.exp_avg],
                "exp_avg_sq": [t.detach().cpu() for t in s.exp_avg_sq]}

    def load_state_dict(self, name: str, state: dict) -> None:
        s = self.adapters[name]
        s.step = int(state["step"])
        for dst, src in zip(s.exp_avg + s.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
            dst.copy_(src)
