"""`lora-sweep`, the command line.

    lora-sweep plan examples/sweep.yaml     # schedule a sweep (no GPU needed): table + Gantt chart
    lora-sweep demo                         # train a tiny packed sweep on this machine
    lora-sweep run examples/sweep.yaml      # train a sweep on this machine's GPUs (or the CPU)

A sweep file (YAML) names the base model, the hardware and the trials; see
`examples/sweep.yaml`. Its keys are in `SWEEP_KEYS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Optional, Sequence

from .config import ConfigError, JobSpec, TrialConfig, quantization_name
from .space import Categorical, Float, random_configs

BASE_KEYS = {"model", "max_seq_len", "dtype", "gradient_checkpointing", "quantization"}  # of an entry of `bases`
SWEEP_KEYS = {
    # the base model and the job: what every trial shares
    "model": "a preset (e.g. qwen2.5-7b; `plan` only), a hub id or local dir, a dict of config fields (`plan` only), "
             "or tiny (the bundled tiny model and task)",
    "max_seq_len": "longest sample in tokens (default 512)",
    "dtype": "bfloat16, float16, float32 or auto (default auto)",
    "gradient_checkpointing": "recompute base activations (default false)",
    "target_modules": "linear layers that get adapters (default all seven)",
    "bases": "several base models in one sweep: name -> {model, and optionally max_seq_len, dtype, "
             "gradient_checkpointing, quantization}, each defaulting to the sweep's; a trial names its base "
             "(`base_model`), a search space may draw it (`base_model: [names]`), else every drawn trial runs on "
             "every base",
    # the hardware (`run` plans for this machine's GPUs instead: at most `gpus` of them)
    "gpus": "GPUs for the sweep (default 8)",
    "gpu_memory_gb": "memory of each GPU (default 80; `plan` only)",
    "gpu": "step-time profile, a name in lora_sweep.costmodel.GPUS (default h100-sxm; `plan` only)",
    "load_factor": "usable fraction of each GPU's memory (default 0.9)",
    # the trials
    "n_trials": "how many trials to draw from search_space (default 120)",
    "seed": "seed of the draws (default 0)",
    "steps": "max_steps of every trial (default 200)",
    "search_space": "field -> {low, high, log} or a list of choices (default PLoRA's Table 1)",
    "trials": "an explicit list of trials (TrialConfig fields) instead of search_space",
    "trial_defaults": "TrialConfig fields every trial shares",
    # the planner
    "max_adapters_per_job": "most trials in one job (default: memory decides)",
    "objective": "time, tokens or rank: what a job's throughput counts (default time: jobs fill up)",
    # where things go
    "output_dir": "adapters, loss curves and the plan's chart go here (default lora_sweep_runs/<sweep file name>)",
    "gantt": "file name of `plan`'s chart in output_dir (default plan.png)",
    # training (`run`)
    "train_data": "training rows, .jsonl or .json (default with model tiny: the tiny task)",
    "eval_data": "evaluation rows, .jsonl or .json (default with model tiny: the tiny task)",
    "eval_every": "evaluate, report and draw a point every this many steps (default 50)",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the `lora-sweep` command line.

    Args:
        argv:
            The arguments (default ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    args = _parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except (ConfigError, ValueError, TypeError, OSError) as err:
        print(f"lora-sweep {args.command}: error: {err}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-sweep", description="Packed multi-LoRA hyperparameter sweeps.")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="schedule a sweep into packed jobs; print them and draw a Gantt chart",
                               description="Schedule a sweep into packed jobs (no GPU needed).")
    plan.add_argument("sweep", help="the sweep YAML file")
    plan.add_argument("--gantt", help="PNG path of the chart (default: <output_dir>/<the file's `gantt` or plan.png>)")
    plan.add_argument("--gpus", type=int, help="override the file's `gpus`")
    plan.add_argument("--gpu-memory-gb", type=float, help="override the file's `gpu_memory_gb`")
    plan.add_argument("--gpu", help="override the file's `gpu` (step-time profile)")
    plan.add_argument("--calibration", help="a cost model saved by `CostModel.save` (e.g. after `calibrate`); "
                      "its model, GPU, sequence length and dtype replace the file's")
    plan.set_defaults(func=_plan)

    demo = commands.add_parser("demo", help="train a tiny packed sweep on this machine",
                               description="A packed sweep on the bundled tiny model: prints the trials' "
                               "results and saves the best adapter.")
    demo.add_argument("--trials", type=int, default=8, help="trials packed into one job (default 8)")
    demo.add_argument("--steps", type=int, default=60, help="optimizer steps per trial (default 60)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random search (default 0)")
    demo.add_argument("--output-dir", default="lora_sweep_runs/demo", help="where adapters are saved")
    demo.add_argument("--model", help="hub id or local dir of the base model (default: the bundled tiny model)")
    demo.add_argument("--train", help="training rows, .jsonl or .json (default: the bundled tiny task)")
    demo.add_argument("--eval", help="evaluation rows, .jsonl or .json (default: the bundled tiny task)")
    demo.add_argument("--max-seq-len", type=int, help="default 24 for the tiny task, else 512")
    demo.set_defaults(func=_demo)

    run = commands.add_parser(
        "run", help="train a sweep on this machine's GPUs (or the CPU)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan a sweep for this machine's GPUs (or the CPU) and train it: each GPU trains its jobs\n"
        "one after another in the plan's order; a job planned on d GPUs runs over d ranks (torchrun).\n"
        "Prints the results table\n"
        "with each trial's adapter directory and draws every trial's loss curves in\n"
        "<output_dir>/loss_curves.png.\n\nSweep file keys (see examples/sweep.yaml):\n"
        + "\n".join(f"  {k}: {v}" for k, v in SWEEP_KEYS.items()))
    run.add_argument("sweep", help="the sweep YAML file")
    run.set_defaults(func=_run)

    ranks = commands.add_parser("train-ranks", help="one rank of a planned job on several GPUs (`run` starts it "
                                "under torchrun)")
    ranks.add_argument("sweep", help="the sweep YAML file")
    ranks.add_argument("--trials", required=True, help="JSON list of the job's trials (TrialConfig fields)")
    ranks.add_argument("--events", required=True, help="where rank 0 writes the job's events, a JSON object a line")
    ranks.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ranks.add_argument("--base", default=None, help="the name of the sweep's base the job trains (`bases`)")
    ranks.set_defaults(func=_train_ranks)
    return parser


# --------------------------------------------------------------------------- plan


def _plan(args: argparse.Namespace) -> int:
    from .costmodel import CostModel
    from .planner import plan

    sweep = read_sweep(args.sweep)
    for key in ("gpus", "gpu_memory_gb", "gpu"):
        if getattr(args, key) is not None:
            sweep[key] = getattr(args, key)
    if sweep.get("bases"):
        return _plan_bases(sweep, args)
    trials = sweep_trials(sweep)
    cost_model = CostModel.load(args.calibration) if args.calibration else _cost_model(sweep)
    result = plan(None, trials, sweep["gpus"], cost_model=cost_model,
                  max_adapters_per_job=sweep.get("max_adapters_per_job"), objective=sweep["objective"])

    gpu = cost_model.gpu
    print(f"{len(trials)} trials of {_model_name(sweep['model'])} (max_seq_len {cost_model.max_seq_len}, "
          f"{cost_model.dtype}) on {sweep['gpus']} x {gpu.name} ({gpu.memory_gb:g} GB, load factor "
          f"{cost_model.load_factor:g})")
    print(f"cost model: {cost_model.calibration.describe()}")
    return _print_plan(result, sweep, args)


def _plan_bases(sweep: dict, args: argparse.Namespace) -> int:
    """`plan` of a sweep over several base models (`bases`): one job per base's trials at most
    shares a GPU at a time; each job names its base."""
    from .planner import plan_bases

    if args.calibration:
        raise ValueError("A calibration holds one base model's cost model; a sweep with `bases` plans from each "
                         "base's config.")
    trials = sweep_trials_by_base(sweep)
    bases = {name: (_cost_model(_base_sweep(sweep, name)), trials[name]) for name in sweep["bases"]}
    result = plan_bases(bases, sweep["gpus"], max_adapters_per_job=sweep.get("max_adapters_per_job"),
                        objective=sweep["objective"])
    gpu = next(iter(bases.values()))[0].gpu
    print(f"{sum(len(t) for t in trials.values())} trials of {len(bases)} base models on {sweep['gpus']} x "
          f"{gpu.name} ({gpu.memory_gb:g} GB, load factor {sweep['load_factor']:g}):")
    for name, (cost_model, base_trials) in bases.items():
        print(f"  {name}: {_model_name(sweep['bases'][name]['model'])}, {len(base_trials)} trials, max_seq_len "
              f"{cost_model.max_seq_len}, {cost_model.quantization or cost_model.dtype}")
    return _print_plan(result, sweep, args)


def _cost_model(sweep: dict):
    """The cost model `plan` predicts a sweep with (or one base's, from `_base_sweep`): its
    model's shape on the sweep's `gpu`."""
    from .costmodel import CostModel

    return CostModel.from_model(
        sweep["model"], sweep["gpu"], gpu_memory_gb=sweep["gpu_memory_gb"], max_seq_len=sweep["max_seq_len"],
        dtype=sweep["dtype"], gradient_checkpointing=sweep["gradient_checkpointing"],
        load_factor=sweep["load_factor"], quantization=quantization_name(sweep.get("quantization")),
        **({"target_modules": sweep["target_modules"]} if sweep.get("target_modules") else {}))


def _base_sweep(sweep: dict, base: str) -> dict:
    """The sweep as one of its `bases` sees it: that entry's model and settings, the sweep's
    where the entry sets none."""
    entry = sweep["bases"][base]
    return {**sweep, **{k: entry[k] for k in BASE_KEYS if k in entry}}


def _print_plan(result, sweep: dict, args: argparse.Namespace) -> int:
    """Print `result`'s table and draw its Gantt chart where the command line or the sweep says."""
    print(result.table())
    path = args.gantt or os.path.join(sweep["output_dir"], sweep.get("gantt") or "plan.png")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    result.gantt(path)
    print(f"Gantt chart: {path}")
    return 0


def _model_name(model: Any) -> str:
    return model if isinstance(model, str) else f"a {model.get('model_type', 'llama')} model"


# --------------------------------------------------------------------------- sweep files


def read_sweep(path: str) -> dict:
    """Read a sweep YAML file and fill in the defaults (see `SWEEP_KEYS`). ``model: tiny`` is
    the bundled tiny model, with its task as the default data.

    Args:
        path:
            The file.

    Returns:
        The sweep as a dict.
    """
    import yaml

    with open(path) as f:
        sweep = yaml.safe_load(f) or {}
    if not isinstance(sweep, dict):
        raise ValueError(f"The sweep file {path!r} must hold a mapping of keys, not a {type(sweep).__name__}.")
    unknown = sorted(set(sweep) - set(SWEEP_KEYS))
    if unknown:
        raise ValueError(f"The sweep file {path!r} has unknown key(s) {unknown}; known keys are {sorted(SWEEP_KEYS)}.")
    if "model" not in sweep and "bases" not in sweep:
        raise ValueError(f"The sweep file {path!r} has no `model`: {SWEEP_KEYS['model']}.")
    bases = sweep.get("bases")
    if bases is not None and not (isinstance(bases, dict) and bases and all(
            isinstance(b, dict) and "model" in b and set(b) <= BASE_KEYS for b in bases.values())):
        raise ValueError(f"The sweep file {path!r} has `bases` {bases!r}, but it must map names to mappings with a "
                         f"`model` and at most the keys {sorted(BASE_KEYS)}.")
    defaults = dict(max_seq_len=512, dtype="auto", gradient_checkpointing=False, gpus=8, gpu_memory_gb=80,
                    gpu="h100-sxm", load_factor=0.9, n_trials=120, seed=0, steps=200, objective="time",
                    output_dir=os.path.join("lora_sweep_runs", os.path.splitext(os.path.basename(path))[0]))
    entries = [sweep, *(bases or {}).values()]
    if any(entry.get("model") == "tiny" for entry in entries):
        from .tiny import tiny_model_path, tiny_task_paths

        train, dev = tiny_task_paths()
        defaults.update(train_data=train, eval_data=dev, max_seq_len=64)
        for entry in entries:
            if entry.get("model") == "tiny":
                entry["model"] = tiny_model_path()
    return {**defaults, **sweep}


def sweep_trials(sweep: dict) -> list[TrialConfig]:
    """The trials of a sweep: its explicit `trials`, else `n_trials` draws from `search_space`.

    Every trial gets ``max_steps = steps`` and the `trial_defaults` unless it sets them, and
    a ``trial_id`` (t000, t001, ...) unless it has one.

    Args:
        sweep:
            A sweep from `read_sweep`.

    Returns:
        The trials.
    """
    from .space import Categorical, Float, Int, config_from_params, random_configs

    defaults = {"max_steps": sweep["steps"], **_numbers(sweep.get("trial_defaults") or {})}
    if sweep.get("trials"):
        trials = [config_from_params(_numbers(t), defaults) for t in sweep["trials"]]
    else:
        space = None
        if sweep.get("search_space"):
            space = {}
            for name, dim in sweep["search_space"].items():
                if isinstance(dim, list):
                    space[name] = Categorical(tuple(dim))
                elif isinstance(dim, dict) and {"low", "high"} <= set(dim):
                    low, high = _number(dim["low"]), _number(dim["high"])
                    kind = Int if isinstance(low, int) and isinstance(high, int) else Float
                    space[name] = kind(low, high, log=bool(dim.get("log", False)))
                else:
                    raise ValueError(f"The search space dimension `{name}` is {dim!r}, but must be a list of "
                                     "choices or a mapping with `low`, `high` and optionally `log`.")
        trials = random_configs(space, sweep["n_trials"], seed=sweep["seed"], defaults=defaults)
    for k, trial in enumerate(trials):
        if trial.trial_id is None:
            trial.trial_id = f"t{k:03d}"
    return trials


def sweep_trials_by_base(sweep: dict) -> dict[str, list[TrialConfig]]:
    """The trials of a sweep with `bases`, by base name, each with its `base_model` set: an
    explicit trial's `base_model` (default the first base); a search space's `base_model`
    dimension (a list of names) drawn like the others; without either, every drawn trial on
    every base, its id suffixed with ``@<base>``."""
    import random

    names = list(sweep["bases"])

    def checked(base):
        if base not in sweep["bases"]:
            raise ValueError(f"A trial's `base_model` is {base!r}, but must be one of the sweep's bases {names}.")
        return base

    if sweep.get("trials"):
        chosen = [checked(t.get("base_model") or names[0]) for t in sweep["trials"]]
        trials = sweep_trials({**sweep, "trials": [{k: v for k, v in t.items() if k != "base_model"}
                                                   for t in sweep["trials"]]})
    else:
        space = dict(sweep.get("search_space") or {})
        drawn = space.pop("base_model", None)
        trials = sweep_trials({**sweep, "search_space": space or None})
        if drawn is None:  # every trial on every base
            return {name: [dataclasses.replace(t, trial_id=f"{t.trial_id}@{name}", base_model=name) for t in trials]
                    for name in names}
        if not isinstance(drawn, list) or not drawn:
            raise ValueError(f"The search space dimension `base_model` is {drawn!r}, but must be a list of base "
                             "names.")
        rng = random.Random(sweep["seed"])
        chosen = [checked(rng.choice(drawn)) for _ in trials]
    by_base: dict[str, list[TrialConfig]] = {name: [] for name in names}
    for trial, base in zip(trials, chosen):
        by_base[base].append(dataclasses.replace(trial, base_model=base))
    return by_base


def _number(value: Any) -> Any:
    """YAML 1.1 reads ``2e-5`` (no dot) as a string; take it as the number it means."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _numbers(values: dict) -> dict:
    return {k: v if k == "trial_id" else _number(v) for k, v in values.items()}


# --------------------------------------------------------------------------- demo and run


# The tiny task wants larger learning rates than PLoRA's space (2e-5..4e-4) to move in a
# minute of CPU time; the spread is wide on purpose so that good and bad trials differ clearly.
DEMO_SPACE = {
    "learning_rate": Float(1e-5, 1e-2, log=True),
    "rank": Categorical([4, 8, 16]),
    "alpha_ratio": Categorical([1.0, 2.0, 4.0]),
    "batch_size": Categorical([2, 4, 8]),
}


def _demo(args: argparse.Namespace) -> int:
    import shutil

    from .plots import LossCurves
    from .tiny import tiny_model_path, tiny_task_paths

    tiny = args.model is None
    train, dev = tiny_task_paths()
    spec = JobSpec(base_model=args.model or tiny_model_path(), train_data=args.train or train,
                   eval_data=args.eval or (dev if args.train is None else None),
                   max_seq_len=args.max_seq_len or (24 if tiny else 512), eval_every=max(1, args.steps // 3),
                   output_dir=args.output_dir, device="cpu" if tiny else "auto")
    trials = random_configs(DEMO_SPACE, args.trials, seed=args.seed,
                            defaults={"max_steps": args.steps, "dropout": 0.05})
    for i, t in enumerate(trials):
        t.trial_id = f"trial-{i}"
    print(f"Training {len(trials)} LoRA trials packed on one base model, {spec.model_name} "
          f"({args.steps} steps each)...")
    curves, results = LossCurves(), {}
    _train_job(spec, trials, curves, results)
    ranked = _print_results(spec, trials, results, curves, adapters=False)
    if not ranked:
        return 1
    metric = _metric(spec)
    best = os.path.join(args.output_dir, "best_adapter")
    shutil.copytree(ranked[0].adapter_dir, best, dirs_exist_ok=True)
    print(f"\nBest: {ranked[0].trial_id} ({metric.replace('_', ' ')} {ranked[0].metrics[metric]:.3f}, worst "
          f"{ranked[-1].metrics[metric]:.3f}). Its PEFT adapter is in {best}:\n"
          f"  from peft import PeftModel\n"
          f"  from transformers import AutoModelForCausalLM\n"
          f"  model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({spec.model_name!r}), {best!r})")
    return 0


def _run(args: argparse.Namespace) -> int:
    import threading

    import torch

    from .costmodel import CostModel
    from .planner import plan, plan_bases
    from .plots import LossCurves

    sweep = read_sweep(args.sweep)
    # Plan for this machine: its GPUs (at most the file's `gpus`) and their measured memory, or the CPU.
    devices = min(sweep["gpus"], torch.cuda.device_count())
    if sweep.get("bases"):  # a spec and the trials of each base; every job trains one base's trials
        specs = {name: sweep_spec(sweep, name) for name in sweep["bases"]}
        by_base = sweep_trials_by_base(sweep)
        result = plan_bases({name: (CostModel.from_model(specs[name], None, load_factor=sweep["load_factor"]),
                                    by_base[name]) for name in specs}, max(1, devices),
                            max_adapters_per_job=sweep.get("max_adapters_per_job"), objective=sweep["objective"])
        trials = [t for base_trials in by_base.values() for t in base_trials]
        what = f"{len(specs)} base models ({', '.join(specs)})"
    else:
        specs = {None: sweep_spec(sweep)}
        trials = sweep_trials(sweep)
        result = plan(None, trials, max(1, devices), cost_model=CostModel.from_model(
            specs[None], None, load_factor=sweep["load_factor"]),
            max_adapters_per_job=sweep.get("max_adapters_per_job"), objective=sweep["objective"])
        what = specs[None].model_name
    spec = next(iter(specs.values()))
    where = f"{devices} x {torch.cuda.get_device_name(0)}" if devices else "the CPU"
    print(f"{len(trials)} trials of {what} on {where}, {len(result.jobs)} packed job(s):")
    print(result.table())

    # Each job starts once the jobs planned before it on its GPUs are done; jobs on other GPUs
    # run side by side. A job on d > 1 GPUs runs over d ranks under torchrun (`_train_on_ranks`).
    curves, results, errors = LossCurves(), {}, []
    lock = threading.Lock()
    last_on: dict = {}  # GPU id (or "cpu") -> the done event of the last job queued there

    def train(job, after: list, done: threading.Event) -> None:
        try:
            for event in after:
                event.wait()
            if errors:
                return
            if job.num_gpus > 1:
                _train_on_ranks(args.sweep, job, "cuda" if devices else "cpu", curves, results, lock)
            else:
                device = f"cuda:{job.gpu_ids[0]}" if devices else "cpu"
                _train_job(dataclasses.replace(specs[job.base], device=device), job.trials, curves, results, lock)
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
        finally:
            done.set()

    threads = []
    for k, job in enumerate(sorted(result.jobs, key=lambda j: (j.start, j.gpu_ids))):
        places = job.gpu_ids if devices else ("cpu",)
        done = threading.Event()
        after = [last_on[g] for g in places if g in last_on]
        last_on.update((g, done) for g in places)
        threads.append(threading.Thread(target=train, args=(job, after, done), name=f"lora-sweep-job-{k}"))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    ranked = _print_results(spec, trials, results, curves, adapters=True)
    return 0 if len(ranked) == len(trials) else 1


def sweep_spec(sweep: dict, base: Optional[str] = None) -> JobSpec:
    """The `JobSpec` that `lora-sweep run` trains a sweep's trials with.

    Args:
        sweep:
            A sweep from `read_sweep`.
        base:
            The name of one of the sweep's `bases`: its model and settings, the sweep's where
            it sets none; None: the sweep's own `model`.

    Returns:
        The spec.
    """
    from .costmodel import PRESETS

    if base is not None:
        sweep = _base_sweep(sweep, base)
    model = sweep["model"]
    if not isinstance(model, str) or model in PRESETS:
        raise ValueError(f"The value of `model` is {model!r}: `plan` models it from its shape alone, but `run` "
                         "needs its weights: a hub id (e.g. Qwen/Qwen2.5-7B), a local directory or `tiny`.")
    if not sweep.get("train_data"):
        raise ValueError("The sweep file has no `train_data`: `run` needs " + SWEEP_KEYS["train_data"] + ".")
    return JobSpec(base_model=model, train_data=sweep["train_data"], eval_data=sweep.get("eval_data"),
                   max_seq_len=sweep["max_seq_len"], dtype=sweep["dtype"],
                   gradient_checkpointing=sweep["gradient_checkpointing"], output_dir=sweep["output_dir"],
                   **{k: sweep[k] for k in ("target_modules", "eval_every", "quantization")
                      if sweep.get(k) is not None})


def _train_job(spec, trials: list[TrialConfig], curves, results: dict, lock: Optional[Any] = None) -> None:
    """Train one packed job to its end; its reports go to `curves`, its Finished events to `results`."""
    import contextlib

    from .engine import PackedJob

    job = PackedJob(spec, trials)
    for event in job.run():
        with lock or contextlib.nullcontext():
            _record(event, curves, results)


def _record(event, curves, results: dict) -> None:
    """A job's event in `run`'s results: every one on the loss curves, a Finished one in
    `results`, a Failed one printed."""
    from .engine import Failed, Finished

    curves.add(event)
    if isinstance(event, Finished):
        results[event.trial_id] = event
    elif isinstance(event, Failed):
        print(f"  {event.trial_id} failed: {event.reason}")


def _train_on_ranks(sweep_path: str, job, device: str, curves, results: dict, lock) -> None:
    """Train a planned job on its `job.num_gpus` GPUs (`job.gpu_ids`; on the CPU, that many gloo
    ranks): `lora-sweep train-ranks` under ``torchrun --nproc-per-node d``, one process per
    rank, rank 0 writing the job's events to a file that is then read like `_train_job`'s."""
    import json
    import subprocess
    import tempfile

    from .engine import Failed, Finished, Report

    with tempfile.TemporaryDirectory(prefix="lora-sweep-ranks-") as tmp:
        trials_path, events_path = os.path.join(tmp, "trials.json"), os.path.join(tmp, "events.jsonl")
        with open(trials_path, "w") as f:
            json.dump([t.to_dict() for t in job.trials], f)
        env = dict(os.environ)
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in job.gpu_ids)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(job.num_gpus),
                   "--standalone", "-m", "lora_sweep.cli", "train-ranks", sweep_path, "--trials", trials_path,
                   "--events", events_path, "--device", device] + (["--base", job.base] if job.base else [])
        done = subprocess.run(command, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"The job of {len(job.trials)} trials on {job.num_gpus} ranks (GPUs {job.gpu_ids}) "
                               f"exited with status {done.returncode}; its ranks' output is above.")
        kinds = {"Report": Report, "Finished": Finished, "Failed": Failed}
        with open(events_path) as f:
            for line in f:
                fields = json.loads(line)
                event = kinds[fields.pop("kind")](**fields)
                with lock:
                    _record(event, curves, results)


def _train_ranks(args: argparse.Namespace) -> int:
    """One rank of `_train_on_ranks`' job: every rank trains its share; rank 0 writes the events."""
    import json

    from .engine import PackedJob

    spec = dataclasses.replace(sweep_spec(read_sweep(args.sweep), args.base), device=args.device)
    with open(args.trials) as f:
        trials = [TrialConfig.from_dict(t) for t in json.load(f)]
    rank = int(os.environ.get("RANK", "0"))
    with open(args.events, "w") if rank == 0 else open(os.devnull, "w") as out:
        for event in PackedJob(spec, trials, progress=rank == 0).run():
            out.write(json.dumps({"kind": type(event).__name__, **dataclasses.asdict(event)}) + "\n")
            out.flush()
    return 0


def _metric(spec) -> str:
    return "eval_loss" if spec.eval_data is not None else "train_loss"


def _print_results(spec, trials: list[TrialConfig], results: dict, curves, adapters: bool) -> list:
    """Print the finished trials, best first, and draw their loss curves beside the table."""
    by_id = {t.trial_id: t for t in trials}
    metric = _metric(spec)
    ranked = sorted(results.values(), key=lambda e: e.metrics[metric])
    header = ["trial", "rank", "alpha", "lr", "batch", metric.replace("_", " "), "tokens/s"]
    rows = [[e.trial_id, by_id[e.trial_id].rank, f"{by_id[e.trial_id].alpha:g}",
             f"{by_id[e.trial_id].learning_rate:.2e}", by_id[e.trial_id].batch_size,
             f"{e.metrics[metric]:.3f}", f"{e.metrics['tokens_per_second']:,.0f}"] for e in ranked]
    if adapters:
        header.append("adapter")
        for row, e in zip(rows, ranked):
            row.append(e.adapter_dir)
    print(_table(header, rows))
    if curves.points:
        print(f"Loss curves: {curves.save(os.path.join(spec.output_dir, 'loss_curves.png'))}")
    return ranked


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths)] + lines[1:])


if __name__ == "__main__":
    sys.exit(main())
