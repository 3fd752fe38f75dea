"""A Ray Tune sweep of LoRA hyperparameters, every trial packed onto one shared base model.

Tune proposes configs and ASHA stops the poor ones early, as usual; `PackedExecutor` trains
the trials of each pack server in one forward/backward over a base model it loaded once.
With the bundled tiny model this runs on a laptop CPU in about a minute. On a Ray cluster
with GPUs the same script starts one pack server per GPU, on every node.

    python examples/ray_tune_sweep.py                        # local Ray, bundled tiny model
    python examples/ray_tune_sweep.py --address auto --base-model Qwen/Qwen2.5-0.5B \\
        --train train.jsonl --eval eval.jsonl --steps 400     # a running Ray cluster
"""

from __future__ import annotations

import argparse
import os

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler

import lora_sweep as ls
from lora_sweep.integrations.ray_tune import PackedExecutor
from lora_sweep.tiny import tiny_model_path, tiny_task_paths


def parse_args() -> argparse.Namespace:
    tiny_train, tiny_eval = tiny_task_paths()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=None, help="Ray cluster address (default: start Ray on this machine)")
    p.add_argument("--base-model", default=tiny_model_path(), help="hub id or local directory (default: tiny)")
    p.add_argument("--train", default=tiny_train, help="train .jsonl of {prompt, completion} rows")
    p.add_argument("--eval", default=tiny_eval, help="eval .jsonl")
    p.add_argument("--max-seq-len", type=int, default=24)
    p.add_argument("--trials", type=int, default=12, help="Tune samples (default 12)")
    p.add_argument("--steps", type=int, default=60, help="max_steps of every trial (default 60)")
    p.add_argument("--adapters-per-pack", type=int, default=6, help="trials packed on one pack server")
    p.add_argument("--output-dir", default="lora_sweep_runs/ray_tune")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.address:
        ray.init(address=args.address)
    else:  # a small local Ray: one pack server plus the trials' light proxies
        ray.init(num_cpus=2, include_dashboard=False)

    # What every trial shares: the base model (loaded once per pack server) and the data.
    spec = ls.JobSpec(base_model=args.base_model, train_data=args.train, eval_data=args.eval,
                      max_seq_len=args.max_seq_len, eval_every=max(1, args.steps // 6),
                      output_dir=os.path.join(args.output_dir, "packs"))
    executor = PackedExecutor(spec, max_adapters_per_server=args.adapters_per_pack)
    print(f"{len(executor.servers)} pack server(s), {executor.capacity} trials at a time")

    # The search space: Tune config keys are TrialConfig fields.
    search_space = {
        "rank": tune.choice([4, 8, 16]),
        "alpha": tune.choice([8.0, 16.0, 32.0]),
        "learning_rate": tune.loguniform(1e-5, 1e-2),
        "batch_size": tune.choice([4, 8]),
        "dropout": 0.05,
        "max_steps": args.steps,
    }
    analysis = executor.run(  # tune.run(executor.trainable, ...) with the packs' capacity
        config=search_space,
        num_samples=args.trials,
        scheduler=ASHAScheduler(metric="eval_loss", mode="min", time_attr="step", max_t=args.steps,
                                grace_period=max(1, args.steps // 6), reduction_factor=2),
        storage_path=os.path.abspath(os.path.join(args.output_dir, "tune")),
        verbose=1,
    )

    # Results: one row per trial, best first.
    results = analysis.results_df.sort_values("eval_loss")
    columns = ["config/rank", "config/alpha", "config/learning_rate", "config/batch_size", "step", "eval_loss",
               "pack_id"]
    print(results[columns].to_string())

    # The best adapter is a PEFT checkpoint.
    best = analysis.get_best_trial("eval_loss", "min", scope="last")
    print(f"\nBest trial {best.trial_id}: eval loss {best.last_result['eval_loss']:.3f} "
          f"at step {best.last_result['step']} with {best.config}")
    print(f"Its adapter (PEFT format): {best.checkpoint.path}\n"
          f"  model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({args.base_model!r}), "
          f"{best.checkpoint.path!r})")
    executor.shutdown()


if __name__ == "__main__":
    main()
