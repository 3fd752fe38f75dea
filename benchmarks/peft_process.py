"""One PEFT trial in a process of its own, as a sweep of separate fine-tunes runs it.

A PEFT step on a small model is host-bound, and it costs more the first time a process meets
its shapes (cuBLAS's and SDPA's kernel choice): on an H200 one config stepped in 172 ms as a
process's first run and in 80 ms later in the same process. A baseline that runs every trial
in one process therefore speeds up as it goes; run each trial here and it starts cold, as a
user's separate fine-tunes do. `sweep_gpu.py`'s makespan uses it for every PEFT trial.

    python -m benchmarks.peft_process --model llama-3.2-1b --seq 256 --rows-seed 3 \\
        --config '{"rank": 16, "alpha": 32, "batch_size": 4, "max_steps": 20}' --out DIR

prints one JSON line: `trial_s`, the seconds from wrapping the model to its adapter saved in
DIR (building the model and tokenising are left out, as in the in-process baseline),
`step_s`, the seconds between consecutive optimizer steps, `tokens`, each step's real
tokens, and `peak_memory_gb`, the process's peak of allocated CUDA memory. `--model` is a
name in `costmodel.PRESETS` (random weights, built on the GPU) or a saved model's directory.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import lora_sweep as ls
from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft
from benchmarks.sweep_gpu import PROJECTIONS, build_model, synthetic_rows, tokenized


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a name in costmodel.PRESETS, or a saved model's directory")
    parser.add_argument("--config", required=True, help="the trial's TrialConfig fields, as JSON")
    parser.add_argument("--out", required=True, help="directory the adapter is saved in")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--rows-seed", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    cfg = ls.TrialConfig.from_dict(json.loads(args.config))
    if os.path.isdir(args.model):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval().requires_grad_(False)
    else:
        model = build_model(args.model)  # random bf16 weights on the GPU
    samples, pad_id = tokenized(model, synthetic_rows(args.rows, args.seq, seed=args.rows_seed), args.seq,
                                device=args.device)

    on_cuda = args.device == "cuda"
    marks, tokens_per_step = [], []  # per step, without waiting for the device: CUDA events there, host clocks here

    def on_step(k, tokens):
        tokens_per_step.append(tokens)
        if on_cuda:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:
            marks.append(time.perf_counter())

    if on_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    peft_model = peft_model_for(model, cfg, PROJECTIONS, device=args.device)
    train_alone_with_peft(peft_model, cfg, samples, pad_id, device=args.device, on_step=on_step)
    peft_model.save_pretrained(args.out)
    if on_cuda:
        torch.cuda.synchronize()
    trial_s = time.perf_counter() - t0
    step_s = [a.elapsed_time(b) / 1e3 if on_cuda else b - a for a, b in zip(marks, marks[1:])]
    peak_memory_gb = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
    print(json.dumps({"trial_s": trial_s, "step_s": step_s, "tokens": tokens_per_step,
                      "peak_memory_gb": peak_memory_gb}))


if __name__ == "__main__":
    main()
