"""Bad input: every invalid field is a ConfigError naming the trial, the field, the value and
the allowed range, raised before any model is loaded; a bad trial in a running job fails alone."""

from __future__ import annotations

import math

import pytest

import lora_sweep as ls
from lora_sweep.engine import Failed, Finished, PackedJob

from test_engine_equivalence import make_spec

BAD_TRIAL_FIELDS = [
    ("rank", 0, "1 <= `rank`"),
    ("rank", 2.5, "integer"),
    ("rank", True, "integer"),
    ("alpha", 0.0, "> 0"),
    ("alpha", math.inf, "finite"),
    ("alpha", "8", "finite number"),
    ("dropout", 1.0, "0 <= `dropout` < 1"),
    ("dropout", -0.1, "0 <= `dropout` < 1"),
    ("learning_rate", -1e-4, "> 0"),
    ("learning_rate", math.nan, "finite"),
    ("batch_size", 0, "1 <= `batch_size`"),
    ("max_steps", 0, "1 <= `max_steps`"),
    ("gradient_accumulation_steps", 0, "1 <= `gradient_accumulation_steps`"),
    ("lr_scheduler", "exponential", "linear, cosine, constant"),
    ("weight_decay", -0.1, ">= 0"),
    ("warmup_steps", -1, "0 <= `warmup_steps`"),
    ("max_grad_norm", -1.0, ">= 0"),
    ("use_rslora", "yes", "True or False"),
    ("target_modules", [], "non-empty"),
    ("seed", -3, "0 <= `seed`"),
]


@pytest.mark.parametrize("name,value,rule", BAD_TRIAL_FIELDS)
def test_bad_trial_field(name, value, rule):
    with pytest.raises(ls.ConfigError) as info:
        ls.TrialConfig(trial_id="t7", **{name: value})
    message = str(info.value)
    assert "Trial 't7'" in message and f"`{name}`" in message and rule in message and repr(value) in message
    assert info.value.field == name and info.value.trial_id == "t7"
    assert isinstance(info.value, ValueError)


def test_unknown_field_from_a_tuner_dict():
    with pytest.raises(ls.ConfigError, match="unknown TrialConfig field.*'lora_rank'"):
        ls.TrialConfig.from_dict({"lora_rank": 8})


@pytest.mark.parametrize("name,value", [("max_seq_len", 1), ("eval_every", 0), ("dtype", "int8"),
                                        ("padding", "left"), ("target_modules", ()), ("shard_base", "fsdp")])
def test_bad_job_field(name, value):
    with pytest.raises(ls.ConfigError, match=f"`{name}`"):
        ls.JobSpec(base_model="x", train_data=[{"text": "a"}], **{name: value})


def test_model_dependent_checks_fail_the_trial_alone(tiny_llama_dir, toy_data, tmp_path):
    good = ls.TrialConfig(rank=4, max_steps=3, dropout=0.0, trial_id="good")
    too_big = ls.TrialConfig(rank=1000, max_steps=3, trial_id="too_big")
    missing = ls.TrialConfig(rank=4, max_steps=3, target_modules=("c_attn",), trial_id="missing")
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path), [good, too_big, missing], progress=False)
    events = list(job.run())
    failed = {e.trial_id: e.reason for e in events if isinstance(e, Failed)}
    assert set(failed) == {"too_big", "missing"}
    assert "`rank` is 1000" in failed["too_big"] and "<= 24" in failed["too_big"]
    # the error lists the linear layers that do exist
    assert "`target_modules`" in failed["missing"] and "q_proj" in failed["missing"]
    assert [e.trial_id for e in events if isinstance(e, Finished)] == ["good"]


def test_bad_trial_added_to_a_running_job_fails_alone(tiny_llama_dir, toy_data, tmp_path):
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path),
                    [ls.TrialConfig(rank=4, max_steps=4, dropout=0.0, trial_id="a")], progress=False)
    events = []
    for event in job.run():
        events.append(event)
        if event.step == 2 and len(events) == 2:
            job.add_trial({"trial_id": "bad", "rank": -1})
            job.add_trial({"trial_id": "nan-lr", "learning_rate": float("nan")})
    failed = {e.trial_id for e in events if isinstance(e, Failed)}
    assert failed == {"bad", "nan-lr"}
    assert any(isinstance(e, Finished) and e.trial_id == "a" for e in events)


def test_job_target_modules_that_do_not_exist(tiny_llama_dir, toy_data, tmp_path):
    with pytest.raises(ls.ConfigError, match="linear layers are .*q_proj"):
        PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path, target_modules=("c_attn", "c_proj")), progress=False)


def test_scaling_follows_peft():
    assert ls.TrialConfig(rank=16, alpha=32).scaling == 2.0
    assert ls.TrialConfig(rank=16, alpha=32, use_rslora=True).scaling == 8.0
