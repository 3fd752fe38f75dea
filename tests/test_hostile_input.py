"""Hostile input: every case is a clear error or a documented behaviour, decided before
training starts; property tests: configs and planner inputs from a tuner never raise
anything but ConfigError."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lora_sweep as ls
from lora_sweep.engine import Finished, PackedJob

from test_engine_equivalence import make_spec

GOOD = {"prompt": "rev ab =", "completion": "ba"}


def job_with(model_dir, tmp_path, train, **kw):
    spec = ls.JobSpec(base_model=model_dir, train_data=train, max_seq_len=32, output_dir=str(tmp_path), **kw)
    return PackedJob(spec, [ls.TrialConfig(rank=4, max_steps=2, dropout=0.0, trial_id="t")], progress=False)


@pytest.mark.parametrize("rows,message", [
    ([GOOD, {"prompt": "only a prompt"}], r"row 1 has keys \['prompt'\]"),
    ([GOOD, {"question": "q", "answer": "a"}], r"row 1 has keys \['answer', 'question'\]"),
    ([GOOD, {"prompt": "p", "completion": 7}], r"row 1 field 'completion' is a int, not a string"),
    ([GOOD, {"text": None}], r"row 1 field 'text' is a NoneType"),
    ([GOOD, ["a", "list"]], r"row 1 is a list, not a dict"),
    ([], r"`train_data` is empty"),
    ([{"prompt": "p", "completion": ""}], r"no usable row"),
])
def test_bad_rows_are_clear_errors_before_the_model_loads(tiny_llama_dir, tmp_path, rows, message):
    with pytest.raises(ls.ConfigError, match=message):
        job_with(tiny_llama_dir, tmp_path, rows)


def test_bad_files(tiny_llama_dir, tmp_path):
    with pytest.raises(ls.ConfigError, match="does not exist"):
        job_with(tiny_llama_dir, tmp_path, str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(ls.ConfigError, match="line 2 .* is not JSON"):
        job_with(tiny_llama_dir, tmp_path, str(bad))
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,completion\n")
    with pytest.raises(ls.ConfigError, match=".jsonl or .json"):
        job_with(tiny_llama_dir, tmp_path, str(csv))


def test_empty_completions_are_dropped_and_counted(tiny_llama_dir, tmp_path):
    with pytest.warns(UserWarning, match="1 of 3 `train_data` rows have no token to learn from"):
        job = job_with(tiny_llama_dir, tmp_path, [GOOD, {"prompt": "p", "completion": ""}, GOOD])
    assert len(job.train_samples) == 2


def test_long_rows_are_truncated_counted_and_reported_once(tiny_llama_dir, tmp_path):
    rows = [GOOD] + [{"prompt": "rev " + "a" * 60 + " =", "completion": "x"}] * 3 + [{"text": "b" * 80}]
    with pytest.warns(UserWarning, match=r"^4 of 5 .*longer than max_seq_len=32") as record:
        job = job_with(tiny_llama_dir, tmp_path, rows)
    assert len([w for w in record if "longer than" in str(w.message)]) == 1
    assert max(len(s) for s in job.train_samples) == 32
    # a prompt that fills max_seq_len leaves nothing to learn: those rows are dropped, also counted
    assert len(job.train_samples) == 2


def test_tokenizer_without_pad_token_pads_with_eos(tiny_llama_dir, tmp_path, char_tokenizer, toy_data):
    from transformers import AutoModelForCausalLM

    tokenizer = char_tokenizer.__class__(tokenizer_object=char_tokenizer.backend_tokenizer,
                                         bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert tokenizer.pad_token_id is None
    spec = make_spec(lambda: AutoModelForCausalLM.from_pretrained(tiny_llama_dir), toy_data, tmp_path,
                     tokenizer=tokenizer)
    job = PackedJob(spec, [ls.TrialConfig(rank=4, max_steps=2, dropout=0.0, trial_id="t")], progress=False)
    assert job.pad_id == tokenizer.eos_token_id
    assert isinstance(list(job.run())[-1], Finished)


def test_model_without_the_requested_target_modules(tiny_llama_dir, toy_data, tmp_path):
    with pytest.raises(ls.ConfigError, match=r"None of `target_modules` \['c_attn'\].*linear layers are"):
        PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path, target_modules=("c_attn",)), progress=False)


# ---------------------------------------------------------------- property tests

ANYTHING = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                     st.lists(st.text(max_size=4), max_size=3))
FIELDS = ["rank", "alpha", "dropout", "learning_rate", "batch_size", "max_steps", "weight_decay", "warmup_steps",
          "lr_scheduler", "max_grad_norm", "gradient_accumulation_steps", "use_rslora", "target_modules", "seed",
          "trial_id"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS + ["bogus"]), ANYTHING, max_size=6))
def test_any_tuner_dict_is_a_config_or_a_config_error(values):
    try:
        cfg = ls.TrialConfig.from_dict(values)
    except ls.ConfigError as err:
        assert str(err)
        return
    assert cfg.rank >= 1 and math.isfinite(cfg.learning_rate) and cfg.learning_rate > 0
    assert 0 <= cfg.dropout < 1 and cfg.alpha > 0 and cfg.batch_size >= 1


TRIALS = st.lists(st.builds(
    ls.TrialConfig,
    rank=st.integers(1, 4096), alpha=st.floats(0.01, 1e4), batch_size=st.integers(1, 256),
    max_steps=st.integers(1, 10**5), learning_rate=st.floats(1e-7, 1.0),
    gradient_accumulation_steps=st.integers(1, 8)), min_size=1, max_size=6)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trials=TRIALS, num_gpus=st.integers(-1, 4), memory=st.floats(-10, 200), seq=st.integers(-5, 8192),
       model=st.sampled_from(["llama-3.2-1b", "qwen2.5-7b", "no-such-model"]))
def test_planner_inputs_give_a_plan_or_a_config_error(trials, num_gpus, memory, seq, model):
    try:
        plan = ls.plan(model, trials, num_gpus=num_gpus, gpu_memory_gb=memory, max_seq_len=seq)
    except (ls.ConfigError, ValueError) as err:  # ConfigError is a ValueError: a clear message either way
        assert str(err)
        return
    planned = [t for job in plan.jobs for t in job.trials] + [f.trial for f in plan.failed]
    assert sorted(map(id, planned)) == sorted(map(id, trials))  # every trial exactly once
    assert all(job.num_gpus <= num_gpus for job in plan.jobs)


# ---------------------------------------------------------------- types, ranges, ids (issue: hostile trials)

import os  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck as _HC  # noqa: E402,F401
from safetensors.torch import load_file  # noqa: E402

from lora_sweep.config import trial_file_name  # noqa: E402
from lora_sweep.engine import Failed, Report  # noqa: E402


def test_numpy_and_torch_scalars_are_stored_as_python_values():
    cfg = ls.TrialConfig(rank=np.int64(4), alpha=np.float32(8.0), dropout=torch.tensor(0.0), learning_rate=np.float64(1e-3),
                         batch_size=torch.tensor(2), max_steps=np.uint8(3), use_rslora=np.bool_(True),
                         seed=np.int64(7), target_modules=np.array(["q_proj", "v_proj"]), trial_id=np.str_("t"))
    for name, kind in [("rank", int), ("alpha", float), ("dropout", float), ("learning_rate", float),
                       ("batch_size", int), ("max_steps", int), ("use_rslora", bool), ("seed", int), ("trial_id", str)]:
        assert type(getattr(cfg, name)) is kind, name
    assert all(type(m) is str for m in cfg.target_modules)
    json.dumps(cfg.to_dict())  # serialisable as it is
    spec = ls.JobSpec(base_model="m", train_data=[GOOD], max_seq_len=np.int64(32), eval_every=torch.tensor(3),
                      gradient_checkpointing=np.bool_(False))
    assert type(spec.max_seq_len) is int and type(spec.eval_every) is int and spec.gradient_checkpointing is False
    with pytest.raises(ls.ConfigError, match="`rank`"):
        ls.TrialConfig(rank=torch.tensor([4, 4]))  # not a scalar
    with pytest.raises(ls.ConfigError, match="`rank`"):
        ls.TrialConfig(rank=np.float32(4.5))


@pytest.mark.parametrize("fields,name", [
    ({"learning_rate": 1e39}, "learning_rate"), ({"learning_rate": 1e-40}, "learning_rate"),
    ({"alpha": 1e39}, "alpha"), ({"alpha": 1e-37, "rank": 64}, "alpha"), ({"weight_decay": 1e39}, "weight_decay"),
    ({"max_grad_norm": 1e-45}, "max_grad_norm"), ({"gradient_accumulation_steps": 10**9}, "gradient_accumulation_steps"),
    ({"batch_size": 10**9}, "batch_size"),
])
def test_values_outside_what_training_can_represent(fields, name):
    with pytest.raises(ls.ConfigError) as info:
        ls.TrialConfig(trial_id="t", **fields)
    assert info.value.field == name and f"`{name}`" in str(info.value) and "<=" in str(info.value) or \
        "float32" in str(info.value)


@pytest.mark.parametrize("bad", ["", ".", "..", "x" * 513, "a\ud800b"])
def test_bad_trial_ids_are_config_errors(bad):
    with pytest.raises(ls.ConfigError, match="`trial_id`") as info:
        ls.TrialConfig(trial_id=bad)
    assert info.value.field == "trial_id"


def test_trial_file_names_are_one_to_one_and_safe():
    ids = ["a", "a_b", "a/b", "a\\b", "a\nb", "A", "a b", ".hidden", "-x", "x" * 300, "x" * 301, "con", "Ü",
           "a_b+" + trial_file_name("a/b").split("+")[1]]
    names = [trial_file_name(t) for t in ids]
    assert len(set(names)) == len(ids) and len({n.lower() for n in names}) == len(ids)
    for n in names:
        assert n not in (".", "..") and "/" not in n and "\\" not in n and len(n) <= 64 + 17
        assert all(c.isascii() and (c.isalnum() or c in "_.-+") for c in n) and not n.startswith((".", "-"))
    assert trial_file_name("trial-3") == "trial-3"


def test_odd_ids_train_into_distinct_directories_inside_output_dir(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=[GOOD] * 4, max_seq_len=16, output_dir=str(out))
    ids = ["a/b", "a_b", "a\nb", "x" * 300, "../up"]
    job = PackedJob(spec, [ls.TrialConfig(rank=2, max_steps=1, dropout=0.0, trial_id=t) for t in ids], progress=False)
    # a dict without an id gets one, returned; a NumPy-valued one trains
    assigned = job.add_trial({"rank": np.int64(2), "max_steps": np.int64(1), "seed": np.int64(5)})
    assert assigned and assigned.startswith("trial-")
    events = list(job.run())
    finished = {e.trial_id: e.adapter_dir for e in events if isinstance(e, Finished)}
    assert set(finished) == set(ids) | {assigned}
    dirs = {os.path.realpath(p) for p in finished.values()}
    assert len(dirs) == len(finished)
    assert all(os.path.dirname(d) == os.path.realpath(out / "adapters") for d in dirs)
    result = json.load(open(os.path.join(finished[assigned], "lora_sweep_result.json")))
    assert result["config"]["seed"] == 5


def test_remove_then_add_of_one_id_trains_the_new_trial(tiny_llama_dir, tmp_path):
    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=[GOOD] * 4, max_seq_len=16, output_dir=str(tmp_path),
                      eval_every=1)
    job = PackedJob(spec, [ls.TrialConfig(rank=2, max_steps=3, dropout=0.0, trial_id="x")], progress=False)
    events = []
    for e in job.run():
        events.append(e)
        if isinstance(e, Report) and e.trial_id == "x" and e.step == 1 and len(events) == 1:
            job.remove_trial("x")
            job.add_trial(ls.TrialConfig(rank=4, max_steps=2, dropout=0.0, trial_id="x"))
            job.add_trial(ls.TrialConfig(rank=4, max_steps=2, dropout=0.0, trial_id="x"))  # a duplicate
    done = [e for e in events if isinstance(e, Finished)]
    assert len(done) == 1 and done[0].step == 2  # the new x (max_steps 2) trained to its end
    assert json.load(open(os.path.join(done[0].adapter_dir, "lora_sweep_result.json")))["config"]["rank"] == 4
    dup = [e for e in events if isinstance(e, Failed)]
    assert len(dup) == 1 and dup[0].rejected and "already in this job" in dup[0].reason


# ---------------------------------------------------------------- data and output_dir before the model loads


def never_loaded():
    raise AssertionError("the model must not load")


def spec_for(data, tmp_path, **kw):
    return ls.JobSpec(base_model=never_loaded, train_data=data, max_seq_len=32,
                      **{"output_dir": str(tmp_path / "o"), "tokenizer": "unused", **kw})


@pytest.mark.parametrize("content,message", [
    (b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xff\xfe", "completion": "b"}\n', r"line 2 of .* not valid UTF-8"),
    (b'{"prompt": "a", "completion": "\\ud800"}\n', r"row 0 field 'completion' is not valid Unicode"),
    (b'{"prompt": "a"}\n', r"row 0 has keys"),
])
def test_bad_encodings_name_file_row_and_field(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(ls.ConfigError, match=message) as info:
        PackedJob(spec_for(str(path), tmp_path), progress=False)
    assert "rows.jsonl" in str(info.value) or "row 0" in str(info.value)


def test_surrogates_in_rows_given_as_a_list(tmp_path):
    with pytest.raises(ls.ConfigError, match=r"row 1 field 'text' is not valid Unicode"):
        PackedJob(spec_for([{"text": "ok"}, {"text": "bad \udc80"}], tmp_path), progress=False)


def test_byte_order_mark_is_read_and_wrong_shapes_are_clear(tiny_llama_dir, tmp_path):
    from lora_sweep.data import load_rows

    for name in ("bom.jsonl", "bom.json"):
        body = json.dumps(GOOD) + "\n" if name.endswith("l") else json.dumps([GOOD])
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + body.encode())
        assert load_rows(str(tmp_path / name), "train_data") == [GOOD]
    (tmp_path / "obj.json").write_text(json.dumps({"rows": [GOOD]}))
    with pytest.raises(ls.ConfigError, match=r"holds a JSON dict, but must hold a list of rows"):
        load_rows(str(tmp_path / "obj.json"), "train_data")
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(ls.ConfigError, match="is a directory"):
        load_rows(str(tmp_path / "d.jsonl"), "train_data")
    with pytest.raises(ls.ConfigError, match="must be a path"):
        load_rows(GOOD, "train_data")


def test_a_huge_row_is_cut_before_tokenising(char_tokenizer):
    import time

    from lora_sweep.data import tokenize_rows

    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match="truncated"):
        samples = tokenize_rows([{"text": "ab " * 2_000_000}], char_tokenizer, 32, "train_data")
    assert time.perf_counter() - t0 < 5 and len(samples[0]) == 32
    # the cut changes nothing: same tokens as tokenising the whole of a shorter long row
    whole = tokenize_rows([{"text": "ab " * 3000}], char_tokenizer, 32, "train_data")
    assert samples[0] == whole[0]


def test_output_dir_is_checked_before_the_model_loads(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ls.ConfigError, match="`output_dir`"):
        PackedJob(spec_for([GOOD], tmp_path, output_dir=str(tmp_path / "file" / "sub")), progress=False)


def test_max_seq_len_beyond_the_models_positions_warns(tiny_llama_dir, tmp_path):
    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=[GOOD], max_seq_len=256, output_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="exceeds the model's 128 positions"):
        PackedJob(spec, progress=False)


def test_cpu_pads_to_the_longest_sample_by_default(tiny_llama_dir, tmp_path):
    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=[GOOD], max_seq_len=64, output_dir=str(tmp_path))
    job = PackedJob(spec, [ls.TrialConfig(rank=2, max_steps=1, trial_id="t")], progress=False)
    list(job.run())
    assert job.pad_length is None and job.step_stats[0]["padded_tokens"] == len(job.train_samples[0])


# ---------------------------------------------------------------- the per-trial failure boundary

HEALTHY = [dict(rank=4, batch_size=1, max_steps=2, dropout=0.0, seed=1, trial_id="h1"),
           dict(rank=2, batch_size=2, max_steps=2, dropout=0.0, seed=2, trial_id="h2")]


def healthy_spec(model_dir, out):
    return ls.JobSpec(base_model=model_dir, train_data=[GOOD, {"prompt": "rev abc =", "completion": "cba"}] * 4,
                      max_seq_len=16, eval_every=1, output_dir=str(out), padding="max_seq_len")


def healthy_weights(job):
    return {t: load_file(os.path.join(job.finished[t], "adapter_model.safetensors")) for t in ("h1", "h2")}


_REFERENCE = {}


def reference_weights(model_dir, tmp_path_factory):
    if model_dir not in _REFERENCE:
        job = PackedJob(healthy_spec(model_dir, tmp_path_factory.mktemp("ref")),
                        [ls.TrialConfig(**t) for t in HEALTHY], progress=False)
        list(job.run())
        _REFERENCE[model_dir] = healthy_weights(job)
    return _REFERENCE[model_dir]


def run_with_hostile(model_dir, out, hostile, patch=None):
    """Run the two healthy trials, adding `hostile` after their first step; returns the events."""
    job = PackedJob(healthy_spec(model_dir, out), [ls.TrialConfig(**t) for t in HEALTHY], progress=False)
    if patch:
        patch(job)
    events, hostile_id, done = [], None, set()
    for e in job.run():
        events.append(e)
        if isinstance(e, Report) and e.trial_id == "h1" and e.step == 1 and hostile_id is None:
            hostile_id = job.add_trial(hostile) or "?"
        if isinstance(e, Finished) and e.trial_id in ("h1", "h2"):
            done.add(e.trial_id)
            if done == {"h1", "h2"} and hostile_id in job.trials:
                job.remove_trial(hostile_id)  # a valid hostile trial may run for long: enough
    return job, events


def test_errors_raised_for_one_trial_fail_it_alone(tiny_llama_dir, tmp_path, tmp_path_factory, monkeypatch):
    import lora_sweep.engine as engine

    real_write = engine.write_peft_adapter

    def write(path, cfg, *args):  # saving the bad trial's adapter fails
        if cfg.trial_id == "bad":
            raise OSError(28, "No space left on device")
        return real_write(path, cfg, *args)

    monkeypatch.setattr(engine, "write_peft_adapter", write)
    job, events = run_with_hostile(tiny_llama_dir, tmp_path / "save", dict(rank=2, max_steps=1, trial_id="bad"))
    failed = [e for e in events if isinstance(e, Failed)]
    assert [e.trial_id for e in failed] == ["bad"] and "No space left on device" in failed[0].reason
    assert not failed[0].rejected
    assert healthy_weights(job).keys() == {"h1", "h2"}
    want = reference_weights(tiny_llama_dir, tmp_path_factory)
    for t in ("h1", "h2"):
        assert all(torch.equal(healthy_weights(job)[t][k], want[t][k]) for k in want[t])


def test_a_cpu_allocation_failure_is_out_of_memory(tiny_llama_dir, tmp_path, tmp_path_factory):
    def patch(job):
        real, calls = job._adapter_losses, []

        def losses(adapters, groups, train):
            calls.append(1)
            if train and len(calls) == 2:
                raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate "
                                   "memory: you tried to allocate 1099511627776 bytes.")
            return real(adapters, groups, train)

        job._adapter_losses = losses

    job, events = run_with_hostile(tiny_llama_dir, tmp_path / "oom", dict(rank=2, max_steps=1, trial_id="x"),
                                   patch=patch)
    assert {e.trial_id for e in events if isinstance(e, Finished)} == {"h1", "h2", "x"}
    assert job.microbatch_tokens is not None  # the step was retried in smaller microbatches


HOSTILE_VALUES = {
    "rank": st.sampled_from([1, np.int64(2), torch.tensor(3), 0, 10**6, np.float32(2.0), True]),
    "alpha": st.sampled_from([1e-40, 1e39, np.float32(1e38), np.float16(8), torch.tensor(4.0), -1.0, math.inf]),
    "learning_rate": st.sampled_from([1e39, 1e30, np.float32(1e-3), 5e-324, torch.tensor(1e20), math.nan]),
    "batch_size": st.sampled_from([1, np.int32(3), 0, 10**9]),
    "max_steps": st.sampled_from([1, np.int64(2), 10**12, -1]),
    "gradient_accumulation_steps": st.sampled_from([1, 4096, 10**9, np.uint16(2)]),
    "use_rslora": st.sampled_from([np.bool_(True), False, "yes"]),
    "dropout": st.sampled_from([0.0, np.float64(0.999), 1.0]),
    "max_grad_norm": st.sampled_from([None, 0.0, 1e-45, np.float32(1.0)]),
    "seed": st.sampled_from([np.int64(3), 2**64, torch.tensor(1)]),
    "trial_id": st.sampled_from(["", ".", "..", "a/b", "../../escape", "h1", np.str_("h2"), "x" * 300, "x" * 600,
                                 "a\ud800", "a\nb", None, np.int64(7)]),
}


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(hostile=st.fixed_dictionaries({}, optional=HOSTILE_VALUES))
def test_a_hostile_trial_never_costs_its_pack_mates(tiny_llama_dir, tmp_path_factory, hostile):
    out = tmp_path_factory.mktemp("hostile")
    job, events = run_with_hostile(tiny_llama_dir, out, hostile)  # never raises
    want = reference_weights(tiny_llama_dir, tmp_path_factory)
    got = healthy_weights(job)
    for t in ("h1", "h2"):
        assert all(torch.equal(got[t][k], want[t][k]) for k in want[t]), t
    for e in events:  # whatever happened to the hostile trial, it happened inside output_dir
        if isinstance(e, Finished):
            assert os.path.realpath(e.adapter_dir).startswith(os.path.realpath(out))


def test_optuna_with_numpy_values_and_a_300_character_study_name(tiny_llama_dir, tmp_path):
    optuna = pytest.importorskip("optuna")
    from lora_sweep.integrations.optuna import PackedLoRASampler

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def space(trial):  # define-by-run, handing NumPy values over as NumPy code does
        return {"rank": np.int64(trial.suggest_int("rank", 2, 4)),
                "learning_rate": np.float32(trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)),
                "batch_size": np.int32(2), "use_rslora": np.bool_(trial.number % 2), "seed": np.int64(trial.number),
                "dropout": np.float64(0.0)}

    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=[GOOD] * 4, eval_data=[GOOD], max_seq_len=16,
                      eval_every=1, output_dir=str(tmp_path / "runs"), checkpoint_every=1)
    study = optuna.create_study(study_name="s" * 300, pruner=optuna.pruners.NopPruner())
    sampler = PackedLoRASampler(study, spec, space, trial_defaults={"max_steps": 2}, max_concurrent=2)
    sampler.optimize(n_trials=2, show_progress_bar=False)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for t in study.trials:
        assert os.path.isdir(t.user_attrs["adapter_dir"])


def test_an_evaluation_error_fails_its_trial_alone_even_when_it_is_evaluated_alone(tiny_llama_dir, tmp_path,
                                                                                    monkeypatch):
    spec = ls.JobSpec(base_model=tiny_llama_dir, train_data=[GOOD] * 4, eval_data=[GOOD] * 2, max_seq_len=32,
                      eval_every=5, output_dir=str(tmp_path))
    # "bad" is evaluated alone at its last step (2), before "ok" is due (3)
    trials = [ls.TrialConfig(rank=4, max_steps=m, dropout=0.0, trial_id=t) for t, m in (("ok", 3), ("bad", 2))]
    job = PackedJob(spec, trials, progress=False)
    evaluate = job.evaluate

    def failing_for_bad(trial_ids=None):
        if trial_ids is not None and "bad" in trial_ids:
            raise RuntimeError("evaluation broke")
        return evaluate(trial_ids)

    monkeypatch.setattr(job, "evaluate", failing_for_bad)
    events = list(job.run())
    assert [(type(e).__name__, e.trial_id) for e in events if not isinstance(e, ls.Report)] == [
        ("Failed", "bad"), ("Finished", "ok")]
    assert "evaluation broke" in next(e for e in events if e.trial_id == "bad").reason


def three_step_trial_job(model_dir, tmp_path) -> tuple[ls.JobSpec, ls.TrialConfig]:
    spec = ls.JobSpec(base_model=model_dir, train_data=[GOOD] * 4, max_seq_len=32, eval_every=1,
                      output_dir=str(tmp_path))
    return spec, ls.TrialConfig(rank=4, max_steps=3, dropout=0.0, trial_id="t")


def test_a_job_stopped_early_unlocks_its_trials_for_the_next_job_in_this_process(tiny_llama_dir, tmp_path):
    spec, trial = three_step_trial_job(tiny_llama_dir, tmp_path)
    first = PackedJob(spec, [trial], progress=False)
    for _ in first.run():
        break  # the caller stops early, as Ctrl-C in a notebook does
    second = PackedJob(spec, [trial], progress=False)
    assert [type(e).__name__ for e in second.run() if not isinstance(e, ls.Report)] == ["Finished"]


def test_a_job_run_again_after_an_early_stop_locks_its_trials_again(tiny_llama_dir, tmp_path):
    spec, trial = three_step_trial_job(tiny_llama_dir, tmp_path)
    job = PackedJob(spec, [trial], progress=False)
    for _ in job.run():
        break
    events = job.run()
    first = next(events)  # running again: its trial is locked again
    other = PackedJob(spec, [trial], progress=False)
    assert [type(e).__name__ for e in other.run()] == ["Failed"]
    assert [type(e).__name__ for e in [first, *events] if not isinstance(e, ls.Report)] == ["Finished"]
