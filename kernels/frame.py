"""Routing tables of a fixed shape whose contents change between calls: what a CUDA graph replays.

A graph replays each kernel with the grid, block sizes and table addresses of the call it
recorded. A `TableFrame` lets the same recorded calls serve every layout of `tokens` rows
cut into the same segments in the same order, segment i at most `caps[i]` rows (none
included: an empty segment computes nothing, and its adapter's gradient is left unwritten),
with any scales and dropout rates:

* its tables (`LoRABatchMeta.build(..., frame=)`) have room for the most tiles and chunks of
  any such layout: `tokens / block_m` row blocks plus one tile per segment boundary, and
  each LoRA segment's chunks at its cap. The unused entries are empty rows (`tokens` to
  `tokens`) of the last segment, which has no LoRA: the kernels skip them;
* every launch choice that reads the layout (chunk length, the longest chunk, whether an
  adapter's gradient takes a second stage) is made for the caps, so it holds for all;
* `fill(seg_lens, scales, dropout_p)` writes a new layout, and the segments' scales and
  dropout rates, into every table built so far, a copy or two per shape from pinned memory,
  queued on the current stream before the replay that reads it. Whether a call draws dropout
  masks at all is a launch choice: tables built without dropout take no rate above zero.

The last segment is the padding after the samples (no adapter, any length, zero included).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .metadata import (ADAPTER_INT_COLS, TILE_COLS, adapter_float_rows, adapter_int_rows, cdiv, make_shared_tables,
                       routing_rows)

_INT = len(ADAPTER_INT_COLS)
_TILE = len(TILE_COLS)


class TableFrame:
    """Fixed-shape tables for layouts of `sum(seg_lens)` rows in `len(seg_lens)` segments,
    segment i at most `caps[i]` rows; `seg_lens` is the first layout they hold."""

    def __init__(self, seg_lens: Sequence[int], caps: Sequence[int]):
        self.tokens = sum(int(s) for s in seg_lens)
        self.caps = tuple(min(int(c), self.tokens) for c in caps)
        if len(self.caps) != len(seg_lens):
            raise ValueError(f"Expected one cap per segment ({len(seg_lens)}), got {len(self.caps)}.")
        self.seg_lens = self._check(seg_lens)
        # each segment's scale and dropout rate, from the first call that adapts it, or `fill`
        self.scales: list[Optional[float]] = [None] * len(self.caps)
        self.dropout_p: list[Optional[float]] = [None] * len(self.caps)
        # build key -> (shared meta, its int64 table buffer and fp32 adapter table, their pinned host twins)
        self._tables: dict[tuple, tuple] = {}

    def _check(self, seg_lens) -> tuple:
        seg_lens = tuple(int(s) for s in seg_lens)
        if len(seg_lens) != len(self.caps) or sum(seg_lens) != self.tokens:
            raise ValueError(f"A layout of this frame has {len(self.caps)} segments of {self.tokens} rows in all, "
                             f"got {list(seg_lens)}.")
        over = [i for i, (n, c) in enumerate(zip(seg_lens[:-1], self.caps)) if not 0 <= n <= c]
        if over:
            i = over[0]
            raise ValueError(f"Segment {i} of a frame must have 0 to {self.caps[i]} rows, got {seg_lens[i]}.")
        return seg_lens

    # --- what `make_shared_tables` asks while it builds a framed meta

    def capacity(self, has_lora, block_m: int, chunk_rows: int) -> tuple[int, int]:
        """(tile entries, chunk entries) that hold every layout of the frame."""
        tiles = cdiv(self.tokens, block_m) + len(self.caps) - 1
        lora_caps = [c for c, lora in zip(self.caps, has_lora) if lora]
        chunks = min(self.tokens // chunk_rows + len(lora_caps), sum(cdiv(c, chunk_rows) for c in lora_caps))
        return tiles, chunks

    def longest_chunks(self, has_lora, chunk_rows: int) -> tuple[int, int]:
        """(the longest chunk, the most chunks of one adapter) of any layout of the frame."""
        lora_caps = [c for c, lora in zip(self.caps, has_lora) if lora]
        return min(chunk_rows, max(lora_caps, default=0)), max((cdiv(c, chunk_rows) for c in lora_caps), default=0)

    def table_size(self, n_tiles: int, n_chunks: int, n_block_entries: int, n_adapters: int) -> int:
        return _TILE * n_tiles + n_block_entries + _TILE * n_chunks + _INT * n_adapters

    def views(self, buffer: torch.Tensor, n_tiles: int, n_chunks: int, n_adapters: int):
        """The tile, row-block, chunk and adapter tables as views of one int64 buffer."""
        n_block_entries = buffer.numel() - (_TILE * n_tiles + _TILE * n_chunks + _INT * n_adapters)
        tiles, blocks, chunks, adapters = buffer.split([_TILE * n_tiles, n_block_entries, _TILE * n_chunks,
                                                        _INT * n_adapters])
        return tiles.view(n_tiles, _TILE), blocks, chunks.view(n_chunks, _TILE), adapters.view(n_adapters, _INT)

    # --- the framed metas, and filling them

    def shared(self, seg_lens, ranks: tuple, scales: tuple, dropout_p: tuple, in_features: int, out_features: int,
               device: torch.device, config):
        """The framed tables (every one but the seeds) of a call of this shape, built at its
        first call from the frame's current layout (`seg_lens` must be it) and values (a
        segment's first call with LoRA sets them; later ones must agree)."""
        if self._check(seg_lens) != self.seg_lens:
            raise ValueError(f"The frame holds layout {list(self.seg_lens)}, the call has {list(seg_lens)}.")
        if ranks[-1]:
            raise ValueError("The last segment of a frame is its padding and must have no LoRA.")
        for i in (i for i, r in enumerate(ranks) if r):
            if self.scales[i] is None:
                self.scales[i], self.dropout_p[i] = float(scales[i]), float(dropout_p[i])
            elif (self.scales[i], self.dropout_p[i]) != (float(scales[i]), float(dropout_p[i])):
                raise ValueError(f"The frame holds scale {self.scales[i]} and dropout {self.dropout_p[i]} for "
                                 f"segment {i}, the call has {scales[i]} and {dropout_p[i]}.")
        scales, dropout_p = self._values(ranks)
        key = (ranks, any(p > 0 for p in dropout_p), in_features, out_features, device, config)
        if key not in self._tables:
            meta = make_shared_tables(self.seg_lens, ranks, scales, dropout_p, in_features, out_features, device,
                                      config, frame=self)
            buffer = meta.tiles._base  # the one buffer all four tables are views of (`views`)
            pinned = device.type == "cuda"
            hosts = (torch.empty(buffer.shape, dtype=torch.int64, pin_memory=pinned),
                     torch.empty(meta.adapters_f.shape, dtype=torch.float32, pin_memory=pinned))
            self._tables[key] = (meta, buffer, hosts)
            self._write(self._tables[key], self.seg_lens)
        return self._tables[key][0]

    def _values(self, ranks) -> tuple[list[float], list[float]]:
        """(scales, dropout rates) of a call with `ranks`: the frame's, zero where no LoRA."""
        return ([s if r else 0.0 for s, r in zip(self.scales, ranks)],
                [p if r else 0.0 for p, r in zip(self.dropout_p, ranks)])

    def fill(self, seg_lens: Sequence[int], scales: Optional[Sequence[float]] = None,
             dropout_p: Optional[Sequence[float]] = None) -> None:
        """Make every table of the frame hold layout `seg_lens` and, if given, these scales and
        dropout rates (one per segment) from the next kernel queued on the current stream on.
        Tables built without dropout (no mask drawn) take none above zero. The pinned twins are
        reused: the caller waits for the kernels that read the previous layout before filling
        again."""
        seg_lens = self._check(seg_lens)
        changed = False
        if scales is not None:
            scales, dropout_p = [float(s) for s in scales], [float(p) for p in dropout_p]
            changed = (scales, dropout_p) != (self.scales, self.dropout_p)
        if changed:
            if any(not meta.has_dropout and any(p > 0 and r for p, r in zip(dropout_p, meta.ranks))
                   for meta, _, _ in self._tables.values()):
                raise ValueError("A frame's tables built without dropout take no dropout rate above zero.")
            self.scales, self.dropout_p = scales, dropout_p
        self.seg_lens = seg_lens
        routings: dict = {}  # shapes whose tables route alike share one computation
        for entry in self._tables.values():
            self._write(entry, self.seg_lens, routings, changed)

    def _write(self, entry, seg_lens, routings: Optional[dict] = None, values: bool = False) -> None:
        """Write layout `seg_lens` into `entry`'s tables, and with `values` the frame's scales
        and dropout rates into its float table (built with those it had then)."""
        meta, buffer, (host, host_f) = entry
        scales, dropout_p = self._values(meta.ranks)
        key = (tuple(r > 0 for r in meta.ranks), meta.config.block_m, meta.chunk_rows)
        routings = {} if routings is None else routings
        if key not in routings:
            routings[key] = routing_rows(seg_lens, *key)
        tiles, block_tiles, chunks, first, count = routings[key]
        pad = (len(seg_lens) - 1, self.tokens, self.tokens)  # empty rows of the padding segment
        tiles_h, blocks_h, chunks_h, adapters_h = self.views(host, meta.n_tiles, meta.n_chunks, len(meta.ranks))
        tiles_h.numpy()[:] = np.array(tiles + [pad] * (meta.n_tiles - len(tiles)), dtype=np.int64).reshape(-1, 3)
        blocks_h.numpy()[:] = block_tiles
        chunks_h.numpy()[:] = np.array(chunks + [pad] * (meta.n_chunks - len(chunks)), dtype=np.int64).reshape(-1, 3)
        adapters_h.numpy()[:] = adapter_int_rows(seg_lens, meta.ranks, dropout_p, first, count)
        buffer.copy_(host, non_blocking=True)
        if values:
            host_f.numpy()[:] = adapter_float_rows(meta.ranks, scales, dropout_p)
            meta.adapters_f.copy_(host_f, non_blocking=True)
