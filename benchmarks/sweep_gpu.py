"""End-to-end GPU evidence: packed LoRA jobs against one trial at a time with PEFT.

Real architectures built from their configs with random bf16 weights (nothing is
downloaded), samples of varying length, one GPU. Sections (pick with --sections):

* throughput  packed jobs of 1..32 adapters vs one adapter alone with PEFT: tokens/s,
              the ratio, and MFU against the bf16 peak measured in the same run
* kernels     the packed job with the Triton kernels vs the torch path (LORA_SWEEP_KERNELS=torch),
              and how much of a step each keeps the GPU busy (--kernels-model, --kernels-seq,
              --kernels-adapters)
* host        where a packed step's time goes (the same job, kernels):
              wall time, the host's time to enqueue the forward + loss and the backward,
              Triton launches and synchronisations per step, the GPU's time
* makespan    120 configs of PLoRA's Table 1 space: the planner's predicted makespan for
              lora_sweep and for one-trial-at-a-time PEFT, and a measured 16-config subset
              both ways against the prediction (each trial's adapter saved, both ways; each
              PEFT trial a process of its own unless --peft-in-process); then the subset as
              co-located PEFT processes, as many at once as fit the GPU (Ray Tune's
              fractional GPUs), wall time from the first start to the last end
* overhead    the same 16 configs through PackedLoRASampler vs PackedJob driven directly

    python -m benchmarks.sweep_gpu --models llama-3.2-1b --seq 256 --out results.json

Timing: CUDA events around each optimizer step after warm-up, medians. Model building is
left out of every timing (random weights would flatter a load time).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import random
import statistics
import tempfile
import time
import warnings

import torch
from torch import nn

import lora_sweep as ls
from lora_sweep.costmodel import PRESETS, ModelShape
from lora_sweep.layers import FusedGatedMLP, FusedRMSNorm, MultiLoRALinear
from lora_sweep.model import swap_children
from lora_sweep.tiny import tiny_model_path

from benchmarks.peft_baseline import peft_model_for, train_alone_with_peft

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIXED_RANKS = [8, 16, 32, 64, 128, 8, 16, 32, 64, 128, 16, 32, 8, 64, 16, 128]  # PLoRA-style spread


# --------------------------------------------------------------------------- set-up


def config_of(fields: dict, **overrides):
    """A transformers config from a shape's fields (`model_type` and the config's own, as in
    `lora_sweep.costmodel.PRESETS`), with `overrides` on top."""
    from transformers import AutoConfig

    fields = {**fields, **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_model(name: str) -> nn.Module:
    """A real architecture from its config, random bf16 weights, on the GPU."""
    from transformers import AutoModelForCausalLM

    config = config_of(PRESETS[name])
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def strip_adapters(model: nn.Module) -> nn.Module:
    """Put the plain linear layers, the model's own norms and MLPs and SDPA attention back
    after a packed job, so the next run (PEFT's included) starts clean."""
    # first the fused modules, whose originals hold the projections
    swap_children(model, lambda m: m.original if isinstance(m, (FusedRMSNorm, FusedGatedMLP)) else None)
    swap_children(model, lambda m: m.base_layer if isinstance(m, MultiLoRALinear) else None)
    model.config._attn_implementation = "sdpa"
    return model


def synthetic_rows(n: int, seq_len: int, seed: int) -> list[dict]:
    """{"text"} rows whose lengths spread like real tasks: log-normal around 40% of the
    maximum, clipped to [10%, 100%] (GLUE-like at 256, GSM8K-like at 1024). Each word of
    the bundled tokenizer's vocabulary is one token."""
    from transformers import AutoTokenizer

    # sorted: the vocabulary's order differs between processes, and the ranks of a job must agree
    words = sorted(w.lstrip("Ġ") for w in AutoTokenizer.from_pretrained(tiny_model_path()).get_vocab()
                   if w.startswith("Ġ") and w[1:].isalpha())
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = int(min(seq_len, max(0.1 * seq_len, rng.lognormvariate(math.log(0.4 * seq_len), 0.5)))) - 2
        rows.append({"text": " ".join(rng.choice(words) for _ in range(max(1, length)))})
    return rows


def spec_for(model, rows, seq_len, device="cuda", **kw) -> ls.JobSpec:
    return ls.JobSpec(base_model=lambda: model, tokenizer=tiny_model_path(), train_data=rows, max_seq_len=seq_len,
                      eval_every=10**9, output_dir=f"/tmp/lora_sweep_bench/{os.getpid()}", device=device, **kw)


def flops(shape: ModelShape, lengths: list[int], rank_tokens: float, modules=PROJECTIONS) -> float:
    """Model FLOPs of one training step: forward + input-gradient of the base (4 x GEMM
    parameters x tokens, the LM head included), causal attention (forward 2*l^2*d per
    layer, backward twice that) and the LoRA matmuls (6 x rank x (in + out) per token)."""
    gemm_params = shape.num_layers * sum(a * b for a, b in shape.linear_dims.values()) \
        + shape.vocab_size * shape.hidden_size
    tokens = sum(lengths)
    attention = 3 * sum(2 * l * l * shape.q_dim for l in lengths) * shape.num_layers
    lora = 6 * rank_tokens * shape.lora_dims(modules) * shape.num_layers
    return 4 * gemm_params * tokens + attention + lora


def ceilings() -> dict:
    """The GPU's measured bf16 matmul rate and copy bandwidth, the denominators of MFU."""
    a, b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16), torch.randn(8192, 8192, device="cuda",
                                                                                      dtype=torch.bfloat16)
    x = torch.randn(2**30 // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    mm = _median_ms(lambda: a @ b, 20)
    cp = _median_ms(lambda: y.copy_(x), 20)
    return {"bf16_tflops": 2 * 8192**3 / mm / 1e9, "copy_gbps": 2 * x.numel() * 2 / cp / 1e6}


@contextlib.contextmanager
def timed_calls(patches):
    """Within the block, `patches` [(owner, attribute name, key)] are wrapped so that each call
    adds its seconds to the yielded Counter under `key` (calls are counted where `key` is None);
    the originals are put back after it. `owner` may be a class, a module or one instance."""
    totals = collections.Counter()
    originals = [getattr(owner, name) for owner, name, _ in patches]

    def timed(orig, key):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                if key is not None:
                    totals[key] += time.perf_counter() - t
                totals["calls" if key is None else key + "_calls"] += 1
        return call

    for (owner, name, key), orig in zip(patches, originals):
        setattr(owner, name, timed(orig, key))
    try:
        yield totals
    finally:
        for (owner, name, _), orig in zip(patches, originals):
            setattr(owner, name, orig)


def _median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# --------------------------------------------------------------------------- one measurement


def time_packed(model, trials, rows, seq_len, warmup: int, steps: int, gpu_busy: bool = False, **spec_kw) -> dict:
    """Median step time of one packed job, timed per step with CUDA events; with `gpu_busy`,
    also where a step's time goes (`gpu_profile`)."""
    job = ls.PackedJob(spec_for(model, rows, seq_len, **spec_kw), trials, progress=False)
    torch.cuda.reset_peak_memory_stats()
    times = []
    with warnings.catch_warnings(record=True) as caught:  # a failed capture, say: kept in the result
        warnings.simplefilter("always")
        for k in range(warmup + steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            failed = [e for e in job.step() if isinstance(e, ls.Failed)]
            end.record()
            torch.cuda.synchronize()
            if failed:  # a timing of the trials left would not be the one asked for
                raise RuntimeError(f"trial {failed[0].trial_id} failed at step {k}: {failed[0].reason}")
            if k >= warmup:
                times.append(start.elapsed_time(end) / 1e3)
    stats = job.step_stats[warmup:]
    result = {"median_step_s": statistics.median(times), "tokens_per_step": statistics.mean(s["tokens"] for s in stats),
              "padded_tokens_per_step": statistics.mean(s["padded_tokens"] for s in stats),
              "rank_tokens_per_step": statistics.mean(s["rank_tokens"] for s in stats),
              "lengths": [len(job.train_samples[i]) for i in range(64)],
              "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30, "step_stats": stats,
              "warnings": sorted({str(w.message)[:500] for w in caught})}
    if gpu_busy:
        result.update(gpu_profile(job))
    job.release_locks()  # the next job of the same trial ids writes to the same output_dir
    del job
    strip_adapters(model)
    torch.cuda.empty_cache()
    return result


def gpu_profile(job, steps: int = 5) -> dict:
    """Where `steps` steps of `job` spend their wall time (torch profiler, CUDA activity only):

    * gpu_s_per_step: the union of the GPU's kernel, copy and fill intervals (kernels on the
      backward's second stream overlap those of the first: their union, not their sum);
    * gpu_busy_share: that union over the steps' wall time;
    * host_s_per_step: the median step's wall time less what its host waited for the GPU at
      its end (`step_stats`' gpu_wait_s): the host's own work, which bounds the step from below;
    * kernels: where the GPU's time goes, the 25 kernels (by name) of most time, each with its
      seconds a step and calls a step, the rest summed under "other".
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            job.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    on_gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in on_gpu):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    busy /= 1e6  # microseconds
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    for e in on_gpu:
        per_kernel[e.name][0] += (e.time_range.end - e.time_range.start) / 1e6 / steps
        per_kernel[e.name][1] += 1 / steps
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    kernels = [{"name": name[:120], "s_per_step": t, "calls_per_step": n} for name, (t, n) in ranked[:25]]
    kernels.append({"name": "other", "s_per_step": sum(t for _, (t, _) in ranked[25:]),
                    "calls_per_step": sum(n for _, (_, n) in ranked[25:])})
    stats = job.step_stats[-steps:]
    return {"gpu_s_per_step": busy / steps, "wall_s_per_step": wall / steps, "gpu_busy_share": busy / wall,
            "host_s_per_step": statistics.median(s["seconds"] - s["gpu_wait_s"] for s in stats),
            "kernels": kernels}


def host_profile(job, steps: int = 3, top: int = 25) -> dict:
    """Where the host's time in `steps` steps of `job` goes (cProfile): the `top` functions of
    most own time ("own") and of most time with their callees ("cumulative"), each with both
    in seconds a step and its calls a step. cProfile slows Python down, so the seconds are an
    upper bound and the ranking is what counts."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        job.step()
    torch.cuda.synchronize()
    profiler.disable()
    rows = pstats.Stats(profiler).stats.items()  # (file, line, name) -> (prim calls, calls, own, cumulative, ..)

    def entry(where, numbers):
        (file, line, name), (_, calls, own, cum, _) = where, numbers
        short = os.path.relpath(file) if file.startswith("/") else file
        return {"function": f"{short}:{line}({name})"[-160:], "own_s_per_step": own / steps,
                "cumulative_s_per_step": cum / steps, "calls_per_step": calls / steps}

    return {order: [entry(*kv) for kv in sorted(rows, key=lambda kv: -kv[1][column])[:top]]
            for order, column in (("own", 2), ("cumulative", 3))}


def tokenized(model, rows, seq_len, device="cuda"):
    """The samples and pad id of `rows` exactly as a packed job tokenises them, for the PEFT side."""
    job = ls.PackedJob(spec_for(model, rows, seq_len, device=device), [], progress=False)
    samples, pad_id = job.train_samples, job.pad_id
    del job
    strip_adapters(model)
    return samples, pad_id


def time_peft(model, cfg, rows, seq_len, warmup: int, steps: int) -> dict:
    """Median step time of one adapter trained alone with PEFT, the same samples."""
    samples, pad_id = tokenized(model, rows, seq_len)
    peft_model = peft_model_for(model, cfg, PROJECTIONS, device="cuda")
    marks, tokens = [], []

    def on_step(k, n):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append(event)
        tokens.append(n)

    torch.cuda.reset_peak_memory_stats()
    train_alone_with_peft(peft_model, cfg, samples, pad_id, device="cuda", steps=warmup + steps, on_step=on_step)
    torch.cuda.synchronize()
    times = [marks[k].elapsed_time(marks[k + 1]) / 1e3 for k in range(warmup, warmup + steps - 1)]
    peft_model.unload()
    torch.cuda.empty_cache()
    return {"median_step_s": statistics.median(times), "tokens_per_step": statistics.mean(tokens[warmup + 1:]),
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
            "step_s": times, "tokens": tokens[warmup + 1:]}  # each interval with the tokens of the step ending it


def peft_in_process_of_its_own(model_name, cfg, seq_len, rows_seed, out_dir) -> dict:
    """One PEFT trial run by `benchmarks.peft_process` in a fresh process (cold, as a user's
    separate fine-tune): its `trial_s` and `step_s`."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "benchmarks.peft_process", "--model", model_name, "--seq", str(seq_len),
           "--rows-seed", str(rows_seed), "--config", json.dumps(cfg.to_dict()), "--out", out_dir]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"PEFT trial {cfg.trial_id} exited with {done.returncode}: {done.stderr[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- sections


def throughput(models, seqs, adapter_counts, batches, peak, warmup, steps, log,
               rank_sets=("16", "mixed")) -> list[dict]:
    rows_out = []
    for name in models:
        model = build_model(name)
        shape = ModelShape.from_config(PRESETS[name])
        for seq in seqs:
            rows = synthetic_rows(512, seq, seed=0)
            for batch in batches:
                solo_cfg = ls.TrialConfig(rank=16, alpha=32, dropout=0.05, batch_size=batch, max_steps=10**6)
                solo = time_peft(model, solo_cfg, rows, seq, warmup, steps)
                solo_tps = solo["tokens_per_step"] / solo["median_step_s"]
                log(f"{name} seq {seq} batch {batch}: PEFT alone {solo_tps:,.0f} tok/s")
                for ranks in rank_sets:
                    for n in adapter_counts:
                        if ranks == "mixed" and n < 4:
                            continue
                        trials = [ls.TrialConfig(rank=16 if ranks == "16" else MIXED_RANKS[i % 16],
                                                 alpha=32, dropout=0.05, batch_size=batch, max_steps=10**6,
                                                 seed=i, trial_id=f"t{i}") for i in range(n)]
                        try:
                            r = time_packed(model, trials, rows, seq, warmup, steps,
                                            max_tokens_per_microbatch=64 * 1024)
                        except torch.OutOfMemoryError as err:
                            log(f"  {n} adapters: out of memory ({err})")
                            strip_adapters(model)
                            torch.cuda.empty_cache()
                            continue
                        lengths = r.pop("lengths")
                        mean_len = statistics.mean(lengths)
                        per_step = flops(shape, [mean_len] * round(r["tokens_per_step"] / mean_len),
                                         r["rank_tokens_per_step"])
                        solo_flops = flops(shape, [mean_len] * max(1, round(solo["tokens_per_step"] / mean_len)),
                                           16 * solo["tokens_per_step"])
                        tps = r["tokens_per_step"] / r["median_step_s"]
                        row = {"model": name, "seq": seq, "batch": batch, "ranks": ranks, "adapters": n,
                               "tokens_per_s": tps, "solo_tokens_per_s": solo_tps, "ratio": tps / solo_tps,
                               "mfu": per_step / r["median_step_s"] / (peak * 1e12),
                               "solo_mfu": solo_flops / solo["median_step_s"] / (peak * 1e12),
                               "padding_waste": 1 - r["tokens_per_step"] / r["padded_tokens_per_step"],
                               "peak_memory_gb": r["peak_memory_gb"], "solo_peak_memory_gb": solo["peak_memory_gb"],
                               "median_step_s": r["median_step_s"], "solo_median_step_s": solo["median_step_s"],
                               "step_stats": r["step_stats"], "warnings": r["warnings"]}
                        rows_out.append(row)
                        log(f"  {n:2d} adapters ({ranks}): {tps:,.0f} tok/s, {row['ratio']:.1f}x, "
                            f"MFU {row['mfu']:.1%} (alone {row['solo_mfu']:.1%}), padding {row['padding_waste']:.0%}, "
                            f"{r['peak_memory_gb']:.1f} GiB")
        del model
        torch.cuda.empty_cache()
    return rows_out


def kernels(model_name, seq, n, peak, warmup, steps, log) -> dict:
    model = build_model(model_name)
    rows = synthetic_rows(512, seq, seed=1)
    # dropout 0: the torch path's counter-based masks are built from many elementwise integer ops
    # (it is the reference, not a fast path); the kernels' dropout costs ~3% (benchmarks/kernels.py)
    trials = [ls.TrialConfig(rank=16, alpha=32, dropout=0.0, batch_size=1, max_steps=10**6, seed=i,
                             trial_id=f"t{i}") for i in range(n)]
    out = {}
    # the kernels, then the torch path
    for mode in ("triton", "torch"):
        os.environ["LORA_SWEEP_KERNELS"] = mode
        r = time_packed(model, trials, rows, seq, warmup, steps, gpu_busy=True)
        out[mode] = {"tokens_per_s": r["tokens_per_step"] / r["median_step_s"], "median_step_s": r["median_step_s"],
                     "gpu_s_per_step": r["gpu_s_per_step"], "gpu_busy": r["gpu_busy_share"],
                     "peak_memory_gb": r["peak_memory_gb"]}
        log(f"{model_name} seq {seq}, {n} adapters, {mode}: {out[mode]['tokens_per_s']:,.0f} tok/s, "
            f"GPU busy {out[mode]['gpu_busy']:.0%} of a step")
    os.environ.pop("LORA_SWEEP_KERNELS")
    out["speedup"] = out["triton"]["tokens_per_s"] / out["torch"]["tokens_per_s"]
    del model
    torch.cuda.empty_cache()
    return {"model": model_name, "seq": seq, "adapters": n, **out}


def step_host(model_name, seq, n, warmup, steps, log) -> dict:
    """Where the wall time of a packed step goes (the `kernels` section's job, Triton path):
    host seconds inside the forward + loss (`PackedJob._adapter_losses`), inside the backward
    (`torch.autograd.grad`) and inside the optimizer step, each timed around the call with
    the GPU running behind; Triton launches per step; the synchronising CUDA calls of one
    step (torch's sync debug mode) and where they come from; the GPU's own time of a step
    (`gpu_profile`). A step whose host time reaches its wall time is host-bound. The
    eager step's (`cuda_graphs=False`): a replayed step's host work is none of these."""
    import warnings

    from triton.runtime.jit import JITFunction

    model = build_model(model_name)
    rows = synthetic_rows(512, seq, seed=1)
    trials = [ls.TrialConfig(rank=16, alpha=32, dropout=0.0, batch_size=1, max_steps=10**6, seed=i,
                             trial_id=f"t{i}") for i in range(n)]
    job = ls.PackedJob(spec_for(model, rows, seq, cuda_graphs=False), trials, progress=False)
    for _ in range(warmup):
        job.step()
    patches = [(type(job), "_adapter_losses", "forward_and_loss_s"), (torch.autograd, "grad", "backward_s"),
               (type(job.optimizer), "step", "optimizer_s"), (JITFunction, "run", None)]
    with timed_calls(patches) as host:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            job.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    host = {"triton_launches": host["calls"], **{k: host[k] for k in ("forward_and_loss_s", "backward_s",
                                                                         "optimizer_s")}}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            job.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    out = {"model": model_name, "seq": seq, "adapters": n, "wall_s_per_step": wall,
           **{k: v / steps for k, v in host.items()}, "syncs_per_step": len(syncs), "sync_sites": syncs,
           **gpu_profile(job)}
    job.release_locks()
    del job
    strip_adapters(model)
    del model
    torch.cuda.empty_cache()
    log(f"{model_name} seq {seq}, {n} adapters: {wall:.3f} s a step; host {out['forward_and_loss_s']:.3f} s in the "
        f"forward and loss, {out['backward_s']:.3f} s in the backward, {out['optimizer_s']:.4f} s in the optimizer; "
        f"{out['triton_launches']:.0f} Triton launches, {len(syncs)} syncs ({', '.join(syncs)}); "
        f"GPU {out['gpu_s_per_step']:.3f} s")
    return out


def table1_configs(n: int, steps: int, seed: int = 0) -> list[ls.TrialConfig]:
    """`n` configs of PLoRA's Table 1 space with a fixed step budget each."""
    from lora_sweep.space import random_configs

    configs = random_configs(n=n, seed=seed, defaults={"max_steps": steps, "dropout": 0.05})
    for i, c in enumerate(configs):
        c.trial_id = f"c{i}"
    return configs


def probe_configs() -> list[ls.TrialConfig]:
    """The configs whose steps calibrate the cost models: the packed engine's probe jobs mix
    them, PEFT runs the first five alone (batch 1 to 32)."""
    return [ls.TrialConfig(rank=r, alpha=2 * r, batch_size=b, max_steps=10**6, trial_id=f"p{i}")
            for i, (r, b) in enumerate([(8, 1), (16, 4), (32, 8), (64, 2), (16, 32), (128, 16), (128, 1), (8, 16),
                                        (32, 64), (64, 48)])]


def peft_cost_model(base_cm, probe_runs: list[dict], trial_s: float | None = None):
    """One-trial-at-a-time PEFT's cost model, fitted to its probes' steps: `probe_runs[i]` is
    `probe_configs()[i]` trained alone, its `step_s` (seconds between optimizer steps) and
    `tokens` (each step's), paired from the end, and with `trial_s` when it ran in a process of
    its own. A trial's time outside steps (wrapping, the first step, saving) is then each run's
    `trial_s` less its intervals and one typical step, else the `trial_s` given.

    Every timed step is a point of the fit, not each probe's median: a trial's time is a sum of
    steps, which least squares over the steps themselves predicts, while four medians let one
    slow probe tilt the whole fit. Steps over `STALL_FACTOR` (3x) the median of all are host
    stalls, not steps, and are left out (on an H200: 4 steps of 1.4 s in one probe of 16,
    against a median of 0.2 s; 1 in 1,856 measured steps)."""
    from lora_sweep.costmodel import STALL_FACTOR, calibrate

    steps = [list(zip(r["step_s"][-8:], r["tokens"][-8:])) for r in probe_runs]
    typical = statistics.median(s for run in steps for s, _ in run)
    steps = [[(s, n) for s, n in run if s < STALL_FACTOR * typical] for run in steps]
    if trial_s is None:  # the first step has no interval: a kept step stands in for it
        trial_s = statistics.mean(r["trial_s"] - sum(r["step_s"]) - statistics.mean(s for s, _ in run)
                                  for r, run in zip(probe_runs, steps))
    stats = [{"tokens": n, "padded_tokens": n, "rank_tokens": cfg.rank * n, "num_adapters": 1, "rank_sum": cfg.rank,
              "seconds": s, "peak_memory_bytes": None} for cfg, run in zip(probe_configs(), steps) for s, n in run]
    return calibrate(base_cm, stats, trial_seconds=trial_s), stats


def peft_colocated(model_name, configs, seq, probe_runs: list[dict], log) -> dict:
    """`configs` trained with PEFT as co-located processes of their own, a user's sweep with
    fractional GPUs: as many at once as fit, a new one starting as one ends. How many fit: each
    process's peak memory, a line in its batch fitted to the PEFT probes (`probe_runs[i]` is
    `probe_configs()[i]`), plus 1 GB of CUDA context, against 90% of the GPU. Wall time from the
    first start to the last end, start-ups included: they are what such a sweep pays (the packed
    side's ratio then counts its one model build too). A process that dies is started once
    more, as a user would rerun the trial; its error is kept in `failures`."""
    import concurrent.futures

    batches = [cfg.batch_size for cfg in probe_configs()[:len(probe_runs)]]
    peaks = [r["peak_memory_gb"] for r in probe_runs]
    slope = statistics.linear_regression(batches, peaks).slope if len(set(batches)) > 1 else 0.0
    per_process = max(peaks) + slope * max(0, max(c.batch_size for c in configs) - max(batches)) + 1.0
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    at_once = max(1, min(len(configs), int(0.9 * total_gb / per_process)))
    log(f"co-located PEFT: {at_once} processes at once ({per_process:.1f} GB each at most)")
    failures = []

    def trial(cfg, out_dir):  # a trial whose process dies is started again, as a user would
        for attempt in range(2):
            try:
                return peft_in_process_of_its_own(model_name, cfg, seq, 3, os.path.join(out_dir, f"{cfg.trial_id}"
                                                                                                  f"-{attempt}"))
            except RuntimeError as err:
                failures.append(str(err))
                log(f"  {str(err)[:60]} ... {str(err)[-300:]}")  # the trial, and the error's last lines
        return None

    with tempfile.TemporaryDirectory() as out_dir:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
            runs = list(pool.map(lambda cfg: trial(cfg, out_dir), configs))
        wall_s = time.perf_counter() - t0
    done = [r for r in runs if r is not None]
    return {"processes_at_once": at_once, "gb_per_process_predicted": per_process, "wall_s": wall_s,
            "completed": len(done), "failures": failures,
            "peak_memory_gb": [r["peak_memory_gb"] for r in done], "trial_s": [r["trial_s"] for r in done]}


def makespan(model_name, seq, steps, log, microbatch_tokens, peft_processes=True, peft_alone=True,
             keep=lambda part: None) -> dict:
    """Predicted makespan of 120 Table-1 configs packed and one at a time, from cost models
    calibrated on this GPU, and a measured 16-config subset both ways. With `peft_processes`
    every PEFT run (probes and measured trials) is a process of its own, started cold, as a
    sweep of separate fine-tunes runs; model building is left out of its time. Without
    `peft_alone` the subset is not run one PEFT trial at a time (only co-located). `keep` is
    given what is measured so far after each part, so a run cut short keeps it."""
    from lora_sweep.costmodel import CostModel, calibrate, detect, profile_job, typical_steps
    from lora_sweep.planner import plan

    t0 = time.perf_counter()
    model = build_model(model_name)
    build_s = time.perf_counter() - t0  # the packed side's start-up, against co-located processes' own
    rows = synthetic_rows(512, seq, seed=3)
    configs = table1_configs(120, steps)
    subset = configs[:16]
    spec = spec_for(model, rows, seq, max_tokens_per_microbatch=microbatch_tokens)
    samples, pad_id = tokenized(model, rows, seq)
    # step times follow the samples' real lengths: the engine packs them without padding
    base_cm = CostModel.from_model(PRESETS[model_name], gpu=detect(), max_seq_len=seq, dtype="bfloat16",
                                   mean_sample_tokens=statistics.mean(len(s) for s in samples))

    # calibrate the packed engine from profiled steps of varied jobs (PLoRA profiles 10): pack
    # sizes from 1 to 16, and ranks and batch sizes that do not grow together, so the fit can
    # tell per-step, per-adapter, token and rank costs apart. The last jobs step about as many
    # tokens as a full pack of Table-1 configs, where the token cost dominates; two of them,
    # with 5 and 16 adapters at about the same tokens, pin the per-adapter cost (without the
    # job of sixteen, steps of sixteen adapters came out 3-19% short).
    probe = probe_configs()
    stats = []
    for members in ([0], [4], [5], [0, 1, 2], [3, 6, 7], [4, 6], [0, 1, 2, 3, 4, 5], list(range(8)), [8, 9],
                    [5, 4, 7, 8, 9]):
        t1 = time.perf_counter()
        job = ls.PackedJob(spec, [probe[i] for i in members], progress=False)
        stats += profile_job(job, steps=3, warmup=2)
        log(f"probe job {members}: {time.perf_counter() - t1:.1f} s, steps "
            + " ".join(f"{st['seconds']:.3f}{'*' if st.get('one_off') else ''}" for st in job.step_stats))
        job.release_locks()  # the next probe job trains some of the same trial ids
        del job
        strip_adapters(model)
    # the job of sixteen, run to completion, also gives a trial's time outside steps (joining,
    # saving its adapter, the job's own start and end shared among its trials, as in the plan's jobs)
    finishing = [dataclasses.replace(probe[i % 8], max_steps=5, trial_id=f"s{i}") for i in range(16)]
    with tempfile.TemporaryDirectory() as out_dir:
        t0 = time.perf_counter()
        job = ls.PackedJob(dataclasses.replace(spec, output_dir=out_dir), finishing, progress=False)
        for _ in job.run():
            pass
        torch.cuda.synchronize()
        stats += typical_steps(job.step_stats[2:])
        # CUDA graph captures are the job's own cost, shared by its trials like its start and end
        steps_s = sum(st["seconds"] for st in job.step_stats if not st.get("one_off"))
        packed_trial_s = (time.perf_counter() - t0 - steps_s) / len(finishing)
        del job
        strip_adapters(model)
    packed_cm = calibrate(base_cm, stats, trial_seconds=packed_trial_s)
    log(f"packed engine calibrated: {packed_cm.calibration.describe()}")
    keep({"probe_steps": {"packed": stats}})

    # calibrate one-trial-at-a-time PEFT from its own steps, and its time outside them
    peft_probes = probe[:5]  # batch 1 to 32: the co-located processes' memory is fitted to them
    peft_runs = {"probes": [], "trials": []}
    for cfg in peft_probes:
        if peft_processes:  # cold: 11 steps
            with tempfile.TemporaryDirectory() as out_dir:
                peft_runs["probes"].append(peft_in_process_of_its_own(
                    model_name, dataclasses.replace(cfg, max_steps=11), seq, 3, out_dir))
        else:
            peft_runs["probes"].append(time_peft(model, cfg, rows, seq, 3, 8))
    peft_trial_s = None  # from the cold probes
    if not peft_processes:  # wrapping the model, saving the adapter, unwrapping
        with tempfile.TemporaryDirectory() as out_dir:
            t0 = time.perf_counter()
            for cfg in peft_probes:
                peft_model = peft_model_for(model, cfg, PROJECTIONS, device="cuda")
                peft_model.save_pretrained(os.path.join(out_dir, cfg.trial_id))
                peft_model.unload()
            torch.cuda.synchronize()
            peft_trial_s = (time.perf_counter() - t0) / len(peft_probes)
    peft_cm, peft_stats = peft_cost_model(base_cm, peft_runs["probes"], peft_trial_s)
    log(f"PEFT calibrated: {peft_cm.calibration.describe()}")

    predicted = {
        "packed_120": plan(PRESETS[model_name], configs, num_gpus=1, cost_model=packed_cm).makespan,
        "peft_120": sum(peft_cm.job_seconds([c]) for c in configs),
        "packed_16": plan(PRESETS[model_name], subset, num_gpus=1, cost_model=packed_cm).makespan,
        "peft_16": sum(peft_cm.job_seconds([c]) for c in subset),
    }
    log(f"predicted: 120 configs packed {predicted['packed_120']:.0f} s vs PEFT {predicted['peft_120']:.0f} s")

    # measured: the subset's plan run job after job, and the subset one trial at a time with PEFT
    subset_plan = plan(PRESETS[model_name], subset, num_gpus=1, cost_model=packed_cm)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    measured_steps, construct_s, outside = [], 0.0, collections.Counter()
    for planned in subset_plan.jobs:  # each trial's adapter is saved in PEFT format when it finishes
        t1 = time.perf_counter()
        job = ls.PackedJob(spec, [dataclasses.replace(t) for t in planned.trials], progress=False)
        construct_s += time.perf_counter() - t1
        # where the time outside steps goes: joins and leaves, and after each step its
        # reports, evaluations and finished trials (saving adapters)
        with timed_calls([(job, "_apply_membership", "membership_s"), (job, "_after_optimizer_step", "after_step_s"),
                          (job, "_finish", "finish_s")]) as calls:
            for _ in job.run():
                pass
        outside.update(calls)
        measured_steps += job.step_stats
        del job
        strip_adapters(model)
    torch.cuda.synchronize()
    measured_packed = time.perf_counter() - t0
    steps_s = sum(st["seconds"] for st in measured_steps)
    log(f"16 configs packed in {len(subset_plan.jobs)} jobs: {measured_packed:.1f} s ({construct_s:.1f} s building, "
        f"{steps_s:.1f} s in {len(measured_steps)} steps, "
        f"{outside['membership_s']:.1f} s joining and leaving, {outside['after_step_s']:.1f} s after steps, "
        f"{outside['finish_s']:.1f} s of it saving)")
    result = {"model": model_name, "seq": seq, "steps": steps, "peft_processes": peft_processes,
              "mean_sample_tokens": base_cm.mean_sample_tokens, "predicted": predicted,
              "measured": {"packed_16": measured_packed},
              "packed_16_breakdown": {"construct_s": construct_s, "steps_s": steps_s,
                                      "rest_s": measured_packed - construct_s - steps_s, **outside},
              "prediction_error": {"packed_16": predicted["packed_16"] / measured_packed - 1},
              "packed_model_build_s": build_s,
              "plan_16_jobs": [[t.trial_id for t in j.trials] for j in subset_plan.jobs],
              "probe_steps": {"packed": stats}, "measured_steps": measured_steps,
              "calibration": {"packed": packed_cm.calibration.describe(), "peft": peft_cm.calibration.describe()}}
    keep(result)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        for cfg in subset if peft_alone else []:  # and each PEFT run saves its adapter, as a user's would
            if peft_processes:
                peft_runs["trials"].append(peft_in_process_of_its_own(model_name, cfg, seq, 3,
                                                                      os.path.join(out_dir, cfg.trial_id)))
            else:
                peft_model = peft_model_for(model, cfg, PROJECTIONS, device="cuda")
                train_alone_with_peft(peft_model, cfg, samples, pad_id, device="cuda")
                peft_model.save_pretrained(os.path.join(out_dir, cfg.trial_id))
                peft_model.unload()
        torch.cuda.synchronize()
        peft_trials = [r["trial_s"] for r in peft_runs["trials"]]  # cold: each process's own time, not its start-up
        measured_peft = (sum(peft_trials) if peft_processes else time.perf_counter() - t0) if peft_alone else None
    del model
    torch.cuda.empty_cache()
    colocated = peft_colocated(model_name, subset, seq, peft_runs["probes"], log) if peft_processes else None
    result["measured"]["peft_16"] = measured_peft
    result["prediction_error"]["peft_16"] = predicted["peft_16"] / measured_peft - 1 if measured_peft else None
    result.update({
        "peft_trial_s": peft_trials or None,
        "ratio": {"predicted_120": predicted["peft_120"] / predicted["packed_120"],
                  "measured_16": measured_peft / measured_packed if measured_peft else None,
                  "measured_16_colocated": (colocated["wall_s"] / (measured_packed + build_s)
                                            if colocated else None)},
        "peft_colocated": colocated,
        # the steps behind the fits and the measured run, so a cost model can be refitted offline
        "probe_steps": {"packed": stats, "peft": peft_stats}, "measured_steps": measured_steps,
        "peft_process_runs": peft_runs if peft_processes else None})
    log(f"16 configs: packed {measured_packed:.1f} s (predicted {predicted['packed_16']:.1f}), "
        + (f"PEFT {measured_peft:.1f} s (predicted {predicted['peft_16']:.1f}), "
           f"ratio {result['ratio']['measured_16']:.2f}x" if measured_peft else "")
        + (f"; co-located PEFT {colocated['wall_s']:.1f} s, ratio {result['ratio']['measured_16_colocated']:.2f}x"
           if colocated else ""))
    return result


def refit(path: str) -> dict:
    """PEFT's predicted 16-config time in a saved makespan run, fitted again from the run's own
    cold probes by `peft_cost_model` as it is now, against the time the run measured: how a
    change to the fit does on runs already made, without a GPU. Also the packed side's
    predicted steps against its measured steps, the part of its prediction that the time
    outside steps does not blur."""
    from lora_sweep.costmodel import CostModel, calibrate, gpu_profile

    with open(path) as f:
        result = json.load(f)
    run = result["makespan"]
    if not run.get("peft_process_runs"):
        raise SystemExit(f"{path} has no cold PEFT probes to refit (it ran with --peft-in-process).")
    mean_tokens = run.get("mean_sample_tokens")
    if mean_tokens is None:  # a run without it: the same rows, tokenised as the engine does
        from transformers import AutoModelForCausalLM

        samples, _ = tokenized(AutoModelForCausalLM.from_pretrained(tiny_model_path()),
                               synthetic_rows(512, run["seq"], seed=3), run["seq"], device="cpu")
        mean_tokens = statistics.mean(len(s) for s in samples)
    base_cm = CostModel.from_model(PRESETS[run["model"]], gpu=gpu_profile(result["gpu"]), max_seq_len=run["seq"],
                                   dtype="bfloat16", mean_sample_tokens=mean_tokens)
    peft_cm, _ = peft_cost_model(base_cm, run["peft_process_runs"]["probes"])
    configs = table1_configs(120, run["steps"])
    predicted_16 = sum(peft_cm.job_seconds([c]) for c in configs[:16])
    predicted_120 = sum(peft_cm.job_seconds([c]) for c in configs)
    # the packed side's steps alone (its fit as the run made it, less the time outside steps)
    steps_cm = calibrate(base_cm, run["probe_steps"]["packed"], trial_seconds=0.0)
    by_id = {c.trial_id: c for c in configs[:16]}
    packed_steps = sum(steps_cm.job_seconds([by_id[i] for i in job]) for job in run["plan_16_jobs"])
    return {"file": os.path.basename(path), "steps": run["steps"], "measured_peft_16": run["measured"]["peft_16"],
            "recorded_error": run["prediction_error"]["peft_16"], "refit_peft_16": predicted_16,
            "refit_error": predicted_16 / run["measured"]["peft_16"] - 1,
            "packed_error": run["prediction_error"]["packed_16"], "ratio": run["ratio"]["measured_16"],
            "refit_ratio_120": predicted_120 / run["predicted"]["packed_120"],
            "packed_steps_error": packed_steps / run["packed_16_breakdown"]["steps_s"] - 1}


def overhead(model_name, seq, steps, log) -> dict:
    """The same 16 configs through PackedLoRASampler and through PackedJob directly."""
    import optuna

    from lora_sweep.integrations.optuna import PackedLoRASampler

    model = build_model(model_name)
    rows = synthetic_rows(512, seq, seed=4)
    configs = table1_configs(16, steps, seed=1)
    spec = spec_for(model, rows, seq, eval_data=rows[:32])
    spec.eval_every = max(1, steps // 2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    job = ls.PackedJob(spec, [dataclasses.replace(c) for c in configs], progress=False)
    for _ in job.run():
        pass
    torch.cuda.synchronize()
    direct = time.perf_counter() - t0
    del job
    strip_adapters(model)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="minimize")
    sampler = PackedLoRASampler(study, spec, search_space=lambda trial: dataclasses.replace(configs[trial.number]),
                                max_concurrent=16)
    t0 = time.perf_counter()
    sampler.optimize(n_trials=16, show_progress_bar=False)
    torch.cuda.synchronize()
    tuned = time.perf_counter() - t0
    done = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    del sampler, study
    strip_adapters(model)
    del model
    torch.cuda.empty_cache()
    result = {"model": model_name, "seq": seq, "steps": steps, "direct_s": direct, "optuna_s": tuned,
              "overhead": tuned / direct - 1, "optuna_complete": done}
    log(f"16 configs direct {direct:.1f} s, through PackedLoRASampler {tuned:.1f} s: overhead {result['overhead']:.1%}")
    return result


def plot(result: dict, path: str) -> None:
    """Tokens/s against the number of packed adapters, one line per model, sequence and ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("throughput", [])
    keys = sorted({(r["model"], r["seq"], r["batch"], r["ranks"]) for r in rows})
    groups = sorted({k[:3] for k in keys})  # one colour per model, sequence and batch; ranks by line style
    colors = {g: plt.get_cmap("tab10")(i % 10) for i, g in enumerate(groups)}
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for key in keys:
        pts = sorted((r["adapters"], r["tokens_per_s"]) for r in rows if (r["model"], r["seq"], r["batch"],
                                                                          r["ranks"]) == key)
        ax.plot(*zip(*pts), marker="o", color=colors[key[:3]], linestyle="-" if key[3] == "16" else "--",
                label=f"{key[0]} seq {key[1]} b{key[2]} r={key[3]}")
        solo = next(r["solo_tokens_per_s"] for r in rows if (r["model"], r["seq"], r["batch"], r["ranks"]) == key)
        ax.axhline(solo, color=colors[key[:3]], linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("adapters packed in one job")
    ax.set_ylabel("tokens / s (dotted: one adapter alone with PEFT)")
    ax.set_title(f"lora_sweep packed jobs, {result['gpu']}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile(model_name, seq, n, batch, log, out_dir) -> str:
    """Where a packed step's time goes: torch profiler table of the top CUDA ops."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    model = build_model(model_name)
    rows = synthetic_rows(512, seq, seed=2)
    trials = [ls.TrialConfig(rank=16, alpha=32, dropout=0.05, batch_size=batch, max_steps=10**6, seed=i,
                             trial_id=f"t{i}") for i in range(n)]
    job = ls.PackedJob(spec_for(model, rows, seq), trials, progress=False)
    for _ in range(3):
        job.step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            job.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60)
    if out_dir:
        prof.export_chrome_trace(os.path.join(out_dir, f"trace_{model_name}_{seq}_{n}.json"))
    job.release_locks()
    del job
    strip_adapters(model)
    del model
    torch.cuda.empty_cache()
    log(table)
    log(cpu_table)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="throughput,kernels")
    parser.add_argument("--models", default="llama-3.2-1b,qwen2.5-7b")
    parser.add_argument("--seq", default="256,1024")
    parser.add_argument("--adapters", default="1,4,8,16,32")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--kernels-model", default="qwen2.5-7b", help="the kernels and host sections' model")
    parser.add_argument("--kernels-seq", type=int, default=1024, help="their sequence length")
    parser.add_argument("--kernels-adapters", type=int, default=16, help="their adapters")
    parser.add_argument("--out", default="benchmarks/results/sweep_gpu.json")
    parser.add_argument("--profile", default="", help="model,seq,adapters,batch of a packed step to profile")
    parser.add_argument("--sweep-steps", type=int, default=30, help="steps of every config in makespan/overhead")
    parser.add_argument("--microbatch-tokens", type=int, default=64 * 1024)
    parser.add_argument("--peft-in-process", action="store_true",
                        help="makespan: run the PEFT trials one after another in this process (warm), not each "
                             "in a process of its own (cold, as separate fine-tunes)")
    parser.add_argument("--no-peft-alone", action="store_true",
                        help="makespan: leave out the 16 PEFT trials one at a time (co-located only)")
    parser.add_argument("--ranks", default="16,mixed", help="throughput: adapter ranks, 16 and/or mixed")
    parser.add_argument("--plot-only", help="redraw the plot of a saved results JSON and exit")
    parser.add_argument("--merge", nargs="+", help="merge the results JSONs of several runs into --out and exit")
    parser.add_argument("--refit", nargs="+", help="refit PEFT's prediction in saved makespan runs and exit (CPU)")
    args = parser.parse_args()
    if args.refit:
        rows = [refit(p) for p in args.refit]
        print(f"{'file':40} steps  PEFT measured  recorded  refit   packed (steps)  ratio  120 predicted")
        for r in rows:
            print(f"{r['file']:40} {r['steps']:5}  {r['measured_peft_16']:11.1f} s  {r['recorded_error']:+7.1%}  "
                  f"{r['refit_error']:+6.1%}  {r['packed_error']:+6.1%} ({r['packed_steps_error']:+6.1%})  "
                  f"{r['ratio']:4.1f}x  {r['refit_ratio_120']:5.1f}x")
        return
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), os.path.splitext(args.plot_only)[0] + ".png")
        return
    if args.merge:
        merge(args.merge, args.out)
        return
    sections = args.sections.split(",")
    lines = []

    started = time.perf_counter()

    def log(msg):  # each line with the seconds since the start, to see where a long run went
        line = f"[{time.perf_counter() - started:5.0f} s] {msg}"
        print(line, flush=True)
        lines.append(line)

    import transformers
    import triton

    result = {"benchmark": "sweep_gpu", "date": datetime.date.today().isoformat(),
              "gpu": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__, "triton": triton.__version__,
                                                                 "transformers": transformers.__version__,
                                                                 "lora_sweep": ls.__version__},
              "args": vars(args)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after every section, so a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["ceilings"] = ceilings()
    peak = result["ceilings"]["bf16_tflops"]
    log(f"{result['gpu']}: bf16 matmul {peak:.0f} TFLOP/s, copy {result['ceilings']['copy_gbps']:.0f} GB/s")
    t0 = time.time()
    if "throughput" in sections:
        result["throughput"] = throughput(args.models.split(","), [int(s) for s in args.seq.split(",")],
                                          [int(n) for n in args.adapters.split(",")],
                                          [int(b) for b in args.batches.split(",")], peak, args.warmup, args.steps, log,
                                          args.ranks.split(","))
        save()
    if "kernels" in sections:
        result["kernels"] = kernels(args.kernels_model, args.kernels_seq, args.kernels_adapters, peak, args.warmup,
                                    args.steps, log)
        save()
    if "host" in sections:
        result["host"] = step_host(args.kernels_model, args.kernels_seq, args.kernels_adapters, args.warmup, args.steps,
                                   log)
        save()
    if "makespan" in sections:
        def keep(part):
            result["makespan"] = {**part, "complete": False}
            save()

        result["makespan"] = makespan(args.models.split(",")[0], int(args.seq.split(",")[0]), args.sweep_steps, log,
                                      args.microbatch_tokens, not args.peft_in_process, not args.no_peft_alone, keep)
        save()
    if "overhead" in sections:
        result["overhead"] = overhead(args.models.split(",")[0], int(args.seq.split(",")[0]), args.sweep_steps, log)
        save()
    if args.profile:
        m, q, n, b = args.profile.split(",")
        result["profile"] = profile(m, int(q), int(n), int(b), log, os.path.dirname(os.path.abspath(args.out)))
    result["seconds"] = time.time() - t0
    result["summary"] = summary(result)
    save()
    if result.get("throughput"):
        plot(result, os.path.splitext(args.out)[0] + ".png")
    log(json.dumps(result["summary"], indent=1))


def summary(result: dict) -> dict:
    """The headline numbers: the best ratio at 16+ adapters and the best MFU of
    every (model, seq, batch), and the makespan, kernel and tuner results."""
    best, best_mfu = {}, {}
    for r in result.get("throughput", []):
        key = f"{r['model']} seq {r['seq']} batch {r['batch']}"
        row = {"adapters": r["adapters"], "ranks": r["ranks"], "ratio": round(r["ratio"], 2),
               "mfu": round(r["mfu"], 3), "solo_mfu": round(r["solo_mfu"], 3)}
        if r["adapters"] >= 16 and r["ratio"] > best.get(key, {}).get("ratio", 0):
            best[key] = row
        if r["mfu"] > best_mfu.get(r["model"], {}).get("mfu", 0):
            best_mfu[r["model"]] = {**row, "seq": r["seq"], "batch": r["batch"]}
    return {"best_ratio_16plus_adapters": best, "best_mfu": best_mfu,
            "kernels_speedup": result.get("kernels", {}).get("speedup"),
            "makespan_ratio": result.get("makespan", {}).get("ratio"),
            "prediction_error": result.get("makespan", {}).get("prediction_error"),
            "tuner_overhead": result.get("overhead", {}).get("overhead")}


def merge(paths: list[str], out: str) -> None:
    """One results file from runs made in pieces (one model per run, say): throughput rows
    concatenated, the other sections from the last run that has them, each run's args and
    date kept. A merged file can be merged again."""
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    if len({r["gpu"] for r in runs}) != 1:
        raise SystemExit(f"Refusing to merge runs on different GPUs: {sorted({r['gpu'] for r in runs})}.")
    merged = {k: runs[0][k] for k in ("benchmark", "date", "gpu", "versions")}
    # a merged file merges again: its own runs are kept as they are
    merged["runs"] = [run for r in runs for run in r.get("runs", [
        {"args": r.get("args"), "ceilings": r["ceilings"], "seconds": r.get("seconds"), "date": r["date"]}])]
    merged["ceilings"] = runs[0]["ceilings"]  # MFU of each row uses its own run's ceiling
    merged["throughput"] = [row for r in runs for row in r.get("throughput", [])]
    for section in ("kernels", "makespan", "overhead", "profile"):
        for r in runs:
            if r.get(section):
                merged[section] = r[section]
    merged["summary"] = summary(merged)
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
    if merged["throughput"]:
        plot(merged, os.path.splitext(out)[0] + ".png")
    print(json.dumps(merged["summary"], indent=1))


if __name__ == "__main__":
    main()
