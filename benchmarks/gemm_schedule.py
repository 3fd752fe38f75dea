"""The base GEMM's schedule alone: what would close the fused GEMM's gap to cuBLAS? (run on
the device machine)

    python benchmarks/gemm_schedule.py --out $OUT/gemm_schedule.json [--rounds 4]

At one clock the fused GEMM, run as a plain GEMM, trails cuBLAS by 3.4-6.4% where each tile
runs 56-64 K steps and by at most 2.1% where it runs 224-296 (KERNELS_NOTES v26): a cost
per tile, its pipeline fill and its epilogue, which cuBLAS overlaps with the next tile's
main loop. This script times plain bf16 GEMMs of the benchmark's shapes (some with a rank-16
term S @ L added, one adapter per row block) in CUDA graphs, their replays interleaved
(`kernels.interleaved_ms`), written here without the fused GEMM's tables:

  cublas          torch's matmul
  ours            `lora_gemm` with no adapter: the fused GEMM as the layer runs it in a graph
                  (on Hopper the Gluon kernel since v28); ours_triton its Triton kernel
  nested          its loop nest without the LoRA term: persistent, the K loop pipelined, the
                  epilogue after it
  nested_chain3   the same, reading a value for the epilogue before the K loop through three
                  dependent loads, as the fused GEMM reads its row block's first tile
                  (row block -> tile -> adapter); nested_load1 through one load;
                  nested_load1_ahead through one load issued an iteration ahead
  flat            the tile and K loops flattened into one (`tl.range(..., flatten=True)`),
                  which lets the pipeliner load the next tile's first K steps during this
                  tile's epilogue; flat_tma_store writes the tile through a TMA descriptor
                  in two halves; flat_ws also warp-specialises the loop
  flat_lora_*     flat_tma_store with the rank-16 term: after the K loop (last), under an
                  `if` on a table's rank (last_if), with loads masked by that rank
                  (last_masked), or before the K loop (first, first_masked)
  gluon           a persistent GEMM in Gluon whose loads are pipelined by hand across tiles
                  (`gluon_gemm.py`); gluon_lora_last and gluon_lora_first add the rank-16
                  term after or before the K steps, as one more asynchronous wgmma;
                  gluon_ws* the same with one warp loading and eight multiplying

Every variant uses the fused GEMM's blocks: 128x256x64, 8 warps, 3 stages, GROUP_M 8.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels as bench  # noqa: E402  (benchmarks/kernels.py: interleaved_ms, rel_err)
try:  # Gluon's Hopper module, where this Triton has it
    from gluon_gemm import gluon_gemm, gluon_ws_gemm  # noqa: E402
except ImportError as e:
    gluon_gemm, GLUON_ERROR = None, f"{type(e).__name__}: {e}"
from lora_sweep.kernels import metadata as meta_mod  # noqa: E402
from lora_sweep.kernels.lora_gemm import lora_gemm  # noqa: E402

BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES, GROUP_M = 128, 256, 64, 8, 3, 8
# (tokens, K, N, direction): Y reads W as [N, K]; dX reads it as [K, N]
CASES = [(16384, 4096, 4096, "Y"), (16384, 4096, 14336, "Y"), (16384, 3584, 18944, "Y"),
         (16384, 4096, 4096, "dX"), (16384, 14336, 4096, "dX"), (2048, 4096, 4096, "Y"),
         (2048, 4096, 14336, "Y"), (2048, 14336, 4096, "dX")]


@triton.jit
def _tile_of(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    num_pid_in_group = GROUP_M * num_pid_n
    first_m = (t // num_pid_in_group) * GROUP_M
    group_size = min(num_pid_m - first_m, GROUP_M)
    return first_m + ((t % num_pid_in_group) % group_size), (t % num_pid_in_group) // group_size


@triton.jit
def _lora_dot(acc, s_ptr, l_ptr, rank_ptr, pm, pn, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              LORA: tl.constexpr):
    """A rank-16 term S[rows] @ L[:, cols] added to acc: LORA 1 unconditionally, 2 under an `if`
    on a rank loaded from a per-row-block table, 3 with the loads masked by that rank (no `if`)."""
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    if LORA == 1:
        st = tl.load(s_ptr + offs_m[:, None].to(tl.int64) * 16 + offs_r[None, :])
        lt = tl.load(l_ptr + offs_r[:, None] * N + offs_n[None, :], mask=(offs_n < N)[None, :], other=0.0)
        acc = tl.dot(st, lt, acc)
    elif LORA == 2:
        rank = tl.load(rank_ptr + pm)
        if rank > 0:
            st = tl.load(s_ptr + offs_m[:, None].to(tl.int64) * 16 + offs_r[None, :])
            lt = tl.load(l_ptr + offs_r[:, None] * N + offs_n[None, :], mask=(offs_n < N)[None, :], other=0.0)
            acc = tl.dot(st, lt, acc)
    elif LORA == 3:
        rank = tl.load(rank_ptr + pm)
        r_mask = offs_r < rank
        st = tl.load(s_ptr + offs_m[:, None].to(tl.int64) * 16 + offs_r[None, :], mask=r_mask[None, :], other=0.0)
        lt = tl.load(l_ptr + offs_r[:, None] * N + offs_n[None, :], mask=r_mask[:, None] & (offs_n < N)[None, :],
                     other=0.0)
        acc = tl.dot(st, lt, acc)
    return acc


@triton.jit
def _gemm_kernel(a_desc, w_desc, c_desc, c_ptr, s_ptr, l_ptr, rank_ptr, M, N, K, n_programs, stride_cm,
                 FORWARD: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr, TMA_STORE: tl.constexpr,
                 LORA: tl.constexpr, LORA_FIRST: tl.constexpr, CHAIN: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # the epilogue's tile counted apart from the loads' (as Triton's tutorial 09 does), so that
    # the flattened loop's prologue and epilogue share no value
    t_out = tl.program_id(0) - n_programs
    if FLATTEN:
        for t in tl.range(tl.program_id(0), num_pid_m * num_pid_n, n_programs, flatten=True, num_stages=STAGES,
                          warp_specialize=WS):
            pm, pn = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if LORA_FIRST:
                acc = _lora_dot(acc, s_ptr, l_ptr, rank_ptr, pm, pn, N, BLOCK_M, BLOCK_N, LORA)
            for ki in range(k_tiles):
                at = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
                if FORWARD:
                    acc = tl.dot(at, w_desc.load([pn * BLOCK_N, ki * BLOCK_K]).T, acc)
                else:
                    acc = tl.dot(at, w_desc.load([ki * BLOCK_K, pn * BLOCK_N]), acc)
            t_out += n_programs
            pm, pn = _tile_of(t_out, num_pid_m, num_pid_n, GROUP_M)
            if not LORA_FIRST:
                acc = _lora_dot(acc, s_ptr, l_ptr, rank_ptr, pm, pn, N, BLOCK_M, BLOCK_N, LORA)
            _epilogue(acc, c_desc, c_ptr, pm, pn, M, N, stride_cm, TMA_STORE, BLOCK_M, BLOCK_N)
    else:
        # CHAIN: a value the tile's epilogue needs, from a table in global memory, as the fused
        # GEMM reads its tile tables before its K loop: 1 through three dependent loads (row
        # block -> tile -> adapter), 2 through one load, 3 through one load issued an
        # iteration ahead, for the program's next tile
        t_next = tl.minimum(tl.program_id(0), num_pid_m * num_pid_n - 1)
        ahead = tl.load(rank_ptr + _tile_of(t_next, num_pid_m, num_pid_n, GROUP_M)[0]) if CHAIN == 3 else 0
        for t in tl.range(tl.program_id(0), num_pid_m * num_pid_n, n_programs):
            pm, pn = _tile_of(t, num_pid_m, num_pid_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if CHAIN == 1:
                v = tl.load(rank_ptr + tl.load(rank_ptr + tl.load(rank_ptr + pm) - 16 + pm) - 16 + pm)
            elif CHAIN == 2:
                v = tl.load(rank_ptr + pm)
            elif CHAIN == 3:
                v = ahead
                t_next = tl.minimum(t + n_programs, num_pid_m * num_pid_n - 1)
                ahead = tl.load(rank_ptr + _tile_of(t_next, num_pid_m, num_pid_n, GROUP_M)[0])
            else:
                v = 0
            for ki in tl.range(0, k_tiles, num_stages=STAGES, warp_specialize=WS):
                at = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
                if FORWARD:
                    acc = tl.dot(at, w_desc.load([pn * BLOCK_N, ki * BLOCK_K]).T, acc)
                else:
                    acc = tl.dot(at, w_desc.load([ki * BLOCK_K, pn * BLOCK_N]), acc)
            if CHAIN:
                acc += (v - 16).to(tl.float32)  # zero: the table holds 16
            _epilogue(acc, c_desc, c_ptr, pm, pn, M, N, stride_cm, TMA_STORE, BLOCK_M, BLOCK_N)


@triton.jit
def _epilogue(acc, c_desc, c_ptr, pm, pn, M, N, stride_cm, TMA_STORE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    if TMA_STORE:  # in two halves, so the epilogue's shared buffer leaves room for the stages
        halves = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], halves[0].to(c_ptr.dtype.element_ty))
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N + BLOCK_N // 2], halves[1].to(c_ptr.dtype.element_ty))
    else:
        offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


VARIANTS = {  # name: (FLATTEN, WS, TMA_STORE, LORA, LORA_FIRST, CHAIN)
    "nested": (False, False, False, 0, False, 0),
    "nested_chain3": (False, False, False, 0, False, 1),
    "nested_load1": (False, False, False, 0, False, 2),
    "nested_load1_ahead": (False, False, False, 0, False, 3),
    "flat": (True, False, False, 0, False, 0),
    "flat_tma_store": (True, False, True, 0, False, 0),
    "flat_ws": (True, True, False, 0, False, 0),
    # a rank-16 LoRA term (one adapter per row block) in the flattened loop
    "flat_lora_last": (True, False, True, 1, False, 0),
    "flat_lora_last_if": (True, False, True, 2, False, 0),
    "flat_lora_last_masked": (True, False, True, 3, False, 0),
    "flat_lora_first": (True, False, True, 1, True, 0),
    "flat_lora_first_masked": (True, False, True, 3, True, 0),
}
GLUON_VARIANTS = {  # name: (warp-specialised, LORA)
    "gluon": (False, 0), "gluon_lora_last": (False, 1), "gluon_lora_first": (False, 2),
    "gluon_ws": (True, 0), "gluon_ws_lora_last": (True, 1), "gluon_ws_lora_first": (True, 2),
}


def plain_gemm(a, w, out, forward, flatten, ws, tma_store, n_sms, lora=0, lora_first=False, s=None, lt=None,
               ranks=None, chain=0):
    M, K = a.shape
    N = out.shape[1]
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K] if forward else [BLOCK_K, BLOCK_N])
    c_desc = TensorDescriptor.from_tensor(out, [BLOCK_M, BLOCK_N // 2])
    grid = min(n_sms, triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N))
    _gemm_kernel[(grid,)](a_desc, w_desc, c_desc, out, s if lora else out, lt if lora else out,
                          ranks if lora or chain else out, M, N, K, grid, out.stride(0), FORWARD=forward,
                          FLATTEN=flatten, WS=ws, TMA_STORE=tma_store, LORA=lora, LORA_FIRST=lora_first, CHAIN=chain,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                          BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, STAGES=STAGES, num_warps=WARPS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemm_schedule.json")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--variants", default="", help="comma-separated names to time beside cublas and ours "
                    "(default: all)")
    args = ap.parse_args()
    wanted = set(filter(None, args.variants.split(",")))
    variants = {k: v for k, v in VARIANTS.items() if not wanted or k in wanted}
    gluon_variants = {k: v for k, v in GLUON_VARIANTS.items() if not wanted or k in wanted}
    device = torch.device("cuda")
    n_sms = torch.cuda.get_device_properties(device).multi_processor_count
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               blocks=dict(block_m=BLOCK_M, block_n=BLOCK_N, block_k=BLOCK_K, warps=WARPS, stages=STAGES),
               rows=[])
    for tokens, k_dim, n_dim, direction in CASES:
        forward = direction == "Y"
        g = torch.Generator(device="cpu").manual_seed(tokens + n_dim + k_dim)
        a = torch.randn(tokens, k_dim, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(n_dim, k_dim, generator=g) / k_dim ** 0.5).to(device, torch.bfloat16)
        if not forward:
            w = w.t().contiguous()  # [K, N]: dX = dY @ W with W [out, in]
        ref = (a.float() @ (w.float().t() if forward else w.float()))
        s_lora = torch.randn(tokens, 16, generator=g).to(device, torch.bfloat16)
        l_lora = torch.randn(16, n_dim, generator=g).to(device, torch.bfloat16)
        ranks = torch.full((triton.cdiv(tokens, BLOCK_M),), 16, dtype=torch.int32, device=device)
        ref_lora = ref + s_lora.float() @ l_lora.float()
        fns, outs = {"cublas": (lambda: a @ w.t()) if forward else (lambda: a @ w)}, {}
        cfg = meta_mod.config_for(16, True, True)
        meta = meta_mod.LoRABatchMeta.build([tokens], [None], [None], [1.0], [0.0], [0], k_dim if forward else n_dim,
                                            n_dim if forward else k_dim, device, cfg)
        s = torch.zeros(tokens, max(meta.rank_stride, 1), device=device, dtype=torch.bfloat16)
        pack = torch.zeros(1, n_dim, device=device, dtype=torch.bfloat16)
        outs["ours"] = torch.empty(tokens, n_dim, device=device, dtype=torch.bfloat16)
        fns["ours"] = lambda: lora_gemm(a, w, None, s, pack, outs["ours"], meta, forward=forward, fused_base=True)
        if cfg.gluon_gemm != "never":  # the library's Triton GEMM beside its Gluon one (Hopper, graphs)
            meta_triton = meta_mod.LoRABatchMeta.build(
                [tokens], [None], [None], [1.0], [0.0], [0], k_dim if forward else n_dim, n_dim if forward else k_dim,
                device, dataclasses.replace(cfg, gluon_gemm="never"))
            outs["ours_triton"] = torch.empty(tokens, n_dim, device=device, dtype=torch.bfloat16)
            fns["ours_triton"] = lambda: lora_gemm(a, w, None, s, pack, outs["ours_triton"], meta_triton,
                                                   forward=forward, fused_base=True)
        row = dict(tokens=tokens, k=k_dim, n=n_dim, direction=direction, errors={}, rel_err={})
        for name, (flatten, ws, tma_store, lora, lora_first, chain) in variants.items():
            out = torch.empty(tokens, n_dim, device=device, dtype=torch.bfloat16)

            def run(out=out, flatten=flatten, ws=ws, tma_store=tma_store, lora=lora, lora_first=lora_first,
                    chain=chain):
                plain_gemm(a, w, out, forward, flatten, ws, tma_store, n_sms, lora, lora_first, s_lora, l_lora, ranks,
                           chain)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as e:  # recorded, not fatal: some variants may not compile on this GPU
                row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                continue
            fns[name], outs[name] = run, out
        for name, (ws, lora) in gluon_variants.items():
            if gluon_gemm is None:
                row["errors"][name] = GLUON_ERROR
                continue
            out = torch.empty(tokens, n_dim, device=device, dtype=torch.bfloat16)

            def run(out=out, ws=ws, lora=lora):
                (gluon_ws_gemm if ws else gluon_gemm)(a, w, out, forward, n_sms, s_lora, l_lora, lora=lora)
            try:
                run()
                torch.cuda.synchronize()
            except Exception as e:  # recorded, not fatal
                row["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                continue
            print(f"  {name}: ran", flush=True)  # a hand-built pipeline that deadlocks stops here
            fns[name], outs[name] = run, out
        with_lora = {n for n, v in VARIANTS.items() if v[3]} | {n for n, v in GLUON_VARIANTS.items() if v[1]}
        for name, out in outs.items():
            fns[name]()
            row["rel_err"][name] = bench.rel_err(out, ref_lora if name in with_lora else ref)
        ms, errors = bench.interleaved_ms(fns, args.rounds)
        row["errors"].update(errors)
        row["ms"] = ms
        row["over_cublas"] = {k: v / ms["cublas"] for k, v in ms.items() if v is not None}
        res["rows"].append(row)
        print(f"{direction:>2} {tokens:>5} K={k_dim:>5} N={n_dim:>5}: " +
              ", ".join(f"{k} {v:.3f}" for k, v in row["over_cublas"].items()) +
              (f"  errors: {list(row['errors'])}" if row["errors"] else ""), flush=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print("\nover cuBLAS (median of replays, interleaved):")
    names = [n for n in ["ours", "ours_triton", *VARIANTS, *GLUON_VARIANTS]
             if any(n in r["over_cublas"] for r in res["rows"])]
    print("case".ljust(26) + "".join(n.rjust(24) for n in names))
    for r in res["rows"]:
        print(f"{r['direction']} {r['tokens']} {r['k']}x{r['n']}".ljust(26) +
              "".join((f"{r['over_cublas'][n]:.3f}" if n in r["over_cublas"] else "-").rjust(24) for n in names))
    print("largest error".ljust(26) + "".join(
        f"{max((r['rel_err'][n] for r in res['rows'] if n in r['rel_err']), default=float('nan')):.1e}".rjust(24)
        for n in names))


if __name__ == "__main__":
    main()
