"""What users get without lora_sweep on one GPU: K separate fine-tunes at once, against one packed job.

K LoRA trials on one GPU do not have to run one at a time: Ray Tune's fractional GPUs
(`resources_per_trial={"gpu": 1/K}`) or K plain scripts run K fine-tunes side by side. This
benchmark measures that, in the same run and on the same model, samples and configs as the
packed job:

* peft     K processes, each training one adapter with PEFT (`get_peft_model`, torch AdamW,
           `benchmarks.peft_baseline.train_alone_with_peft`)
* unsloth  the same through Unsloth's `FastLanguageModel.get_peft_model`, where `import unsloth`
           works (else recorded as unavailable, with the reason); dropout 0 only, its fast path
* packed   one `PackedJob` holding the K adapters, in a process of its own, its step replayed
           from CUDA graphs; with `--profile`, also the GPU's time in its step, the share of
           the step the GPU is busy, the host's time per step, the kernels that take the
           GPU's time (`sweep_gpu.gpu_profile`) and the functions that take the host's
           (`sweep_gpu.host_profile`)
* packed-eager  the same job with `cuda_graphs=False`: every kernel launched from Python

Every trial: rank 16 (`--rank`) on all seven projections, batch 1, loss on every token, its own
seed. Each process builds the model from its config with random bf16 weights (nothing is
downloaded; Unsloth loads the same random model from a temporary directory), runs `--warmup`
steps, waits on a barrier shared with its peers, then trains `--steps` steps. A process that
runs out of memory is reported as such; larger K of that method are then skipped.

Throughput: real (non-padding) tokens over the *common wall window*, from the last process's
start to the first process's end, each process's tokens counted within it (a step's tokens spread
evenly over its interval). `union_tokens_per_s` divides all tokens by the span from the first
start to the last end. Step ends are CUDA events, placed on the host's monotonic clock (shared by
the machine's processes) after the run, so no step waits for the GPU to be timed.

    python -m benchmarks.peers --model llama-3.2-1b --seq 256 --k 8,16,32 --steps 30 --warmup 5 \\
        --peers peft,unsloth,packed --out results.json --plot peers.png

`--quantization nf4` (or fp4, int8) puts every method on the same base with its linear layers
quantized by bitsandbytes (QLoRA): PEFT on the quantized model, Unsloth with `load_in_4bit`
(nf4 only), the packed job with `JobSpec(quantization=...)`.

`--dry` runs on the CPU with the bundled tiny model (K=2, 2 steps), for the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from importlib import metadata

import torch  # transformers, peft and lora_sweep are imported in the workers, after unsloth where it is used

START_TIMEOUT_S = 900  # model build and warm-up of the slowest process (a 7B model in 16 processes)
PACKED = ("packed", "packed-eager")  # the methods that run one PackedJob
UNSLOTH_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1"}


# --------------------------------------------------------------------------- one process


class _Clock:
    """Step ends on the host's monotonic clock. On CUDA each is an event read after the run."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks, self.tokens = cuda, [], []

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = time.monotonic()
        if self.cuda:
            self.e0 = torch.cuda.Event(enable_timing=True)
            self.e0.record()

    def mark(self, tokens: int) -> None:
        self.tokens.append(tokens)
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.monotonic())

    def ends(self) -> list[float]:
        if not self.cuda:
            return list(self.marks)
        torch.cuda.synchronize()
        return [self.t0 + self.e0.elapsed_time(e) / 1e3 for e in self.marks]


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _base_model(task):
    """The task's model, frozen: the bundled tiny model on the CPU, else random bf16 weights on the GPU;
    with `--quantization`, loaded from `model_dir` with its linears quantized by bitsandbytes."""
    torch.manual_seed(0)  # the same base weights in every process
    if task.get("quantization"):
        from transformers import AutoModelForCausalLM

        from lora_sweep.quantized import bitsandbytes_config
        device, dtype = ("cpu", torch.float32) if task["dry"] else ("cuda", torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(
            task["model_dir"], dtype=dtype, device_map={"": device},
            quantization_config=bitsandbytes_config(task["quantization"], dtype)).eval().requires_grad_(False)
    if task["dry"]:
        from transformers import AutoModelForCausalLM

        from lora_sweep.tiny import tiny_model_path
        return AutoModelForCausalLM.from_pretrained(tiny_model_path()).eval().requires_grad_(False)
    from benchmarks.sweep_gpu import build_model
    return build_model(task["model"])


def _train(task, on_step) -> dict:
    """Build the task's model and train warm-up + timed steps, calling `on_step(k, real_tokens)`
    after step k. Returns what the run adds to the report."""
    if task["method"] == "unsloth":
        os.environ.update(UNSLOTH_ENV)
        import unsloth  # noqa: F401  before transformers and peft, so that it patches them
        from unsloth import FastLanguageModel
    import lora_sweep as ls
    from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft
    from benchmarks.sweep_gpu import PROJECTIONS, spec_for
    from lora_sweep.data import Sample

    device = "cpu" if task["dry"] else "cuda"
    total = task["warmup"] + task["steps"]
    trials = [ls.TrialConfig.from_dict(t) for t in task["trials"]]
    if task["method"] in PACKED:
        graphs = task["method"] == "packed"
        if task["quantization"]:  # the job loads the saved model and quantizes it itself
            spec = dataclasses.replace(spec_for(None, task["rows"], task["seq"], device=device, cuda_graphs=graphs),
                                       base_model=task["model_dir"], quantization=task["quantization"])
        else:
            spec = spec_for(_base_model(task), task["rows"], task["seq"], device=device, cuda_graphs=graphs)
        job = ls.PackedJob(spec, trials, progress=False)
        for k in range(1, total + 1):
            job.step()
            on_step(k, job.step_stats[-1]["tokens"])
        peaks = [s["peak_memory_bytes"] for s in job.step_stats if s["peak_memory_bytes"] is not None]
        extra = {"evictions": job.evictions, "microbatches": max(s["microbatches"] for s in job.step_stats),
                 "peak_allocated_gb": max(peaks, default=0) / 2**30,
                 "graphed_steps": sum(s["graphed"] for s in job.step_stats),
                 "captures": job.graphed_step.captures if job.graphed_step is not None else 0,
                 "eager_bucket_steps": job.graphed_step.eager_steps if job.graphed_step is not None else 0,
                 "padded_tokens_per_step": statistics.mean(s["padded_tokens"] for s in job.step_stats)}
        if task["profile"] and device == "cuda":
            from benchmarks.sweep_gpu import gpu_profile, host_profile
            extra["profile"] = gpu_profile(job)
            extra["profile"]["host_functions"] = host_profile(job)
        return extra

    (cfg,) = trials
    samples = [Sample(tuple(ids), tuple(ids)) for ids in task["samples"]]  # loss on every token
    if task["method"] == "unsloth":
        model, _ = FastLanguageModel.from_pretrained(task["model_dir"], max_seq_length=task["seq"],
                                                     dtype=torch.bfloat16, load_in_4bit=task["quantization"] == "nf4")
        model = FastLanguageModel.get_peft_model(
            model, r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(PROJECTIONS),
            bias="none", use_gradient_checkpointing=task["unsloth_checkpointing"], random_state=cfg.seed)
    else:
        base = _base_model(task)
        torch.manual_seed(cfg.seed)  # the adapter's own initialisation
        model = peft_model_for(base, cfg, PROJECTIONS, device=device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train_alone_with_peft(model, cfg, samples, task["pad_id"], device=device, steps=total, on_step=on_step)
    return {"peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0}


def _process(task, barrier, results) -> None:
    """One process of a run: train, meet the others at `barrier` after warm-up, report on `results`.
    A failure before the barrier still waits there, so that its peers start together."""
    cuda = not task["dry"]
    if cuda:
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(1)
    clock, started = _Clock(cuda), False

    def on_step(k, tokens):
        nonlocal started
        if k == task["warmup"]:
            if cuda:
                torch.cuda.synchronize()
            barrier.wait(START_TIMEOUT_S)
            started = True
            clock.start()
        elif k > task["warmup"]:
            clock.mark(tokens)

    report = {"index": task["index"], "status": "ok"}
    try:
        report.update(_train(task, on_step))
        report.update(start=clock.t0, ends=clock.ends(), tokens=clock.tokens)
    except threading.BrokenBarrierError:
        report["status"] = "a peer died before the start"
    except BaseException as err:  # reported, not raised: one process's failure is a result
        where = "timed steps" if started else "build or warm-up"
        report["status"] = f"out of memory in {where}" if _is_oom(err) else \
            f"error in {where}: {type(err).__name__}: {str(err)[:300]}"
        report["traceback"] = traceback.format_exc()[-3000:]
        if not started:
            try:
                barrier.wait(START_TIMEOUT_S)
            except threading.BrokenBarrierError:
                pass
    if cuda:
        report["device"] = torch.cuda.get_device_name(0)
        report["reserved_gb"] = torch.cuda.memory_reserved() / 2**30  # the caching allocator keeps its peak
        # cudaMallocs that failed, emptied the allocator's cache (synchronising) and were retried
        report["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    results.put(report)


# --------------------------------------------------------------------------- one run: K processes


def _launch(tasks: list[dict]) -> list[dict]:
    """Run `tasks` as processes of their own (spawned: each gets a fresh CUDA context) behind one
    barrier; a process that dies without a report breaks the barrier for the others."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(tasks)), ctx.Queue()
    procs = [ctx.Process(target=_process, args=(t, barrier, results), daemon=True) for t in tasks]
    for p in procs:
        p.start()
    reports = {}
    while len(reports) < len(tasks):
        try:
            r = results.get(timeout=1.0)
            reports[r["index"]] = r
        except queue.Empty:
            for t, p in zip(tasks, procs):  # exit code 0: its report is on the way
                if t["index"] not in reports and p.exitcode not in (None, 0):
                    reports[t["index"]] = {"index": t["index"], "status": f"died (exit code {p.exitcode})"}
                    barrier.abort()
    for p in procs:
        p.join()
    return [reports[t["index"]] for t in tasks]


def window_throughput(reports: list[dict]) -> dict:
    """Real tokens/s of the processes that finished: over the common window (last start to first
    end, a step's tokens spread over its interval) and over the union of their spans."""
    done = [r for r in reports if r["status"] == "ok"]
    if not done:
        return {"tokens_per_s": None, "union_tokens_per_s": None, "window_s": None}
    lo, hi = max(r["start"] for r in done), min(r["ends"][-1] for r in done)
    inside = 0.0
    for r in done:
        for a, b, n in zip([r["start"]] + r["ends"][:-1], r["ends"], r["tokens"]):
            inside += n * max(0.0, min(b, hi) - max(a, lo)) / max(b - a, 1e-12)
    union = max(r["ends"][-1] for r in done) - min(r["start"] for r in done)
    return {"tokens_per_s": inside / (hi - lo) if hi > lo else None,
            "union_tokens_per_s": sum(sum(r["tokens"]) for r in done) / union, "window_s": hi - lo}


def steady_throughput(reports: list[dict], steps: list[float]) -> float | None:
    """Real tokens/s at the median step: every finished process's mean tokens per step over the
    median of all their step times. Unlike the window's figure it leaves out one-off stalls,
    such as a packed job's first step at a new length (a CUDA graph captured)."""
    done = [r for r in reports if r["status"] == "ok"]
    if not done or not steps:
        return None
    return sum(statistics.mean(r["tokens"]) for r in done) / statistics.median(steps)


def run_one(method: str, k: int, dropout: float, setup: dict) -> dict:
    """K processes of `method` (one for the packed methods, holding the K adapters), summarised."""
    trials = [dict(rank=setup["rank"], alpha=setup["alpha"], dropout=dropout, learning_rate=2e-4, batch_size=1,
                   max_steps=10**6, seed=i, trial_id=f"t{i}") for i in range(k)]
    common = {key: setup[key] for key in ("dry", "model", "seq", "warmup", "steps", "profile", "model_dir",
                                          "quantization", "unsloth_checkpointing")}
    if method in PACKED:
        tasks = [dict(common, method=method, index=0, trials=trials, rows=setup["rows"])]
    else:
        tasks = [dict(common, method=method, index=i, trials=[t], samples=setup["samples"], pad_id=setup["pad_id"])
                 for i, t in enumerate(trials)]
    reports = _launch(tasks)
    failed = [r["status"] for r in reports if r["status"] != "ok"]
    steps = [b - a for r in reports if r["status"] == "ok" for a, b in zip([r["start"]] + r["ends"][:-1], r["ends"])]
    out = {"method": method, "k": k, "dropout": dropout, "processes": len(tasks),
           "status": "ok" if not failed else f"{len(failed)} of {len(tasks)} processes: {failed[0]}",
           **window_throughput(reports), "steady_tokens_per_s": steady_throughput(reports, steps),
           "median_step_s": statistics.median(steps) if steps else None,
           "peak_reserved_gb_per_process": max((r.get("reserved_gb", 0.0) for r in reports), default=0.0),
           "peak_allocated_gb_per_process": max((r.get("peak_allocated_gb", 0.0) for r in reports), default=0.0),
           "device": next((r["device"] for r in reports if "device" in r), None),
           "reports": [{key: v for key, v in r.items() if key not in ("ends", "start")} for r in reports]}
    if method in PACKED and reports[0]["status"] == "ok":
        for key in ("evictions", "microbatches", "graphed_steps", "captures", "eager_bucket_steps",
                    "padded_tokens_per_step"):
            out[key] = reports[0][key]
        if "profile" in reports[0]:  # the GPU's share of a step, and the host's time per step
            out.update(reports[0]["profile"])
    return out


# --------------------------------------------------------------------------- set-up and output


def unsloth_status() -> str:
    """"available", or "unavailable: <reason>" from importing it in a process of its own."""
    import importlib.util

    if importlib.util.find_spec("unsloth") is None:
        return "unavailable: not installed"
    done = subprocess.run([sys.executable, "-c", "import unsloth"], capture_output=True, text=True,
                          env={**os.environ, **UNSLOTH_ENV}, timeout=600)
    if done.returncode == 0:
        return "available"
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return f"unavailable: {lines[-1] if lines else f'exit code {done.returncode}'}"


def _save_random_model(name: str, path: str) -> None:
    """The random model a GPU peer builds, saved for Unsloth to load, with the bundled tokenizer
    (its pad token differs from EOS and UNK, as Unsloth requires)."""
    from transformers import AutoTokenizer

    from lora_sweep.tiny import tiny_model_path
    _base_model({"dry": False, "model": name}).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(path)


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _write(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def table(result: dict) -> str:
    lines = [f"{'method':12} {'dropout':>7} {'K':>4} {'tokens/s':>10} {'steady':>8} {'step s':>8} {'GB/proc':>8} "
             f"{'GPU busy':>8} {'host s':>7}  status"]
    for r in result["runs"]:
        tps = f"{r['tokens_per_s']:10.0f}" if r.get("tokens_per_s") else f"{'-':>10}"
        steady = f"{r['steady_tokens_per_s']:8.0f}" if r.get("steady_tokens_per_s") else f"{'-':>8}"
        step = f"{r['median_step_s']:8.3f}" if r.get("median_step_s") else f"{'-':>8}"
        mem = f"{r.get('peak_reserved_gb_per_process', 0.0):8.1f}"
        busy = f"{r['gpu_busy_share']:8.0%}" if "gpu_busy_share" in r else f"{'-':>8}"
        host = f"{r['host_s_per_step']:7.3f}" if "host_s_per_step" in r else f"{'-':>7}"
        lines.append(f"{r['method']:12} {r['dropout']:7.2f} {r['k']:4d} {tps} {steady} {step} {mem} {busy} {host}  "
                     f"{r['status']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Tokens/s against K, one line per method and dropout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, dropout in sorted({(r["method"], r["dropout"]) for r in result["runs"]}):
        pts = sorted((r["k"], r["tokens_per_s"]) for r in result["runs"]
                     if (r["method"], r["dropout"]) == (method, dropout) and r.get("tokens_per_s"))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"{method}, dropout {dropout:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K trials on one GPU (processes, or adapters in one packed job)")
    ax.set_ylabel("real tokens / s, common window")
    ax.set_title(f"{result['model']} seq {result['seq']}, rank {result['rank']}, {result['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", help="a name in lora_sweep.costmodel.PRESETS")
    parser.add_argument("--seq", type=int, default=256, help="max_seq_len; samples average about 40%% of it")
    parser.add_argument("--k", default="8,16,32", help="trials on the GPU at once, comma-separated")
    parser.add_argument("--packed-k", default=None, help="adapters of the packed methods' jobs, if not --k's")
    parser.add_argument("--peft-k", default=None, help="PEFT processes at once, if not --k's")
    parser.add_argument("--unsloth-k", default=None, help="Unsloth processes at once, if not --k's")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of every process")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the barrier (at least 1)")
    parser.add_argument("--peers", default="peft,unsloth,packed", help="methods, comma-separated")
    parser.add_argument("--dropout", default="0,0.05", help="dropouts of peft and packed; unsloth runs at 0")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=512, help="samples every trial draws from")
    parser.add_argument("--unsloth-checkpointing", default="false", choices=["false", "true", "unsloth"],
                        help="use_gradient_checkpointing of Unsloth's get_peft_model (PEFT's side has none)")
    parser.add_argument("--profile", action="store_true",
                        help="the packed step's GPU time, busy share, kernels and host functions")
    parser.add_argument("--quantization", choices=["nf4", "fp4", "int8"], default=None,
                        help="every method on the same base with its linears quantized by bitsandbytes (QLoRA); "
                             "Unsloth takes nf4 only")
    parser.add_argument("--out", default="benchmarks/results/peers.json")
    parser.add_argument("--plot", default=None, help="PNG of tokens/s against K")
    parser.add_argument("--dry", action="store_true", help="CPU, bundled tiny model, K=2, 2 steps (tests)")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error(f"The value of `--warmup` is {args.warmup}, but must be `--warmup >= 1`.")
    methods = args.peers.split(",")
    unknown = set(methods) - {"peft", "unsloth", *PACKED}
    if unknown:
        parser.error(f"`--peers` takes peft, unsloth, packed and packed-eager, got {', '.join(sorted(unknown))}.")
    ks, dropouts = [int(k) for k in args.k.split(",")], [float(d) for d in args.dropout.split(",")]
    if args.dry:
        args.model, args.seq, args.steps, args.warmup, args.rows, ks = "tiny", 64, 2, 1, 64, [2]
    own_ks = {"peft": args.peft_k, "unsloth": args.unsloth_k, **dict.fromkeys(PACKED, args.packed_k)}
    # the Ks each method runs at: its own list, else --k's (a dry run: K=2 for every method)
    ks_of = {method: [int(k) for k in own.split(",")] if own and not args.dry else ks
             for method, own in own_ks.items()}

    from transformers import AutoTokenizer

    from benchmarks.sweep_gpu import synthetic_rows
    from lora_sweep.data import tokenize_rows
    from lora_sweep.tiny import tiny_model_path

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    rows = synthetic_rows(args.rows, args.seq, seed=3)
    samples = [list(s.input_ids) for s in tokenize_rows(rows, tokenizer, args.seq, "train_data")]
    setup = dict(dry=args.dry, model=args.model, seq=args.seq, warmup=args.warmup, steps=args.steps,
                 profile=args.profile, rank=args.rank, alpha=2.0 * args.rank, rows=rows, samples=samples,
                 pad_id=tokenizer.pad_token_id, model_dir=None, quantization=args.quantization, unsloth_checkpointing={
                     "false": False, "true": True}.get(args.unsloth_checkpointing, args.unsloth_checkpointing))
    unsloth = unsloth_status() if "unsloth" in methods else "not asked"
    if args.quantization not in (None, "nf4") and unsloth == "available":
        unsloth = f"unavailable: Unsloth's 4-bit base is nf4, not {args.quantization}"
    if args.quantization and args.dry:  # the bundled model, loaded and quantized by each method
        setup["model_dir"] = tiny_model_path()
    elif (args.quantization or "unsloth" in methods and unsloth == "available") and not args.dry:
        setup["model_dir"] = tempfile.mkdtemp(prefix="peers_model_")
        saver = mp.get_context("spawn").Process(target=_save_random_model, args=(args.model, setup["model_dir"]))
        saver.start()
        saver.join()

    result = {"benchmark": "peers", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": "cpu" if args.dry else None, "model": args.model, "seq": args.seq, "rank": args.rank,
              "alpha": 2.0 * args.rank, "batch_size": 1, "steps": args.steps, "warmup": args.warmup,
              "mean_sample_tokens": statistics.mean(len(s) for s in samples),
              "versions": {d: _version(d) for d in ("torch", "triton", "transformers", "peft", "unsloth",
                                                    "unsloth_zoo", "lora_sweep")},
              "unsloth": unsloth, "unsloth_checkpointing": setup["unsloth_checkpointing"],
              "quantization": args.quantization,
              "window": "common: real tokens from the last process's start to the first process's end; "
                        "union_tokens_per_s: all tokens from the first start to the last end",
              "runs": []}
    try:
        for method in methods:
            for dropout in ([0.0] if method == "unsloth" else dropouts):
                too_big = None  # the smallest K that did not fit: larger K are skipped
                for k in ks_of[method]:
                    if method == "unsloth" and unsloth != "available":
                        run = {"method": method, "k": k, "dropout": dropout, "status": unsloth}
                    elif too_big is not None:
                        run = {"method": method, "k": k, "dropout": dropout, "status": f"skipped: K={too_big} failed"}
                    else:
                        run = run_one(method, k, dropout, setup)
                        too_big = k if run["status"] != "ok" else None
                        result["gpu"] = result["gpu"] or run["device"]  # "cpu" from the start in a dry run
                    result["runs"].append(run)
                    _write(result, args.out)  # after every run: a run cut short keeps what it measured
                    tps = f"{run['tokens_per_s']:.0f} tokens/s, " if run.get("tokens_per_s") else ""
                    print(f"{method} dropout {dropout:g} K={k}: {tps}{run['status']}", flush=True)
    finally:
        if setup["model_dir"] and not args.dry:
            shutil.rmtree(setup["model_dir"], ignore_errors=True)

    _write(result, args.out)
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
