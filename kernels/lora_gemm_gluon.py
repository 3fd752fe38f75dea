"""The fused base GEMM of `lora_gemm.py` for Hopper, written in Gluon: one warp loads, eight
multiply, and the LoRA term is one more wgmma on the tile's accumulator.

    Y  = x @ W^T + bias + scale_i * S @ B_i^T                  (forward)
    dX = dY @ W + keep_i / (1 - p_i) * (dS @ A_i)              (backward)

Triton's own pipeliner keeps a persistent GEMM's loads flowing across tiles only while its
loop holds one dot; with the LoRA dot after the K steps it stops pipelining, and the nested
loop the Triton kernel keeps instead pays each tile's pipeline fill and epilogue: 3-6% over
cuBLAS where K is 3584-4096. Here the schedule is written out. A loading warp runs through
every (tile, K step) the program owns and fills a ring of STAGES shared buffers (the "ring")
as the MMA warps free them, so the next tile's first operands arrive under this tile's last
steps and its epilogue. After the K steps it loads the tile's LoRA operands, 16, 32 or 64
ranks at a time (the pack's largest rank, rounded up: `rank_step`): the row block's rows of
S and the adapter's rows of the packed B^T (A). Steps of 16 or 32 ranks go into the output
tile's buffer, idle from the previous tile's store until this tile's epilogue, two steps
ahead (`lora_slots`), so that a block of several adapters loads the next one's while it adds
this one's. Steps of 64, of which that buffer holds one, go through the ring like K steps,
up to STAGES ahead (`lora_in_ring`). The MMA warps mask them (the block's rows of other
adapters, the rank's end: another adapter's values, NaN included, never reach this one's
rows), scale S by scale_i (forward), and add them with one wgmma whose first operand comes
from registers, only as deep as the adapter's ranks left need (16, 32 or the whole step).
The tile leaves through TMA while the next one starts.

dX with dropout masks the LoRA term by the keep-mask the forward shrink stored, which an
accumulator already holding the base product cannot take. So its term comes first: the
loading warp puts its rank steps through the ring ahead of the tile's K steps (the S and A
blocks at the start of a slot's x and W buffers), the MMA warps add them onto zeros, mask
the result, and run the K steps on top. The mask's nibbles (a uint8 of four columns' bits)
are loaded 16 to a thread and handed through shared memory to the threads whose accumulator
columns they cover: loaded where the accumulator holds them, each thread's 128 byte loads
would spill registers.

`lora_gemm` runs it on Hopper (`KernelConfig.gluon_gemm`), where the layer runs faster with
it than with the Triton kernel, at a few thousand tokens and at many, with dropout or
without. Its launch builds five TMA descriptors on the host, the Triton kernel's two.

Gluon kernels do not run under TRITON_INTERPRET=1: CI checks the Triton kernel on the CPU,
and the GPU tests check this one against float64 (`tests/test_fused_ops_gpu.py`). Gluon is
experimental and changes between Triton releases, so this kernel runs only with the releases
it was checked with (`metadata.GLUON_TRITON_RELEASES`, Triton 3.6 to 3.9); others take the
Triton GEMM.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton

from .metadata import ADAPTER_FLOAT_COLS, ADAPTER_INT_COLS, LAUNCH_OPTIONS, LoRABatchMeta, cdiv, gemm_programs

try:  # Gluon's Hopper language, where this Triton has it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.9 renamed three of Gluon's calls that this kernel makes: the TMA copies
    # (async_copy_global_to_shared and async_copy_shared_to_global up to 3.8, which has the
    # new names too) and a shared buffer's view in another shape (_reinterpret up to 3.8).
    # The kernel takes whichever this Triton has; a Triton with neither leaves the kernel
    # out, as one without Gluon does.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _VIEW_RENAMED = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))
except (ImportError, AttributeError):  # pragma: no cover - the Triton path runs instead
    gluon = None


if gluon is not None:
    _RANK = gl.constexpr(ADAPTER_INT_COLS.index("rank"))
    _R_OFFSET = gl.constexpr(ADAPTER_INT_COLS.index("r_offset"))
    _THRESHOLD = gl.constexpr(ADAPTER_INT_COLS.index("keep_threshold"))
    _SCALE = gl.constexpr(ADAPTER_FLOAT_COLS.index("scale"))
    _INV_KEEP = gl.constexpr(ADAPTER_FLOAT_COLS.index("inv_keep"))
    _N_INT = gl.constexpr(len(ADAPTER_INT_COLS))
    _N_FLOAT = gl.constexpr(len(ADAPTER_FLOAT_COLS))

    @gluon.jit
    def _view(buf, shape: gl.constexpr, desc):
        """The shared buffer `buf` seen as `shape` of `desc`'s blocks (its dtype and layout)."""
        if _VIEW_RENAMED:
            return buf.reinterpret(desc.dtype, shape, desc.layout)
        else:
            return buf._reinterpret(desc.dtype, shape, desc.layout)

    @gluon.jit
    def _wait_for_previous_kernel(PDL: gl.constexpr):
        """Programmatic dependent launch: block until the kernel before this one (the one that
        wrote S or dS) has finished and its writes are visible."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)

    @gluon.jit
    def _pair(i, n_programs, n_blocks, num_pid_n, GROUP_M: gl.constexpr):
        """(row block, column block) of the program's i-th (row block, column block) pair: pairs
        go to programs round robin, in groups of GROUP_M row blocks (as `_grouped_tile`)."""
        t = gl.program_id(0) + i * n_programs
        num_pid_in_group = GROUP_M * num_pid_n
        first_block = (t // num_pid_in_group) * GROUP_M
        group_size = gl.minimum(n_blocks - first_block, GROUP_M)
        return first_block + ((t % num_pid_in_group) % group_size), (t % num_pid_in_group) // group_size

    @gluon.jit
    def _program_work(N, K, n_blocks, n_programs, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """The program's share of the work, which both partitions walk in step (a difference
        would leave one waiting on a barrier the other never signals): the column blocks,
        the (row block, column block) pairs it owns and the K steps of each."""
        num_pid_n = gl.cdiv(N, BLOCK_N)
        return num_pid_n, gl.cdiv(n_blocks * num_pid_n - gl.program_id(0), n_programs), gl.cdiv(K, BLOCK_K)

    @gluon.jit
    def _tile(tiles_ptr, adapters_i_ptr, adapters_f_ptr, tile):
        """One tile of a row block: its rows [row_start, row_end) and its adapter's rank, row
        offset in the packed adapters and scale."""
        adapter = gl.load(tiles_ptr + tile * 3)
        row_start = gl.load(tiles_ptr + tile * 3 + 1).to(gl.int32)
        row_end = gl.load(tiles_ptr + tile * 3 + 2).to(gl.int32)
        rank = gl.load(adapters_i_ptr + adapter * _N_INT + _RANK).to(gl.int32)
        r_offset = gl.load(adapters_i_ptr + adapter * _N_INT + _R_OFFSET).to(gl.int32)
        scale = gl.load(adapters_f_ptr + adapter * _N_FLOAT + _SCALE)
        return row_start, row_end, rank, r_offset, scale

    @gluon.jit
    def _tile_dropout(tiles_ptr, adapters_i_ptr, adapters_f_ptr, tile):
        """A tile's adapter's dropout: whether it drops (keep threshold > 0) and 1 / (1 - p)."""
        adapter = gl.load(tiles_ptr + tile * 3)
        drops = gl.load(adapters_i_ptr + adapter * _N_INT + _THRESHOLD) > 0
        return drops, gl.load(adapters_f_ptr + adapter * _N_FLOAT + _INV_KEEP)

    @gluon.jit
    def _load_lora_steps(s_desc, l_desc, s_dst, l_dst, ready, empty, block_tiles_ptr, tiles_ptr, adapters_i_ptr,
                         adapters_f_ptr, block, row0, n0, step, SLOTS: gl.constexpr, L_FIRST: gl.constexpr,
                         STRIDE: gl.constexpr):
        """The row block's LoRA operands, one rank step a slot, as `_add_lora_steps` takes them:
        each tile's rows of S (dS) into `s_dst.index(slot * STRIDE)`, its adapter's rows of the
        packed B^T (A) into `l_dst.index(L_FIRST + slot * STRIDE)`, slot `step % SLOTS`, once
        `empty` says the MMA warps are done with it. Through the ring: the start of a slot's x
        (dY) and W buffers; else the output tile's buffer's two halves. Returns the next step."""
        R_STEP: gl.constexpr = s_desc.block_type.shape[1]
        for tile in range(gl.load(block_tiles_ptr + block).to(gl.int32),
                          gl.load(block_tiles_ptr + block + 1).to(gl.int32)):
            _, _, rank, r_offset, _ = _tile(tiles_ptr, adapters_i_ptr, adapters_f_ptr, tile)
            for r0 in range(0, rank, R_STEP):
                slot = step % SLOTS
                mbarrier.wait(empty.index(slot), ((step // SLOTS) & 1) ^ 1)  # barriers start as if freed once
                bar = ready.index(slot)
                mbarrier.expect(bar, s_desc.block_type.nbytes + l_desc.block_type.nbytes)
                _tma_load(s_desc, [row0, r0], bar, s_dst.index(slot * STRIDE))
                _tma_load(l_desc, [r_offset + r0, n0], bar, l_dst.index(L_FIRST + slot * STRIDE))
                step += 1
        return step

    @gluon.jit
    def _load_partition(a_desc, w_desc, s_desc, l_desc, a_bufs, w_bufs, s_bufs, l_bufs, s_ring, l_ring, ready, empty,
                        lora_ready, lora_empty, c_free, block_tiles_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr, N,
                        K, n_blocks, n_programs, FORWARD: gl.constexpr, OUT_DROPOUT: gl.constexpr,
                        GROUP_M: gl.constexpr, PDL: gl.constexpr, LORA_IN_RING: gl.constexpr):
        """The loading warp: each step's x (dY) and W blocks into the ring as the MMA warps free
        a buffer, up to STAGES steps ahead and across tiles, and the tile's LoRA operands
        through the same ring, one rank step per slot: after its K steps (LORA_IN_RING), or
        before them with OUT_DROPOUT. Without LORA_IN_RING they go after the K steps into the
        output tile's buffer instead, once the previous tile's store has left it."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        LORA_SLOTS: gl.constexpr = lora_ready.type.shape[0]
        R_STEP: gl.constexpr = s_desc.block_type.shape[1]
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = l_desc.block_type.shape[1]
        RING_STRIDE: gl.constexpr = BLOCK_K // R_STEP  # a ring slot's views: one rank step's S and L at its start
        L_HALF: gl.constexpr = l_bufs.type.shape[0] // 2  # the output buffer's second half: its slots of L
        num_pid_n, n_pairs, k_steps = _program_work(N, K, n_blocks, n_programs, BLOCK_N, BLOCK_K)
        step = 0
        lora_step = 0
        for i in range(n_pairs):
            block, pid_n = _pair(i, n_programs, n_blocks, num_pid_n, GROUP_M)
            row0 = block * BLOCK_M
            n0 = pid_n * BLOCK_N
            if OUT_DROPOUT:
                _wait_for_previous_kernel(PDL)  # it wrote dS (returns at once after the first time)
                step = _load_lora_steps(s_desc, l_desc, s_ring, l_ring, ready, empty, block_tiles_ptr, tiles_ptr,
                                        adapters_i_ptr, adapters_f_ptr, block, row0, n0, step, STAGES, 0, RING_STRIDE)
            for ki in range(k_steps):
                buf = step % STAGES
                mbarrier.wait(empty.index(buf), ((step // STAGES) & 1) ^ 1)  # barriers start as if freed once
                bar = ready.index(buf)
                mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                _tma_load(a_desc, [row0, ki * BLOCK_K], bar, a_bufs.index(buf))
                if FORWARD:  # W [N, K]
                    _tma_load(w_desc, [n0, ki * BLOCK_K], bar, w_bufs.index(buf))
                else:  # W [K, N]
                    _tma_load(w_desc, [ki * BLOCK_K, n0], bar, w_bufs.index(buf))
                step += 1
            if not OUT_DROPOUT:
                # x (dY) and W were written before the kernel before this one started; S (dS) is
                # that kernel's output (returns at once after the first time)
                _wait_for_previous_kernel(PDL)
                if LORA_IN_RING:
                    step = _load_lora_steps(s_desc, l_desc, s_ring, l_ring, ready, empty, block_tiles_ptr, tiles_ptr,
                                            adapters_i_ptr, adapters_f_ptr, block, row0, n0, step, STAGES, 0,
                                            RING_STRIDE)
                else:
                    mbarrier.wait(c_free, i & 1)  # the previous tile's store has left the output buffer
                    lora_step = _load_lora_steps(s_desc, l_desc, s_bufs, l_bufs, lora_ready, lora_empty,
                                                 block_tiles_ptr, tiles_ptr, adapters_i_ptr, adapters_f_ptr, block,
                                                 row0, n0, lora_step, LORA_SLOTS, L_HALF, 1)

    @gluon.jit
    def _lora_wgmma(acc, s_view, l_view, rows, r0, rank, scale, s_layout: gl.constexpr, l_layout: gl.constexpr,
                    FORWARD: gl.constexpr):
        """acc + S's ranks r0.. times L's rows of them, as many as the views are wide (K): S's
        block rows of this tile only (`rows`), its ranks only (the columns past them are not
        written), in the forward times scale_i in fp32 and rounded back as the Triton kernel
        does; L's rows past the rank, the next adapter's, zeroed. Returns once the wgmma is done."""
        K: gl.constexpr = s_view.type.shape[1]
        offs_r = gl.arange(0, K, layout=gl.SliceLayout(0, s_layout))
        st = s_view.load(s_layout)
        st = gl.where(rows[:, None] & (r0 + offs_r < rank)[None, :], st, 0.0)
        if FORWARD:
            st = (st.to(gl.float32) * scale).to(st.dtype)
        if rank - r0 < K:
            offs_lr = gl.arange(0, K, layout=gl.SliceLayout(1, l_layout))
            lt = l_view.load(l_layout)
            l_view.store(gl.where((r0 + offs_lr < rank)[:, None], lt, 0.0))
            fence_async_shared()
        acc = warpgroup_mma(st, l_view, acc, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

    @gluon.jit
    def _add_lora_step(acc, s_view, l_view, rows, r0, rank, scale, s_layout: gl.constexpr, l_layout: gl.constexpr,
                       FORWARD: gl.constexpr):
        """acc + rank step r0 of a tile's LoRA term, its operands in shared memory (`_lora_wgmma`).
        A step holding 16 or 32 ranks or fewer multiplies only those (its first 16 or 32 columns
        of S and rows of L): in a pack of mixed ranks the step is the largest rank's, up to 64,
        and an adapter of rank 8 or 16 would otherwise pay a 64-deep wgmma and zero 64 rows of L
        in shared memory on every tile."""
        R_STEP: gl.constexpr = s_view.type.shape[1]
        if R_STEP == 64:
            if rank - r0 <= 16:
                acc = _lora_wgmma(acc, s_view.slice(0, 16, dim=1), l_view.slice(0, 16, dim=0), rows, r0, rank, scale,
                                  s_layout, l_layout, FORWARD)
            elif rank - r0 <= 32:
                acc = _lora_wgmma(acc, s_view.slice(0, 32, dim=1), l_view.slice(0, 32, dim=0), rows, r0, rank, scale,
                                  s_layout, l_layout, FORWARD)
            else:
                acc = _lora_wgmma(acc, s_view, l_view, rows, r0, rank, scale, s_layout, l_layout, FORWARD)
        elif R_STEP == 32:
            if rank - r0 <= 16:
                acc = _lora_wgmma(acc, s_view.slice(0, 16, dim=1), l_view.slice(0, 16, dim=0), rows, r0, rank, scale,
                                  s_layout, l_layout, FORWARD)
            else:
                acc = _lora_wgmma(acc, s_view, l_view, rows, r0, rank, scale, s_layout, l_layout, FORWARD)
        else:
            acc = _lora_wgmma(acc, s_view, l_view, rows, r0, rank, scale, s_layout, l_layout, FORWARD)
        fence_async_shared()  # our reads of the buffer before the loader's next TMA write
        return acc

    @gluon.jit
    def _add_lora_steps(acc, s_src, l_src, ready, empty, rows, rank, scale, step, s_layout: gl.constexpr,
                        l_layout: gl.constexpr, FORWARD: gl.constexpr, SLOTS: gl.constexpr, L_FIRST: gl.constexpr,
                        STRIDE: gl.constexpr):
        """acc + one tile's LoRA term, a rank step a slot as `_load_lora_steps` put them there,
        each slot handed back once added. Returns acc and the next step."""
        R_STEP: gl.constexpr = s_src.type.shape[2]
        for r0 in range(0, rank, R_STEP):
            slot = step % SLOTS
            mbarrier.wait(ready.index(slot), (step // SLOTS) & 1)
            acc = _add_lora_step(acc, s_src.index(slot * STRIDE), l_src.index(L_FIRST + slot * STRIDE), rows, r0,
                                 rank, scale, s_layout, l_layout, FORWARD)
            mbarrier.arrive(empty.index(slot))
            step += 1
        return acc, step

    @gluon.jit
    def _mma_partition(c_desc, a_bufs, w_bufs, s_bufs, l_bufs, s_ring, l_ring, c_smem, ready, empty, lora_ready,
                       lora_empty, c_free, bias_ptr, mask_ptr, block_tiles_ptr, tiles_ptr, adapters_i_ptr,
                       adapters_f_ptr, M, N, K, n_blocks, n_groups, n_programs, FORWARD: gl.constexpr,
                       OUT_DROPOUT: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr, PDL: gl.constexpr,
                       LORA_IN_RING: gl.constexpr, num_warps: gl.constexpr):
        """The MMA warps: the K steps' wgmmas as their operands land, each buffer handed back
        once the wgmma after it has started; the block's LoRA terms, masked to their tiles;
        the bias; the tile out through TMA. With OUT_DROPOUT the LoRA terms come first, from
        the ring, and are masked by the forward's keep-mask before the K steps add to them."""
        STAGES: gl.constexpr = a_bufs.type.shape[0]
        LORA_SLOTS: gl.constexpr = lora_ready.type.shape[0]
        R_STEP: gl.constexpr = s_bufs.type.shape[2]
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        RING_STRIDE: gl.constexpr = BLOCK_K // R_STEP  # a ring slot's views: one rank step's S and L at its start
        L_HALF: gl.constexpr = l_bufs.type.shape[0] // 2  # the output buffer's second half: its slots of L
        dtype: gl.constexpr = c_desc.dtype
        # the accumulator: the warps stacked along M, one 16 x BLOCK_N x 16 wgmma each
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        s_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
        l_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        bias_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])  # a value or two per thread
        num_pid_n, n_pairs, k_steps = _program_work(N, K, n_blocks, n_programs, BLOCK_N, BLOCK_K)
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        offs_am = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
        # the keep-mask (OUT_DROPOUT): its [BLOCK_M, BLOCK_N // 4] nibbles as loaded, and the
        # accumulator's layout seen as [BLOCK_M, BLOCK_N // 4 nibbles, 4 bits]
        nibble_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [num_warps, 1], [1, 0])
        offs_nm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, nibble_layout))
        offs_ng = gl.arange(0, BLOCK_N // 4, layout=gl.SliceLayout(0, nibble_layout))
        bit_layout: gl.constexpr = gl.reshape(gl.zeros([BLOCK_M, BLOCK_N], gl.int32, acc_layout),
                                              [BLOCK_M, BLOCK_N // 4, 4]).type.layout
        offs_bit = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, bit_layout)))
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        step = 0
        lora_step = 0
        for i in range(n_pairs):
            block, pid_n = _pair(i, n_programs, n_blocks, num_pid_n, GROUP_M)
            row0 = block * BLOCK_M
            n0 = pid_n * BLOCK_N
            if HAS_BIAS:  # loaded before the K steps, which hide its latency; added after them
                offs_b = n0 + gl.arange(0, BLOCK_N, layout=bias_layout)
                bias = gl.load(bias_ptr + offs_b, mask=offs_b < N, other=0.0)
            if OUT_DROPOUT:
                # The masked term first, onto zeros: masked after the K steps it would need an
                # accumulator of its own. Writing the accumulator here does not serialise the
                # wgmmas, as adding the bias into it after the K steps does (checked in the SASS).
                acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
                row_factor = gl.full((BLOCK_M, ), 1.0, gl.float32, layout=gl.SliceLayout(1, acc_layout))
                dropped = offs_am < 0  # rows whose adapter has dropout
                for tile in range(gl.load(block_tiles_ptr + block).to(gl.int32),
                                  gl.load(block_tiles_ptr + block + 1).to(gl.int32)):
                    row_start, row_end, rank, _, scale = _tile(tiles_ptr, adapters_i_ptr, adapters_f_ptr, tile)
                    drops, inv_keep = _tile_dropout(tiles_ptr, adapters_i_ptr, adapters_f_ptr, tile)
                    rows = (row0 + offs_m >= row_start) & (row0 + offs_m < row_end)
                    acc_rows = (row0 + offs_am >= row_start) & (row0 + offs_am < row_end)
                    row_factor = gl.where(acc_rows, inv_keep, row_factor)
                    dropped = dropped | (acc_rows & drops)
                    acc, step = _add_lora_steps(acc, s_ring, l_ring, ready, empty, rows, rank, scale, step, s_layout,
                                                l_layout, FORWARD, STAGES, 0, RING_STRIDE)
                # The keep-mask: the tile's nibbles read 16 to a thread, handed to the threads whose
                # accumulator columns they cover (through shared memory), each column's bit
                # shifted out. The forward stored no mask for rows without dropout: they keep
                # every column.
                groups = n0 // 4 + offs_ng
                nibbles = gl.load(mask_ptr + (row0 + offs_nm).to(gl.int64)[:, None] * n_groups + groups[None, :],
                                  mask=(row0 + offs_nm < M)[:, None] & (groups < n_groups)[None, :], other=0)
                nibbles = gl.convert_layout(nibbles, gl.SliceLayout(2, bit_layout)).to(gl.int32)
                bits = (gl.expand_dims(nibbles, 2) >> gl.expand_dims(gl.expand_dims(offs_bit, 0), 1)) & 1
                keep = (gl.convert_layout(gl.reshape(bits, [BLOCK_M, BLOCK_N]), acc_layout) != 0) | \
                    (dropped == 0)[:, None]
                acc = gl.where(keep, acc * row_factor[:, None], 0.0)
            first_use: gl.constexpr = 0 if OUT_DROPOUT else 1  # the first K step onto the accumulator
            for ki in range(k_steps):
                buf = step % STAGES
                mbarrier.wait(ready.index(buf), (step // STAGES) & 1)
                w_op = w_bufs.index(buf).permute((1, 0)) if FORWARD else w_bufs.index(buf)
                acc = warpgroup_mma(a_bufs.index(buf), w_op, acc, use_acc=ki >= first_use, is_async=True)
                # at most this wgmma in flight: the previous step's buffer goes back to the loader
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=ki > 0)
                if not OUT_DROPOUT and not LORA_IN_RING:
                    if ki == gl.minimum(2, k_steps - 1):  # a few steps in, the previous tile's store is out:
                        tma.store_wait(pendings=0)  # its buffer can take this tile's LoRA operands
                        mbarrier.arrive(c_free)
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
            if not OUT_DROPOUT:  # the term after the K steps: from the ring, or from the output tile's buffer
                for tile in range(gl.load(block_tiles_ptr + block).to(gl.int32),
                                  gl.load(block_tiles_ptr + block + 1).to(gl.int32)):
                    row_start, row_end, rank, _, scale = _tile(tiles_ptr, adapters_i_ptr, adapters_f_ptr, tile)
                    rows = (row0 + offs_m >= row_start) & (row0 + offs_m < row_end)
                    if LORA_IN_RING:
                        acc, step = _add_lora_steps(acc, s_ring, l_ring, ready, empty, rows, rank, scale, step,
                                                    s_layout, l_layout, FORWARD, STAGES, 0, RING_STRIDE)
                    else:
                        acc, lora_step = _add_lora_steps(acc, s_bufs, l_bufs, lora_ready, lora_empty, rows, rank, scale,
                                                         lora_step, s_layout, l_layout, FORWARD, LORA_SLOTS, L_HALF, 1)
            if HAS_BIAS:
                # into new registers: ptxas serialises every wgmma of the kernel (a wait after each)
                # once other instructions write the accumulator's registers
                bias_n = gl.convert_layout(bias, gl.SliceLayout(0, acc_layout)).to(gl.float32)
                out = (acc + bias_n[None, :]).to(dtype)
            else:
                out = acc.to(dtype)
            # before any store: the kernel before may still read memory that `out` reuses
            _wait_for_previous_kernel(PDL)
            tma.store_wait(pendings=0)  # the previous tile's store has left c_smem
            c_smem.store(out)
            fence_async_shared()
            _tma_store(c_desc, [row0, n0], c_smem)  # rows and columns past the edge dropped
        tma.store_wait(pendings=0)

    @gluon.jit(do_not_specialize=["M", "n_blocks", "n_programs"])  # per-step ints: metadata.py
    def _lora_gemm_gluon_kernel(a_desc, w_desc, c_desc, s_desc, l_desc, bias_ptr, mask_ptr, block_tiles_ptr,
                                tiles_ptr, adapters_i_ptr, adapters_f_ptr, M, N, K, n_blocks, n_groups, n_programs,
                                FORWARD: gl.constexpr, OUT_DROPOUT: gl.constexpr, HAS_BIAS: gl.constexpr,
                                STAGES: gl.constexpr, GROUP_M: gl.constexpr, PDL: gl.constexpr,
                                LORA_SLOTS: gl.constexpr, LORA_IN_RING: gl.constexpr, num_warps: gl.constexpr):
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
        # the LoRA operands live in the output tile's buffer, idle between a tile's store and its
        # epilogue: S's rows in its first half, the adapter's rows of B^T (A) in its second, one
        # rank step in each of LORA_SLOTS slots (two fit up to 32 ranks a step), so that a
        # tile's next step (its block's next adapter) loads while the MMA warps add this one
        BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
        R_STEP: gl.constexpr = s_desc.block_type.shape[1]
        # (slot i: s_bufs.index(i), l_bufs.index(l_bufs.type.shape[0] // 2 + i))
        s_bufs = _view(c_smem, [BLOCK_N // R_STEP, BLOCK_M, R_STEP], s_desc)
        l_bufs = _view(c_smem, [BLOCK_M // R_STEP, R_STEP, BLOCK_N], l_desc)
        # with OUT_DROPOUT they go through the ring instead, ahead of the K steps: a rank step's S
        # and L at the start of a slot's x (dY) and W buffers, slot b at index b * BLOCK_K // R_STEP
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        s_ring = _view(a_bufs, [STAGES * BLOCK_K // R_STEP, BLOCK_M, R_STEP], s_desc)
        l_ring = _view(w_bufs, [STAGES * BLOCK_K // R_STEP, R_STEP, BLOCK_N], l_desc)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        lora_ready = gl.allocate_shared_memory(gl.int64, [LORA_SLOTS, 1], mbarrier.MBarrierLayout())
        lora_empty = gl.allocate_shared_memory(gl.int64, [LORA_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(LORA_SLOTS):
            mbarrier.init(lora_ready.index(i), count=1)
            mbarrier.init(lora_empty.index(i), count=1)
        c_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(c_free, count=1)
        gl.warp_specialize([
            (_mma_partition, (c_desc, a_bufs, w_bufs, s_bufs, l_bufs, s_ring, l_ring, c_smem, ready, empty, lora_ready,
                              lora_empty, c_free, bias_ptr, mask_ptr, block_tiles_ptr, tiles_ptr, adapters_i_ptr,
                              adapters_f_ptr, M, N, K, n_blocks, n_groups, n_programs, FORWARD, OUT_DROPOUT, HAS_BIAS,
                              GROUP_M, PDL, LORA_IN_RING, num_warps)),
            (_load_partition, (a_desc, w_desc, s_desc, l_desc, a_bufs, w_bufs, s_bufs, l_bufs, s_ring, l_ring, ready,
                               empty, lora_ready, lora_empty, c_free, block_tiles_ptr, tiles_ptr, adapters_i_ptr,
                               adapters_f_ptr, N, K, n_blocks, n_programs, FORWARD, OUT_DROPOUT, GROUP_M, PDL,
                               LORA_IN_RING)),
        ], [1], [40])


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple, dtype: torch.dtype):
    """The swizzled shared layout of a TMA block, built once: building it costs more host time
    than the descriptor itself."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def _desc(t: torch.Tensor, block: list[int]) -> "TensorDescriptor":
    return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block), t.dtype))


# the launch: one loading warp beside NUM_WARPS MMA warps, at most MAX_REGISTERS a thread
TILE_N, TILE_K, STAGES, NUM_WARPS, MAX_REGISTERS = 256, 64, 3, 8, 168


def rank_step(max_rank: int) -> int:
    """Ranks per LoRA step (the S and L blocks' width): the pack's largest rank, rounded up to
    16, 32 or 64 (a wgmma's K is 16)."""
    return 16 if max_rank <= 16 else 32 if max_rank <= 32 else 64


# buffers of the unmasked LoRA term's operands in the output tile's buffer, where they fit
LORA_BUFFERS = 2


def lora_slots(r_step: int, block_m: int) -> int:
    """Buffers of the unmasked LoRA term's operands: `LORA_BUFFERS`, or as many as fit where
    fewer do. S's [block_m, r_step] blocks share one half of the output tile's buffer
    ([block_m, TILE_N]), L's [r_step, TILE_N] blocks the other."""
    fits = min(TILE_N // (2 * r_step), block_m // (2 * r_step))
    return max(1, min(LORA_BUFFERS, fits))


def lora_in_ring(r_step: int, block_m: int) -> bool:
    """Whether the unmasked LoRA term's operands go through the K steps' ring of shared
    buffers rather than the output tile's buffer: where that buffer holds one rank step only
    (`lora_slots`), so that a tile's second step would wait for its load after the first."""
    return lora_slots(r_step, block_m) == 1


def launch_descriptors(a, w, out, s, pack, forward: bool, block_m: int, r_step: int) -> tuple:
    """The kernel's five TMA descriptors, in its argument order: x (dY), W, the output, S
    (dS) and the packed B^T (A), in blocks of TILE_N output columns, TILE_K of K and
    r_step ranks."""
    return (_desc(a, [block_m, TILE_K]), _desc(w, [TILE_N, TILE_K] if forward else [TILE_K, TILE_N]),
            _desc(out, [block_m, TILE_N]), _desc(s, [block_m, r_step]), _desc(pack, [r_step, TILE_N]))


def spare_sms(meta: LoRABatchMeta, n_cols: int) -> int:
    """SMs that the GEMM's grid (`metadata.gemm_programs`) leaves free for its whole run, over an
    output of `n_cols` columns in `meta`'s layout."""
    return meta.sm_count - gemm_programs(meta.n_blocks * cdiv(n_cols, TILE_N), meta.sm_count)


def lora_gemm_gluon(
    a: torch.Tensor,  # [M, K] contiguous: x or dY
    w: torch.Tensor,  # [N, K] (forward) or [K, N] (backward)
    bias: Optional[torch.Tensor],  # [N]
    s: torch.Tensor,  # [M, meta.rank_stride]: S or dS
    lora_pack: torch.Tensor,  # [R_total, N]: packed B^T (forward) or A (backward)
    out: torch.Tensor,  # [M, N], written
    meta: LoRABatchMeta,
    forward: bool,
    mask_nibbles: Optional[torch.Tensor] = None,  # dX with dropout: the forward's keep-mask, uint8 [M, ceil(N / 4)]
    programs: Optional[int] = None,  # persistent programs; None: `metadata.gemm_programs`
) -> torch.Tensor:
    """`lora_gemm`'s fused path on Hopper: 16-bit operands that TMA can describe (`tma_ready`),
    blocks 128 x 256 x 64, 3 stages, 8 MMA warps and one loading warp, at most one program per
    SM, as few as finish as soon (`metadata.gemm_programs`)."""
    if gluon is None:
        raise RuntimeError(f"Triton {triton.__version__} has no Gluon language this kernel can use; "
                           "set KernelConfig.gluon_gemm=False (`config_for`'s choice there) to take the Triton GEMM.")
    cfg = meta.config
    M, K = a.shape
    N = out.shape[1]
    n_pairs = meta.n_blocks * cdiv(N, TILE_N)
    grid = programs or gemm_programs(n_pairs, meta.sm_count)
    r_step = rank_step(meta.max_rank)
    # an empty pack still needs a descriptor: one zero row of the right width, never read
    pack = lora_pack if lora_pack.shape[0] else lora_pack.new_zeros(1, N)
    if mask_nibbles is not None:
        assert mask_nibbles.is_contiguous() and mask_nibbles.shape == (M, cdiv(N, 4))
    _lora_gemm_gluon_kernel[(grid, )](
        *launch_descriptors(a, w, out, s, pack, forward, cfg.block_m, r_step), bias if bias is not None else out,
        mask_nibbles if mask_nibbles is not None else out,
        *meta.block_args()[:4], M, N, K, meta.n_blocks, cdiv(N, 4), grid, FORWARD=forward,
        OUT_DROPOUT=mask_nibbles is not None, HAS_BIAS=bias is not None, STAGES=STAGES, GROUP_M=cfg.group_m,
        PDL=cfg.pdl, LORA_SLOTS=lora_slots(r_step, cfg.block_m), LORA_IN_RING=lora_in_ring(r_step, cfg.block_m),
        num_warps=NUM_WARPS,
        maxnreg=MAX_REGISTERS, launch_pdl=cfg.pdl, **LAUNCH_OPTIONS)
    return out
