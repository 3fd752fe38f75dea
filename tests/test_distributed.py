"""A packed job over two ranks (torchrun, gloo on CPU) trains what it trains on one process.

The script is tests/distributed_worker.py, as a user would write it for one GPU; under
``torchrun --nproc-per-node 2`` it spans both ranks (FSDP2 over the frozen base, each trial
trained by one rank). Everything is fp32 on CPU with rows padded to max_seq_len.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from distributed_worker import run_job

WORKER = Path(__file__).with_name("distributed_worker.py")
REPO = WORKER.parent.parent


def torchrun(args: dict, path: Path) -> subprocess.CompletedProcess:
    """The worker under torchrun on two ranks with `args`; its output and exit status."""
    path.write_text(json.dumps(args))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(WORKER), str(path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def in_process(args: dict) -> list[dict]:
    """The worker's job on this one process (d = 1)."""
    _, seen = run_job(args)
    return seen


@pytest.fixture(scope="module")
def base_args(tiny_llama_dir, toy_data):
    train, dev = toy_data
    return {"model_dir": tiny_llama_dir, "train": train, "eval": dev[:6], "kill_at": None}


def key(event: dict) -> tuple:
    return event["kind"], event["trial_id"], event["step"]


def weights(event: dict) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(event["adapter_dir"], "adapter_model.safetensors"))


def assert_same_training(got: list[dict], want: list[dict]) -> None:
    """The same events, losses within 1e-5 relative, saved adapters within 1e-4 relative."""
    assert sorted(map(key, got)) == sorted(map(key, want))
    wanted = {key(e): e for e in want}
    for e in got:
        w = wanted[key(e)]
        if e["metrics"] is not None:
            for name in ("train_loss", "eval_loss"):
                assert math.isclose(e["metrics"][name], w["metrics"][name], rel_tol=1e-5), (key(e), name)
        if e["kind"] == "Finished":
            a, b = weights(e), weights(w)
            assert a.keys() == b.keys()
            for k in a:
                assert ((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)).item() < 1e-4, (key(e), k)


@pytest.mark.parametrize("shard_base", ["auto", False])
def test_two_ranks_train_what_one_trains_with_a_join_and_a_leave(base_args, tmp_path, shard_base):
    # two 32-token rows per microbatch: the ranks run different numbers of forwards per step
    # (rank 0 with a and c: two for training, six per evaluation; rank 1 with b: one and three),
    # in lockstep with a sharded base, each at its own pace with a whole one
    args = {**base_args, "scenario": "join_leave", "microbatch_tokens": 64, "shard_base": shard_base}
    one = in_process({**args, "out": str(tmp_path / "d1")})
    proc = torchrun({**args, "out": str(tmp_path / "d2")}, tmp_path / "args.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "d2" / "result.json").read_text())
    # CPU ranks share one memory: "auto" shards the frozen base with FSDP2; False keeps it whole on each
    assert result["sharded"] == (shard_base == "auto")
    # a, c on rank 0 and b on rank 1; d joins (asked for on a's report) on rank 1, the emptier one,
    # and c on rank 0 leaves when b's report on rank 1 asks for it
    assert result["owners"] == {"a": 0, "b": 1, "c": 0, "d": 1}
    two = result["events"]
    assert sorted(e["trial_id"] for e in two if e["kind"] == "Finished") == ["a", "b", "d"]
    assert not any(e["kind"] == "Failed" for e in two)
    # c, stepping every second job step, left at job step 4 after its step-2 report
    assert [key(e) for e in two if e["trial_id"] == "c"] == [("Report", "c", 2)]
    assert_same_training(two, one)
    assert "rank 1 done" in proc.stdout  # the other rank ran the whole job and yielded nothing


def test_an_optuna_sweep_under_torchrun_spans_both_ranks(base_args, tmp_path):
    """The sampler's script as a user writes it for one GPU, under torchrun: rank 0 asks and
    tells the study, both ranks train, and each trial's adapter is the one a job on one
    process gives the same config."""
    optuna = pytest.importorskip("optuna")
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    one = {e["trial_id"]: e for e in in_process({**base_args, "scenario": "plain", "out": str(tmp_path / "d1")})
           if e["kind"] == "Finished"}
    journal = str(tmp_path / "journal.log")
    proc = torchrun({**base_args, "scenario": "optuna", "out": str(tmp_path / "d2"), "journal": journal},
                    tmp_path / "args.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):  # one job over both ranks, each training some of the trials
        assert f"rank {rank} done: one job on 2 ranks, trials on ranks [0, 1]" in proc.stdout, proc.stdout
    study = optuna.load_study(study_name="ranks", storage=JournalStorage(JournalFileBackend(journal)))
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3  # asked once each, by rank 0
    for t, want in zip(trials, "abc"):
        got, ref = weights({"adapter_dir": t.user_attrs["adapter_dir"]}), weights(one[want])
        for k in ref:
            assert ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() < 1e-4, (want, k)


def test_an_optuna_sweep_over_two_device_groups_trains_a_job_on_each(base_args, tmp_path):
    """`PackedLoRASampler(devices=[["cpu", "cpu"], ["cpu", "cpu"]])` in one process: a job over
    two ranks per group, each rank a process of its own; every trial completes with the adapter
    a job on one process gives its config."""
    optuna = pytest.importorskip("optuna")
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from distributed_worker import make_spec, three_trials
    from lora_sweep.integrations.optuna import PackedLoRASampler

    one = {e["trial_id"]: e for e in in_process({**base_args, "scenario": "plain", "out": str(tmp_path / "d1")})
           if e["kind"] == "Finished"}
    study = optuna.create_study(storage=JournalStorage(JournalFileBackend(str(tmp_path / "journal.log"))))
    configs = [{k: v for k, v in t.to_dict().items() if k != "trial_id"} for t in three_trials()]
    sampler = PackedLoRASampler(study, make_spec({**base_args, "out": str(tmp_path / "groups")}),
                                metric="train_loss", max_concurrent=1, devices=[["cpu", "cpu"], ["cpu", "cpu"]])
    try:
        sampler.optimize(objective=lambda trial: configs[trial.number], n_trials=3, show_progress_bar=False)
        assert [job.devices for job in sampler.jobs] == [["cpu", "cpu"], ["cpu", "cpu"]]
    finally:
        for job in sampler.jobs:
            job.close()
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 3
    assert len({t.user_attrs["pack_id"] for t in trials}) == 2  # one trial at a time per group: both trained
    for t, want in zip(trials, "abc"):
        got, ref = weights({"adapter_dir": t.user_attrs["adapter_dir"]}), weights(one[want])
        for k in ref:
            assert ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() < 1e-4, (want, k)


def test_a_killed_rank_stops_the_job_and_a_restart_resumes_from_checkpoints(base_args, tmp_path):
    args = {**base_args, "scenario": "plain", "out": str(tmp_path / "d2")}
    killed = torchrun({**args, "kill_at": 5}, tmp_path / "killed.json")  # rank 1 dies at its 5th step
    assert killed.returncode != 0
    log = killed.stdout + killed.stderr
    assert "PeerFailure: The packed job on 2 ranks stopped" in log
    assert "resume its trials from their checkpoints" in log
    assert not (tmp_path / "d2" / "result.json").exists()
    assert sorted(os.listdir(tmp_path / "d2" / "checkpoints")) == ["a.pt", "b.pt", "c.pt"]
    shutil.copytree(tmp_path / "d2", tmp_path / "d1-resumed")  # the same checkpoints, for a job on one process

    resumed = torchrun(args, tmp_path / "resumed.json")  # the same command again
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    events = json.loads((tmp_path / "d2" / "result.json").read_text())["events"]
    first_report = {t: min(e["step"] for e in events if e["trial_id"] == t) for t in ("a", "b", "c")}
    # from their step-4 (a, b) and step-2 (c, accumulating over two micro-steps) checkpoints
    assert first_report == {"a": 6, "b": 6, "c": 4}
    uninterrupted = in_process({**args, "out": str(tmp_path / "d1")})
    finished = [e for e in events if e["kind"] == "Finished"]
    assert sorted(e["trial_id"] for e in finished) == ["a", "b", "c"]
    assert_same_training(finished, [e for e in uninterrupted if e["kind"] == "Finished"])
    # the checkpoints of the job on two ranks resume in a job on one process just as well
    on_one = in_process({**args, "out": str(tmp_path / "d1-resumed")})
    assert {t: min(e["step"] for e in on_one if e["trial_id"] == t) for t in ("a", "b", "c")} == first_report
    assert_same_training([e for e in on_one if e["kind"] == "Finished"],
                         [e for e in uninterrupted if e["kind"] == "Finished"])


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen_dir"])
def test_a_sharded_base_is_read_from_its_files_as_from_pretrained_reads_it(model_dir, request, tmp_path):
    """Built on the meta device, sharded, then filled rank by rank from the safetensors files
    (here one gloo rank): every weight, the tied LM head (Qwen2) and the rotary buffers equal
    what `from_pretrained` loads."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lora_sweep import JobSpec
    from lora_sweep.distributed import materialize, shard_base
    from lora_sweep.model import load_base_model, split_causal_lm

    path = request.getfixturevalue(model_dir)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        spec = JobSpec(base_model=path, train_data=[{"prompt": "a", "completion": "b"}], output_dir=str(tmp_path))
        model, _ = load_base_model(spec, torch.device("cpu"), torch.float32, on_meta=True)
        assert next(model.parameters()).is_meta
        shard_base(split_causal_lm(model)[0])
        head = materialize(model, path, torch.device("cpu"), torch.float32)
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for name, want in whole.state_dict().items():
            got = model.state_dict()[name]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            assert torch.equal(got, want), name
        assert torch.equal(head, whole.lm_head.weight)
        for name, want in whole.named_buffers():
            assert torch.equal(dict(model.named_buffers())[name], want), name
    finally:
        dist.destroy_process_group()


def test_a_ray_pack_server_on_two_ranks_trains_what_one_process_trains(base_args, tmp_path):
    """`PackedExecutor(gpus_per_server=2)`: each pack server is a job over two ranks (here two
    CPU actors in a placement group, gloo): Tune's trials spread over both ranks, and each
    trial's final adapter is the one a job on one process gives the same config."""
    ray = pytest.importorskip("ray")
    from distributed_worker import make_spec, three_trials
    from test_ray_tune import points

    from lora_sweep.integrations.ray_tune import PackedExecutor

    one = {e["trial_id"]: e for e in in_process({**base_args, "scenario": "plain", "out": str(tmp_path / "d1")})
           if e["kind"] == "Finished"}
    configs = {t.seed: (t.trial_id, {k: v for k, v in t.to_dict().items() if k != "trial_id"})
               for t in three_trials()}
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    try:
        with PackedExecutor(make_spec({**base_args, "out": str(tmp_path / "d2")}), gpus_per_server=2,
                            resources_per_server={"CPU": 1}, max_adapters_per_server=3, poll_seconds=0.5,
                            proxy_resources={"CPU": 0.01}) as executor:
            analysis = executor.run(**points([c for _, c in configs.values()]), storage_path=str(tmp_path / "tune"),
                                    verbose=0)
            (stats,) = executor.stats()
    finally:
        ray.shutdown()
    assert all(t.status == "TERMINATED" for t in analysis.trials) and len(analysis.trials) == 3
    assert stats["ranks"] == 2 and stats["trial_ranks"] == [0, 1]  # one job over both ranks, trials on each
    for t in analysis.trials:
        want = one[configs[t.config["seed"]][0]]
        with t.checkpoint.as_directory() as path:
            got = load_file(os.path.join(path, "adapter_model.safetensors"))
        ref = weights(want)
        for k in ref:
            assert ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-12)).item() < 1e-4, (t.trial_id, k)


def test_the_multi_gpu_benchmark_runs_on_cpu_ranks(tmp_path):
    """`benchmarks/multi_gpu.py --dry --from-files`: the tiny Llama's architecture written with
    random weights a layer at a time, then the same job under torchrun on one process and on
    two gloo ranks (each reading its shard of those files) trains the same losses, and the cost
    model is fitted to both runs."""
    from benchmarks.multi_gpu import main

    result = main(["--dry", "--from-files", "--gpus", "1,2", "--out", str(tmp_path / "multi_gpu.json")])
    assert result["from_files"] and result["checkpoint_written_s"] > 0
    one, two = result["runs"]
    assert (one["d"], two["d"]) == (1, 2)
    assert two["loss_max_rel_diff"] < 1e-5
    assert sorted(set(result["owners"][2].values())) == [0, 1]
    assert set(result["cost_model"]) == {"all", "d=1"}
    assert all(p["step_s"] > 0 for p in result["cost_model"]["all"]["predicted"].values())


def test_the_base_layouts_benchmark_computes_the_same_gradient_three_ways(tmp_path):
    """`benchmarks/base_parallelism.py --dry`: the tiny Llama's layers on two gloo ranks, whole,
    under FSDP2 and under tensor parallelism, give rank 0's rows the same input gradient."""
    from benchmarks.base_parallelism import main

    result = main(["--dry", "--out", str(tmp_path / "base_parallelism.json")])
    (run,) = result["runs"]
    assert run["d"] == 2 and set(run["layouts"]) == {"whole", "fsdp", "tp"}
    for layout, r in run["layouts"].items():
        assert r["tokens_per_s"] > 0 and r["grad_rel_diff"] < 1e-5, layout
