"""The script of tests/test_distributed.py: one packed job, run as a user would write it for one
GPU. Under torchrun it spans the ranks; imported, `run_job` runs it in the test's process.

    python -m torch.distributed.run --nproc-per-node 2 --standalone tests/distributed_worker.py args.json

args.json: {"model_dir", "train", "eval", "out", "scenario": "join_leave" | "plain" | "optuna", "kill_at": null |
int, "microbatch_tokens": null | int, "shard_base": JobSpec.shard_base, "journal": the Optuna journal file of "optuna"}.
Rank 0 writes to <out>/result.json the events it saw, the trials' owners and whether the base is
sharded.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

import lora_sweep as ls
from lora_sweep.engine import PackedJob, Report


def three_trials() -> list[ls.TrialConfig]:
    return [
        ls.TrialConfig(rank=4, alpha=8, learning_rate=3e-3, batch_size=1, max_steps=6, dropout=0.0, seed=1,
                       trial_id="a"),
        ls.TrialConfig(rank=8, alpha=4, learning_rate=1e-3, batch_size=2, max_steps=6, dropout=0.1, seed=2,
                       weight_decay=0.1, warmup_steps=2, lr_scheduler="cosine", trial_id="b"),
        ls.TrialConfig(rank=4, alpha=16, learning_rate=2e-3, batch_size=2, max_steps=6, dropout=0.0, seed=3,
                       gradient_accumulation_steps=2, target_modules=("q_proj", "v_proj"), trial_id="c"),
    ]


JOINER = ls.TrialConfig(rank=8, alpha=16, learning_rate=2e-3, batch_size=1, max_steps=4, dropout=0.0, seed=4,
                        trial_id="d")


def make_spec(args: dict) -> ls.JobSpec:
    return ls.JobSpec(base_model=args["model_dir"], train_data=args["train"], eval_data=args["eval"],
                      max_seq_len=32, eval_every=2, checkpoint_every=2, padding="max_seq_len",
                      max_tokens_per_microbatch=args.get("microbatch_tokens"), output_dir=args["out"],
                      shard_base=args.get("shard_base", "auto"))


class KilledAt(PackedJob):
    """A job whose rank 1 kills itself with SIGKILL at its `kill_at`-th step."""

    kill_at = None

    def _train_step(self) -> None:
        self.steps_begun = getattr(self, "steps_begun", 0) + 1
        if self.ranks is not None and self.ranks.rank == 1 and self.steps_begun == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._train_step()


def count_whole_loads() -> list[int]:
    """A counter of the base's whole loads (`from_pretrained`) from here on: a d-rank job reads
    its shards instead."""
    from transformers import AutoModelForCausalLM

    calls, load = [0], AutoModelForCausalLM.from_pretrained.__func__

    def counted(cls, *a, **kw):
        calls[0] += 1
        return load(cls, *a, **kw)

    AutoModelForCausalLM.from_pretrained = classmethod(counted)
    return calls


def run_job(args: dict) -> tuple[PackedJob, list[dict]]:
    """Run the scenario; returns the job and the events seen (all of them on rank 0, none elsewhere).
    "join_leave": trial d joins once a reports step 2, and c leaves once b reports step 4."""
    KilledAt.kill_at = args.get("kill_at")
    job = KilledAt(make_spec(args), three_trials(), progress=False)
    seen = []
    for event in job.run():
        seen.append({"kind": type(event).__name__, "trial_id": event.trial_id, "step": event.step,
                     "metrics": getattr(event, "metrics", None), "reason": getattr(event, "reason", None),
                     "adapter_dir": getattr(event, "adapter_dir", None)})
        if args["scenario"] == "join_leave" and isinstance(event, Report):
            if (event.trial_id, event.step) == ("a", 2):
                job.add_trial(JOINER)
            if (event.trial_id, event.step) == ("b", 4):
                job.remove_trial("c")
    return job, seen


def run_optuna_sweep(args: dict) -> None:
    """The three trials as an Optuna sweep through `PackedLoRASampler` on a journal file: under
    torchrun, rank 0 asks and tells the study and every rank trains its share of the one job."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from lora_sweep.integrations.optuna import PackedLoRASampler

    study = optuna.create_study(storage=JournalStorage(JournalFileBackend(args["journal"])), study_name="ranks",
                                load_if_exists=True)
    configs = [{k: v for k, v in t.to_dict().items() if k != "trial_id"} for t in three_trials()]
    sampler = PackedLoRASampler(study, make_spec(args), metric="train_loss", max_concurrent=3)
    sampler.optimize(objective=lambda trial: configs[trial.number], n_trials=3, show_progress_bar=False)
    (job,) = sampler.jobs
    print(f"rank {job.ranks.rank} done: one job on {job.ranks.size} ranks, trials on ranks "
          f"{sorted(set(job.ranks.owners.values()))}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        args = json.load(f)
    if args["scenario"] == "optuna":
        run_optuna_sweep(args)
        return
    whole_loads = count_whole_loads()
    job, seen = run_job(args)
    rank = int(os.environ.get("RANK", "0"))
    assert whole_loads[0] == 0, "a rank loaded the whole base"
    if rank == 0:
        from torch.distributed.tensor import DTensor

        sharded = isinstance(job.body.layers[0].self_attn.q_proj.base_layer.weight, DTensor)
        with open(os.path.join(args["out"], "result.json"), "w") as f:
            json.dump({"events": seen, "owners": job.ranks.owners, "sharded": sharded}, f)
    else:
        assert seen == [], "only rank 0 yields events"
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
