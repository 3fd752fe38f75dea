"""QLoRA: packed adapters on a 4-bit base, against PEFT's QLoRA alone on the same base.

* The base: a real architecture from its config (`costmodel.PRESETS`, up to Llama-3.1-70B),
  random weights, every decoder layer's linears quantized by bitsandbytes as
  soon as that layer is built (`build_quantized`): the model never exists in bf16, so a 70B
  base (about 37 GB in NF4) builds on one 80 GB GPU.
* packed: one `PackedJob` of K rank-16 adapters on it (batch 1, samples of `sweep_gpu`'s
  lengths): median step time over `--steps` after `--warmup`, real tokens/s, MFU against the
  bf16 matmul rate measured in the same run (`sweep_gpu.ceilings`, `sweep_gpu.flops`: padding
  counts nothing), peak memory.
* peft: one adapter alone with PEFT's QLoRA on the same base and samples
  (`peft_baseline.train_alone_with_peft`), the same measurements.

K co-located PEFT QLoRA processes are `peers.py --quantization nf4` (each process loads the
saved model, so for bases that fit the host).

    python -m benchmarks.quantized --model llama-3.1-70b --k 16 --seq 1024 --out results.json

`--dry`: the CPU, a tiny Llama shape, K=2, 2 steps (for the tests).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
from torch import nn

import lora_sweep as ls
from benchmarks.peers import _version, _write
from benchmarks.sweep_gpu import PROJECTIONS, config_of
from lora_sweep.costmodel import PRESETS, ModelShape

# the presets, and a shape of the bundled tokenizer's vocabulary for `--dry`
SHAPES = {**PRESETS, "tiny": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=649)}


def build_quantized(name: str, quantization: str, device: str, dtype: torch.dtype) -> nn.Module:
    """`name`'s architecture with random weights (normal, std 0.02; norms 1), its decoder layers'
    linears bitsandbytes `Linear4bit` of `quantization` ("nf4" or "fp4") with `dtype` as their
    compute dtype, built on the meta device and materialised one layer at a time."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    config = config_of(SHAPES[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    torch.manual_seed(0)
    for layer in model.model.layers:
        layer.to_empty(device=device)
        for child_name, child in list(layer.named_modules()):
            if isinstance(child, nn.Linear):
                weight = torch.randn(child.out_features, child.in_features, device=device, dtype=dtype) * 0.02
                quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=dtype, quant_type=quantization, device="meta")
                quantized.weight = bnb.nn.Params4bit(weight.cpu() if device == "cpu" else weight,
                                                     requires_grad=False, quant_type=quantization).to(device)
                if child.bias is not None:
                    quantized.bias = nn.Parameter(torch.zeros(child.out_features, device=device, dtype=dtype),
                                                  requires_grad=False)
                parent_name, _, attr = child_name.rpartition(".")
                setattr(layer.get_submodule(parent_name) if parent_name else layer, attr, quantized)
            elif hasattr(child, "weight") and child.weight is not None and child.weight.dim() == 1:  # a norm
                child.weight.data.fill_(1.0)
    rest = [model.model.embed_tokens, model.model.norm, model.lm_head]
    for module in rest:
        module.to_empty(device=device)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.02)
        model.model.norm.weight.fill_(1.0)
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight.normal_(0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)  # its buffers computed, not random
    return model.eval().requires_grad_(False)


def _timed_steps(step, device: str, warmup: int, steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `step()` after `warmup` (CUDA events on a GPU)."""
    times = []
    for k in range(warmup + steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            step()
            seconds = time.perf_counter() - t0
        if k >= warmup:
            times.append(seconds)
    return times


def packed(model, k: int, rows, args, device: str) -> dict:
    from benchmarks.sweep_gpu import strip_adapters
    from lora_sweep.tiny import tiny_model_path

    trials = [ls.TrialConfig(rank=16, alpha=32, dropout=0.0, batch_size=1, max_steps=10**6, seed=i,
                             trial_id=f"t{i}") for i in range(k)]
    spec = ls.JobSpec(base_model=lambda: model, tokenizer=tiny_model_path(), train_data=rows, max_seq_len=args.seq,
                      eval_every=10**9, output_dir=args.work_dir, device=device, target_modules=args.targets.split(","),
                      gradient_checkpointing=args.gradient_checkpointing)
    job = ls.PackedJob(spec, trials, progress=False)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = _timed_steps(job.step, device, args.warmup, args.steps)
    stats = job.step_stats[args.warmup:]
    job.release_locks()
    strip_adapters(model)  # the base as it was, for the next run
    if len(job.active) < k:  # out of memory even one sample at a time: the job moved trials out
        raise RuntimeError(f"{k - len(job.active)} of {k} adapters did not fit and were moved out of the job")
    return {"median_step_s": statistics.median(times), "tokens_per_step": statistics.mean(s["tokens"] for s in stats),
            "rank_tokens_per_step": statistics.mean(s["rank_tokens"] for s in stats),
            "lengths": [len(s) for s in job.train_samples[:64]],
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def peft_alone(model, samples, pad_id, args, device: str) -> dict:
    from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft
    cfg = ls.TrialConfig(rank=16, alpha=32, dropout=0.0, batch_size=1, max_steps=10**6, seed=0)
    peft_model = peft_model_for(model, cfg, args.targets.split(","), device=device)
    ends, tokens = [], []

    def on_step(_, n):
        if device == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
        tokens.append(n)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train_alone_with_peft(peft_model, cfg, samples, pad_id, device=device, steps=args.warmup + args.steps + 1,
                          on_step=on_step)
    peft_model.unload()
    times = [b - a for a, b in zip(ends[args.warmup:], ends[args.warmup + 1:])]
    return {"median_step_s": statistics.median(times), "tokens_per_step": statistics.mean(tokens[args.warmup + 1:]),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--quantization", default="nf4", choices=["nf4", "fp4"])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--k", default="16", help="adapters of the packed job, comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-peft", action="store_true", help="the packed job only")
    parser.add_argument("--targets", default=",".join(PROJECTIONS), help="the projections given adapters")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="the packed job recomputes base activations (with --no-peft: PEFT's side runs without)")
    parser.add_argument("--memory-gib", type=float,
                        help="cap this process's GPU memory (torch's allocator) at this many GiB, e.g. 79 for an "
                             "H100 80GB's")
    parser.add_argument("--work-dir", default="/tmp/lora_sweep_quantized")
    parser.add_argument("--out", default="benchmarks/results/quantized.json")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shape, K=2, 2 steps (tests)")
    args = parser.parse_args(argv)
    if args.gradient_checkpointing and not args.no_peft:
        parser.error("`--gradient-checkpointing` is the packed job's alone: give it with `--no-peft`.")
    ks = [int(k) for k in args.k.split(",")]
    device, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    if args.dry:
        args.model, args.seq, args.warmup, args.steps, ks = "tiny", 64, 1, 2, [2]

    from benchmarks.sweep_gpu import ceilings, flops, synthetic_rows, tokenized

    if args.memory_gib and device == "cuda":
        torch.cuda.set_per_process_memory_fraction(args.memory_gib * 2**30 / torch.cuda.mem_get_info()[1])
    started = time.perf_counter()
    model = build_quantized(args.model, args.quantization, device, dtype)
    build_s = time.perf_counter() - started
    rows = synthetic_rows(256, args.seq, seed=0)
    peak = ceilings()["bf16_tflops"] if device == "cuda" else None
    shape = ModelShape.from_config(SHAPES[args.model])
    result = {"benchmark": "quantized", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": args.model,
              "quantization": args.quantization, "seq": args.seq, "rank": 16, "build_s": build_s,
              "targets": args.targets.split(","), "gradient_checkpointing": args.gradient_checkpointing,
              "memory_cap_gib": args.memory_gib,
              "bf16_tflops": peak, "versions": {d: _version(d) for d in ("torch", "triton", "transformers", "peft",
                                                                        "bitsandbytes", "lora_sweep")},
              "runs": []}

    def rates(r):
        tps = r["tokens_per_step"] / r["median_step_s"]
        lengths = r.pop("lengths", None)
        mfu = None
        if peak and lengths:
            mean_len = statistics.mean(lengths)
            step_flops = flops(shape, [mean_len] * round(r["tokens_per_step"] / mean_len), r["rank_tokens_per_step"],
                               modules=args.targets.split(","))
            mfu = step_flops / r["median_step_s"] / (peak * 1e12)
        return {**r, "tokens_per_s": tps, "mfu": mfu}

    for k in ks:
        result["runs"].append({"method": "packed", "k": k, **rates(packed(model, k, rows, args, device))})
        print(f"packed K={k}: {result['runs'][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
        _write(result, args.out)
    if not args.no_peft:
        samples, pad_id = tokenized(model, rows, args.seq, device=device)
        result["runs"].append({"method": "peft", "k": 1, **rates(peft_alone(model, samples, pad_id, args, device))})
        print(f"peft alone: {result['runs'][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    _write(result, args.out)
    return result


if __name__ == "__main__":
    main()
