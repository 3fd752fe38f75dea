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


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
