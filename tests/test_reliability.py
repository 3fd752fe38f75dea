"""Reliability: microbatch splitting, out-of-memory recovery, crash-safe checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import lora_sweep as ls
from lora_sweep.engine import Failed, Finished, PackedJob, Report
from lora_sweep.export import atomic_write

from test_engine_equivalence import make_spec, run_packed


def trials():
    return [ls.TrialConfig(rank=4, learning_rate=2e-3, batch_size=2, max_steps=6, dropout=0.0, seed=1, trial_id="a"),
            ls.TrialConfig(rank=8, learning_rate=1e-3, batch_size=3, max_steps=6, dropout=0.0, seed=2, trial_id="b"),
            ls.TrialConfig(rank=4, learning_rate=3e-3, batch_size=1, max_steps=6, dropout=0.0, seed=3, trial_id="c",
                           gradient_accumulation_steps=2)]


def finals(job):
    return {t: load_file(f"{p}/adapter_model.safetensors") for t, p in job.finished.items()}


def compare(a, b, exact: bool):
    assert a.keys() == b.keys()
    for t in a:
        for k in a[t]:
            if exact:
                assert torch.equal(a[t][k], b[t][k]), (t, k)
            else:
                assert torch.allclose(a[t][k], b[t][k], rtol=1e-5, atol=1e-7), (t, k)


@pytest.fixture
def unsplit(tiny_llama_dir, toy_data, tmp_path):
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "unsplit", eval_every=2, padding="max_seq_len"), trials(), progress=False)
    losses = run_packed(job)
    return finals(job), losses


def test_microbatches_by_whole_adapters_are_bit_identical(tiny_llama_dir, toy_data, tmp_path, unsplit):
    # 32 tokens per row: a cap of 96 keeps every adapter whole (3 rows at most) but splits the step
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "split", eval_every=2, padding="max_seq_len",
                              max_tokens_per_microbatch=96), trials(), progress=False)
    losses = run_packed(job)
    assert all(s["microbatches"] >= 2 for s in job.step_stats if s["num_adapters"] == 3)
    compare(finals(job), unsplit[0], exact=True)
    assert losses == unsplit[1]


def test_microbatches_inside_an_adapter_match_to_rounding(tiny_llama_dir, toy_data, tmp_path, unsplit):
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "split", eval_every=2, padding="max_seq_len",
                              max_tokens_per_microbatch=32), trials(), progress=False)
    run_packed(job)
    assert max(s["microbatches"] for s in job.step_stats) == 6  # one row each
    compare(finals(job), unsplit[0], exact=False)


def test_out_of_memory_splits_the_step_and_every_trial_finishes(tiny_llama_dir, toy_data, tmp_path, unsplit,
                                                                out_of_memory_when):
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "oom", eval_every=2, padding="max_seq_len"), trials(), progress=False)
    out_of_memory_when(lambda job, padded_tokens: padded_tokens > 100)
    events = list(job.run())
    assert job.microbatch_tokens is not None and job.microbatch_tokens <= 100
    assert sorted(e.trial_id for e in events if isinstance(e, Finished)) == ["a", "b", "c"]
    compare(finals(job), unsplit[0], exact=False)


def test_adapter_that_cannot_fit_moves_out_and_comes_back(tiny_llama_dir, toy_data, tmp_path, unsplit,
                                                         out_of_memory_when):
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "evict", eval_every=2, padding="max_seq_len"), trials(), progress=False)
    # three adapters' states leave no room for activations at all; two leave room for 64 tokens
    out_of_memory_when(lambda job, padded_tokens: len(job.active) >= 3 or padded_tokens > 64)
    events = list(job.run())
    assert job.evictions == 1 and not job.waiting
    assert sorted(e.trial_id for e in events if isinstance(e, Finished)) == ["a", "b", "c"]
    compare(finals(job), unsplit[0], exact=False)  # b's 3 rows no longer fit one 64-token microbatch


def test_interrupted_checkpoint_write_leaves_the_previous_one(tmp_path):
    path = str(tmp_path / "ckpt" / "a.pt")
    atomic_write(path, b"good")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:  # a writer killed after its temporary file, before the rename
        f.write(b"half")
    assert open(path, "rb").read() == b"good"


RUNNER = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    import lora_sweep as ls
    from lora_sweep.engine import PackedJob, Report, Finished
    model_dir, data, out = sys.argv[1:4]
    trials = [ls.TrialConfig(rank=4, learning_rate=2e-3, batch_size=2, max_steps=12, dropout=0.1, seed=1, trial_id="a"),
              ls.TrialConfig(rank=8, learning_rate=1e-3, batch_size=3, max_steps=12, seed=2, trial_id="b"),
              ls.TrialConfig(rank=4, learning_rate=3e-3, batch_size=1, max_steps=12, seed=3, trial_id="c",
                             gradient_accumulation_steps=2),
              ls.TrialConfig(rank=4, learning_rate=3e-3, batch_size=1, max_steps=3, seed=4, trial_id="short")]
    spec = ls.JobSpec(base_model=model_dir, train_data=json.load(open(data)), max_seq_len=32, eval_every=1,
                      padding="max_seq_len",
                      checkpoint_every=int(sys.argv[4]) if len(sys.argv) > 4 else 2, output_dir=out)
    job = PackedJob(spec, trials, progress=False)
    for e in job.run():
        print(type(e).__name__, e.trial_id, e.step, flush=True)
    print("STEPS", json.dumps([s["num_adapters"] for s in job.step_stats]), flush=True)
""")


def test_kill_9_and_restart_gives_the_uninterrupted_adapters(tiny_llama_dir, toy_data, tmp_path):
    script, data = tmp_path / "runner.py", tmp_path / "train.json"
    script.write_text(RUNNER)
    data.write_text(json.dumps(toy_data[0]))
    run = lambda out: [sys.executable, str(script), tiny_llama_dir, str(data), str(out)]  # noqa: E731

    clean = subprocess.run(run(tmp_path / "clean"), capture_output=True, text=True, check=True)
    assert "Finished short 3" in clean.stdout

    proc = subprocess.Popen(run(tmp_path / "killed"), stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("Report a 7"):  # mid-run: "short" finished, the others past a checkpoint
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    resumed = subprocess.run(run(tmp_path / "killed"), capture_output=True, text=True, check=True)
    lines = resumed.stdout.splitlines()
    assert "Finished short 3" in lines  # reported from its saved result ...
    assert not any(line.startswith("Report short") for line in lines)  # ... not retrained
    first_a = next(line for line in lines if line.startswith("Report a "))
    assert first_a == "Report a 7"  # resumed from its step-6 checkpoint, not restarted
    for t in ("a", "b", "c", "short"):
        got = load_file(tmp_path / "killed" / "adapters" / t / "adapter_model.safetensors")
        want = load_file(tmp_path / "clean" / "adapters" / t / "adapter_model.safetensors")
        assert got.keys() == want.keys()
        for k in got:
            assert torch.equal(got[k], want[k]), (t, k)


def test_trial_that_cannot_fit_even_alone_fails_alone(tiny_llama_dir, toy_data, tmp_path, out_of_memory_when):
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "alone", eval_every=2, padding="max_seq_len"), trials()[:1],
                    progress=False)
    out_of_memory_when(lambda job, padded_tokens: True)  # no memory at all
    events = list(job.run())
    assert len(events) == 1 and events[0].trial_id == "a" and "out of memory" in events[0].reason


def test_a_trial_state_continues_exactly_in_another_job_under_another_id(tiny_llama_dir, toy_data, tmp_path, unsplit):
    first = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "first", eval_every=2, padding="max_seq_len"), trials(), progress=False)
    for event in first.run():
        if isinstance(event, Report) and event.trial_id == "b" and event.step == 4:
            break
    state = first.trial_state("b")
    with pytest.raises(KeyError):
        first.trial_state("nope")
    second = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "second", eval_every=2, padding="max_seq_len"), [], progress=False)
    import dataclasses
    second.add_trial(dataclasses.replace(trials()[1], trial_id="b-rerun"), state=state)
    second.add_trial(dataclasses.replace(trials()[0], trial_id="wrong"), state=state)  # a's config, b's state
    events = list(second.run())
    assert [e.trial_id for e in events if isinstance(e, Failed)] == ["wrong"]
    assert [e.step for e in events if isinstance(e, Report)] == [6]  # continued from step 4, not restarted
    got = load_file(f"{second.finished['b-rerun']}/adapter_model.safetensors")
    for k, v in unsplit[0]["b"].items():
        assert torch.equal(got[k], v), k


def test_out_of_memory_corrects_the_jobs_memory_model(tiny_llama_dir, toy_data, tmp_path, out_of_memory_when):
    from lora_sweep.costmodel import CostModel

    spec = make_spec(tiny_llama_dir, toy_data, tmp_path / "oom-model", eval_every=2, padding="max_seq_len")
    job = PackedJob(spec, trials(), progress=False)
    job.memory_model = CostModel.from_model(spec, gpu="h100-sxm", gpu_memory_gb=0.05)
    assert job.memory_model.fits(trials())  # the model thinks they fit ...
    out_of_memory_when(lambda job, padded_tokens: padded_tokens > 100)  # ... the device disagrees
    events = list(job.run())
    assert sorted(e.trial_id for e in events if isinstance(e, Finished)) == ["a", "b", "c"]
    assert not job.memory_model.fits(trials())  # corrected from what was seen
    assert job.memory_model.fits(trials()[:1])  # a smaller pack still fits
    assert "out of memory" in job.memory_model.calibration.source


def test_sigterm_checkpoints_every_adapter_and_a_restart_resumes(tiny_llama_dir, toy_data, tmp_path):
    script, data = tmp_path / "runner.py", tmp_path / "train.json"
    script.write_text(RUNNER)
    data.write_text(json.dumps(toy_data[0]))
    # checkpoint_every=1000: the only checkpoints are the ones SIGTERM writes
    run = [sys.executable, str(script), tiny_llama_dir, str(data), str(tmp_path / "out"), "1000"]
    proc = subprocess.Popen(run, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("Report b 5"):
            proc.send_signal(signal.SIGTERM)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGTERM  # it still exits as asked
    assert {p.name for p in (tmp_path / "out" / "checkpoints").iterdir()} >= {"a.pt", "b.pt"}
    resumed = subprocess.run(run, capture_output=True, text=True, check=True).stdout.splitlines()
    first_b = next(line for line in resumed if line.startswith("Report b "))
    assert int(first_b.split()[-1]) > 5  # continued after the SIGTERM checkpoint


# ---------------------------------------------------------------- integrity of what a job wrote

import random  # noqa: E402
import warnings  # noqa: E402

from lora_sweep.config import trial_file_name  # noqa: E402

FIVE = ["trunc", "garbage", "bitflip", "isdir", "fine"]


def five_trials(max_steps=3):
    return [ls.TrialConfig(rank=2, learning_rate=2e-3, max_steps=max_steps, dropout=0.0, seed=i, trial_id=t)
            for i, t in enumerate(FIVE)]


def five_spec(model_dir, toy_data, out, **kw):
    return make_spec(model_dir, toy_data, out, eval_every=1, checkpoint_every=1, padding="max_seq_len", **kw)


def damage(path, how):
    data = path.read_bytes()
    if how == "trunc":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(random.Random(0).randbytes(len(data)))
    elif how == "bitflip":  # one bit in the middle of the file: inside the tensors' bytes
        flipped = bytearray(data)
        flipped[len(data) * 2 // 3] ^= 0x04
        path.write_bytes(bytes(flipped))
    elif how == "isdir":
        path.unlink()
        path.mkdir()


def test_damaged_checkpoints_restart_their_trial_and_the_others_resume(tiny_llama_dir, toy_data, tmp_path):
    clean = PackedJob(five_spec(tiny_llama_dir, toy_data, tmp_path / "clean"), five_trials(), progress=False)
    list(clean.run())
    first = PackedJob(five_spec(tiny_llama_dir, toy_data, tmp_path / "crash"), five_trials(), progress=False)
    for event in first.run():
        if isinstance(event, Report) and event.trial_id == "fine" and event.step == 2:
            break  # every trial has its step-2 checkpoint
    del first
    for how in FIVE[:4]:
        damage(tmp_path / "crash" / "runs" / "checkpoints" / f"{how}.pt", how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = PackedJob(five_spec(tiny_llama_dir, toy_data, tmp_path / "crash"), five_trials(), progress=False)
        events = list(again.run())
    for how in FIVE[:4]:
        assert any(f"Trial {how!r}" in str(w.message) and "checkpoint" in str(w.message) for w in caught), how
    first_report = {t: min(e.step for e in events if isinstance(e, Report) and e.trial_id == t) for t in FIVE}
    assert first_report == {"trunc": 1, "garbage": 1, "bitflip": 1, "isdir": 1, "fine": 3}
    compare(finals(again), finals(clean), exact=True)


def test_damaged_results_and_adapters_are_retrained(tiny_llama_dir, toy_data, tmp_path):
    out = tmp_path / "done"
    job = PackedJob(five_spec(tiny_llama_dir, toy_data, out), five_trials(2), progress=False)
    list(job.run())
    want = {t: {k: v.clone() for k, v in w.items()} for t, w in finals(job).items()}  # not views of the files
    adapters = out / "runs" / "adapters"
    (adapters / "trunc" / "adapter_model.safetensors").unlink()  # a missing adapter file
    damage(adapters / "garbage" / "lora_sweep_result.json", "garbage")
    damage(adapters / "bitflip" / "adapter_model.safetensors", "bitflip")
    damage(adapters / "isdir" / "lora_sweep_result.json", "isdir")
    with pytest.warns(UserWarning, match="trained again"):
        again = PackedJob(five_spec(tiny_llama_dir, toy_data, out), five_trials(2), progress=False)
        events = list(again.run())
    trained = {e.trial_id for e in events if isinstance(e, Report)}
    assert trained == set(FIVE[:4])  # "fine" is reported Finished from its result
    assert {e.trial_id for e in events if isinstance(e, Finished)} == set(FIVE)
    compare(finals(again), want, exact=True)


def test_checkpoints_of_trials_that_leave_unfinished_are_deleted_unless_kept(tiny_llama_dir, toy_data, tmp_path):
    for keep in (False, True):
        spec = five_spec(tiny_llama_dir, toy_data, tmp_path / str(keep), keep_checkpoints=keep)
        job = PackedJob(spec, five_trials(4)[:2], progress=False)
        for event in job.run():
            if isinstance(event, Report) and event.trial_id == "garbage" and event.step == 2:
                job.remove_trial("trunc")
        left = {p.name for p in (tmp_path / str(keep) / "runs" / "checkpoints").iterdir()}
        assert left == ({"trunc.pt"} if keep else set())  # the finished trial's is always gone


def test_a_second_job_on_the_same_output_dir_fails_its_trials_at_once(tiny_llama_dir, toy_data, tmp_path):
    script, data = tmp_path / "runner.py", tmp_path / "train.json"
    script.write_text(RUNNER)
    data.write_text(json.dumps(toy_data[0]))
    out = tmp_path / "shared"
    proc = subprocess.Popen([sys.executable, str(script), tiny_llama_dir, str(data), str(out)],
                            stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("Report a 1"):
            break
    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=toy_data[0], max_seq_len=32, output_dir=str(out),
                      checkpoint_every=2)
    second = PackedJob(spec, [ls.TrialConfig(rank=4, max_steps=12, trial_id=t) for t in ("a", "b")], progress=False)
    events = list(second.run())
    assert [type(e) for e in events] == [Failed, Failed] and all(e.rejected for e in events)
    assert all(f"pid {proc.pid}" in e.reason and str(out) in e.reason for e in events), [e.reason for e in events]
    rest = proc.stdout.read()
    assert proc.wait() == 0
    assert all(f"Finished {t} " in rest or f"Finished {t} " in line for t in ("a", "b", "c"))
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["a", "b", "c", "short"]
    assert trial_file_name("a") == "a"
