"""Probe: can a shrink run on the SMs a persistent GEMM leaves free, beside it?

At 2048 tokens the fused GEMM's (row block, column block) pairs do not divide evenly over
the SMs (256 pairs on 132 SMs: 124 programs take two, 8 take one), so the same makespan
needs fewer programs: `metadata.gemm_programs`, the fewest that keep the largest share of pairs
per program. The SMs left over could run the shrink that the GEMM waits for (S, or dS in
the backward) beside the GEMM's K loop, instead of before it: the GEMM reads S only in its
tiles' LoRA steps, after the K loop, and programmatic dependent launch already lets it
start its K loop while the kernel before it runs. That only pays if a few programs stream
x (or dY) fast enough: the whole shrink must be done before the GEMM's first tiles reach
their LoRA steps, one tile's K loop in.

`rates`: the shrink's streaming rate on P programs, each looping over row blocks, by
blocks, stages and load path (pointers, or TMA descriptors), L2 flushed before each call.
`beside`: the graphed pair (shrink on the leftover SMs, then the GEMM on the balanced
grid, PDL) against today's (the shrink on every SM, then the GEMM on 132 programs), for the
forward GEMM and for dX, with the probe's shrinks and the layer's own (`lora_shrink(programs=...)`).
Timing only: the probe shrink gives every row block adapter 0's A, which changes what the
GEMM adds, not what it reads. `layer`: the layer's forward alone and its fwd+bwd with the
shrinks before the GEMMs and beside them wherever there are spare SMs, so that each pass's
share of a difference shows (KERNELS_NOTES v35). `grads`: how much of the adapter
gradients' reductions (dA, dB) the second stream hides beside the dX GEMM (v36).

    python -m benchmarks.side_sms --out benchmarks/results/side_sms_h200.json
    python -m benchmarks.side_sms --sections layer --out benchmarks/results/side_sms_h200_layer.json
    python -m benchmarks.side_sms --sections grads --out benchmarks/results/side_sms_h200_grads.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch
import triton
import triton.language as tl

from benchmarks import kernels as kb
from lora_sweep.kernels import lora_gemm_gluon, metadata
from lora_sweep.kernels._triton_common import let_next_kernel_start, wait_for_previous_kernel
from lora_sweep.kernels.pack import pack_adapters
from lora_sweep.kernels.shrink import lora_shrink

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


@triton.jit
def _looped_shrink(x_ptr, l_ptr, s_ptr, M, K, stride_s, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   R: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr):
    """S[rows, :R] = x[rows] @ L[:R]^T for the row blocks pid, pid + P, ...: pointer loads, or
    (TMA) x_ptr and l_ptr are TMA descriptors."""
    wait_for_previous_kernel(PDL)
    let_next_kernel_start(PDL)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, R)
    for b in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        offs_m = b * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            if TMA:
                xt = x_ptr.load([b * BLOCK_M, k0])
                lt = l_ptr.load([0, k0]).T
            else:
                xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + (k0 + offs_k)[None, :])
                lt = tl.load(l_ptr + offs_r[None, :] * K + (k0 + offs_k)[:, None])
            acc = tl.dot(xt, lt, acc)
        tl.store(s_ptr + offs_m[:, None] * stride_s + offs_r[None, :], acc.to(s_ptr.dtype.element_ty))


# (load path, rows, K step, stages)
CONFIGS = [("ptr", 128, 64, 4), ("ptr", 128, 64, 6), ("ptr", 128, 128, 4), ("ptr", 64, 128, 6),
           ("tma", 128, 64, 6), ("tma", 128, 128, 4), ("tma", 128, 128, 5), ("tma", 64, 128, 8)]


def looped_shrink(x, lora, s, programs, cfg, pdl=True):
    path, bm, bk, stages = cfg
    M, K = x.shape
    R = s.shape[1]
    tma = path == "tma"
    x_arg = TensorDescriptor.from_tensor(x, [bm, bk]) if tma else x
    l_arg = TensorDescriptor.from_tensor(lora[:R], [R, bk]) if tma else lora
    _looped_shrink[(programs, )](x_arg, l_arg, s, M, K, s.stride(0), BLOCK_M=bm, BLOCK_K=bk, R=R, STAGES=stages,
                                 TMA=tma, PDL=pdl, num_warps=4, launch_pdl=pdl)


def gemm(a, w, s, pack, out, meta, forward, programs):
    lora_gemm_gluon.lora_gemm_gluon(a, w, None, s, pack, out, meta, forward, programs=programs)


def section_rates(res, device, tokens, in_f):
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16)
    lora = torch.randn(16, in_f, device=device, dtype=torch.bfloat16) / in_f ** 0.5
    s = torch.empty(tokens, 16, device=device, dtype=torch.bfloat16)
    ref = (x.float() @ lora.float().T)
    fns = {}
    for cfg in CONFIGS:
        if cfg[0] == "tma" and TensorDescriptor is None:
            continue
        for programs in (2, 4, 8, 16, 32, metadata.sm_count(device)):
            name = f"{cfg[0]} bm{cfg[1]} bk{cfg[2]} st{cfg[3]} p{programs}"
            try:
                s.zero_()
                looped_shrink(x, lora, s, programs, cfg, pdl=False)
                torch.cuda.synchronize()
                err = kb.rel_err(s.float(), ref)
                assert err < 1e-2, err
            except Exception as e:
                res["errors"][name] = f"{type(e).__name__}: {e}"[:300]
                continue
            fns[name] = (lambda c=cfg, p=programs: looped_shrink(x, lora, s, p, c, pdl=False))
    ms, errors = kb.interleaved_ms(fns, rounds=1)
    res["errors"].update(errors)
    for name, t in ms.items():
        if t:
            gbps = x.numel() * 2 / t / 1e6
            programs = int(name.rsplit("p", 1)[1])
            res["rates"].append(dict(name=name, tokens=tokens, in_f=in_f, ms=t, GBps=gbps,
                                     GBps_per_program=gbps / programs))


def section_beside(res, device, tokens, in_f, out_f, side_cfgs):
    n_sms = metadata.sm_count(device)
    p = kb.make_pack(in_f, out_f, tokens, 4, [16] * 4, 0.0, device)
    config = metadata.config_for(16, True, True)
    meta = kb.pack_meta(p, config)
    ptr_meta = kb.pack_meta(p, dataclasses.replace(config, beside_tma=False))
    a_pack, bt_pack = pack_adapters(p["lora_a"], p["lora_b"], torch.bfloat16)
    x, w = p["x"].detach(), p["weight"]
    dy = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
    s = torch.empty(tokens, meta.rank_stride, device=device, dtype=torch.bfloat16)
    for forward in (True, False):
        a, shrink_pack, gemm_pack = (x, a_pack, bt_pack) if forward else (dy, bt_pack, a_pack)
        n_out = out_f if forward else in_f
        out = torch.empty(tokens, n_out, device=device, dtype=torch.bfloat16)
        pairs = meta.n_blocks * metadata.cdiv(n_out, lora_gemm_gluon.TILE_N)
        full = min(pairs, n_sms)
        fewer = metadata.gemm_programs(pairs, n_sms)
        side = n_sms - fewer
        fns = {
            "today": lambda: (lora_shrink(a, shrink_pack, s, meta, apply_scale=not forward, dropout=False),
                              gemm(a, w, s, gemm_pack, out, meta, forward, full)),
            "gemm_full": lambda: gemm(a, w, s, gemm_pack, out, meta, forward, full),
            "gemm_fewer": lambda: gemm(a, w, s, gemm_pack, out, meta, forward, fewer),
            "shrink_today": lambda: lora_shrink(a, shrink_pack, s, meta, apply_scale=not forward, dropout=False),
        }
        for tag, m in (("layer shrink", meta), ("layer shrink ptr", ptr_meta)) if side else ():
            # the layer's own shrink beside the GEMM (`lora_shrink(programs=...)`), x by TMA or pointers
            fns[f"beside {tag}"] = (lambda m=m: (
                lora_shrink(a, shrink_pack, s, m, apply_scale=not forward, dropout=False, programs=side),
                gemm(a, w, s, gemm_pack, out, meta, forward, fewer)))
            fns[f"side alone {tag}"] = (lambda m=m: lora_shrink(a, shrink_pack, s, m, apply_scale=not forward,
                                                                dropout=False, programs=side))
        for cfg in side_cfgs if side else ():
            tag = f"{cfg[0]} bm{cfg[1]} bk{cfg[2]} st{cfg[3]}"
            fns[f"beside {tag}"] = (lambda c=cfg: (looped_shrink(a, shrink_pack, s[:, :16], side, c),
                                                   gemm(a, w, s, gemm_pack, out, meta, forward, fewer)))
            fns[f"side alone {tag}"] = (lambda c=cfg: looped_shrink(a, shrink_pack, s[:, :16], side, c))
        ms, errors = kb.interleaved_ms(fns, rounds=2)
        row = dict(tokens=tokens, in_f=in_f, out_f=out_f, forward=forward, pairs=pairs, full=full, fewer=fewer,
                   side_programs=side, ms=ms, errors=errors)
        res["beside"].append(row)
        print(json.dumps(row), flush=True)


def section_layer(res, device, packs):
    """The layer itself, graphed and interleaved: its forward alone and its fwd+bwd, with the
    shrinks before the GEMMs and beside them wherever there are spare SMs (`beside_rows`
    unbounded), so that the two passes' shares of a difference show apart."""
    for in_f, out_f, tokens, n, rank in packs:
        p = kb.make_pack(in_f, out_f, tokens, n, [rank] * n, 0.0, device)
        default = metadata.config_for(rank, True, True)
        configs = dict(before=dataclasses.replace(default, shrink_beside_gemm=False),
                       beside=dataclasses.replace(default, beside_rows=1 << 30), default=default)
        fns = {}
        for name, cfg in configs.items():
            fns[f"fwd {name}"] = (lambda c=cfg: kb.m_fused(p, c))
            fns[f"fwd+bwd {name}"] = kb.fwd_bwd_fn(lambda q, c=cfg: kb.m_fused(q, c), p)
        with torch.no_grad():
            ms, errors = kb.interleaved_ms({k: v for k, v in fns.items() if k.startswith("fwd ")}, rounds=2)
        more, more_errors = kb.interleaved_ms({k: v for k, v in fns.items() if k.startswith("fwd+bwd")}, rounds=2)
        row = dict(in_f=in_f, out_f=out_f, tokens=tokens, adapters=n, rank=rank, ms={**ms, **more},
                   errors={**errors, **more_errors})
        res["layer"].append(row)
        print(json.dumps(row), flush=True)


def section_grads(res, device, packs):
    """The backward's adapter gradients beside the dX GEMM: how much of dA and dB the second
    stream hides today. Each alone, the dX GEMM alone (on `metadata.gemm_programs`' grid, which
    leaves SMs spare), all three in series, and the reductions on a second stream forked
    before the GEMM's launch, as the graphed layer queues them; graphed and interleaved.
    hidden = (dX + dA + dB - beside) / (dA + dB)."""
    from lora_sweep.kernels.row_reduce import lora_row_reduce

    for in_f, out_f, tokens, n, kind in packs:
        ranks = kb.ranks_for(n, kind, random.Random(n * 7 + tokens))
        p = kb.make_pack(in_f, out_f, tokens, n, ranks, 0.0, device)
        meta = kb.pack_meta(p, metadata.config_for(max(ranks), True, True))
        a_pack, bt_pack = pack_adapters(p["lora_a"], p["lora_b"], torch.bfloat16)
        x, w = p["x"].detach(), p["weight"]
        dy = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)
        s, ds = (torch.randn(tokens, meta.rank_stride, device=device, dtype=torch.bfloat16) for _ in range(2))
        da = torch.empty(meta.r_total, in_f, device=device)
        db = torch.empty(out_f * meta.r_total, device=device)
        dx = torch.empty(tokens, in_f, device=device, dtype=torch.bfloat16)
        side = torch.cuda.Stream()

        def dX():
            gemm(dy, w, ds, a_pack, dx, meta, False, None)

        def dA():
            lora_row_reduce(x, ds, da, meta, out_is_b=False)

        def dB():
            lora_row_reduce(dy, s, db, meta, out_is_b=True)

        def beside(*reductions):
            main = torch.cuda.current_stream()
            ready = main.record_event()
            dX()
            side.wait_event(ready)
            with torch.cuda.stream(side):
                for f in reductions:
                    f()
            main.wait_stream(side)

        fns = {"dX": dX, "dA": dA, "dB": dB, "serial": lambda: (dX(), dA(), dB()),
               "dA beside": lambda: beside(dA), "dA,dB beside": lambda: beside(dA, dB)}
        ms, errors = kb.interleaved_ms(fns, rounds=2)
        row = dict(in_f=in_f, out_f=out_f, tokens=tokens, adapters=n, rank=kind, ranks=ranks,
                   gemm_programs=metadata.gemm_programs(meta.n_blocks * metadata.cdiv(in_f, lora_gemm_gluon.TILE_N),
                                                        metadata.sm_count(device)),
                   ms=ms, errors=errors)
        if all(ms.values()):
            row["hidden"] = (ms["dX"] + ms["dA"] + ms["dB"] - ms["dA,dB beside"]) / (ms["dA"] + ms["dB"])
        res["grads"].append(row)
        print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default="rates,beside")
    args = ap.parse_args()
    device = torch.device("cuda")
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%d"), rates=[], beside=[], layer=[], grads=[], errors={})
    sections = args.sections.split(",")
    if "rates" in sections:
        section_rates(res, device, 2048, 4096)
        best = {}
        for r in res["rates"]:
            cfg = r["name"].rsplit(" p", 1)[0]
            if r["name"].endswith(" p4"):
                best[cfg] = r["GBps"]
        for r in sorted(res["rates"], key=lambda r: r["name"]):
            print(f'{r["name"]:32s} {r["ms"] * 1e3:8.1f} us {r["GBps"]:7.0f} GB/s {r["GBps_per_program"]:6.1f} /prog')
        side_cfgs = [next(c for c in CONFIGS if f"{c[0]} bm{c[1]} bk{c[2]} st{c[3]}" == name)
                     for name in sorted(best, key=best.get, reverse=True)[:3]]
    else:
        side_cfgs = [("tma", 128, 128, 5), ("ptr", 128, 128, 4)]
    if "beside" in sections:
        for in_f, out_f in ((4096, 4096), (4096, 14336), (3584, 18944)):
            section_beside(res, device, 2048, in_f, out_f, side_cfgs)
    if "layer" in sections:
        section_layer(res, device, [(4096, 4096, 2048, 4, 16), (4096, 14336, 2048, 4, 16), (4096, 4096, 2048, 1, 16),
                                    (4096, 14336, 2048, 4, 64), (3584, 18944, 2048, 4, 16), (4096, 4096, 1024, 4, 16),
                                    (4096, 4096, 512, 4, 16)])
        for r in res["layer"]:
            ms = r["ms"]
            print(f'{r["in_f"]}->{r["out_f"]} tok={r["tokens"]} {r["adapters"]}x r{r["rank"]}: '
                  + " ".join(f'{k} {v * 1e3:.1f}' for k, v in ms.items() if v))
    if "grads" in sections:
        section_grads(res, device, [(4096, 4096, 16384, 16, "mixed"), (4096, 4096, 16384, 32, "mixed"),
                                    (4096, 4096, 16384, 4, "16"), (4096, 14336, 16384, 16, "mixed"),
                                    (4096, 4096, 2048, 4, "16"), (4096, 4096, 2048, 16, "mixed")])
        for r in res["grads"]:
            print(f'{r["in_f"]}->{r["out_f"]} tok={r["tokens"]} {r["adapters"]}x r{r["rank"]} P={r["gemm_programs"]}: '
                  + " ".join(f'{k} {v * 1e3:.1f}' for k, v in r["ms"].items() if v)
                  + (f' hidden {r["hidden"]:.2f}' if "hidden" in r else ""))
    print("errors:", res["errors"])
    print(f'{"shape":22s} {"pass":4s} {"P":>9s} {"today":>7s} {"full":>7s} {"fewer":>7s} best beside (cfg)')
    for r in res["beside"]:
        ms = r["ms"]
        besides = {k: v for k, v in ms.items() if k.startswith("beside") and v}
        best = min(besides, key=besides.get) if besides else None
        print(f'{r["in_f"]}->{r["out_f"]:<12} {"fwd" if r["forward"] else "dX":4s} {r["full"]:>4}/{r["fewer"]:<4} '
              f'{ms["today"] * 1e3:7.1f} {ms["gemm_full"] * 1e3:7.1f} {ms["gemm_fewer"] * 1e3:7.1f} '
              + (f'{besides[best] * 1e3:7.1f} ({best}; alone {ms["side alone" + best[6:]] * 1e3:.1f})'
                 if best else '-'))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
