"""Hopper GEMMs written in Gluon, with an optional rank-16 LoRA term: the probes behind
`gemm_schedule.py`'s `gluon*` variants (KERNELS_NOTES v28).

Triton's pipeliner loads a persistent GEMM's next tile under this one's epilogue only when
the tile and K loops are flattened into one, and then only while the loop holds one dot: a
LoRA dot after or before the K steps stops it pipelining at all (KERNELS_NOTES v27). Gluon
leaves the schedule to the kernel. Two schedules:

- `_gluon_gemm_kernel`: one counter runs over every (tile, K step) a program owns; the load
  for step c + STAGES - 1 is issued as the MMA of step c starts, whichever tile either
  belongs to. The same warps load and multiply, and every load issue costs a barrier of the
  whole block: 1.25-1.29x cuBLAS's time.
- `_gluon_ws_gemm_kernel`: warp-specialised. One warp loads every step's operands into a
  ring of STAGES buffers as the eight MMA warps free them, running ahead across tiles; the
  MMA warps only wait, multiply and store. 0.98-1.04x cuBLAS, with the LoRA term or without.

The LoRA term's two small operands (S's rows [BLOCK_M, 16] and L's columns [16, BLOCK_N])
have a buffer of their own, and their MMA is one more asynchronous wgmma on the tile's
accumulator, after the K steps (LORA=1) or before them (LORA=2). The tile leaves through
TMA, and the program waits for that store only when it next needs the buffer. The library's
kernel (`kernels/lora_gemm_gluon.py`) is the warp-specialised schedule with the layer's
tables, masks and bias.

Hopper only (wgmma, TMA, mbarriers); Gluon kernels do not run under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

# the library kernel's tile order and TMA descriptors: the probes walk tiles as it does
from lora_sweep.kernels.lora_gemm_gluon import _desc, _pair, _tma_load, _tma_store

LORA_RANK = 16


@gluon.jit
def _issue_step_load(step, k_steps, n_programs, num_pid_m, num_pid_n, a_desc, w_desc, a_bufs, w_bufs, ready,
                     pred, FORWARD: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Start the TMA loads of flat step `step` (its tile's K step) into buffer step % STAGES."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0] if FORWARD else w_desc.block_type.shape[1]
    pm, pn = _pair(step // k_steps, n_programs, num_pid_m, num_pid_n, GROUP_M)
    k = (step % k_steps) * BLOCK_K
    buf = step % STAGES
    bar = ready.index(buf)
    mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
    _tma_load(a_desc, [pm * BLOCK_M, k], bar, a_bufs.index(buf), pred)
    if FORWARD:  # W [N, K]: Y = x @ W^T
        _tma_load(w_desc, [pn * BLOCK_N, k], bar, w_bufs.index(buf), pred)
    else:  # W^T stored [K, N]
        _tma_load(w_desc, [k, pn * BLOCK_N], bar, w_bufs.index(buf), pred)


@gluon.jit
def _issue_lora_load(idx, n_tiles, n_programs, num_pid_m, num_pid_n, s_desc, l_desc, s_buf, l_buf, lora_bar,
                     GROUP_M: gl.constexpr):
    """Start the loads of the program's idx-th tile's LoRA operands, if it has that tile."""
    BLOCK_M: gl.constexpr = s_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = l_desc.block_type.shape[1]
    pm, pn = _pair(idx, n_programs, num_pid_m, num_pid_n, GROUP_M)
    pred = idx < n_tiles
    mbarrier.expect(lora_bar, s_desc.block_type.nbytes + l_desc.block_type.nbytes, pred=pred)
    _tma_load(s_desc, [pm * BLOCK_M, 0], lora_bar, s_buf, pred)
    _tma_load(l_desc, [0, pn * BLOCK_N], lora_bar, l_buf, pred)


@gluon.jit
def _gluon_gemm_kernel(a_desc, w_desc, c_desc, s_desc, l_desc, M, N, K, n_programs, FORWARD: gl.constexpr,
                       LORA: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    # the wgmma accumulator: 8 warps stacked along M, one 16 x BLOCK_N x 16 instruction each
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])

    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    s_buf = gl.allocate_shared_memory(dtype, s_desc.block_type.shape, s_desc.layout)
    l_buf = gl.allocate_shared_memory(dtype, l_desc.block_type.shape, l_desc.layout)
    lora_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(lora_bar, count=1)

    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    n_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), n_programs)
    k_steps = gl.cdiv(K, BLOCK_K)
    n_steps = n_tiles * k_steps

    # the first STAGES - 1 steps' loads, and the first tile's LoRA operands
    for i in gl.static_range(STAGES - 1):
        _issue_step_load(i, k_steps, n_programs, num_pid_m, num_pid_n, a_desc, w_desc, a_bufs, w_bufs, ready,
                         i < n_steps, FORWARD, STAGES, GROUP_M)
    if LORA:
        _issue_lora_load(0, n_tiles, n_programs, num_pid_m, num_pid_n, s_desc, l_desc, s_buf, l_buf, lora_bar,
                         GROUP_M)

    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    step = 0
    for idx in range(n_tiles):
        if LORA == 2:  # the term first: it opens the accumulator
            mbarrier.wait(lora_bar, idx & 1)
            acc = warpgroup_mma(s_buf, l_buf, acc, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # blocks on nothing: a tensor again
        for ki in range(k_steps):
            use_acc = (ki > 0) | (LORA == 2)
            buf = step % STAGES
            mbarrier.wait(ready.index(buf), (step // STAGES) & 1)
            w_op = w_bufs.index(buf).permute((1, 0)) if FORWARD else w_bufs.index(buf)
            acc = warpgroup_mma(a_bufs.index(buf), w_op, acc, use_acc=use_acc, is_async=True)
            # at most this MMA in flight: the previous step's buffer is free for the load
            # STAGES - 1 steps ahead, of this tile or the next
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            nxt = step + STAGES - 1
            _issue_step_load(nxt, k_steps, n_programs, num_pid_m, num_pid_n, a_desc, w_desc, a_bufs, w_bufs, ready,
                             nxt < n_steps, FORWARD, STAGES, GROUP_M)
            step += 1
        if LORA == 1:  # the term last, on the finished K steps
            mbarrier.wait(lora_bar, idx & 1)
            acc = warpgroup_mma(s_buf, l_buf, acc, use_acc=True, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if LORA:  # the operands were read: load the next tile's
            _issue_lora_load(idx + 1, n_tiles, n_programs, num_pid_m, num_pid_n, s_desc, l_desc, s_buf, l_buf,
                             lora_bar, GROUP_M)
        pm, pn = _pair(idx, n_programs, num_pid_m, num_pid_n, GROUP_M)
        out = acc.to(dtype)
        tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
        c_smem.store(out)
        fence_async_shared()
        _tma_store(c_desc, [pm * BLOCK_M, pn * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(lora_bar)


def gluon_gemm(a, w, out, forward, n_sms, s, lt, lora=0, block_m=128, block_n=256, block_k=64, stages=3,
               group_m=8, warps=8):
    """out = a @ w^T (forward, w [N, K]) or a @ w (w [K, N]), plus s @ lt where lora is 1 (the
    term after the K steps) or 2 (before them); s [M, 16], lt [16, N], all bf16 (read only
    where lora is set, but the descriptors need them)."""
    M, K = a.shape
    N = out.shape[1]
    grid = min(n_sms, triton.cdiv(M, block_m) * triton.cdiv(N, block_n))
    _gluon_gemm_kernel[(grid, )](
        _desc(a, [block_m, block_k]), _desc(w, [block_n, block_k] if forward else [block_k, block_n]),
        _desc(out, [block_m, block_n]), _desc(s, [block_m, LORA_RANK]), _desc(lt, [LORA_RANK, block_n]),
        M, N, K, grid, FORWARD=forward, LORA=lora, STAGES=stages, GROUP_M=group_m, num_warps=warps)


# ---- the same GEMM warp-specialised: one warp loads, the other eight multiply and store ----

@gluon.jit
def _ws_load_partition(a_desc, w_desc, s_desc, l_desc, a_bufs, w_bufs, s_buf, l_buf, ready, empty, lora_ready,
                       lora_empty, M, N, K, n_programs, FORWARD: gl.constexpr, LORA: gl.constexpr,
                       GROUP_M: gl.constexpr):
    """The loading warp: every step's operands into the ring of buffers as soon as the MMA
    warps free one, running up to STAGES steps ahead, across tiles; each tile's LoRA
    operands into their own buffer once the previous tile's term has read it."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = l_desc.block_type.shape[1]
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    n_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), n_programs)
    k_steps = gl.cdiv(K, BLOCK_K)
    step = 0
    for idx in range(n_tiles):
        pm, pn = _pair(idx, n_programs, num_pid_m, num_pid_n, GROUP_M)
        for ki in range(k_steps):
            buf = step % STAGES
            mbarrier.wait(empty.index(buf), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(buf)
            mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(a_desc, [pm * BLOCK_M, ki * BLOCK_K], bar, a_bufs.index(buf))
            if FORWARD:
                _tma_load(w_desc, [pn * BLOCK_N, ki * BLOCK_K], bar, w_bufs.index(buf))
            else:
                _tma_load(w_desc, [ki * BLOCK_K, pn * BLOCK_N], bar, w_bufs.index(buf))
            step += 1
            # the LoRA operands after the step loads that come before their use (the tile's
            # last for a term after the K steps, its first for one before), so that waiting
            # for their buffer never holds up the next tile's first steps
            if LORA:
                if ki == (k_steps - 1 if LORA == 1 else 0):
                    mbarrier.wait(lora_empty, (idx & 1) ^ 1)  # barriers start with phase 1 complete
                    mbarrier.expect(lora_ready, s_desc.block_type.nbytes + l_desc.block_type.nbytes)
                    _tma_load(s_desc, [pm * BLOCK_M, 0], lora_ready, s_buf)
                    _tma_load(l_desc, [0, pn * BLOCK_N], lora_ready, l_buf)


@gluon.jit
def _ws_mma_partition(c_desc, a_bufs, w_bufs, s_buf, l_buf, c_smem, ready, empty, lora_ready, lora_empty, M, N, K,
                      n_programs, FORWARD: gl.constexpr, LORA: gl.constexpr, GROUP_M: gl.constexpr,
                      num_warps: gl.constexpr):
    """The MMA warps: each step's wgmma as its operands land, the buffer handed back once
    the wgmma after it has started; the LoRA term; the tile out through TMA."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    dtype: gl.constexpr = c_desc.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_pid_m = gl.cdiv(M, BLOCK_M)
    num_pid_n = gl.cdiv(N, BLOCK_N)
    n_tiles = gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), n_programs)
    k_steps = gl.cdiv(K, BLOCK_K)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    step = 0
    for idx in range(n_tiles):
        if LORA == 2:  # the term first: it opens the accumulator
            mbarrier.wait(lora_ready, idx & 1)
            acc = warpgroup_mma(s_buf, l_buf, acc, use_acc=False, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # blocks on nothing: a tensor again
        for ki in range(k_steps):
            buf = step % STAGES
            mbarrier.wait(ready.index(buf), (step // STAGES) & 1)
            w_op = w_bufs.index(buf).permute((1, 0)) if FORWARD else w_bufs.index(buf)
            acc = warpgroup_mma(a_bufs.index(buf), w_op, acc, use_acc=(ki > 0) | (LORA == 2), is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # the previous step's wgmma is done: its buffer goes back to the loading warp
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
            if LORA == 2:  # and the term before it is done with the LoRA operands
                mbarrier.arrive(lora_empty, pred=ki == 0)
            step += 1
        if LORA == 1:  # the term last, on the finished K steps
            mbarrier.wait(lora_ready, idx & 1)
            acc = warpgroup_mma(s_buf, l_buf, acc, use_acc=True, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        if LORA == 1:
            mbarrier.arrive(lora_empty)
        pm, pn = _pair(idx, n_programs, num_pid_m, num_pid_n, GROUP_M)
        out = acc.to(dtype)
        tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
        c_smem.store(out)
        fence_async_shared()
        _tma_store(c_desc, [pm * BLOCK_M, pn * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _gluon_ws_gemm_kernel(a_desc, w_desc, c_desc, s_desc, l_desc, M, N, K, n_programs, FORWARD: gl.constexpr,
                          LORA: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    s_buf = gl.allocate_shared_memory(dtype, s_desc.block_type.shape, s_desc.layout)
    l_buf = gl.allocate_shared_memory(dtype, l_desc.block_type.shape, l_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    lora_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    lora_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(lora_ready, count=1)
    mbarrier.init(lora_empty, count=1)
    gl.warp_specialize([
        (_ws_mma_partition, (c_desc, a_bufs, w_bufs, s_buf, l_buf, c_smem, ready, empty, lora_ready, lora_empty,
                             M, N, K, n_programs, FORWARD, LORA, GROUP_M, num_warps)),
        (_ws_load_partition, (a_desc, w_desc, s_desc, l_desc, a_bufs, w_bufs, s_buf, l_buf, ready, empty, lora_ready,
                              lora_empty, M, N, K, n_programs, FORWARD, LORA, GROUP_M)),
    ], [1], [40])


def gluon_ws_gemm(a, w, out, forward, n_sms, s, lt, lora=0, block_m=128, block_n=256, block_k=64, stages=3,
                  group_m=8, warps=8, maxnreg=168):
    """As `gluon_gemm`, warp-specialised."""
    M, K = a.shape
    N = out.shape[1]
    grid = min(n_sms, triton.cdiv(M, block_m) * triton.cdiv(N, block_n))
    _gluon_ws_gemm_kernel[(grid, )](
        _desc(a, [block_m, block_k]), _desc(w, [block_n, block_k] if forward else [block_k, block_n]),
        _desc(out, [block_m, block_n]), _desc(s, [block_m, LORA_RANK]), _desc(lt, [LORA_RANK, block_n]),
        M, N, K, grid, FORWARD=forward, LORA=lora, STAGES=stages, GROUP_M=group_m, num_warps=warps, maxnreg=maxnreg)
