"""One packed job over d GPUs of one host: tokens/s, memory per GPU, the cost model's step time.

The same job (K adapters of rank 16 on all seven projections, batch 1, dropout 0, samples of
varying length, a real architecture with random bf16 weights) runs on d = 1, 2, 4 GPUs, each
d a ``torchrun --nproc-per-node d`` of this script's worker: the frozen base sharded with FSDP2
or whole on each GPU (`JobSpec.shard_base`, `--shard-base`), each trial trained by one rank
(lora_sweep/distributed.py). Steps replay CUDA graphs at every d (`cuda_graphs=True`, so that
no d's choice between graphs and eager steps colours the comparison) but where the base is
sharded, which runs eagerly. Every rank builds the same weights from the same seed, whole on
its GPU, before the job shards them or keeps them; with `--from-files` (a base larger than one
GPU) they are written once as a safetensors checkpoint, a layer at a time, and each rank reads
its shard of it.

Per d: the median step (host clock around each synchronised step, after warm-up), real
tokens/s summed over the ranks, MFU against d x the bf16 matmul rate measured in the same
run, peak memory of each GPU, and every trial's loss at every step. The losses of d > 1 are
compared with d = 1's: the same training, to bf16 rounding. Then the cost model: fitted to
the smallest d's steps only, it predicts the larger d's step; fitted to every run, it is what
the planner uses for jobs over several GPUs. A prediction is compared with the mean of the
timed steps, what a plan's makespan adds up (and, in the JSON, with their median too).

    python -m benchmarks.multi_gpu --model qwen2.5-7b --seq 1024 --k 16 --gpus 1,2 --out multi_gpu.json

`--dry`: the same on CPU processes (gloo) with the bundled tiny Llama, K=3, 3 steps (for the tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_BASE = {"auto": "auto", "true": True, "false": False}


def worker(args) -> None:
    """One rank of the job (or the only process, for d = 1): build, warm up, time, write."""
    import torch.distributed as dist

    import lora_sweep as ls
    from benchmarks.sweep_gpu import build_model, spec_for, synthetic_rows
    from lora_sweep.tiny import tiny_model_path

    rank, d = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    device = "cpu" if args.dry else "cuda"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(0)  # every rank builds the same weights
    # a path (the bundled tiny Llama, or --from-files' checkpoint): each rank reads its shard
    model = args.checkpoint or (tiny_model_path() if args.dry else build_model(args.model))
    rows = synthetic_rows(512, args.seq, seed=0)
    trials = [ls.TrialConfig(rank=16, alpha=32, learning_rate=1e-3, dropout=0.0, batch_size=1, max_steps=10**6,
                             seed=i, trial_id=f"t{i}") for i in range(args.k)]
    spec = dataclasses.replace(spec_for(model, rows, args.seq, device=device), eval_every=1,
                               output_dir=args.work_dir, shard_base=SHARD_BASE[args.shard_base],
                               cuda_graphs=not args.dry)  # every d replays its steps, unless sharded (eager)
    if isinstance(model, str):
        spec = dataclasses.replace(spec, base_model=model)
    job = ls.PackedJob(spec, trials, progress=False)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds, tokens, rank_tokens, one_off, losses = [], [], [], [], {}
    for _ in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        events = job.step()
        sync()
        seconds.append(time.perf_counter() - start)
        last = job.step_stats[-1]
        counts = torch.tensor([last["tokens"], last["rank_tokens"], last["one_off"]], device=device,
                              dtype=torch.float64)
        if d > 1:
            dist.all_reduce(counts)
        tokens.append(counts[0].item())
        rank_tokens.append(counts[1].item())
        one_off.append(counts[2].item() > 0)  # a rank captured a CUDA graph in this step
        for e in events:
            if isinstance(e, ls.Report):
                losses.setdefault(e.trial_id, []).append(e.metrics["train_loss"])
    peaks = [torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0]
    if d > 1:
        gathered = [None] * d
        dist.all_gather_object(gathered, peaks[0])
        peaks = gathered
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"d": d, "seconds": seconds, "tokens": tokens, "rank_tokens": rank_tokens, "one_off": one_off,
                       "losses": losses, "peak_memory_gb": peaks, "owners": job.ranks.owners if job.ranks else None,
                       "graphed": [s["graphed"] for s in job.step_stats], "sharded": job.sharded,
                       "lengths": [len(s) for s in job.train_samples[:256]]}, f)
    job.release_locks()


def run_on(d: int, args, work: str) -> dict:
    """The worker on `d` GPUs under torchrun; its rank 0's results."""
    arguments = ["--model", args.model, "--seq", str(args.seq), "--k", str(args.k), "--warmup", str(args.warmup),
                 "--steps", str(args.steps), "--shard-base", args.shard_base,
                 "--work-dir", os.path.join(work, f"job{d}")] \
        + (["--checkpoint", args.checkpoint] if args.checkpoint else [])
    return torchrun_worker("benchmarks.multi_gpu", d, arguments, os.path.join(work, f"d{d}.json"), args.dry)


def torchrun_worker(module: str, d: int, arguments: list[str], out: str, dry: bool) -> dict:
    """``python -m module --worker-out out *arguments`` on d ranks under torchrun (GPUs 0 to
    d - 1, or CPU ranks with `dry`, which it passes on as `--dry`): the JSON its rank 0 wrote."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(d),
           "-m", module, "--worker-out", out, *arguments] + (["--dry"] if dry else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    if not dry:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(d)))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"d = {d} failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f)


def write_random_checkpoint(config, directory: str, device: str) -> float:
    """`config`'s architecture with random bf16 weights (normal, std `initializer_range`; norms
    1) as a safetensors checkpoint in `directory`: config.json, a file per decoder layer, one
    for the rest, and their index, written a layer at a time, so the whole base never exists in
    memory. A job over d ranks reads it back shard by shard (`distributed.materialize`), as it
    reads a downloaded model. Returns the seconds it took."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    config.save_pretrained(directory)
    with torch.device("meta"):
        names = AutoModelForCausalLM.from_config(config).named_parameters()  # names and shapes only
    files: dict[str, list] = {}
    for name, param in names:
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        files.setdefault(f"layer-{int(layer.group(1)):03d}.safetensors" if layer else "rest.safetensors",
                         []).append((name, param.shape))
    generator = torch.Generator(device).manual_seed(0)
    std, weight_map = getattr(config, "initializer_range", 0.02), {}
    for file, params in files.items():
        tensors = {name: (torch.ones(shape, dtype=torch.bfloat16) if name.endswith("norm.weight") else
                          (torch.randn(shape, generator=generator, device=device) * std).to(torch.bfloat16).cpu())
                   for name, shape in params}
        save_file(tensors, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return time.perf_counter() - started


def summarise(run: dict, args, shape, peak_tflops: float) -> dict:
    from benchmarks.sweep_gpu import flops

    timed = [i for i in range(args.warmup, len(run["seconds"])) if not run["one_off"][i]]
    step = statistics.median(run["seconds"][i] for i in timed)
    tokens = statistics.mean(run["tokens"][i] for i in timed)
    mean_len = statistics.mean(run["lengths"])
    rank_tokens = statistics.mean(run["rank_tokens"][i] for i in timed)
    step_flops = flops(shape, [mean_len] * round(tokens / mean_len), rank_tokens)
    return {"d": run["d"], "median_step_s": step, "mean_step_s": statistics.mean(run["seconds"][i] for i in timed),
            "tokens_per_step": tokens, "tokens_per_s": tokens / step,
            "max_tokens_per_step": max(run["tokens"][args.warmup:]),
            "mfu": step_flops / step / (run["d"] * peak_tflops * 1e12) if peak_tflops else None,
            "peak_memory_gb": run["peak_memory_gb"], "graphed_steps": sum(run["graphed"][i] for i in timed),
            "timed_steps": len(timed), "sharded": run["sharded"]}


def step_stats(run: dict, args) -> list[dict]:
    """The run's timed steps as `calibrate` reads them (tokens summed over the ranks; steps that
    captured a CUDA graph marked `one_off`, which `calibrate` leaves out)."""
    return [{"tokens": n, "rank_tokens": rn, "num_adapters": args.k, "rank_sum": 16 * args.k, "seconds": s,
             "num_gpus": run["d"], "peak_memory_bytes": max(run["peak_memory_gb"]) * 2**30, "one_off": o}
            for s, n, rn, o in list(zip(run["seconds"], run["tokens"], run["rank_tokens"],
                                        run["one_off"]))[args.warmup:]]


def loss_agreement(run: dict, reference: dict) -> float:
    """The largest relative difference of a trial's loss at a step between two runs."""
    return max(abs(a - b) / abs(b) for t in reference["losses"]
               for a, b in zip(run["losses"][t], reference["losses"][t], strict=True))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--k", type=int, default=16, help="adapters of the job")
    parser.add_argument("--gpus", default="1,2", help="the d to run, comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--shard-base", default="auto", choices=sorted(SHARD_BASE),
                        help="JobSpec.shard_base of the job: auto keeps a base within a quarter of a GPU whole")
    parser.add_argument("--from-files", action="store_true",
                        help="write the random base as a safetensors checkpoint a layer at a time and load it from "
                             "there, each rank reading its shard (for bases larger than one GPU)")
    parser.add_argument("--out", default="benchmarks/results/multi_gpu.json")
    parser.add_argument("--plot", help="a PNG of tokens/s and memory per GPU against d")
    parser.add_argument("--dry", action="store_true", help="CPU (gloo), the tiny Llama, K=3, 3 steps (tests)")
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set: this process is a rank of one run
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)  # --from-files' directory
    args = parser.parse_args(argv)
    if args.worker_out:
        worker(args)
        return {}

    import transformers
    import triton

    import lora_sweep as ls
    from benchmarks.sweep_gpu import ceilings
    from lora_sweep.costmodel import PRESETS, CostModel, ModelShape, calibrate, detect
    from lora_sweep.tiny import tiny_model_path

    gpus = [int(g) for g in args.gpus.split(",")]
    if args.dry:
        args.model, args.seq, args.k, args.warmup, args.steps = "tiny", 64, 3, 1, 3
    elif args.model not in PRESETS:
        parser.error(f"`--model` is {args.model!r}, but must be one of {sorted(PRESETS)}.")
    elif max(gpus) > torch.cuda.device_count():
        parser.error(f"`--gpus` asks for {max(gpus)} GPUs, but this machine has {torch.cuda.device_count()}.")
    peak = None if args.dry else ceilings()["bf16_tflops"]
    torch.cuda.empty_cache()
    config = tiny_model_path() if args.dry else PRESETS[args.model]
    shape = ModelShape.from_config(config)
    with tempfile.TemporaryDirectory() as work:
        written_s = None
        if args.from_files:
            from transformers import AutoConfig

            from benchmarks.sweep_gpu import config_of

            args.checkpoint = os.path.join(work, "base")
            model_config = AutoConfig.from_pretrained(config) if args.dry else config_of(PRESETS[args.model])
            written_s = write_random_checkpoint(model_config, args.checkpoint, "cpu" if args.dry else "cuda")
            print(f"{args.model}: random checkpoint written in {written_s:.0f} s", flush=True)
        runs = {}
        for d in gpus:
            runs[d] = run_on(d, args, work)
            s = summarise(runs[d], args, shape, peak)
            print(f"{args.model} d={d}: {s['tokens_per_s']:,.0f} tokens/s, step {s['median_step_s']:.3f} s, "
                  f"peak {max(s['peak_memory_gb']):.1f} GiB per GPU", flush=True)
    result = {"benchmark": "multi_gpu", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": "cpu" if args.dry else torch.cuda.get_device_name(), "gpus_on_host": torch.cuda.device_count(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "lora_sweep": ls.__version__},
              "model": args.model, "seq": args.seq, "k": args.k, "rank": 16, "steps": args.steps,
              "shard_base": args.shard_base, "from_files": args.from_files, "checkpoint_written_s": written_s,
              "warmup": args.warmup, "bf16_tflops": peak,
              "runs": [summarise(runs[d], args, shape, peak) for d in gpus],
              "losses": {d: runs[d]["losses"] for d in gpus}, "owners": {d: runs[d]["owners"] for d in gpus}}
    if 1 in runs:
        for r in result["runs"]:
            r["speedup"] = r["tokens_per_s"] / result["runs"][gpus.index(1)]["tokens_per_s"]
            r["loss_max_rel_diff"] = loss_agreement(runs[r["d"]], runs[1])
    mean_len = statistics.mean(runs[gpus[0]]["lengths"])
    base = CostModel.from_model(config, gpu=detect("cpu" if args.dry else None), max_seq_len=args.seq,
                                mean_sample_tokens=mean_len)
    fits = {"all": [s for d in gpus for s in step_stats(runs[d], args)]}
    if len(gpus) > 1:  # the smallest d alone: the larger ones are predicted out of sample
        fits[f"d={gpus[0]}"] = step_stats(runs[gpus[0]], args)
    result["cost_model"] = {}
    for name, stats in fits.items():
        cm = calibrate(base, stats)
        result["cost_model"][name] = {
            "calibration": cm.calibration.describe(), "coefficients": dataclasses.asdict(cm.calibration),
            "predicted": {d: {"step_s": cm.step_seconds(r["tokens_per_step"], 16 * r["tokens_per_step"], args.k, d),
                              # the peak comes with the run's largest step
                              "memory_gb": cm.peak_memory(r["max_tokens_per_step"], 16 * r["max_tokens_per_step"],
                                                          16 * args.k, d) / 2**30}
                          for d, r in zip(gpus, result["runs"])}}
        for d, r in zip(gpus, result["runs"]):
            p = result["cost_model"][name]["predicted"][d]
            p["step_error"] = p["step_s"] / r["mean_step_s"] - 1  # a plan's makespan sums steps: their mean
            p["median_step_error"] = p["step_s"] / r["median_step_s"] - 1
            p["memory_error"] = p["memory_gb"] / max(r["peak_memory_gb"]) - 1 if max(r["peak_memory_gb"]) else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(f"{'d':>2} {'tokens/s':>9} {'speedup':>7} {'MFU':>6} {'GiB/GPU':>7} {'loss diff':>9} "
          + " ".join(f"{'pred(' + n + ')':>12}" for n in result["cost_model"]))
    for r in result["runs"]:
        preds = " ".join(f"{result['cost_model'][n]['predicted'][r['d']]['step_error']:>+12.1%}"
                         for n in result["cost_model"])
        speedup = f"{r['speedup']:>6.2f}x" if "speedup" in r else f"{'-':>7}"
        loss = f"{r['loss_max_rel_diff']:>9.1e}" if "loss_max_rel_diff" in r else f"{'-':>9}"
        print(f"{r['d']:>2} {r['tokens_per_s']:>9,.0f} {speedup} {r['mfu'] or 0:>6.1%} "
              f"{max(r['peak_memory_gb']):>7.1f} {loss} {preds}")
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = [r["d"] for r in result["runs"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.bar([str(d) for d in ds], [r["tokens_per_s"] for r in result["runs"]], color="tab:blue")
    left.set(xlabel="GPUs (d)", ylabel="real tokens/s", title=f"{result['model']}, {result['k']} adapters")
    right.bar([str(d) for d in ds], [max(r["peak_memory_gb"]) for r in result["runs"]], color="tab:orange")
    right.set(xlabel="GPUs (d)", ylabel="peak GiB per GPU", title=f"seq {result['seq']}, rank 16")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
