"""8 adapters packed in one PackedJob against the same 8 trained one after another with PEFT,
on the bundled tiny model, on CPU, same steps and samples. Prints both times and the ratio.

    python -m benchmarks.engine_cpu [--steps 30] [--out benchmarks/results/engine_cpu.json]

Both sides include loading the base model (the packed job loads it once, the PEFT loop once per
trial, as a sweep does today); the training-only times are reported too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time

import torch
import transformers
import peft

import lora_sweep as ls
from lora_sweep.engine import PackedJob
from lora_sweep.tiny import tiny_model_path, tiny_task_paths

from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft


def eight_trials(steps: int) -> list[ls.TrialConfig]:
    ranks = [4, 8, 16, 8, 4, 16, 8, 4]
    batches = [1, 2, 4, 2, 1, 4, 2, 1]
    lrs = [3e-4, 1e-3, 2e-3, 5e-4, 1e-3, 3e-3, 2e-4, 1e-3]
    return [ls.TrialConfig(rank=r, alpha=2 * r, learning_rate=lr, batch_size=b, max_steps=steps, dropout=0.0,
                           seed=i, trial_id=f"t{i}") for i, (r, b, lr) in enumerate(zip(ranks, batches, lrs))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "engine_cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train, dev = tiny_task_paths()
    out_dir = tempfile.mkdtemp()
    spec = ls.JobSpec(base_model=tiny_model_path(), train_data=train, eval_data=None, max_seq_len=24,
                      eval_every=10**9, output_dir=out_dir, device="cpu", padding="longest")
    trials = eight_trials(args.steps)

    # packed: one base model, every adapter in the same forward/backward
    t0 = time.perf_counter()
    job = PackedJob(spec, trials, progress=False)
    t_load = time.perf_counter()
    for _ in job.run():
        pass
    packed_total, packed_train = time.perf_counter() - t0, time.perf_counter() - t_load

    # sequential PEFT: what a sweep does today, one fine-tune after another
    samples, pad_id = job.train_samples, job.pad_id
    seq_total = seq_train = 0.0
    for cfg in trials:
        t0 = time.perf_counter()
        model = peft_model_for(tiny_model_path(), cfg, spec.target_modules)
        t_load = time.perf_counter()
        train_alone_with_peft(model, cfg, samples, pad_id)
        seq_total += time.perf_counter() - t0
        seq_train += time.perf_counter() - t_load

    result = {
        "benchmark": "engine_cpu",
        "date": datetime.date.today().isoformat(),
        "machine": {"processor": platform.processor() or platform.machine(), "threads": args.threads,
                    "cpus": os.cpu_count()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "lora_sweep": ls.__version__},
        "setup": {"adapters": len(trials), "steps": args.steps, "ranks": [t.rank for t in trials],
                  "batch_sizes": [t.batch_size for t in trials], "padding": spec.padding},
        "packed_seconds": packed_total, "packed_train_seconds": packed_train,
        "sequential_peft_seconds": seq_total, "sequential_peft_train_seconds": seq_train,
        "summary": {"speedup": seq_total / packed_total, "speedup_train_only": seq_train / packed_train},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'':24}{'total s':>10}{'train s':>10}")
    print(f"{'packed (PackedJob)':24}{packed_total:10.2f}{packed_train:10.2f}")
    print(f"{'sequential PEFT':24}{seq_total:10.2f}{seq_train:10.2f}")
    print(f"{'speedup':24}{seq_total / packed_total:10.2f}x{seq_train / packed_train:9.2f}x")


if __name__ == "__main__":
    main()
