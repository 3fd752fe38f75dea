"""Does the cost model hold on a real GPU? Memory and step time of packed jobs, predicted
against measured, on real architectures with random bf16 weights.

For each model: calibrate the step-time coefficients on a few profiled steps of jobs of 1,
4 and 16 adapters (PLoRA profiles ~10 steps), then run three other packed jobs of 1 to 16 adapters (mixed ranks and batch sizes)
and compare, per job, the memory model's peak with `torch.cuda.max_memory_allocated` (the
roofline memory model, not the calibrated one: it must hold before anything was run) and
the calibrated step time with the median measured one. Samples are max_seq_len tokens
long, the length the memory model plans for.

    python -m benchmarks.costmodel_gpu --out benchmarks/results/costmodel_gpu_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch

import lora_sweep as ls
from lora_sweep.costmodel import PRESETS, CostModel, calibrate, detect, profile_job

from benchmarks.sweep_gpu import build_model, spec_for, strip_adapters

JOBS = {  # three packed jobs per model: (rank, batch size) of each adapter
    "one": [(16, 4)],
    "four": [(8, 1), (16, 2), (64, 4), (128, 1)],
    "sixteen": [(r, b) for r, b in zip([8, 16, 32, 64, 128, 8, 16, 32] * 2, [1, 2, 1, 4, 1, 2, 1, 1] * 2)],
}
# profiling jobs of 1, 4 and 16 adapters (other ranks and batches than the jobs checked): a
# calibration should span the pack sizes it will predict; a small step is host-bound, a large
# one device-bound, and a linear fit only interpolates between the two
PROFILE = [(32, 2), (8, 4), (128, 2), (16, 1)] + [(r, b) for r, b in zip([64, 8, 16, 32, 128, 16] * 2,
                                                                          [1, 1, 2, 2, 1, 4] * 2)]


def full_length_rows(n: int, seq_len: int) -> list[dict]:
    """Rows of exactly `seq_len` tokens with the bundled tokenizer (one token per word, plus BOS/EOS)."""
    return [{"text": " ".join(["the"] * (seq_len - 2))} for _ in range(n)]


def trials_of(pairs, prefix):
    return [ls.TrialConfig(rank=r, alpha=2 * r, batch_size=b, dropout=0.05, max_steps=10**6, seed=i,
                           trial_id=f"{prefix}{i}") for i, (r, b) in enumerate(pairs)]


def check_model(name: str, seq: int, warmup: int, steps: int, log) -> dict:
    model = build_model(name)
    rows = full_length_rows(256, seq)
    spec = spec_for(model, rows, seq)
    roofline = CostModel.from_model(PRESETS[name], gpu=detect(), max_seq_len=seq, dtype="bfloat16")

    # a few steps of jobs of 1, 3 and 6 adapters: the fit needs steps that differ in tokens,
    # rank-tokens and adapter count to tell its terms apart
    profile = []
    for k in (1, 4, 16):
        job = ls.PackedJob(spec, trials_of(PROFILE[:k], "p"), progress=False)
        profile += profile_job(job, steps=4, warmup=2)
        del job
        strip_adapters(model)
    calibrated = calibrate(roofline, profile)
    torch.cuda.empty_cache()

    jobs = {}
    for label, pairs in JOBS.items():
        trials = trials_of(pairs, label)
        job = ls.PackedJob(spec, trials, progress=False)
        stats = profile_job(job, steps=steps, warmup=warmup)
        del job
        strip_adapters(model)
        torch.cuda.empty_cache()
        peak = max(s["peak_memory_bytes"] for s in stats)
        seconds = statistics.median(s["seconds"] for s in stats)
        predicted_memory = roofline.memory_per_gpu(trials)
        predicted_seconds = calibrated.job_step_seconds(trials)
        jobs[label] = {"adapters": len(trials), "tokens_per_step": statistics.mean(s["tokens"] for s in stats),
                       "measured_peak_gib": peak / 2**30, "predicted_peak_gib": predicted_memory / 2**30,
                       "memory_error": predicted_memory / peak - 1, "measured_step_s": seconds,
                       "predicted_step_s": predicted_seconds, "time_error": predicted_seconds / seconds - 1,
                       "memory_terms_gib": {k: v / 2**30 for k, v in roofline.memory_terms(
                           *roofline._totals(trials, for_time=False), 1).items()}}
        log(f"{name} {label:8s} memory {peak / 2**30:6.1f} GiB measured, {predicted_memory / 2**30:6.1f} predicted "
            f"({jobs[label]['memory_error']:+.1%}); step {seconds * 1e3:7.1f} ms measured, "
            f"{predicted_seconds * 1e3:7.1f} predicted ({jobs[label]['time_error']:+.1%})")
    del model
    torch.cuda.empty_cache()
    return {"model": name, "seq": seq, "calibration": calibrated.calibration.describe(), "jobs": jobs,
            "profile_stats": profile}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.2-1b,qwen2.5-7b")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results/costmodel_gpu.json")
    args = parser.parse_args()

    def log(msg):
        print(msg, flush=True)

    import transformers
    import triton

    result = {"benchmark": "costmodel_gpu", "date": datetime.date.today().isoformat(),
              "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "triton": triton.__version__,
                           "transformers": transformers.__version__, "lora_sweep": ls.__version__},
              "models": [check_model(m, args.seq, args.warmup, args.steps, log) for m in args.models.split(",")]}
    errors = [j for m in result["models"] for j in m["jobs"].values()]
    result["summary"] = {"max_abs_memory_error": max(abs(j["memory_error"]) for j in errors),
                         "max_abs_time_error": max(abs(j["time_error"]) for j in errors),
                         "within_15_percent": all(abs(j["memory_error"]) <= 0.15 and abs(j["time_error"]) <= 0.15
                                                  for j in errors)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()
