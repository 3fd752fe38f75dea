"""The packed multi-LoRA linear on the Triton kernels, as one autograd Function.

LoRAFusion's split at the rank-r tensor S, per call:

    forward   S  = dropout(x) @ A_i^T                       shrink.py     (mask from the seed, kept)
              Y  = x @ W^T + bias + scale_i * S @ B_i^T      lora_gemm.py  (one output write)
    backward  dS = scale_i * dY @ B_i                        shrink.py     } or both in one pass
              dB = scale_i * dY_i^T @ S_i                    row_reduce.py } over dY: ds_db.py
              dA = dS_i^T @ dropout(x_i)                     row_reduce.py (mask kept by the shrink)
              dX = dY @ W + mask_i / (1 - p_i) * (dS @ A_i)  lora_gemm.py

Saved for backward: x, S ([tokens, rank] in x's dtype), the dropout keep-mask (drawn once,
by the forward shrink; a bit per column, four to a uint8 "nibble": 1/8 of x's size), the
packed adapters and the routing tables; no dropped x. W and bias are frozen: no gradient is ever computed for them.
Each adapter's A and B enter the Function as inputs of their own and are packed into the
compute dtype inside it (`pack.pack_adapters`); the backward writes all dA into one buffer and all
dB into another and hands each adapter a view of its slice. Autograd then records one node
per call and each parameter's gradient accumulation, with no cat or reshape nodes between
them: host time, which is what bounds a call at a few thousand tokens.

Captured in a CUDA graph, the backward queues dA (and dB, where it takes its own pass over
dY) on a second stream: nothing on the way to dX needs them, and at a few thousand tokens
each is a fraction of a wave that would otherwise run alone.

Where the Gluon GEMM's grid leaves SMs spare and they can stream every tile in time, the
shrink before it runs "beside" it: on those SMs, at the same time (`beside_programs`); dS
beside dX then leaves dB a pass over dY of its own.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .dropout import empty_mask_nibbles
from .metadata import KernelConfig, LoRABatchMeta, cdiv, config_for, fuses_base, tma_ready
from .reference import Seeds, per_adapter_seeds


def _check_inputs(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens):
    n = len(seg_lens)
    if not (len(lora_a) == len(lora_b) == len(scales) == len(dropout_p) == n):
        raise ValueError("lora_a, lora_b, scales, dropout_p and seg_lens must have one entry per adapter.")
    if any(int(s) < 0 for s in seg_lens) or sum(int(s) for s in seg_lens) != x.shape[0]:
        raise ValueError(f"seg_lens must be >= 0 and sum to x's {x.shape[0]} rows, got {list(seg_lens)}.")
    out_f, in_f = weight.shape
    if x.dim() != 2 or x.shape[1] != in_f:
        raise ValueError(f"x must be [tokens, {in_f}], got {tuple(x.shape)}.")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight ({weight.dtype}) and x ({x.dtype}) must share a dtype on the Triton path.")
    dtypes = set()
    for i, (a, b) in enumerate(zip(lora_a, lora_b)):
        if (a is None) != (b is None):
            raise ValueError(f"Adapter {i}: `lora_a` and `lora_b` must both be None or both be tensors.")
        if a is None:
            continue
        r = a.shape[0]
        if a.shape != (r, in_f) or b.shape != (out_f, r) or r < 1:
            raise ValueError(f"Adapter {i}: expected A [r, {in_f}] and B [{out_f}, r], "
                             f"got {tuple(a.shape)} and {tuple(b.shape)}.")
        dtypes |= {a.dtype, b.dtype}
    if len(dtypes) > 1:
        raise TypeError(f"All adapters must share one dtype, got {sorted(map(str, dtypes))}.")


def _fuses_gemm(a, weight, meta) -> bool:
    """Whether the GEMM of `a` by `weight` is the fused one (else cuBLAS, then the LoRA term
    added in place): where the config says so and TMA can read the operands."""
    return meta.config.fused_base and tma_ready(a, weight)


# Rows a program beside the GEMM may stream (`beside_programs`): of x and adapter for S, and
# fewer of dY and adapter for dS, since beside dX the one pass over dY gives way to two.
BESIDE_ROWS = 576
BESIDE_ROWS_DS = 512


def beside_programs(meta: LoRABatchMeta, n_cols: int, forward: bool) -> int:
    """Programs of a shrink beside the Gluon GEMM of `n_cols` output columns in `meta`'s layout,
    S's before Y (`forward`) or dS's before dX, or 0: the SMs the GEMM's grid leaves spare
    (`lora_gemm_gluon.spare_sms`), where they can shrink every tile within about one tile's K
    loop of the GEMM, which is when the GEMM's first tiles wait for S (or dS).

    Each of them streams its share of the (tile, rank block) items, a block of block_m rows
    of x (dY) and one of block_r adapter rows per K step, at what one SM can stream; one
    tile's K loop of the GEMM reads K columns too, at one SM's share of the matmul rate. So
    whatever K, the items per program times (block_m + block_r) must stay within a budget:
    `BESIDE_ROWS` for S, about the break-even, and `BESIDE_ROWS_DS` for dS, lower since
    beside dX the pass over dY that gives dS and dB together (ranks up to 16) gives way to
    two. At 2048 tokens of 4 adapters of rank 16 on 4 spare SMs (576 rows each) the layer
    runs faster; at rank 64 (768 rows each) slower."""
    from .lora_gemm_gluon import spare_sms

    spare = spare_sms(meta, n_cols)
    items = meta.n_tiles * cdiv(meta.max_rank, meta.block_r)
    if not (spare and items):
        return 0
    budget = BESIDE_ROWS if forward else BESIDE_ROWS_DS
    return spare if cdiv(items, spare) * (meta.config.block_m + meta.block_r) <= budget else 0


def _shrink_beside(a, weight, meta, forward) -> int:
    """`beside_programs` for the shrink that writes S (forward) or dS before the GEMM of `a` by
    `weight`, where that GEMM is the Gluon one and launched with PDL, else 0: the shrink
    before it, a program per output block. Not with dropout: the forward shrink's mask draw
    runs at a third of its speed on whole tiles, and dX adds its masked LoRA term before its
    K loop."""
    from .lora_gemm import takes_gluon

    if not (meta.config.pdl and a.is_cuda) or meta.has_dropout:
        return 0
    if not (_fuses_gemm(a, weight, meta) and takes_gluon(a, meta)):
        return 0
    return beside_programs(meta, weight.shape[0] if forward else weight.shape[1], forward)


def _base_plus_lora(a, weight, bias, s, lora_pack, meta, forward, mask_nibbles=None):
    """Y = x W^T + b + LoRA (forward) or dX = dY W + LoRA (backward): the base GEMM fused with
    the LoRA term (`_fuses_gemm`), else cuBLAS and the LoRA term added in place."""
    from .lora_gemm import lora_gemm

    fused = _fuses_gemm(a, weight, meta)
    if fused:
        out = a.new_empty(a.shape[0], weight.shape[0] if forward else weight.shape[1])
    else:
        out = F.linear(a, weight, bias) if forward else a @ weight
        bias = None
    return lora_gemm(a, weight, bias, s, lora_pack, out, meta, forward=forward, fused_base=fused,
                     mask_nibbles=mask_nibbles)


class _TritonMultiLoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, meta: LoRABatchMeta, *adapters):
        # adapters: A_0.. then B_0.. of the adapters with rows (meta.ranks > 0), in order
        from .pack import pack_adapters
        from .shrink import lora_shrink

        x = x.contiguous()
        n = len(adapters) // 2
        if n:
            a_pack, bt_pack = pack_adapters(adapters[:n], adapters[n:], x.dtype)
        else:  # no LoRA rows at all: the kernels have nothing to read
            a_pack, bt_pack = x.new_empty(0, x.shape[1]), x.new_empty(0, weight.shape[0])
        s = torch.empty(x.shape[0], meta.rank_stride, device=x.device, dtype=x.dtype)  # (tokens, rank)
        mask_nibbles = empty_mask_nibbles(x.shape[0] if meta.has_dropout else 0, x.shape[1], x.device)
        lora_shrink(x, a_pack, s, meta, apply_scale=False, dropout=True, mask_nibbles=mask_nibbles,
                    programs=_shrink_beside(x, weight, meta, forward=True))
        y = _base_plus_lora(x, weight, bias, s, bt_pack, meta, forward=True)
        ctx.save_for_backward(x, weight, s, a_pack, bt_pack, mask_nibbles)
        ctx.meta = meta
        ctx.grad_dtype = adapters[0].dtype if n else x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        from .ds_db import lora_ds_and_db
        from .row_reduce import lora_row_reduce
        from .shrink import lora_shrink

        x, weight, s, a_pack, bt_pack, mask_nibbles = ctx.saved_tensors
        meta = ctx.meta
        dy = dy.contiguous()
        ds = torch.empty_like(s)  # (tokens, rank)
        wants_dx = ctx.needs_input_grad[0]
        beside = _shrink_beside(dy, weight, meta, forward=False) if wants_dx else 0
        adapter_grads = [None] * (len(ctx.needs_input_grad) - 4)
        dx = None
        if not any(ctx.needs_input_grad[4:]):
            lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False, programs=beside)
        else:
            # every dB_i [out, r_i] one after another in one flat buffer, every dA_i [r_i, in]
            # stacked in another: each adapter's gradient is a contiguous view. (In a frame's
            # layout a segment may have no rows: no kernel writes its adapter's gradient.)
            db = torch.empty(dy.shape[1] * meta.r_total, device=x.device, dtype=ctx.grad_dtype)
            da = torch.empty(meta.r_total, x.shape[1], device=x.device, dtype=ctx.grad_dtype)
            # A second stream costs the host about 0.1 ms a call in events and switches: more
            # than it saves the GPU where a call is launched eagerly at a few thousand tokens,
            # whose host time bounds it. A CUDA graph pays that once.
            if wants_dx and dy.is_cuda and torch.cuda.is_current_stream_capturing():
                dx = _dx_with_adapter_grads_beside(x, dy, weight, s, ds, a_pack, bt_pack, mask_nibbles, da, db,
                                                   meta, beside)
            elif beside:  # dS beside the dX GEMM; then dB, in a pass over dY of its own, and dA
                lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False, programs=beside)
                dx = _base_plus_lora(dy, weight, None, ds, a_pack, meta, forward=False, mask_nibbles=mask_nibbles)
                lora_row_reduce(dy, s, db, meta, out_is_b=True)
                lora_row_reduce(x, ds, da, meta, out_is_b=False, mask_nibbles=mask_nibbles)
            else:
                lora_ds_and_db(dy, s, bt_pack, ds, db, meta)
                lora_row_reduce(x, ds, da, meta, out_is_b=False, mask_nibbles=mask_nibbles)
            ranks = [r for r in meta.ranks if r]
            db_blocks = db.split([dy.shape[1] * r for r in ranks])
            adapter_grads = [*da.split(ranks), *(g.view(dy.shape[1], r) for g, r in zip(db_blocks, ranks))]

        if wants_dx and dx is None:  # not already computed with the adapter gradients
            dx = _base_plus_lora(dy, weight, None, ds, a_pack, meta, forward=False, mask_nibbles=mask_nibbles)
        return dx, None, None, None, *adapter_grads


def _dx_with_adapter_grads_beside(x, dy, weight, s, ds, a_pack, bt_pack, mask_nibbles, da, db, meta, beside):
    """The backward with dA and dB on a second stream, under a CUDA graph: nothing on the way
    to dX needs them. dA runs beside the dX GEMM; dB, where it takes a
    pass over dY of its own (ranks above 16), beside the dS shrink. Each is queued after the
    kernel it runs beside, so that that kernel's programs take the SMs first and the
    reduction fills what its last wave leaves idle. Where the dS shrink itself runs beside
    the GEMM on `beside` programs (`_shrink_beside`), dB takes a pass of its own and waits
    for the shrink too, so that it does not take the SMs the shrink runs on. Writes dS, dA
    and dB; returns dX."""
    from .ds_db import lora_ds_and_db
    from .row_reduce import lora_row_reduce
    from .shrink import lora_shrink

    main, side = torch.cuda.current_stream(dy.device), _side_stream(dy.device)
    if beside:
        lora_shrink(dy, bt_pack, ds, meta, apply_scale=True, dropout=False, programs=beside)
    else:
        dy_ready = main.record_event()
        # dB needs only dY and S: where it takes its own pass over dY, it goes beside the dS shrink
        lora_ds_and_db(dy, s, bt_pack, ds, db, meta, db_pass=lambda: _beside(side, dy_ready))
    ds_ready = main.record_event()
    dx = _base_plus_lora(dy, weight, None, ds, a_pack, meta, forward=False, mask_nibbles=mask_nibbles)
    with _beside(side, ds_ready):
        if beside:
            lora_row_reduce(dy, s, db, meta, out_is_b=True)
        lora_row_reduce(x, ds, da, meta, out_is_b=False, mask_nibbles=mask_nibbles)
    main.wait_stream(side)  # before anything reads the gradients or reuses the buffers they read
    return dx


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The second stream of the backward's adapter gradients on `device`, one per process."""
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def _beside(side: torch.cuda.Stream, after: torch.cuda.Event):
    """Queue the block's kernels on `side`, to start once `after` is reached. Tensors the
    block allocates come from `side`'s memory; those it reads must outlive its kernels,
    which the caller's join (`wait_stream`) before returning ensures."""
    side.wait_event(after)
    with torch.cuda.stream(side):
        yield


def triton_multi_lora_linear(
    x: torch.Tensor,  # [tokens, in], adapters' rows contiguous in adapter order
    weight: torch.Tensor,  # [out, in], frozen
    bias: Optional[torch.Tensor],  # [out] or None, frozen
    lora_a: Sequence[Optional[torch.Tensor]],  # each [r_i, in], or None
    lora_b: Sequence[Optional[torch.Tensor]],  # each [out, r_i], or None
    scales: Sequence[float],
    dropout_p: Sequence[float],
    seg_lens: Sequence[int],
    seed: Seeds = 0,
    config: Optional[KernelConfig] = None,
    frame=None,
) -> torch.Tensor:
    """The Triton path of `multi_lora_linear`, on any device Triton runs on (CUDA, or CPU
    tensors under TRITON_INTERPRET=1). `config` overrides the per-shape block sizes; with a
    `frame` (`frame.TableFrame`) the tables are the frame's, which a CUDA graph replays for
    each of its layouts."""
    _check_inputs(x, weight, lora_a, lora_b, scales, dropout_p, seg_lens)
    seg_lens = [int(s) for s in seg_lens]
    # a tensor of seeds (one per adapter, int64, on x's device) is used as it is
    seeds = seed if isinstance(seed, torch.Tensor) and seed.dim() == 1 else per_adapter_seeds(seed, len(seg_lens))
    max_rank = max((a.shape[0] for a in lora_a if a is not None), default=0)
    if config is None:
        config = config_for(max_rank, x.is_cuda, fuses_base(x.device, x.element_size()))
    meta = LoRABatchMeta.build(seg_lens, lora_a, lora_b, scales, dropout_p, seeds,
                               weight.shape[1], weight.shape[0], x.device, config, frame=frame)
    # an adapter with no rows is not packed and gets no gradient (None), as in the reference
    used = [i for i, r in enumerate(meta.ranks) if r]
    return _TritonMultiLoRALinear.apply(x, weight, bias, meta, *(lora_a[i] for i in used),
                                        *(lora_b[i] for i in used))
