"""One layer's forward+backward: the fused multi-LoRA op against what it replaces.

A pack of LoRA adapters shares one frozen linear layer, each adapter on its own run of rows.
Timed, in bf16, one forward and the backward of a random dY (gradients of x and the adapters):
  fused, fused_dropout  `triton_multi_lora_linear`, every adapter's dropout 0 or DROPOUT
  base                  the frozen base linear alone: what the layer costs without adapters
  segref                the segmented reference, `reference_multi_lora_linear`: one base GEMM
                        and a loop over the adapters
  peft_loop             what N separate PEFT models do: each adapter its own base linear and
                        LoRA branch on its rows

Sections (`--sections`):
  check  the fused op in bf16 against a float64 reference on fresh random inputs (never
         zeros), output and every gradient, on both base paths (the fused GEMM, and cuBLAS with
         the LoRA term added in place), over a fuzz of shapes: relative error < 1e-2.
  ceil   the GPU's ceilings: a 1 GiB device copy (GB/s, read + write), an 8192^3 bf16 matmul.
  main   SHAPES x TOKENS x PACKS. Each method's fwd+bwd is captured in a CUDA graph (GPU time,
         no host time) and the replays of the methods compared are interleaved: each round
         replays every graph once, the L2 flushed before each, the order rotated by one, so
         that they share the GPU's clock as it drifts; each gets the median of its replays
         (CUDA events). Two interleaves a row: base, fused, fused_dropout (`*_graphed`); then
         base, fused, segref, peft_loop (`refs_graphed`).

    python -m benchmarks.kernels --out kernels.json --plot kernels.png
    python -m benchmarks.kernels --compare benchmarks/results/kernels_h100.json  # this run beside a saved one
    python -m benchmarks.kernels --compare OLD.json NEW.json  # two saved runs, nothing timed
    python -m benchmarks.kernels --plot-from benchmarks/results/kernels_h100.json --plot kernels_h100.png
    python -m benchmarks.kernels --dry  # CPU, TRITON_INTERPRET=1, tiny shapes: checks the script

The JSON (`--out`) is written after each section; a short table is printed last.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
import types

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import lora_sweep.kernels as K
except ImportError:  # not installed: the kernels straight from this checkout (setup.cfg maps kernels/ into
    # the package), under a bare `lora_sweep` that imports nothing else
    for name in [m for m in sys.modules if m == "lora_sweep" or m.startswith("lora_sweep.")]:
        del sys.modules[name]
    sys.modules["lora_sweep"] = types.ModuleType("lora_sweep")
    sys.modules["lora_sweep"].__path__ = [os.path.join(ROOT, "lora_sweep")]
    spec = importlib.util.spec_from_file_location("lora_sweep.kernels", os.path.join(ROOT, "kernels", "__init__.py"),
                                                  submodule_search_locations=[os.path.join(ROOT, "kernels")])
    K = sys.modules["lora_sweep.kernels"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(K)

from lora_sweep.kernels.metadata import config_for, fuses_base  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (3584, 18944)]  # (in, out): Llama-3-8B q/o, up/gate; Qwen2-7B up/gate
TOKENS = [2048, 16384]
PACKS = [(1, "16"), (4, "16"), (4, "64"), (16, "mixed"), (32, "16"), (32, "64"), (32, "mixed")]  # adapters x rank
MIXED_RANKS = [8, 16, 32, 64, 128]
DROPOUT = 0.05
WARMUP = 3  # replays of each graph before timing
REPS = 64  # timed replays of each method per interleave
FLUSH_BYTES = 256 << 20  # larger than any L2
if DRY:
    SHAPES, TOKENS, PACKS, WARMUP, REPS = [(64, 48)], [64], [(2, "16")], 0, 1
SECTIONS = ("check", "ceil", "main")
GPU = torch.cuda.is_available() and not DRY  # CUDA graphs and events; else (--dry) plain calls and the CPU's clock


# --------------------------------------------------------------------------- packs and methods


def ranks_for(n, kind, tokens):
    """The ranks of a pack of `n` adapters: all `kind`, or drawn from MIXED_RANKS with a seed of
    the pack, so every run draws the same."""
    rng = random.Random(n * 7 + tokens)
    return [rng.choice(MIXED_RANKS) for _ in range(n)] if kind == "mixed" else [int(kind)] * n


def even_split(tokens, n):
    """Rows of each of n adapters sharing `tokens` rows, the remainder to the last."""
    return [tokens // n] * (n - 1) + [tokens - (n - 1) * (tokens // n)]


def make_pack(in_f, out_f, seg_lens, ranks, dropout, device, seed=0, none_every=0):
    """Random inputs of one layer call: x and the frozen base in bf16 (float32 on the CPU, whose
    interpreted bf16 dot is not exact), fp32 adapters with B random (not PEFT's zeros) so that
    the LoRA term and every gradient are non-trivial; every `none_every`-th adapter has none."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(sum(seg_lens), in_f, generator=g).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(device, dtype)
    bias = (torch.randn(out_f, generator=g) * 0.1).to(device, dtype)
    lora_a, lora_b = [], []
    for i, r in enumerate(ranks):
        if none_every and i % none_every == none_every - 1:
            lora_a.append(None)
            lora_b.append(None)
            continue
        lora_a.append((torch.randn(r, in_f, generator=g) / math.sqrt(in_f)).to(device).requires_grad_(True))
        lora_b.append((torch.randn(out_f, r, generator=g) / math.sqrt(r)).to(device).requires_grad_(True))
    n = len(ranks)
    return dict(x=x, weight=weight, bias=bias, lora_a=lora_a, lora_b=lora_b,
                scales=[2.0 if i % 2 else 0.5 for i in range(n)], dropout_p=[dropout] * n, seg_lens=list(seg_lens),
                seed=[1000 + 7 * i for i in range(n)])


def params_of(p):
    """The tensors a fwd+bwd differentiates: x, then each adapter's A and B."""
    return [p["x"]] + [t for pair in zip(p["lora_a"], p["lora_b"]) for t in pair if t is not None]


def args_of(p):
    return (p["x"], p["weight"], p["bias"], p["lora_a"], p["lora_b"], p["scales"], p["dropout_p"], p["seg_lens"],
            p["seed"])


def m_fused(p, config=None):
    return K.triton_multi_lora_linear(*args_of(p), config=config)


def m_base(p):
    return F.linear(p["x"], p["weight"], p["bias"])


def m_segref(p):
    return K.reference_multi_lora_linear(*args_of(p))


def m_peft_loop(p):
    """Each adapter its own base linear on its rows, plus its fp32 LoRA branch, outputs concatenated."""
    outs, start = [], 0
    for a, b, s, rows, dp in zip(p["lora_a"], p["lora_b"], p["scales"], p["seg_lens"], p["dropout_p"]):
        xi = p["x"][start : start + rows]
        start += rows
        y = F.linear(xi, p["weight"], p["bias"])
        if a is not None:
            xl = F.dropout(xi.to(a.dtype), dp, training=True) if dp > 0 else xi.to(a.dtype)
            y = (y + F.linear(F.linear(xl, a), b) * s).to(y.dtype)
        outs.append(y)
    return torch.cat(outs)


def fwd_bwd(fn, p):
    """One forward of `fn` on pack `p` and the backward of a fixed random dY, as a closure; the
    gradients are dropped after each call, so that no accumulation kernel runs."""
    params = params_of(p)
    dy = torch.randn(p["x"].shape[0], p["weight"].shape[0], dtype=p["x"].dtype, device=p["x"].device)

    def step():
        fn(p).backward(dy)
        for t in params:
            t.grad = None

    return step


# --------------------------------------------------------------------------- timing


def capture(fn):
    """`fn` captured in a CUDA graph, returned as the graph's replay; warmed up on a side stream
    first, as torch's whole-network capture does, so that every kernel is compiled and every
    cached table built. On the CPU, `fn` itself."""
    if not GPU:
        fn()
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def stamp():
    """Now: a recorded CUDA event, or the CPU's clock in ms."""
    if not GPU:
        return time.perf_counter() * 1e3
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def interleaved_ms(fns, reps=REPS):
    """Median ms of each zero-argument function in `fns` ({name: fn}), each captured in a CUDA
    graph, the replays interleaved (see the module's docstring). A function that fails to run
    or capture gets None and its error: returns ({name: ms}, {name: error})."""
    replays, errors = {}, {}
    for name, fn in fns.items():
        try:
            replays[name] = capture(fn)
        except Exception as e:  # a method this torch or GPU cannot run is recorded, not fatal
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    flush = torch.empty(FLUSH_BYTES if GPU else 1, dtype=torch.uint8, device="cuda" if GPU else "cpu")
    order, times = list(replays), {name: [] for name in replays}
    for rnd in range(WARMUP + reps if order else 0):
        spans = []
        for name in order[rnd % len(order):] + order[:rnd % len(order)]:
            flush.zero_()
            start = stamp()
            replays[name]()
            spans.append((name, start, stamp()))
        if GPU:
            torch.cuda.synchronize()
        for name, start, end in spans if rnd >= WARMUP else ():
            times[name].append(start.elapsed_time(end) if GPU else end - start)
    return {name: statistics.median(times[name]) if times.get(name) else None for name in fns}, errors


# --------------------------------------------------------------------------- sections


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_cases():
    """Shapes of the check: real layers, empty and one-row segments, adapters without LoRA,
    odd widths TMA cannot read, ranks from 1 to 256, then random ones."""
    rng = random.Random(1234)
    cases = [
        dict(in_f=4096, out_f=4096, seg_lens=[2048], ranks=[16], dropout=0.0),
        dict(in_f=4096, out_f=14336, seg_lens=[512] * 4, ranks=[16, 64, 8, 128], dropout=0.05),
        dict(in_f=3584, out_f=18944, seg_lens=[300, 0, 1, 700, 23], ranks=[8, 16, 32, 64, 128], dropout=0.1),
        dict(in_f=1000, out_f=744, seg_lens=[rng.randint(0, 90) for _ in range(40)],
             ranks=[rng.choice([1, 3, 17, 64, 130, 256]) for _ in range(40)], dropout=0.05, none_every=7),
        dict(in_f=4096, out_f=4096, seg_lens=[1024] * 16, ranks=[rng.choice(MIXED_RANKS) for _ in range(16)],
             dropout=0.05),
        dict(in_f=2048, out_f=512, seg_lens=[5000, 3], ranks=[32, 200], dropout=0.3),
        dict(in_f=999, out_f=745, seg_lens=[700, 300], ranks=[16, 64], dropout=0.1),
        dict(in_f=4096, out_f=11000, seg_lens=[3000, 0, 1, 1500, 77], ranks=[8, 16, 5, 1, 12], dropout=0.1),
    ]
    for _ in range(4):
        n = rng.randint(1, 12)
        cases.append(dict(in_f=rng.choice([256, 1536, 2048, 4096]), out_f=rng.choice([256, 1024, 4096, 11008]),
                          seg_lens=[rng.choice([0, 1, rng.randint(2, 3000)]) for _ in range(n)],
                          ranks=[rng.choice([1, 8, 16, 17, 64, 100, 128]) for _ in range(n)],
                          dropout=rng.choice([0.0, 0.1]), none_every=rng.choice([0, 3])))
    if DRY:
        cases = [dict(in_f=40, out_f=24, seg_lens=[5, 0, 1, 20], ranks=[3, 16, 17, 8], dropout=0.1, none_every=3)]
    return [c for c in cases if sum(c["seg_lens"])]


def section_check(res, device):
    """Output and gradients against float64 on the same inputs and seeds (the reference draws the
    same dropout masks). dA and dB are compared over all adapters together, and per adapter for
    adapters of 64 rows or more: a one-row, rank-1 adapter's gradient is a single bf16 dot
    product, which cancellation alone can put more than 1% off."""
    res["check"] = out = []
    for ci, c in enumerate(check_cases()):
        for fused_base in sorted({fuses_base(device, 2), False}, reverse=True):
            p = make_pack(c["in_f"], c["out_f"], c["seg_lens"], c["ranks"], c["dropout"], device, seed=100 + ci,
                          none_every=c.get("none_every", 0))
            max_rank = max(a.shape[0] for a in p["lora_a"] if a is not None)
            config = config_for(max_rank, device.type == "cuda", fused_base)
            # freed memory the outputs will reuse holds NaN: an element left unwritten shows
            torch.full((p["x"].shape[0] * max(c["in_f"], c["out_f"]) * 4,), float("nan"), device=device,
                       dtype=torch.bfloat16)
            y = m_fused(p, config)
            dy = torch.randn_like(y)
            grads = torch.autograd.grad(y, params_of(p), dy, allow_unused=True)
            leaf = lambda t: None if t is None else t.detach().double().requires_grad_(True)  # noqa: E731
            p64 = dict(p, x=leaf(p["x"]), weight=p["weight"].double(), bias=p["bias"].double(),
                       lora_a=[leaf(a) for a in p["lora_a"]], lora_b=[leaf(b) for b in p["lora_b"]])
            y64 = m_segref(p64)
            grads64 = torch.autograd.grad(y64, params_of(p64), dy.double(), allow_unused=True)
            errs = dict(y=rel_err(y, y64), dx=rel_err(grads[0], grads64[0]))
            rows = [n for n, a in zip(c["seg_lens"], p["lora_a"]) if a is not None]
            pairs = [(g, r, n) for g, r, n in zip(grads[1:], grads64[1:], [n for n in rows for _ in "ab"])
                     if r is not None]
            if pairs:
                flat = lambda ts: torch.cat([t.reshape(-1).double() for t in ts])  # noqa: E731
                errs["dA"] = rel_err(flat(g for g, _, _ in pairs[::2]), flat(r for _, r, _ in pairs[::2]))
                errs["dB"] = rel_err(flat(g for g, _, _ in pairs[1::2]), flat(r for _, r, _ in pairs[1::2]))
                if big := [(g, r) for g, r, n in pairs if n >= 64]:
                    errs["dAdB_max_per_adapter_64rows"] = max(rel_err(g, r) for g, r in big)
            finite = all(bool(torch.isfinite(t).all()) for t in (y, *grads) if t is not None)
            ok = finite and all(e < 1e-2 for e in errs.values())
            out.append(dict(case=ci, fused_base=fused_base, in_f=c["in_f"], out_f=c["out_f"], seg_lens=c["seg_lens"],
                            ranks=c["ranks"], dropout=c["dropout"], errors=errs, finite=finite, ok=ok))
            print(f"check {ci:2d} fused_base={fused_base!s:5} {c['in_f']}->{c['out_f']} n={len(c['seg_lens'])} "
                  + " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + ("" if ok else "  FAIL"), flush=True)


def section_ceil(res, device):
    n = (1 << 20) if DRY else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    m = 256 if DRY else 8192
    x, w = (torch.randn(m, m, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms, _ = interleaved_ms(dict(copy=lambda: b.copy_(a), matmul=lambda: torch.mm(x, w)), reps=min(REPS, 20))
    res["ceilings"] = dict(copy_GBps=2 * n / ms["copy"] / 1e6, bf16_matmul_TFLOPs=2 * m**3 / ms["matmul"] / 1e9)
    print(f"ceilings: copy {res['ceilings']['copy_GBps']:.0f} GB/s (read + write), "
          f"bf16 matmul {res['ceilings']['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)


def graphed_rates(row, ceilings):
    """TFLOP/s of the graphed fwd+bwd of the fused layer and of the base, and each over the
    matmul ceiling. FLOPs: the base's two GEMMs (Y and dX), 4 x tokens x in x out; the LoRA
    part's six rank-r products (S, S B^T, dS, dB, dA, dS A), 6 x (in + out) x sum of r_i x rows_i."""
    rows = even_split(row["tokens"], row["adapters"])
    base = 4 * row["tokens"] * row["in_f"] * row["out_f"]
    lora = 6 * (row["in_f"] + row["out_f"]) * sum(r * t for r, t in zip(row["ranks"], rows))
    rates = dict(fused_TFLOPs=(base + lora) / row["fused_graphed"] / 1e9, base_TFLOPs=base / row["base_graphed"] / 1e9)
    rates.update({k + "_of_matmul_ceiling": v / ceilings["bf16_matmul_TFLOPs"] for k, v in list(rates.items())})
    return rates


def section_main(res, device, deadline, shapes, tokens_list, packs):
    rows = res["main"] = []
    print(TABLE_HEAD)
    for in_f, out_f in shapes:
        for tokens in tokens_list:
            for n, kind in packs:
                key = dict(in_f=in_f, out_f=out_f, tokens=tokens, adapters=n, rank=kind)
                if time.time() > deadline:
                    res.setdefault("skipped", []).append(key)
                    continue
                row = dict(key, ranks=ranks_for(n, kind, tokens))
                p = make_pack(in_f, out_f, even_split(tokens, n), row["ranks"], 0.0, device)
                pd = make_pack(in_f, out_f, even_split(tokens, n), row["ranks"], DROPOUT, device)
                ms, errors = interleaved_ms(dict(base=fwd_bwd(m_base, p), fused=fwd_bwd(m_fused, p),
                                                 fused_dropout=fwd_bwd(m_fused, pd)))
                row.update({k + "_graphed": v for k, v in ms.items()})
                # the baselines apart: replays of these memory-bound loops leave the GPU cooler
                # for the method after them, which would move the base
                ms, more = interleaved_ms(dict(base=fwd_bwd(m_base, p), fused=fwd_bwd(m_fused, p),
                                               segref=fwd_bwd(m_segref, p), peft_loop=fwd_bwd(m_peft_loop, p)))
                row["refs_graphed"] = ms
                if errors or more:
                    row["errors"] = {**errors, **{"refs_" + k: e for k, e in more.items()}}
                if res.get("ceilings") and row["fused_graphed"] and row["base_graphed"]:
                    row["graphed_rates"] = graphed_rates(row, res["ceilings"])
                del p, pd
                if GPU:
                    torch.cuda.empty_cache()
                rows.append(row)
                print(table_line(row) + (f"  errors: {row['errors']}" if row.get("errors") else ""), flush=True)


# --------------------------------------------------------------------------- summary, table, comparison, picture


def row_label(r):
    return f"{r['tokens']} x {r['in_f']}->{r['out_f']} x {r['adapters']} {r['rank']}"


def ratio(r, num, den):
    """r[num] / r[den] (keys of a row or of its `refs_graphed`), or None where either is missing."""
    a, b = r.get(num), r.get(den)
    return a / b if a and b else None


def fused_over_base(r):
    return ratio(r, "fused_graphed", "base_graphed")


def segref_over_fused(r):
    return ratio(r.get("refs_graphed") or {}, "segref", "fused")


def spread(values):
    values = sorted(v for v in values if v is not None)
    return dict(median=statistics.median(values), min=values[0], max=values[-1], of=len(values)) if values else None


def summarize(res):
    main, many = res.get("main", []), [r for r in res.get("main", []) if r["adapters"] >= 4]
    refs = lambda r: r.get("refs_graphed") or {}  # noqa: E731
    s = dict(
        graphed_fused_over_base=spread(map(fused_over_base, main)),
        graphed_fused_dropout_over_base=spread(ratio(r, "fused_dropout_graphed", "base_graphed") for r in main),
        graphed_dropout_cost=spread(ratio(r, "fused_dropout_graphed", "fused_graphed") for r in main),
        graphed_speedup_vs_segref_4plus=spread(map(segref_over_fused, many)),
        graphed_segref_over_base_4plus=spread(ratio(refs(r), "segref", "base") for r in many),
        graphed_speedup_vs_peft_loop=spread(ratio(refs(r), "peft_loop", "fused") for r in main),
        graphed_rates_over_ceilings={k: spread(r["graphed_rates"][k] for r in main if r.get("graphed_rates"))
                                     for k in ("fused_TFLOPs_of_matmul_ceiling", "base_TFLOPs_of_matmul_ceiling")})
    if res.get("check"):
        s["check_all_ok"] = all(c["ok"] for c in res["check"])
        s["check_max_rel_err"] = max(max(c["errors"].values()) for c in res["check"])
    res["summary"] = {k: v for k, v in s.items() if v}


TABLE_HEAD = (f"{'fwd+bwd, graphed':>30} | {'base ms':>8} {'fused/base':>10} {f'p={DROPOUT}/base':>11} | "
              f"{'segref/fused':>12} {'peft/fused':>10}")


def table_line(r):
    refs = r.get("refs_graphed") or {}
    c = [f"{v:.2f}" if v else "-" for v in (fused_over_base(r), ratio(r, "fused_dropout_graphed", "base_graphed"),
                                           segref_over_fused(r), ratio(refs, "peft_loop", "fused"))]
    base = f"{r['base_graphed']:.3f}" if r.get("base_graphed") else "-"
    return f"{row_label(r):>30} | {base:>8} {c[0]:>10} {c[1]:>11} | {c[2]:>12} {c[3]:>10}"


def print_table(res):
    print(f"\n== one layer in bf16, {res['gpu']}, torch {res['torch']}, Triton {res['triton']} ==\n{TABLE_HEAD}")
    for r in res.get("main", []):
        print(table_line(r))
    print(json.dumps(res.get("summary", {}), indent=1))


def compare(new, old):
    """Row by row (matched on shape, tokens and pack), the graphed fused/base and segref/fused of
    run `new` beside run `old`'s, and the median over rows of new/old for each; prints the
    table and returns {"rows": [...], "median_new_over_old": {...}}. Reads any run of this
    script (a run without the graphed reference shows "-")."""
    key = lambda r: (r["in_f"], r["out_f"], r["tokens"], r["adapters"], r["rank"])  # noqa: E731
    olds = {key(r): r for r in old.get("main", [])}
    measures = dict(fused_over_base=fused_over_base, segref_over_fused=segref_over_fused)
    rows = [dict(row=row_label(r), **{name: (f(r), f(olds[key(r)]) if key(r) in olds else None)
                                      for name, f in measures.items()}) for r in new.get("main", [])]
    medians = {}
    for name in measures:
        changes = [n / o for n, o in (row[name] for row in rows) if n and o]
        medians[name] = dict(median=statistics.median(changes), of=len(changes)) if changes else None
    print(f"\n== new: {new.get('gpu')}, {new.get('date')}; old: {old.get('gpu')}, {old.get('date')} ==")
    if new.get("gpu") != old.get("gpu"):
        print("  (different GPUs: the ratios are not expected to agree)")
    print(f"{'row':>30} | {'fused/base new':>14} {'old':>6} {'new/old':>7} | {'segref/fused new':>16} {'old':>6} "
          f"{'new/old':>7}")
    for row in rows:
        (n1, o1, c1), (n2, o2, c2) = ([f"{v:.3f}" if v else "-" for v in (n, o, n / o if n and o else None)]
                                      for n, o in (row["fused_over_base"], row["segref_over_fused"]))
        print(f"{row['row']:>30} | {n1:>14} {o1:>6} {c1:>7} | {n2:>16} {o2:>6} {c2:>7}")
    for name, m in medians.items():
        print(f"median new/old of {name}: " + (f"{m['median']:.3f} over {m['of']} rows" if m else "-"))
    return dict(rows=rows, median_new_over_old=medians)


def plot_main(rows, path, title):
    """The rows' graphed fused/base, without and with dropout, a bar each per row, a panel per
    token count; the layer shapes labelled over their runs of packs. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(1, len(tokens), figsize=(7 * len(tokens), 4.5), squeeze=False)
    for ax, n_tok in zip(axes[0], tokens):
        sel = [r for r in rows if r["tokens"] == n_tok and fused_over_base(r)]
        xs = range(len(sel))
        ax.bar([x - 0.2 for x in xs], [fused_over_base(r) for r in sel], 0.4, label="fused")
        ax.bar([x + 0.2 for x in xs], [ratio(r, "fused_dropout_graphed", "base_graphed") or 0 for r in sel], 0.4,
               label=f"fused, dropout {DROPOUT}")
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_ylim(0.9, None)
        ax.set_ylabel("fwd+bwd time / frozen base (graphed)")
        ax.set_title(f"{n_tok} tokens")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['adapters']}x{r['rank']}" for r in sel], fontsize=7, rotation=90)
        starts = [i for i, r in enumerate(sel) if i == 0 or (r["in_f"], r["out_f"]) != (sel[i - 1]["in_f"],
                                                                                      sel[i - 1]["out_f"])]
        for i, j in zip(starts, starts[1:] + [len(sel)]):
            if i:
                ax.axvline(i - 0.5, color="0.7", linewidth=0.8)
            ax.text((i + j - 1) / 2, 0.97, f"{sel[i]['in_f']} -> {sel[i]['out_f']}", ha="center", va="top",
                    fontsize=7, transform=ax.get_xaxis_transform())
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, 0.92))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def plot_title(res):
    return f"fused multi-LoRA layer over the frozen base: {res['gpu']}, torch {res['torch']}, Triton {res['triton']}"


# --------------------------------------------------------------------------- command line


def parse_args(argv=None):
    grid = lambda conv: lambda s: [conv(v) for v in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kernels.json", help="the JSON of this run")
    ap.add_argument("--sections", type=grid(str), default=list(SECTIONS), help="comma-separated, of check,ceil,main")
    ap.add_argument("--tokens", type=grid(int), default=TOKENS, help="main: token counts, e.g. 2048,16384")
    ap.add_argument("--packs", type=grid(lambda s: (int(s.split("x", 1)[0]), s.split("x", 1)[1])), default=PACKS,
                    help="main: packs as adapters x rank, e.g. 4x64,32xmixed")
    ap.add_argument("--shapes", type=grid(lambda s: tuple(int(d) for d in s.split("x"))), default=SHAPES,
                    help="main: layers as in x out features, e.g. 4096x14336")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="start no main row after this many seconds from the start")
    ap.add_argument("--dry", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: checks the script only")
    ap.add_argument("--plot", default=None, help="draw the main rows into this PNG")
    ap.add_argument("--plot-from", nargs="+", default=None, help="saved runs for --plot to draw; times nothing")
    ap.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                    help="OLD: this run beside a saved one; OLD NEW: two saved runs, timing nothing")
    args = ap.parse_args(argv)
    if bad := [s for s in args.sections if s not in SECTIONS]:
        ap.error(f"--sections takes {','.join(SECTIONS)}, got {','.join(bad)}")
    if args.compare and len(args.compare) > 2:
        ap.error(f"--compare takes one or two JSON files, got {len(args.compare)}")
    if DRY:  # the dry run keeps its tiny grid
        args.tokens, args.packs, args.shapes = TOKENS, PACKS, SHAPES
    return args


def main(argv=None):
    args = parse_args(argv)
    load = lambda path: json.load(open(path))  # noqa: E731
    if args.compare and len(args.compare) == 2:
        compare(load(args.compare[1]), load(args.compare[0]))
        return
    if args.plot_from:
        saved = [load(path) for path in args.plot_from]
        plot_main([r for res in saved for r in res.get("main", [])], args.plot or "kernels.png", plot_title(saved[0]))
        return
    import triton

    device = torch.device("cpu" if DRY else "cuda")
    start = time.time()
    res = dict(gpu="cpu (dry run)" if DRY else torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, cuda=torch.version.cuda,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               config=dict(sections=args.sections, shapes=args.shapes, tokens=args.tokens, packs=args.packs,
                           dropout=DROPOUT, warmup=WARMUP, reps=REPS, budget_s=args.budget_s,
                           fwd_bwd="forward, then backward of a random dY; gradients of x and the adapters"))
    sections = dict(check=lambda: section_check(res, device), ceil=lambda: section_ceil(res, device),
                    main=lambda: section_main(res, device, start + args.budget_s, args.shapes, args.tokens, args.packs))

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for section in args.sections:
        t = time.time()
        try:
            sections[section]()
        except Exception as e:  # recorded; the next sections still run
            traceback.print_exc()
            res.setdefault("errors", {})[section] = f"{type(e).__name__}: {e}"[:1000]
        res.setdefault("section_seconds", {})[section] = time.time() - t
        summarize(res)
        save()
    if args.plot and res.get("main"):
        plot_main(res["main"], args.plot, plot_title(res))
    print_table(res)
    if args.compare:
        res["compare"] = compare(res, load(args.compare[0]))
        save()


if __name__ == "__main__":
    main()
