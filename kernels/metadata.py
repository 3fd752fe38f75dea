"""Per-microbatch metadata of the multi-LoRA kernels, built on the host once per layout.

The adapters themselves travel packed (`pack.pack_adapters`): adapter i's rows start
at `r_offset` in one [R_total, in] A and one [R_total, out] B^T, so the kernels read them
with plain, aligned, vectorisable loads; the table holds offsets, never pointers.

Tiles never span two adapters (LoRAFusion's tile-level routing): the packed rows are cut
at every adapter's first row and at every multiple of `block_m`, so a tile holds at most
`block_m` rows of one adapter, and every kernel reads from the tile table which adapter,
rows, rank, scale, dropout threshold and seed a tile belongs to. The base GEMM is blind to
adapters and works on row blocks, the `block_m` rows from each multiple of it: a row block
is a run of consecutive tiles (`block_tiles`), and its LoRA term is added tile by tile,
each with its own adapter. So no segment is padded to the tile height: 32 adapters of 64
rows run the GEMM on as many row blocks as one adapter of 2048 rows. Reductions over rows
(dA, dB) use a second table of longer chunks, each inside one adapter.

Integer arguments that follow a step's tokens (`M`, row blocks, programs, tile items) are
passed with `do_not_specialize`. Triton otherwise compiles one variant for a value of 1, one
for multiples of 16 and one for the rest, per such argument: an eager step of a new length
could stop for seconds to compile kernels the job has already compiled for other lengths.
Strides and widths stay specialised: they are fixed for a layer and their alignment makes
loads wider.

Nothing here imports Triton: the CPU reference path never needs it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .dropout import check_dropout_p, keep_threshold, normalize_seed

# Columns of the per-adapter tables, in the order `_triton_common.load_adapter` reads them.
ADAPTER_INT_COLS = ("rank", "seg_start", "keep_threshold", "r_offset", "chunk_first", "chunk_count")
ADAPTER_FLOAT_COLS = ("scale", "inv_keep")
TILE_COLS = ("adapter", "row_start", "row_end")  # the tile and chunk tables


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and path choices of one call: what `config_for` picks for the GPU and the
    pack's largest rank, or `INTERPRET_CONFIG` on the CPU."""

    block_m: int = 128  # rows per tile at most and per row block of the base GEMM, all kernels
    # the base GEMM with the LoRA term in its accumulator (lora_gemm.py); False: cuBLAS's base
    # GEMM, then the LoRA term added in place (`fuses_base` says where the fused one runs)
    fused_base: bool = True
    gemm_block_n: int = 256
    gemm_block_k: int = 64
    gemm_warps: int = 8
    gemm_stages: int = 3
    group_m: int = 8  # row blocks per L2 swizzle group
    # programmatic dependent launch (Hopper on): the fused GEMMs start their K loops while the
    # kernel that writes S or dS still runs, and wait for it only before the LoRA term
    pdl: bool = False
    # the fused GEMMs (Y, dX) in Gluon (lora_gemm_gluon.py), where it runs (`gluon_gemm_runs`):
    # warp-specialised, its loads pipelined across tiles
    gluon_gemm: bool = False
    # the LoRA term added in place to a cuBLAS product (`fused_base=False`)
    add_block_n: int = 128
    add_warps: int = 4
    # shrinks (S = dropout(x) A^T, dS = scale dY B)
    shrink_block_m: int = 64  # rows per shrink program at most (`shrink_blocks` may take fewer); divides block_m
    shrink_block_k: int = 64
    shrink_warps: int = 4
    shrink_stages: int = 3  # pipeline stages of the shrinks, and what `shrink_blocks` sizes their blocks for
    # pipeline stages of a shrink that draws no dropout mask (dS; S where no adapter has
    # dropout): faster than 3 at 16384 tokens; with the mask to draw, 4 gain nothing
    shrink_stages_no_dropout: int = 4
    # a shrink "beside" the Gluon GEMM: a few programs on the SMs that the GEMM's grid leaves
    # spare, running while the GEMM does (`multi_lora.beside_programs`)
    beside_block_k: int = 128  # its K step: its programs take whole tiles
    beside_stages: int = 5  # its pipeline stages at most: as many as fit in shared memory (`beside_stages`)
    # row reductions: dA = dS^T dropout(x) (reduce_*) and dB = scale dY^T S (db_*)
    reduce_block_m: int = 64  # rows per step
    reduce_block_n: int = 64
    reduce_warps: int = 4
    reduce_stages: int = 3  # at most: no more than the longest chunk has row steps (`reduction_stages`)
    reduce_max_block_r: int = 128  # dA's rank block is the pack's, up to this
    db_block_m: int = 64  # dB's rows per step (`db_rows_per_step` may take fewer), and the one pass's
    db_block_n: int = 128
    db_warps: int = 4
    db_max_block_r: int = 64  # dB's rank block is the pack's, up to this
    chunk_rows: int = 1024  # rows per deterministic partial sum at most (`reduce_chunk_rows`); multiple of block_m
    chunk_sum_values: int = 2048  # fp32 accumulator of one program that adds the chunks' partials up
    # dS and dB in one pass over dY (ds_db.py) instead of the dS shrink and the dB reduction
    one_pass_dy: bool = False
    ds_db_block_n: int = 256  # columns of dY per column block
    ds_db_warps: int = 8
    # column blocks per program of the one pass where every chunk is one row step (`ds_db.ds_db_col_group`)
    ds_db_col_group: int = 4


# Interpreter (CPU) blocks: small, so that tests run many tiles, K steps and chunks.
INTERPRET_CONFIG = KernelConfig(block_m=16, gemm_block_n=32, gemm_block_k=32, gemm_warps=4,
                                gemm_stages=1, group_m=2, add_block_n=32, shrink_block_m=16, shrink_block_k=32,
                                reduce_block_m=16, reduce_block_n=32, reduce_max_block_r=32, db_block_m=16,
                                db_block_n=16, db_max_block_r=16, chunk_rows=32, chunk_sum_values=256,
                                one_pass_dy=True, ds_db_block_n=16, beside_block_k=32)

# Where the layout has too few tiles to give every SM a shrink program, a shrink that draws no
# dropout mask splits K between programs (`shrink_k_splits`), each over this many K steps at least.
SHRINK_SPLIT_MIN_STEPS = 4


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host side of the kernels. `triton.cdiv` is a constexpr function in
    recent Triton: each host call unwraps its arguments as constexprs, which costs host time
    on every launch."""
    return -(-a // b)


@functools.lru_cache(maxsize=1)
def gpu_capability() -> tuple[int, int]:
    """The current CUDA device's compute capability, (0, 0) where there is none: what every
    choice here that depends on the GPU's generation reads."""
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def hopper_or_newer() -> bool:
    """Whether the current CUDA device has TMA and programmatic dependent launch (9.0 on)."""
    return gpu_capability() >= (9, 0)


# Compile options of every launch: floating-point contraction (FMA) on, as the defaults here
# were measured. Triton 3.9 defaults to it with a warning that 3.10 will default to off.
LAUNCH_OPTIONS = dict(enable_fp_fusion=True)

# Triton releases whose Gluon language the Gluon GEMM was checked with on a GPU. Gluon is
# experimental and changes between releases (3.8 added new names for the kernel's two TMA
# copies, 3.9 dropped the old ones and renamed a third call; it takes either name), so other
# releases get the Triton GEMM.
GLUON_TRITON_RELEASES = ("3.6", "3.7", "3.8", "3.9")


def gluon_release(release: str) -> bool:
    """Whether Triton `release` (as `triton.__version__`) is one of `GLUON_TRITON_RELEASES`."""
    return any(release == r or release.startswith(r + ".") for r in GLUON_TRITON_RELEASES)


@functools.lru_cache(maxsize=1)
def gluon_gemm_runs() -> bool:
    """Whether the Gluon GEMM can run here: a Hopper GPU (sm_90; its wgmma and register
    budget are Hopper's) and a Triton release it was checked with (`gluon_release`)."""
    if gpu_capability()[0] != 9:
        return False
    try:
        import triton
    except ImportError:
        return False
    return gluon_release(triton.__version__)


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; the interpreter (CPU) counts as 4, so that tests
    see launches of a few programs, each looping over several tiles."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def has_tma(device: torch.device) -> bool:
    """Whether kernels on `device` read through TMA descriptors: on Hopper on, and under the
    interpreter (CPU tensors), which emulates them. Before Hopper, Triton turns a descriptor's
    loads into plain loads that it does not pipeline (tests/test_kernels_compile.py)."""
    return device.type != "cuda" or hopper_or_newer()


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA can read each 2-D tensor: its device has TMA (`has_tma`), its rows are
    contiguous, its row stride and start aligned to 16 bytes (so bf16 widths must be
    multiples of 8)."""
    return all(has_tma(t.device) and t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in tensors)


@functools.lru_cache(maxsize=8)
def shared_memory_per_program(device: torch.device) -> int:
    """Shared memory one program may take on `device`; 144 KiB where torch does not say, and
    on the interpreter."""
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return getattr(props, "shared_memory_per_block_optin", 0) or 144 * 1024


def shrink_stage_bytes(device: torch.device) -> int:
    """Shared memory a shrink program's pipeline buffers may take on `device`: two thirds of
    what one program may use there (Triton keeps some for itself)."""
    return shared_memory_per_program(device) * 2 // 3


def beside_stages(config: KernelConfig, block_r: int, device: torch.device) -> int:
    """Pipeline stages of a shrink beside the GEMM (`multi_lora.beside_programs`): as many as
    fit, up to `config.beside_stages`, with 32 KiB left to Triton. Each of its few programs
    must stream a share of x as fast as one SM can, so it keeps as many bytes in flight as it
    holds."""
    stage = (config.block_m + block_r) * config.beside_block_k * 2  # 16-bit x and adapter blocks
    return max(2, min(config.beside_stages, (shared_memory_per_program(device) - 32 * 1024) // stage))


def shrink_blocks(n_tiles: int, n_rank_blocks: int, block_r: int, config: KernelConfig, n_sms: int,
                  stage_bytes: int, min_rows: int = 16) -> tuple[int, int]:
    """(rows, K step) of one shrink program, for a layout of `n_tiles` tiles of `config.block_m`
    rows and `n_rank_blocks` rank blocks of `block_r` columns, rows halved down to `min_rows`.

    The shrink streams x (or dY) once, one row block per program, and its programs are
    otherwise independent. With few tiles (2048 tokens: 16 tiles of 128 rows, so 32 programs
    of 64 rows on a GPU of 132 SMs) most SMs would sit idle while a few stream the whole
    input. So the rows per program halve, down to 16, until the launch has a program per SM,
    and the K step doubles with them while a program's pipeline buffers (16-bit operands)
    fit in `stage_bytes` (`shrink_stage_bytes`): each program still has as many bytes in
    flight per step.

    Where K may be split instead (a shrink that draws no mask, `shrink_k_splits`), the rows
    stop halving at the rank block: `split_min_rows`.
    """
    bm, bk = config.shrink_block_m, config.shrink_block_k
    while bm > min_rows and n_tiles * (config.block_m // bm) * n_rank_blocks < n_sms:
        bm //= 2
        if (bm + block_r) * (2 * bk) * 2 * config.shrink_stages <= stage_bytes:
            bk *= 2
    return bm, bk


def split_min_rows(config: KernelConfig, block_r: int) -> int:
    """The fewest rows of a shrink program that draws no dropout mask (`shrink_blocks`), whose K
    may be split over programs instead (`shrink_k_splits`): the rank block, up to
    `config.shrink_block_m`, since a program of fewer rows reads more bytes of its adapter than
    of x."""
    return max(16, min(config.shrink_block_m, block_r))


def shrink_k_splits(n_programs: int, K: int, block_k: int, n_sms: int) -> int:
    """Programs per shrink output block, each over a part of K, for a launch of `n_programs`
    output blocks with rows (`shrink_blocks`' rows) over K columns in steps of `block_k`.

    At 2048 tokens, 4 adapters of rank 64 make 16 tiles: 32 programs of 64 rows on a GPU of
    132 SMs. Halving the rows to 16 fills the SMs, but each program then reads its adapter's
    whole [64, K] block for 16 rows of x or dY. Splitting K instead keeps one adapter byte per
    byte of x: the splits double while the launch still has at most a program per SM and each
    split keeps `SHRINK_SPLIT_MIN_STEPS` K steps. Their fp32 partials cost 4 x rank bytes per
    row per split, against 2 x K bytes per row of x.

    The forward shrink that draws the dropout mask is not split: its draw runs faster on
    shorter row blocks, and the layer is slower with dropout when it splits.
    """
    splits = 1
    while n_programs * splits * 2 <= n_sms and K >= splits * 2 * SHRINK_SPLIT_MIN_STEPS * block_k:
        splits *= 2
    return splits


def gemm_programs(n_pairs: int, n_sms: int) -> int:
    """Programs of the persistent fused GEMM over `n_pairs` (row block, column block) pairs:
    the fewest that give no program more pairs than one program per SM would.

    At 2048 tokens the pairs rarely divide evenly over the SMs: 256 pairs on 132 SMs leave 124
    programs with two and 8 with one, idle for half the GEMM. 128 programs of two finish as
    soon, and leave 4 SMs to other work from the start (`multi_lora.beside_programs`).
    """
    return cdiv(n_pairs, cdiv(n_pairs, n_sms)) if n_pairs else 0


def reduce_chunk_rows(seg_lens: Sequence[int], has_lora: Sequence[bool], programs_per_chunk: int,
                      config: KernelConfig, n_sms: int) -> int:
    """Rows per chunk of the row reductions (dA, dB, the one pass over dY) for a layout whose
    larger reduction grid runs `programs_per_chunk` programs per chunk.

    A reduction runs one program per (chunk, column block) that sums its chunk's rows, and an
    adapter of one chunk gets its gradient written directly. With `config.chunk_rows` rows
    per chunk, 2048 tokens of one adapter make two chunks: at 4096^2 the one pass over dY
    then runs 32 programs and dA 64, on a GPU of 132 SMs. So the rows per chunk halve, down
    to `block_m`, while even the larger grid has fewer programs than half the SMs. Each
    halving costs a second launch per reduction, which adds the partials up, and 4 x rank
    bytes per column per chunk written and read again: halving further, until every SM had a
    program, gained less than the layer lost to those launches.
    """
    def n_chunks(rows):
        return sum(cdiv(int(s), rows) for s, lora in zip(seg_lens, has_lora) if lora)

    rows = config.chunk_rows
    if programs_per_chunk < 1:
        return rows
    while (rows // 2 >= config.block_m and (rows // 2) % config.block_m == 0
           and 2 * n_chunks(rows) * programs_per_chunk < n_sms):
        rows //= 2
    return rows


def reduce_rank_block(config: KernelConfig, block_r: int, out_is_b: bool) -> int:
    """The rank block of a row reduction in a pack whose rank block is `block_r`: the pack's,
    up to `config.db_max_block_r` (dB) or `config.reduce_max_block_r` (dA)."""
    return min(block_r, config.db_max_block_r if out_is_b else config.reduce_max_block_r)


def reduce_grid(config: KernelConfig, n_cols: int, max_rank: int, block_r: int, out_is_b: bool) -> tuple[int, int]:
    """(column blocks, rank blocks) of a row reduction over `n_cols` columns, per chunk, in a
    pack whose largest rank is `max_rank` and rank block `block_r`: dA's or dB's blocks."""
    block_n = config.db_block_n if out_is_b else config.reduce_block_n
    return cdiv(n_cols, block_n), cdiv(max_rank, reduce_rank_block(config, block_r, out_is_b))


def reduction_stages(meta: "LoRABatchMeta", block_m: int) -> int:
    """Pipeline stages of a reduction that steps `block_m` rows through its chunks:
    `config.reduce_stages`, or as many as the longest chunk has row steps where that is fewer.
    At 2048 tokens 32 adapters make chunks of one step, and three stages' buffers would leave
    two unused and hold the pass over dY to two programs an SM."""
    cfg = meta.config
    return max(1, min(cfg.reduce_stages, cdiv(meta.longest_chunk, block_m)))


def db_rows_per_step(meta: "LoRABatchMeta") -> int:
    """Rows per step of dB's reduction: `config.db_block_m`, halved while the layout's longest
    chunk would fit in half a step. A step taller than every chunk loads and multiplies rows
    that belong to no chunk (32 adapters of 64 rows at 2048 tokens)."""
    block_m = meta.config.db_block_m
    while block_m > 16 and meta.longest_chunk <= block_m // 2:
        block_m //= 2
    return block_m


def takes_one_pass(config: KernelConfig, max_rank: int, block_r: int) -> bool:
    """Whether dS and dB come from one pass over dY (`ds_db.py`): where the config takes it
    (`one_pass_dy`) and every rank fits one rank block."""
    return config.one_pass_dy and max_rank <= block_r


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


FUSED_BLOCK_M = 128  # row block of the fused base GEMM: its warpgroup MMA's 128 x 256 tile; 64 rows run slower


def fuses_base(device: torch.device, element_size: int) -> bool:
    """Whether a call's base GEMM is the fused one (`KernelConfig.fused_base`) rather than
    cuBLAS's with the LoRA term added in place. It reads its operands through TMA and keeps
    a 128 x 256 fp32 accumulator, which only a warpgroup MMA holds without spilling:
    Hopper's (9.x) and datacenter Blackwell's (10.x). Compiled for the others (Ampere, Ada,
    consumer Blackwell), it spills or is not pipelined (tests/test_kernels_compile.py). On a
    GPU it takes only 16-bit inputs, since its fp32 dot would run in TF32, where torch's
    does not; the interpreter takes it for every dtype."""
    return device.type != "cuda" or (element_size == 2 and gpu_capability()[0] in (9, 10))


@functools.lru_cache(maxsize=64)
def config_for(max_rank: int, on_cuda: bool, fuse_base: bool = True) -> KernelConfig:
    """Block sizes for a call whose largest adapter rank is `max_rank`, with the base GEMM
    fused with the LoRA term (`fuse_base`, as `fuses_base` decides) or run by cuBLAS: the
    blocks and paths measured fastest on Hopper GPUs, each kernel alone and the whole layer;
    the interpreter gets small blocks (`INTERPRET_CONFIG`)."""
    if not on_cuda:
        return INTERPRET_CONFIG if fuse_base else dataclasses.replace(INTERPRET_CONFIG, fused_base=False)
    block_r = rank_blocks(max(max_rank, 1))[0]
    # - dA and dB alike: 128 columns, 4 warps, 64-row steps, rank blocks of at most 64: faster
    #   for mixed ranks than blocks of 128, and the backward's keep-mask unpacks better on 4
    #   warps than on 8.
    # - the shrinks take 8 warps for rank blocks of 128, 4 below.
    # - dS and dB in one pass over dY where the rank block is 16, faster than two passes. From
    #   rank 32 on, its partial sums of dS cost more than dY's second read.
    shared = dict(shrink_block_m=64, shrink_block_k=64, shrink_warps=4 if block_r <= 64 else 8,
                  reduce_block_m=64, reduce_block_n=128, reduce_warps=4, reduce_max_block_r=64, db_block_m=64,
                  db_block_n=128, db_warps=4, db_max_block_r=64, chunk_rows=1024, one_pass_dy=block_r <= 16,
                  ds_db_block_n=256, ds_db_warps=8)
    if fuse_base:
        # The base GEMM through TMA with the LoRA term in its accumulator (128 x 256 x 64 tiles,
        # 8 warps, 3 stages): a layer's fwd+bwd faster than with cuBLAS plus the in-place add
        # on most shapes; in Gluon on Hopper, and with programmatic dependent launch from
        # Hopper on (`pdl`).
        # The in-place add (for operands TMA cannot read) gets 8 warps for its 128-row tiles:
        # the registers per thread of the 64-row, 4-warp config.
        # dB in 128-row steps where some rank takes two of dB's rank blocks (above 64), cut to
        # the layout's chunks (`db_rows_per_step`): faster for mixed ranks up to 128, no faster
        # at rank 64, slower at 16. Measured on Hopper only; it spills compiled for sm_80.
        return KernelConfig(block_m=FUSED_BLOCK_M, gemm_block_n=256, gemm_block_k=64, gemm_warps=8, gemm_stages=3,
                            fused_base=True, add_block_n=128, add_warps=8, pdl=hopper_or_newer(),
                            gluon_gemm=gluon_gemm_runs(), **dict(shared, db_block_m=128 if block_r > 64 else 64))
    # cuBLAS base GEMMs plus the LoRA term added in place: the adds run faster on 64-row tiles
    # than on 128-row ones.
    return KernelConfig(block_m=64, fused_base=False, add_block_n=128, add_warps=4, **shared)


def rank_blocks(max_rank: int) -> tuple[int, int]:
    """(BLOCK_R of the shrink/reduce outputs, BLOCK_R of the expand's rank loop).

    The output block holds an adapter's whole rank up to 128 (x is read once); the expand
    loops over an adapter's own rank in steps of up to 64, so small ranks are not padded to
    the pack's largest rank there. Triton's dot needs blocks of at least 16.
    """
    return max(16, min(128, _next_pow2(max_rank))), max(16, min(64, _next_pow2(max_rank)))


@dataclass
class LoRABatchMeta:
    """Routing tables of one packed call (see module docstring); build with `build`.

    Everything but `seeds` depends only on the segment layout, the adapters' ranks, scales and
    dropout rates and the layer's shape, so it is built once and shared by every layer of
    that shape in a microbatch; each layer brings its own dropout seeds."""

    tiles: torch.Tensor  # int64 [n_tiles, 3]: adapter, row_start, row_end (global rows)
    block_tiles: torch.Tensor  # int64 [n_blocks + 1]: row block b holds tiles block_tiles[b] .. block_tiles[b + 1]
    chunks: torch.Tensor  # int64 [n_chunks, 3]: same, chunks of up to chunk_rows, LoRA adapters only
    adapters_i: torch.Tensor  # int64 [n_adapters, len(ADAPTER_INT_COLS)]
    adapters_f: torch.Tensor  # fp32 [n_adapters, len(ADAPTER_FLOAT_COLS)]
    n_tiles: int
    n_blocks: int  # row blocks of the base GEMM: ceil(tokens / block_m)
    n_chunks: int
    chunk_rows: int  # rows per chunk at most (`reduce_chunk_rows`)
    longest_chunk: int  # rows of the longest chunk: chunk_rows, or fewer where segments are shorter
    max_chunks_per_adapter: int
    max_rank: int
    rank_stride: int  # row stride of S / dS ([tokens, rank_stride] in x's dtype)
    block_r: int  # shrink / reduce output rank block
    block_r_expand: int  # expand rank-loop step
    shrink_block_m: int  # rows of one program of a shrink that draws no dropout mask (`shrink_blocks`)
    shrink_block_k: int  # its K step
    shrink_programs: int  # its programs with rows and ranks to shrink, K whole (`k_splits`)
    mask_shrink_block_m: int  # rows of one program of the shrink that draws the mask, K never split
    mask_shrink_block_k: int  # its K step
    sm_count: int  # SMs of the device: the shrink's splits of K (`shrink_k_splits`), the pass over dY's column groups
    has_dropout: bool
    ranks: tuple[int, ...]
    r_total: int  # rows of the packed adapters: sum of the ranks of adapters with rows
    config: KernelConfig
    seeds: Optional[torch.Tensor] = None  # int64 [n_adapters]: the calling layer's dropout seeds

    def args(self) -> tuple:
        """Tile-routed kernels' table arguments, in kernel order."""
        return (self.tiles, self.adapters_i, self.adapters_f, self.seeds)

    def k_splits(self, K: int) -> int:
        """Programs per output block of a shrink over K columns that draws no dropout mask
        (`shrink_k_splits`)."""
        return shrink_k_splits(self.shrink_programs, K, self.shrink_block_k, self.sm_count)

    def block_args(self) -> tuple:
        """The base GEMM's table arguments (row blocks, then their tiles), in kernel order."""
        return (self.block_tiles, self.tiles, self.adapters_i, self.adapters_f, self.seeds)

    def chunk_args(self) -> tuple:
        """Row-reduction kernels' table arguments, in kernel order."""
        return (self.chunks, self.adapters_i, self.adapters_f, self.seeds)

    @staticmethod
    def build(
        seg_lens: Sequence[int],
        lora_a: Sequence[Optional[torch.Tensor]],
        lora_b: Sequence[Optional[torch.Tensor]],
        scales: Sequence[float],
        dropout_p: Sequence[float],
        seeds: Union[Sequence[int], torch.Tensor],
        in_features: int,
        out_features: int,
        device: torch.device,
        config: KernelConfig,
        frame=None,
    ) -> "LoRABatchMeta":
        """The tables of one call. The shared part comes from a cache keyed by the layout, or
        from `frame` (a `frame.TableFrame`, whose tables change layout in place); `seeds` is
        one int per adapter, or already an int64 tensor on `device`."""
        scales, dropout_p = tuple(float(s) for s in scales), tuple(float(p) for p in dropout_p)
        if frame is None:
            ranks = tuple(0 if a is None or rows == 0 else int(a.shape[0]) for a, rows in zip(lora_a, seg_lens))
            shared = _shared_tables(tuple(int(s) for s in seg_lens), ranks, scales, dropout_p, in_features,
                                    out_features, torch.device(device), config)
        else:  # every segment of a frame has rows (`TableFrame`), whatever its current length
            ranks = tuple(0 if a is None else int(a.shape[0]) for a in lora_a)
            shared = frame.shared(seg_lens, ranks, scales, dropout_p, in_features, out_features,
                                  torch.device(device), config)
        if not isinstance(seeds, torch.Tensor):
            seeds = _seed_table(tuple(normalize_seed(s) for s in seeds), torch.device(device))
        if seeds.shape != (len(ranks),) or seeds.dtype != torch.int64:
            raise ValueError(f"Expected one int64 seed per adapter ({len(ranks)}), got {tuple(seeds.shape)} "
                             f"{seeds.dtype}.")
        meta = copy.copy(shared)
        meta.seeds = seeds
        return meta


@functools.lru_cache(maxsize=64)
def _shared_tables(seg_lens: tuple, ranks: tuple, scales: tuple, dropout_p: tuple, in_features: int,
                   out_features: int, device: torch.device, config: KernelConfig) -> LoRABatchMeta:
    """Every table of a call but the seeds; cached, since all layers of one shape in a
    microbatch share it (and a model has only a few shapes)."""
    return make_shared_tables(seg_lens, ranks, scales, dropout_p, in_features, out_features, device, config)


def make_shared_tables(seg_lens: tuple, ranks: tuple, scales: tuple, dropout_p: tuple, in_features: int,
                       out_features: int, device: torch.device, config: KernelConfig,
                       frame=None) -> LoRABatchMeta:
    """`_shared_tables`, uncached. With a `frame` (`frame.TableFrame`), the tables are sized
    for any layout the frame admits and every launch choice holds for all of them."""
    bm = config.block_m
    if config.chunk_rows % bm:
        raise ValueError(f"`chunk_rows` ({config.chunk_rows}) must be a multiple of `block_m` ({bm}).")
    max_rank = max(ranks, default=0)
    block_r, block_r_expand = rank_blocks(max(max_rank, 1))
    # the larger of the reduction grids, programs per chunk: dA's, or dB's or the one pass's
    da_programs = math.prod(reduce_grid(config, in_features, max_rank, block_r, out_is_b=False))
    if takes_one_pass(config, max_rank, block_r):
        db_programs = cdiv(out_features, config.ds_db_block_n)
    else:
        db_programs = math.prod(reduce_grid(config, out_features, max_rank, block_r, out_is_b=True))
    has_lora = tuple(r > 0 for r in ranks)
    n_sms = sm_count(device)
    chunk_rows = reduce_chunk_rows(seg_lens, has_lora, max(da_programs, db_programs), config, n_sms)
    if frame is None:  # the layout's own tables, built once and shared by the shapes whose chunks are as long
        routing, (tiles_t, block_tiles_t, chunks_t) = _routing_tables(seg_lens, has_lora, bm, chunk_rows, device)
    else:
        routing = routing_rows(seg_lens, has_lora, bm, chunk_rows)
    tiles, block_tiles, chunks, chunk_first, chunk_count = routing
    tile_rows = [(i, r1 - r0) for i, r0, r1 in tiles]
    rows_i = adapter_int_rows(seg_lens, ranks, dropout_p, chunk_first, chunk_count)
    rows_f = adapter_float_rows(ranks, scales, dropout_p)
    longest_chunk = min(chunk_rows, max((rows for rows, lora in zip(seg_lens, has_lora) if lora), default=0))
    max_chunks_per_adapter = max(chunk_count, default=0)
    if frame is None:
        adapters_i = device_table(rows_i, len(ADAPTER_INT_COLS), torch.int64, device)
        n_tiles = len(tiles)
    else:  # room for the most tiles and chunks of any layout of the frame, in one buffer
        n_tiles, n_chunks = frame.capacity(has_lora, bm, chunk_rows)
        buffer = torch.empty(frame.table_size(n_tiles, n_chunks, len(block_tiles), len(ranks)), dtype=torch.int64,
                             device=device)
        tiles_t, block_tiles_t, chunks_t, adapters_i = frame.views(buffer, n_tiles, n_chunks, len(ranks))
        longest_chunk, max_chunks_per_adapter = frame.longest_chunks(has_lora, chunk_rows)
    stage_bytes, n_rank_blocks = shrink_stage_bytes(device), cdiv(max_rank, block_r)
    mask_m, mask_k = shrink_blocks(n_tiles, n_rank_blocks, block_r, config, n_sms, stage_bytes)
    shrink_m, shrink_k = shrink_blocks(n_tiles, n_rank_blocks, block_r, config, n_sms, stage_bytes,
                                       split_min_rows(config, block_r))
    # programs that shrink something: past a segment's rows or an adapter's rank they return at once
    shrink_programs = sum(cdiv(rows, shrink_m) * cdiv(ranks[i], block_r) for i, rows in tile_rows)

    meta = LoRABatchMeta(
        tiles=tiles_t,
        block_tiles=block_tiles_t,
        chunks=chunks_t,
        adapters_i=adapters_i,
        adapters_f=device_table(rows_f, len(ADAPTER_FLOAT_COLS), torch.float32, device),
        n_tiles=n_tiles,
        n_blocks=len(block_tiles) - 1,
        n_chunks=chunks_t.shape[0],
        chunk_rows=chunk_rows,
        longest_chunk=longest_chunk,
        max_chunks_per_adapter=max_chunks_per_adapter,
        max_rank=max_rank,
        rank_stride=max(16, cdiv(max_rank, 16) * 16),
        block_r=block_r,
        block_r_expand=block_r_expand,
        shrink_block_m=shrink_m,
        shrink_block_k=shrink_k,
        shrink_programs=shrink_programs,
        mask_shrink_block_m=mask_m,
        mask_shrink_block_k=mask_k,
        sm_count=n_sms,
        has_dropout=any(r > 0 and p > 0 for r, p in zip(ranks, dropout_p)),
        ranks=ranks,
        r_total=sum(ranks),
        config=config,
    )
    return meta


def adapter_float_rows(ranks, scales, dropout_p) -> list[tuple]:
    """The per-adapter float table (`ADAPTER_FLOAT_COLS`): scale, and 1 / (1 - p) where it has LoRA."""
    return [(scales[i], 1.0 / (1.0 - (check_dropout_p(dropout_p[i]) if rank else 0.0)))
            for i, rank in enumerate(ranks)]


def adapter_int_rows(seg_lens, ranks, dropout_p, chunk_first, chunk_count) -> list[tuple]:
    """The per-adapter int table (`ADAPTER_INT_COLS`) of a layout. An adapter with no rows is
    not packed and gets no gradient (None), as in the reference: its rank is 0."""
    rows_i = []
    start = r_offset = 0
    for i, (rows, rank) in enumerate(zip(seg_lens, ranks)):
        p = check_dropout_p(dropout_p[i]) if rank else 0.0
        rows_i.append((rank, start, keep_threshold(p), r_offset, chunk_first[i], chunk_count[i]))
        r_offset += rank
        start += rows
    return rows_i


@functools.lru_cache(maxsize=256)
def _seed_table(seeds: tuple, device: torch.device) -> torch.Tensor:
    """Seeds given as ints, on the device: cached, as a copy per call would cost more host
    time than a small kernel (the engine passes a device tensor instead)."""
    return device_table(seeds, 1, torch.int64, device).reshape(-1)


def device_table(rows, width, dtype, device) -> torch.Tensor:
    """A host table (rows of `width` values) as a [len(rows), width] tensor on `device`."""
    return torch.tensor(rows, dtype=dtype).reshape(-1, width).to(device, non_blocking=True)


def routing_rows(seg_lens, has_lora, block_m: int, chunk_rows: int):
    """Tile, row-block and chunk tables of a segment layout, as host lists: (tiles, block_tiles,
    chunks, each adapter's first chunk, each adapter's chunk count). Tiles are cut at
    adapters' first rows and at multiples of `block_m`, so each lies in one row block, and the
    row blocks' tiles are runs of the tile table. Every layer of a microbatch shares them
    (they hold no adapter pointers)."""
    tiles, chunks, first, count = [], [], [], []
    start = 0
    for i, (rows, lora) in enumerate(zip(seg_lens, has_lora)):
        end = start + rows
        cuts = [start, *range((start // block_m + 1) * block_m, end, block_m), end]
        tiles += [(i, r0, r1) for r0, r1 in zip(cuts, cuts[1:]) if r1 > r0]
        first.append(len(chunks))
        if lora:
            chunks += [(i, r0, min(r0 + chunk_rows, end)) for r0 in range(start, end, chunk_rows)]
        count.append(len(chunks) - first[-1])
        start = end
    # the first tile of each row block, then the tile count: tiles come in row order
    block_tiles = [t for t, (_, r0, _) in enumerate(tiles) if r0 % block_m == 0] + [len(tiles)]
    return tiles, block_tiles, chunks, tuple(first), tuple(count)


@functools.lru_cache(maxsize=64)
def _routing_tables(seg_lens: tuple, has_lora: tuple, block_m: int, chunk_rows: int, device: torch.device):
    """`routing_rows`' host lists, and its tile, row-block and chunk tables on the device: built
    and copied once per layout, and shared by the shapes whose chunks are as long."""
    routing = routing_rows(seg_lens, has_lora, block_m, chunk_rows)
    tiles, block_tiles, chunks, _, _ = routing
    return routing, (device_table(tiles, len(TILE_COLS), torch.int64, device),
                     device_table(block_tiles, 1, torch.int64, device).reshape(-1),
                     device_table(chunks, len(TILE_COLS), torch.int64, device))
