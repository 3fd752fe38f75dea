"""AdamW and gradient clipping over every adapter's tensors at once.

Each adapter keeps its own learning rate, schedule, weight decay, step count and clipping
norm. Its weights live in one flat buffer (each layer's `lora_A`/`lora_B` weight is a view
into it), and so do its gradient and its two AdamW moments. The update is then a handful of
`torch._foreach_*` calls over one tensor per adapter, with per-adapter scalar lists: a
packed job of 32 adapters on a 16-layer model steps 32 tensors, not 7,000. The arithmetic is
`torch.optim.AdamW`'s foreach path, term for term, so an adapter updated here matches one
updated alone by torch's AdamW.

`step_on_device` is the same update with every per-step value in a device table, for a
step captured in a CUDA graph: nothing in it reads a value back to the host. Such a graph
reads each adapter's buffers at their addresses, so an adapter may take over the buffers of
one that left (`add(..., storage=)`): the graph then steps it in that one's place.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field
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
    """One adapter's weights, gradient and AdamW moments, each one flat buffer. `params` are
    views into `flat` (its layers' weights); each param's `.grad` is a view into `grad`. With
    `storage` (the state of an adapter that left, of the same parameter shapes and dtype)
    the buffers are that one's, refilled: the weights with `params`' values, the rest zeros."""

    params: list[torch.Tensor]
    lr: float
    schedule: Callable[[int], float]
    weight_decay: float
    max_grad_norm: float | None
    storage: InitVar["AdapterOptState | None"] = None
    flat: torch.Tensor = field(init=False)
    grad: torch.Tensor = field(init=False)
    exp_avg: torch.Tensor = field(init=False)
    exp_avg_sq: torch.Tensor = field(init=False)
    step: int = 0  # optimizer steps taken

    def __post_init__(self, storage):
        # Move the weights into one buffer; the Parameter objects (and the layers holding
        # them) stay the same, only their storage changes.
        with torch.no_grad():
            values = torch.cat([p.detach().reshape(-1) for p in self.params])
            if storage is None:
                self.flat = values
                self.grad, self.exp_avg, self.exp_avg_sq = (torch.zeros_like(values) for _ in range(3))
            else:
                if [p.shape for p in storage.params] != [p.shape for p in self.params] \
                        or storage.flat.dtype != values.dtype:
                    raise ValueError("An adapter takes over only the storage of one of the same parameter shapes "
                                     "and dtype.")
                self.flat, self.grad = storage.flat, storage.grad
                self.exp_avg, self.exp_avg_sq = storage.exp_avg, storage.exp_avg_sq
                self.flat.copy_(values)
                for buffer in (self.grad, self.exp_avg, self.exp_avg_sq):
                    buffer.zero_()
        offset = 0
        for p in self.params:
            n = p.numel()
            p.data = self.flat[offset:offset + n].view_as(p)
            p.grad = self.grad[offset:offset + n].view_as(p)
            offset += n

    @property
    def current_lr(self) -> float:
        return self.lr * self.schedule(self.step)


# Columns of `PackedAdamW.step_on_device`'s table, one row per adapter.
DEVICE_COLS = ("lr", "step", "stepping", "max_grad_norm", "weight_decay")


class PackedAdamW:
    """AdamW (decoupled weight decay) for many adapters, stepped together."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.adapters: dict[str, AdapterOptState] = {}

    def add(self, name: str, params: list[torch.Tensor], lr: float, schedule: Callable[[int], float],
            weight_decay: float, max_grad_norm: float | None, storage: AdapterOptState | None = None) -> None:
        """Take over an adapter's parameters: from here on their storage is one flat buffer
        and their `.grad` views of a flat gradient, zero until a backward adds to it. With
        `storage` (what `remove` returned for an adapter of the same shapes), those buffers."""
        self.adapters[name] = AdapterOptState(list(params), lr, schedule, weight_decay, max_grad_norm or None,
                                              storage)

    def remove(self, name: str) -> AdapterOptState | None:
        """Forget adapter `name`; returns its state (its buffers), if it had one."""
        return self.adapters.pop(name, None)

    def grad_norms(self, names: list[str]) -> torch.Tensor:
        """Each adapter's total gradient L2 norm, [len(names)], one foreach pass."""
        return torch.stack(torch._foreach_norm([self.adapters[n].grad for n in names])).float()

    def step(self, names: list[str], norms: list[float]) -> None:
        """Clip each adapter by its own norm (host values of `grad_norms`, which the engine
        reads anyway to catch non-finite gradients), then one AdamW update for all."""
        if not names:
            return
        states = [self.adapters[n] for n in names]
        clip, decay, step_size, bc2_sqrt = [], [], [], []
        for s, norm in zip(states, norms):
            # as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), at most 1
            clip.append(min(1.0, s.max_grad_norm / (norm + 1e-6)) if s.max_grad_norm else 1.0)
            lr = s.current_lr
            s.step += 1
            decay.append(1 - lr * s.weight_decay)
            step_size.append(-(lr / (1 - self.beta1 ** s.step)))
            bc2_sqrt.append(math.sqrt(1 - self.beta2 ** s.step))
        params, grads = [s.flat for s in states], [s.grad for s in states]
        exp_avg, exp_avg_sq = [s.exp_avg for s in states], [s.exp_avg_sq for s in states]

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

    def step_on_device(self, states: list[AdapterOptState], table: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        """`step` of the adapters whose states are `states`, with the host's per-step values in
        `table` (fp32, [len(states), len(DEVICE_COLS)], on the adapters' device) and nothing
        read back: capturable in a CUDA graph, whose replays may step other adapters in the
        same buffers (`add(..., storage=)`).

        For adapter i, with w its weights, g its gradient and n = ||g||:
            clip_i = min(1, max_grad_norm_i / (n + 1e-6))   (1 without max_grad_norm)
            w *= 1 - lr_i * weight_decay_i                   (AdamW's decoupled decay)
            Adam on clip_i * g at lr_i and step count step_i (torch's fused AdamW, no decay)
            g = 0 after the update
        An adapter whose `stepping` is 0 (inside its accumulation window) keeps its weights,
        moments and gradient; one whose norm or loss (`losses`, [len(states)]) is not finite
        keeps its weights and moments. Returns the gradient norms, [len(states)]."""
        norms = torch.stack(torch._foreach_norm([s.grad for s in states])).float()
        lr, step, stepping, max_norm, weight_decay = table.unbind(1)
        clip = torch.where(max_norm > 0, (max_norm / (norms + 1e-6)).clamp(max=1.0), 1.0)
        finite = torch.isfinite(norms) & torch.isfinite(losses)
        grad_scale = torch.where(finite, 1.0 / clip, 1.0)  # the fused AdamW divides g by it
        skip = ~finite | (stepping == 0)  # the fused AdamW leaves an adapter alone where 1
        decay = torch.where(skip, 1.0, 1.0 - lr * weight_decay)
        torch._foreach_mul_([s.flat for s in states], list(decay.unbind(0)))
        skip = skip.float()
        for i, s in enumerate(states):
            torch._fused_adamw_([s.flat], [s.grad], [s.exp_avg], [s.exp_avg_sq], [], [step[i]], lr=lr[i],
                                beta1=self.beta1, beta2=self.beta2, weight_decay=0.0, eps=self.eps,
                                amsgrad=False, maximize=False, grad_scale=grad_scale[i], found_inf=skip[i])
        keep = 1.0 - stepping
        torch._foreach_mul_([s.grad for s in states], list(keep.unbind(0)))
        return norms

    @staticmethod
    def fill_device_row(s: AdapterOptState, stepping: bool, row) -> None:
        """The row of `step_on_device`'s table (a writable sequence of len(DEVICE_COLS) floats)
        of the adapter whose state is `s`, for the coming micro-step."""
        row[:] = (s.current_lr, s.step + 1, 1.0, s.max_grad_norm or 0.0, s.weight_decay) if stepping \
            else (0.0, 1.0, 0.0, 0.0, 0.0)

    def count_step(self, names: list[str]) -> None:
        """Record an optimizer step that `step_on_device` took for each of `names`."""
        for n in names:
            self.adapters[n].step += 1

    def add_grads(self, name: str, grads: list[torch.Tensor]) -> None:
        """Add one gradient per parameter (in `params` order) to the adapter's gradient."""
        torch._foreach_add_([p.grad for p in self.adapters[name].params], grads)

    def zero_grad(self, names: list[str]) -> None:
        for n in names:
            self.adapters[n].grad.zero_()

    def state_dict(self, name: str) -> dict:
        s = self.adapters[name]
        return {"step": s.step, "exp_avg": s.exp_avg.detach().cpu().clone(),
                "exp_avg_sq": s.exp_avg_sq.detach().cpu().clone()}

    def load_state_dict(self, name: str, state: dict) -> None:
        s = self.adapters[name]
        s.step = int(state["step"])
        s.exp_avg.copy_(state["exp_avg"])
        s.exp_avg_sq.copy_(state["exp_avg_sq"])
