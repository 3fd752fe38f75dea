"""Kernels specialised on per-step integers against kernels that are not, in one process.

Triton compiles a kernel once per class of each integer argument it specialises (the value 1,
multiples of 16, the rest). The multi-LoRA kernels take a step's token count and what follows
from it (`M`, row blocks, programs, tile items) unspecialised (`do_not_specialize`, see
`kernels/metadata.py`), so that an eager step of a new length runs kernels already compiled.
This benchmark runs the same eager packed job twice from a cold Triton cache, each time with
fresh copies of every `*_kernel` of `lora_sweep.kernels`:

* specialised     copies without `do_not_specialize` (Triton's default)
* as shipped      copies with the kernels' own `do_not_specialize`

and reports for each the job's wall time, the kernels it compiled, the steps that stalled
(over `costmodel.STALL_FACTOR` times the median: a compile inside the step) and the median
step. Then, compiled, jobs of the two take turns (`--warm-rounds`): their median step shows
whether the unspecialised kernels run any slower.

    python -m benchmarks.specialization --model llama-3.2-1b --seq 1024 --k 16 --steps 40 --out spec.json
    python -m benchmarks.specialization --model qwen2.5-7b --seq 1024 --k 16 --steps 30 --out spec_7b.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import pkgutil
import statistics
import tempfile
import time

import torch
import transformers
import triton
from triton.runtime.jit import JITFunction

import lora_sweep as ls
from lora_sweep.costmodel import typical_steps

from benchmarks.sweep_gpu import build_model, spec_for, strip_adapters, synthetic_rows


def kernel_copies(keep_do_not_specialize: bool) -> dict:
    """A fresh copy (an empty in-memory cache) of every `*_kernel` of `lora_sweep.kernels`, with
    or without its `do_not_specialize`, by (module, name); `install` puts them in place."""
    import lora_sweep.kernels as package

    copies = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                original = getattr(value, "_original", value)
                copy = type(original)(original.fn, noinline=original.noinline,
                                      do_not_specialize=original.do_not_specialize if keep_do_not_specialize else None)
                copy._original = original
                copies[module, name] = copy
    return copies


def install(copies: dict) -> None:
    for (module, name), copy in copies.items():
        setattr(module, name, copy)


def eager_job(model, rows, seq, k, steps, cache_dir) -> dict:
    """An eager packed job of `k` adapters for `steps` steps, its kernels cached in `cache_dir`."""
    triton.knobs.cache.dir = cache_dir
    trials = [ls.TrialConfig(rank=16, alpha=32, dropout=0.05, batch_size=1, max_steps=10**6, seed=i,
                             trial_id=f"t{i}") for i in range(k)]
    job = ls.PackedJob(spec_for(model, rows, seq, cuda_graphs=False), trials, progress=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        job.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    seconds = [s["seconds"] for s in job.step_stats]
    tokens = [s["tokens"] for s in job.step_stats]
    kept = {id(s) for s in typical_steps(job.step_stats)}  # a stall: over STALL_FACTOR times the median
    stalls = [s["seconds"] for s in job.step_stats if id(s) not in kept]
    job.release_locks()
    del job
    strip_adapters(model)
    compiled = sum(name.endswith(".cubin") for _, _, names in os.walk(cache_dir) for name in names)
    return {"wall_s": wall, "compiled_kernels": compiled, "stalls": len(stalls), "stall_s": sum(stalls),
            "median_step_s": statistics.median(seconds), "step_s": seconds, "tokens": tokens,
            "tokens_divisible_by_16": sum(n % 16 == 0 for n in tokens)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warm-rounds", type=int, default=2, help="compiled jobs of each side, in turn")
    parser.add_argument("--warm-steps", type=int, default=15)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    model = build_model(args.model)
    rows = synthetic_rows(512, args.seq, seed=5)
    result = {"benchmark": "specialization", "date": datetime.date.today().isoformat(),
              "gpu": torch.cuda.get_device_name(), "model": args.model, "seq": args.seq, "adapters": args.k,
              "steps": args.steps, "versions": {"torch": torch.__version__, "triton": triton.__version__,
                                                "transformers": transformers.__version__,
                                                "lora_sweep": ls.__version__}, "runs": {}}
    sides = {"specialised": kernel_copies(False), "as shipped": kernel_copies(True)}
    with tempfile.TemporaryDirectory() as root:
        caches = {side: os.path.join(root, side.replace(" ", "_")) for side in sides}
        for side, copies in sides.items():  # each from an empty cache
            install(copies)
            result["runs"][side] = {"kernels": len(copies),
                                    **eager_job(model, rows, args.seq, args.k, args.steps, caches[side])}
        for side in sides:
            result["runs"][side]["warm_step_s"] = []
        for _ in range(args.warm_rounds):  # compiled: the two in turn, for the steady step
            for side, copies in sides.items():
                install(copies)
                warm = eager_job(model, rows, args.seq, args.k, args.warm_steps, caches[side])
                result["runs"][side]["warm_step_s"] += warm["step_s"][1:]  # the job's first step is its own
    for r in result["runs"].values():
        r["warm_median_step_s"] = statistics.median(r["warm_step_s"]) if r["warm_step_s"] else None
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.model} seq {args.seq}, {args.k} adapters, {args.steps} eager steps from a cold Triton cache, "
          f"then {args.warm_rounds} x {args.warm_steps} compiled, in turn")
    print(f"{'kernels':<12} {'wall s':>8} {'compiled':>9} {'stalls':>7} {'stall s':>8} {'median step':>12} "
          f"{'warm median':>12}")
    for side, r in result["runs"].items():
        warm = f"{r['warm_median_step_s']:12.4f}" if r["warm_median_step_s"] else f"{'-':>12}"
        print(f"{side:<12} {r['wall_s']:8.1f} {r['compiled_kernels']:9d} {r['stalls']:7d} {r['stall_s']:8.1f} "
              f"{r['median_step_s']:12.4f} {warm}")


if __name__ == "__main__":
    main()
