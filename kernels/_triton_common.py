"""Device helpers shared by the multi-LoRA kernels: the adapter table reader and the
dropout keep-mask. Not kernels themselves; each kernel file imports what it needs.

The per-adapter table is laid out by `metadata.LoRABatchMeta` (column indices there).
"""

import triton
import triton.language as tl


@triton.jit
def load_adapter(adapters_i_ptr, adapters_f_ptr, seeds_ptr, adapter, N_INT_COLS: tl.constexpr,
                 N_FLOAT_COLS: tl.constexpr):
    """One adapter's row of the tables: (rank, seg_start, seed, keep_threshold, r_offset, scale,
    inv_keep). Column order matches metadata.ADAPTER_INT_COLS / _FLOAT_COLS; the seeds are
    their own vector, since each layer has its own and the rest of the table is shared."""
    base_i = adapters_i_ptr + adapter * N_INT_COLS
    base_f = adapters_f_ptr + adapter * N_FLOAT_COLS
    rank = tl.load(base_i + 0).to(tl.int32)
    seg_start = tl.load(base_i + 1).to(tl.int32)
    seed = tl.load(seeds_ptr + adapter)
    threshold = tl.load(base_i + 2).to(tl.int32)
    r_offset = tl.load(base_i + 3)
    scale = tl.load(base_f + 0)
    inv_keep = tl.load(base_f + 1)
    return rank, seg_start, seed, threshold, r_offset, scale, inv_keep


@triton.jit
def keep_mask(seed, rows, col0, n_cols, threshold, BLOCK_COLS: tl.constexpr):
    """Dropout keep-mask [rows.shape[0], BLOCK_COLS] for columns col0 .. col0 + BLOCK_COLS of
    the int64 segment rows `rows` (col0 and BLOCK_COLS multiples of 4).

    Word `col % 4` of Philox (`tl.randint4x`) at counter `row * ceil(n_cols / 4) + col // 4`,
    folded to 31 bits as `tl.rand` folds it, kept iff >= `threshold`.
    `dropout.dropout_keep_mask` reproduces it bit for bit in torch.
    """
    groups = (n_cols + 3) // 4
    counters = rows[:, None] * groups + (col0 // 4 + tl.arange(0, BLOCK_COLS // 4))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)
    k0 = _fold31(r0) >= threshold
    k1 = _fold31(r1) >= threshold
    k2 = _fold31(r2) >= threshold
    k3 = _fold31(r3) >= threshold
    # [rows, groups, 2, 2] with [..., t, s] = word 2t + s, so the row-major reshape puts word w at 4 * group + w
    keep = tl.join(tl.join(k0, k2), tl.join(k1, k3))
    return tl.reshape(keep, (rows.shape[0], BLOCK_COLS))


@triton.jit
def _fold31(r):
    r = r.to(tl.int32, bitcast=True)
    return tl.where(r < 0, ~r, r)

