"""The frozen base over d GPUs three ways, side by side: whole on each, FSDP2, tensor parallel.

The measurement behind `JobSpec.shard_base` and docs/architecture.md's choice of FSDP2 over
tensor parallelism. A packed step's base work is a forward and a backward to the input (the
adapters' gradients need no weight gradient) through the decoder layers. This runs that on
`--layers` decoder layers of a real architecture (random bf16 weights, frozen), for a step of
`--tokens` tokens in sequences of `--seq`, on d ranks (``torchrun --nproc-per-node d``, one
per d of `--gpus`):

* whole  every rank holds the layers and runs its own T / d tokens: nothing crosses GPUs
* fsdp   the engine's `shard_base` (`fully_shard` on each layer, then on the body); each rank
         runs its own T / d tokens and gathers each layer's weights in the forward and again
         in the backward
* tp     `parallelize_module`: q, k, v, gate and up split by output columns, o and down by
         input rows; every rank runs all T tokens on its 1/d of each weight and all-reduces
         each layer's activations twice in the forward and twice in the backward

Per d and layout: the median step (host clock around a synchronised step, after warm-up),
tokens/s over all ranks, peak memory per GPU, and how far rank 0's input gradient is from the
whole layout's on the same rows (the three compute the same thing). Rank 0 of each run writes
its part; the JSON has every d.

    python -m benchmarks.base_parallelism --model qwen2.5-32b --layers 8 --tokens 8192 --seq 1024 \\
        --gpus 2,4 --out base_parallelism.json

`--dry`: CPU ranks (gloo), fp32, a tiny Llama, d = 2, 2 steps (for the tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time

import torch

LAYOUTS = ("whole", "fsdp", "tp")
COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWS = ("self_attn.o_proj", "mlp.down_proj")
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)


def build_body(args, device: str, dtype: torch.dtype):
    """The decoder (embeddings, `.layers`, final norm) of `--model` cut to `--layers` layers, random
    weights from one seed (the same on every rank), frozen."""
    from transformers import AutoModelForCausalLM

    from benchmarks.sweep_gpu import config_of
    from lora_sweep.costmodel import PRESETS

    config = config_of(TINY if args.dry else PRESETS[args.model], num_hidden_layers=args.layers)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.model.requires_grad_(False)


def lay_out(body, layout: str, mesh) -> None:
    """Shard `body`'s layers in place as `layout` says ("whole" leaves them). FSDP2 is the
    engine's own `shard_base`: with the body as FSDP's root, each layer's weights are freed after
    its forward and gathered again for its backward."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lora_sweep.distributed import shard_base

    if layout == "fsdp":
        shard_base(body)
    elif layout == "tp":
        plan = {**{name: ColwiseParallel() for name in COLUMNS}, **{name: RowwiseParallel() for name in ROWS}}
        for layer in body.layers:
            parallelize_module(layer, mesh, plan)


def base_step(body, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The base's part of a training step: forward through the layers, backward to the input.
    Returns the input's gradient."""
    x = hidden.detach().requires_grad_(True)
    h = body(inputs_embeds=x, position_ids=positions, use_cache=False).last_hidden_state
    (grad,) = torch.autograd.grad(h, x, grad_outputs=torch.ones_like(h))
    return grad


def worker(args) -> None:
    """One rank: every layout in turn on the same inputs; rank 0 writes the results."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lora_sweep.distributed import attach

    rank, d = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    attach(torch.device(device))  # the group, taken down at exit once every rank is there
    mesh = init_device_mesh(device, (d,))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = args.tokens // args.seq  # sequences of the whole step
    mine = slice(rank * rows // d, (rank + 1) * rows // d)  # this rank's, where the tokens are split
    results, reference = {}, None
    for layout in LAYOUTS:
        body = build_body(args, device, dtype)
        lay_out(body, layout, mesh)
        hidden_size = body.config.hidden_size
        generator = torch.Generator(device).manual_seed(1)
        hidden = torch.randn(rows, args.seq, hidden_size, generator=generator, device=device, dtype=dtype)
        hidden = hidden if layout == "tp" else hidden[mine]
        positions = torch.arange(args.seq, device=device).expand(hidden.shape[0], -1)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(args.warmup + args.steps):
            dist.barrier()
            sync()
            start = time.perf_counter()
            grad = base_step(body, hidden, positions)
            sync()
            seconds.append(time.perf_counter() - start)
        grad = (grad if layout != "tp" else grad[mine]).float()
        reference = grad if reference is None else reference
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        peaks = [None] * d
        dist.all_gather_object(peaks, peak)
        step = statistics.median(seconds[args.warmup:])
        results[layout] = {"median_step_s": step, "tokens_per_s": args.tokens / step, "peak_memory_gb": peaks,
                           "grad_rel_diff": ((grad - reference).norm() / reference.norm()).item()}
        del body, grad, hidden
    if rank == 0:
        with open(args.worker_out, "w") as f:
            json.dump({"d": d, "layouts": results}, f)


def run_on(d: int, args, work: str) -> dict:
    """The worker on `d` ranks under torchrun; its rank 0's results."""
    from benchmarks.multi_gpu import torchrun_worker

    arguments = ["--model", args.model, "--layers", str(args.layers), "--tokens", str(args.tokens),
                 "--seq", str(args.seq), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    return torchrun_worker("benchmarks.base_parallelism", d, arguments, os.path.join(work, f"d{d}.json"), args.dry)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-32b", help="a name in lora_sweep.costmodel.PRESETS")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (the model's own count is not needed)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the whole step, over all ranks")
    parser.add_argument("--seq", type=int, default=1024, help="tokens of each sequence")
    parser.add_argument("--gpus", default="2", help="the d to run, comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/base_parallelism.json")
    parser.add_argument("--dry", action="store_true", help="CPU ranks (gloo), fp32, a tiny Llama, d = 2, 2 steps")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)  # set: this process is a rank of one run
    args = parser.parse_args(argv)
    if args.dry:
        args.model, args.layers, args.tokens, args.seq, args.gpus, args.warmup, args.steps = \
            "tiny", 2, 128, 32, "2", 1, 2
    gpus = [int(g) for g in args.gpus.split(",")]
    for d in gpus:
        if (args.tokens // args.seq) % d or args.tokens % args.seq:
            parser.error(f"`--tokens` is {args.tokens}, but must be a multiple of --seq x d = {args.seq * d}.")
    if args.worker_out:
        worker(args)
        return {}

    import transformers

    with tempfile.TemporaryDirectory() as work:
        runs = [run_on(d, args, work) for d in gpus]
    result = {"benchmark": "base_parallelism", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "gpu": "cpu" if args.dry else torch.cuda.get_device_name(),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
              "model": args.model, "layers": args.layers, "tokens": args.tokens, "seq": args.seq,
              "warmup": args.warmup, "steps": args.steps, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{'d':>2} {'layout':>6} {'step s':>8} {'tokens/s':>9} {'vs whole':>8} {'GiB/GPU':>7} {'grad diff':>9}")
    for run in runs:
        whole = run["layouts"]["whole"]["tokens_per_s"]
        for layout, r in run["layouts"].items():
            print(f"{run['d']:>2} {layout:>6} {r['median_step_s']:>8.4f} {r['tokens_per_s']:>9,.0f} "
                  f"{r['tokens_per_s'] / whole:>7.2f}x {max(r['peak_memory_gb']):>7.1f} {r['grad_rel_diff']:>9.1e}")
    return result


if __name__ == "__main__":
    main()
