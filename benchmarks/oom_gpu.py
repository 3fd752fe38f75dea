"""Out-of-memory recovery on a real GPU: a packed job sized over the memory it may use
(`torch.cuda.set_per_process_memory_fraction`) splits its steps into microbatches and every
trial finishes with the losses of an unconstrained run.

    python -m benchmarks.oom_gpu --out benchmarks/results/oom_gpu_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

import lora_sweep as ls
from lora_sweep.engine import Finished, Report

from benchmarks.sweep_gpu import build_model, spec_for, strip_adapters, synthetic_rows


def run(model, rows, seq, steps):
    trials = [ls.TrialConfig(rank=r, alpha=2 * r, batch_size=8, dropout=0.0, max_steps=steps, seed=i,
                             trial_id=f"t{i}") for i, r in enumerate([8, 16, 32, 64, 16, 8, 128, 32])]
    spec = spec_for(model, rows, seq)
    spec.eval_every = 1
    job = ls.PackedJob(spec, trials, progress=False)
    torch.cuda.reset_peak_memory_stats()
    events = list(job.run())
    losses = {e.trial_id: e.metrics["train_loss"] for e in events if isinstance(e, Report)}
    finished = sorted(e.trial_id for e in events if isinstance(e, Finished))
    out = {"finished": finished, "last_losses": losses, "microbatch_tokens": job.microbatch_tokens,
           "microbatches": [s["microbatches"] for s in job.step_stats],
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del job
    strip_adapters(model)
    torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/oom_gpu.json")
    args = parser.parse_args()
    model = build_model(args.model)
    rows = synthetic_rows(256, args.seq, seed=5)
    free = run(model, rows, args.seq, args.steps)
    total = torch.cuda.get_device_properties(0).total_memory
    weights = torch.cuda.memory_allocated()
    limit = weights + 0.5 * (free["peak_gib"] * 2**30 - weights)  # half the activations' room
    torch.cuda.set_per_process_memory_fraction(limit / total)
    tight = run(model, rows, args.seq, args.steps)
    torch.cuda.set_per_process_memory_fraction(1.0)
    worst = max(abs(tight["last_losses"][t] / free["last_losses"][t] - 1) for t in free["last_losses"])
    result = {"benchmark": "oom_gpu", "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "lora_sweep": ls.__version__},
              "model": args.model, "seq": args.seq, "limit_gib": limit / 2**30, "unconstrained": free,
              "constrained": tight,
              "summary": {"all_finished": tight["finished"] == free["finished"] == sorted(free["last_losses"]),
                          "split": max(tight["microbatches"]) > 1, "max_rel_loss_diff": worst}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"unconstrained peak {free['peak_gib']:.1f} GiB; limit {limit / 2**30:.1f} GiB -> microbatches "
          f"{tight['microbatches']}, cap {tight['microbatch_tokens']} tokens; all finished: "
          f"{result['summary']['all_finished']}; worst loss difference {worst:.2e}")


if __name__ == "__main__":
    main()
