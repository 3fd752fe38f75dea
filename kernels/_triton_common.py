"""Device helpers shared by the multi-LoRA kernels: the tile/chunk and adapter table readers, the dropout
keep-mask and its stored copy. Not kernels themselves; each kernel file imports what it
needs.

The keep-mask is drawn once, by the forward shrink, which also stores it as "nibbles": one
uint8 holding four bits, one per column of a group of four ([tokens, ceil(in / 4)], bit w =
column 4 g + w, the layout Philox draws them in, so storing and loading need no shuffles).
Philox costs more than reading x itself, and the backward needs the mask twice (dA and dX).

The per-adapter table is laid out by `metadata.LoRABatchMeta` (column indices there).
"""

import triton
import triton.language as tl


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With programmatic dependent launch (PDL: a kernel launched with `launch_pdl=True` on
    Hopper may start while the kernel before it in the stream still runs), wait until that
    kernel has finished and its writes are visible. Before this a kernel may read only what
    was written before the previous kernel started, and may write nothing."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_kernel_start(PDL: tl.constexpr):
    """With PDL, let the next kernel in the stream start early, on the SMs this one leaves
    free. Called only after `wait_for_previous_kernel`, so that whatever started early can
    rely on everything before this kernel having finished."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def load_row_block(table_ptr, i):
    """Row i of a tile or chunk table (metadata.TILE_COLS): (adapter, first row, end row),
    global rows, as int32."""
    adapter = tl.load(table_ptr + i * 3).to(tl.int32)
    row_start = tl.load(table_ptr + i * 3 + 1).to(tl.int32)
    row_end = tl.load(table_ptr + i * 3 + 2).to(tl.int32)
    return adapter, row_start, row_end


# Rank blocks of a program: powers of two from MIN_RANK_BLOCK (Triton's dot needs 16) up to
# the pack's block (at most 128, `metadata.rank_blocks`), so RANK_BLOCK_SIZES sizes at most.
MIN_RANK_BLOCK = tl.constexpr(16)
RANK_BLOCK_SIZES = tl.constexpr(4)


@triton.jit
def fit_rank_block(rank_left, BLOCK_R: tl.constexpr):
    """The smallest rank block from MIN_RANK_BLOCK up to BLOCK_R (powers of two) that holds
    `rank_left` columns, or BLOCK_R if none does: an adapter's own rank block in a pack whose
    largest one is BLOCK_R. Programs branch on it to a body compiled for each size."""
    fit = tl.full((), BLOCK_R, tl.int32)
    for halvings in tl.static_range(1, RANK_BLOCK_SIZES):
        if (BLOCK_R >> halvings) >= MIN_RANK_BLOCK:
            fit = tl.where(rank_left <= (BLOCK_R >> halvings), BLOCK_R >> halvings, fit)
    return fit


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
def keep_nibbles(seed, rows, col0, n_cols, threshold, BLOCK_COLS: tl.constexpr):
    """The dropout keep-mask for columns col0 .. col0 + BLOCK_COLS of the int64 segment rows
    `rows` (col0 and BLOCK_COLS multiples of 4), one int32 [rows.shape[0], BLOCK_COLS // 4]
    nibble per group of four columns: bit w of group g keeps column 4 g + w.

    Word `col % 4` of Philox (`tl.randint4x`) at counter `row * ceil(n_cols / 4) + col // 4`,
    folded to 31 bits as `tl.rand` folds it, kept iff >= `threshold`.
    `dropout.dropout_keep_mask` reproduces it bit for bit in torch.
    """
    groups = (n_cols + 3) // 4
    counters = rows[:, None] * groups + (col0 // 4 + tl.arange(0, BLOCK_COLS // 4))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, counters)
    return ((_fold31(r0) >= threshold).to(tl.int32) | ((_fold31(r1) >= threshold).to(tl.int32) << 1)
            | ((_fold31(r2) >= threshold).to(tl.int32) << 2) | ((_fold31(r3) >= threshold).to(tl.int32) << 3))


@triton.jit
def nibbles_to_mask(nibbles, BLOCK_COLS: tl.constexpr):
    """The bool keep-mask [rows, BLOCK_COLS] of `keep_nibbles`' [rows, BLOCK_COLS // 4]."""
    k0 = (nibbles & 1) != 0
    k1 = (nibbles & 2) != 0
    k2 = (nibbles & 4) != 0
    k3 = (nibbles & 8) != 0
    # [rows, groups, 2, 2] with [..., t, s] = bit 2t + s, so the row-major reshape puts bit w at 4 * group + w
    keep = tl.join(tl.join(k0, k2), tl.join(k1, k3))
    return tl.reshape(keep, (nibbles.shape[0], BLOCK_COLS))


@triton.jit
def keep_mask(seed, rows, col0, n_cols, threshold, BLOCK_COLS: tl.constexpr):
    """The bool keep-mask [rows.shape[0], BLOCK_COLS] drawn by `keep_nibbles`."""
    return nibbles_to_mask(keep_nibbles(seed, rows, col0, n_cols, threshold, BLOCK_COLS), BLOCK_COLS)


@triton.jit
def store_nibbles(nibbles_ptr, nibbles, rows, row_mask, col0, n_groups, BLOCK_COLS: tl.constexpr):
    """Store `keep_nibbles`' output as uint8 at rows `rows` (int64, global) of the [*, n_groups]
    nibble matrix, groups col0 // 4 ..: the forward keeps its mask for the backward."""
    offs_g = col0 // 4 + tl.arange(0, BLOCK_COLS // 4)
    tl.store(nibbles_ptr + rows[:, None] * n_groups + offs_g[None, :], nibbles.to(tl.uint8),
             mask=row_mask[:, None] & (offs_g < n_groups)[None, :])


@triton.jit
def load_keep_mask(nibbles_ptr, rows, row_mask, col0, n_groups, BLOCK_COLS: tl.constexpr):
    """The bool keep-mask [rows.shape[0], BLOCK_COLS] from the nibbles `store_nibbles` stored.

    Each nibble is copied to its four columns and each column shifts its own bit out: the
    mask then comes out in the layout of a plain [rows, BLOCK_COLS] load, and only the small
    nibble tile changes layout. Joining the four bits back (`nibbles_to_mask`) gives a layout
    of its own, into which the compiler converts the x tile it masks through shared memory on
    every row step. The forward shrink draws its nibbles from Philox in registers and joins
    them (`keep_mask`): spread there, it runs slower."""
    offs_g = col0 // 4 + tl.arange(0, BLOCK_COLS // 4)
    nibbles = tl.load(nibbles_ptr + rows[:, None] * n_groups + offs_g[None, :],
                      mask=row_mask[:, None] & (offs_g < n_groups)[None, :], other=0).to(tl.int32)
    spread = tl.broadcast_to(nibbles[:, :, None], (nibbles.shape[0], BLOCK_COLS // 4, 4))
    spread = tl.reshape(spread, (nibbles.shape[0], BLOCK_COLS))
    return ((spread >> (tl.arange(0, BLOCK_COLS) % 4)[None, :]) & 1) != 0


@triton.jit
def _fold31(r):
    r = r.to(tl.int32, bitcast=True)
    return tl.where(r < 0, ~r, r)


