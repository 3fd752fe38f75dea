"""A packed LoRA hyperparameter sweep with Optuna.

With no arguments it tunes the bundled tiny model on its toy task, on the CPU, in
a minute or two:

    python examples/optuna_sweep.py

On a real model, with a storage so that the sweep survives a crash (run the same command
again to resume) and can be shared by several workers (run it on each machine, or once per
GPU with --devices cuda:1, ...):

    python examples/optuna_sweep.py --model Qwen/Qwen2.5-0.5B --train train.jsonl --eval eval.jsonl \\
        --trials 64 --max-steps 400 --eval-every 50 --storage sqlite:///lora.db --study-name qwen-lora

Trials are PLoRA's Table 1 space (learning rate, batch size, rank, alpha) for a real model,
and a smaller one for the tiny model, whose layers are only a few dozen wide.
"""

from __future__ import annotations

import argparse

import optuna

import lora_sweep as ls
from lora_sweep.integrations.optuna import PackedLoRASampler
from lora_sweep.space import Float, Int

# The tiny model's layers are narrower than PLoRA's ranks: a space that fits it.
TINY_SPACE = {
    "learning_rate": Float(1e-4, 3e-2, log=True),
    "rank": Int(2, 16, log=True),
    "alpha_ratio": Float(0.25, 4.0, log=True),  # alpha = alpha_ratio * rank
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="Hub id or local directory of the base model "
                                        "(default: the bundled tiny model).")
    parser.add_argument("--train", help="Training rows, .jsonl of {prompt, completion} or {text}.")
    parser.add_argument("--eval", help="Evaluation rows, same format.")
    parser.add_argument("--trials", type=int, default=12, help="Trials in the study, in total over all workers.")
    parser.add_argument("--timeout", type=float, help="Seconds after which no new trial starts.")
    parser.add_argument("--storage", help="Optuna storage: an RDB URL (sqlite:///lora.db) or a path ending in "
                                          ".log for a JournalStorage file. Default: in memory.")
    parser.add_argument("--study-name", default="lora_sweep", help="Study to create or resume.")
    parser.add_argument("--max-steps", type=int, default=30, help="Optimizer steps of each trial.")
    parser.add_argument("--eval-every", type=int, default=5, help="Steps between evaluations (and pruning).")
    parser.add_argument("--batch-size", type=int, help="Fix the batch size instead of tuning it.")
    parser.add_argument("--max-seq-len", type=int, help="Longest sample in tokens (default: 64 for the tiny "
                                                            "model, 512 otherwise).")
    parser.add_argument("--max-eval-samples", type=int, help="Evaluate on at most this many rows (default: 64 "
                                                              "for the tiny model, all otherwise).")
    parser.add_argument("--max-concurrent", type=int, default=8, help="Most trials packed into one job.")
    parser.add_argument("--devices", nargs="+", help="Devices of this worker, one packed job each (cuda:0 cuda:1).")
    parser.add_argument("--output-dir", default="lora_sweep_runs", help="Adapters are saved here.")
    parser.add_argument("--seed", type=int, default=0, help="Seeds the sampler.")
    return parser.parse_args()


def make_storage(url):
    """An RDB URL as is; a path ending in .log becomes a JournalStorage file (good on NFS too)."""
    if url is None or "://" in url:
        return url
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    return JournalStorage(JournalFileBackend(url))


def main() -> None:
    args = parse_args()

    # data and model: the bundled tiny ones unless given
    if args.model is None:
        from lora_sweep.tiny import tiny_model_path, tiny_task_paths

        model, (train, dev), space = tiny_model_path(), tiny_task_paths(), TINY_SPACE
        args.max_seq_len = args.max_seq_len or 64
        args.max_eval_samples = args.max_eval_samples or 64
    else:
        model, train, dev, space = args.model, args.train, args.eval, None  # None: PLoRA's Table 1
    if train is None or dev is None:
        raise SystemExit("--model needs --train and --eval.")
    spec = ls.JobSpec(base_model=model, train_data=train, eval_data=dev, max_seq_len=args.max_seq_len or 512,
                      max_eval_samples=args.max_eval_samples, eval_every=args.eval_every, output_dir=args.output_dir)

    # the study: TPE that spreads out the many trials in flight, successive halving from the first eval
    study = optuna.create_study(
        study_name=args.study_name, storage=make_storage(args.storage), load_if_exists=True, direction="minimize",
        sampler=optuna.samplers.TPESampler(constant_liar=True, seed=args.seed),
        pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=args.eval_every, reduction_factor=2),
    )
    defaults = {"max_steps": args.max_steps, "dropout": 0.0}
    if args.batch_size is not None:
        defaults["batch_size"] = args.batch_size
    elif space is TINY_SPACE:
        defaults["batch_size"] = 4
    sampler = PackedLoRASampler(study, spec, space, trial_defaults=defaults, max_concurrent=args.max_concurrent,
                                devices=args.devices)
    sampler.optimize(n_trials=args.trials, timeout=args.timeout)

    # results
    states = [t.state.name for t in study.trials]
    print(f"{len(states)} trials: " + ", ".join(f"{states.count(s)} {s.lower()}" for s in sorted(set(states))))
    best = study.best_trial
    print(f"best eval loss {best.value:.4f} (trial {best.number}): {best.params}")
    print(f"adapter: {best.user_attrs['adapter_dir']}")
    print(f"load it with peft.PeftModel.from_pretrained(base_model, {best.user_attrs['adapter_dir']!r})")


if __name__ == "__main__":
    main()
