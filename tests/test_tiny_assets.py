"""The bundled tiny model and task load offline and are what they claim to be."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_sweep.tiny import tiny_model_path, tiny_task_paths


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path())


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_model_path())


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_model_is_a_small_gqa_llama(model):
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.max_position_embeddings >= 256
    assert sum(p.numel() for p in model.parameters()) < 1.5e6
    names = {n.split(".")[-1] for n, _ in model.named_modules()}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names


def test_tokenizer_special_tokens(model, tokenizer):
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    assert None not in ids and len(ids) == 4
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer("the fox").input_ids[0] == tokenizer.bos_token_id
    # byte-level: any text encodes without <unk> and decodes back
    text = "Hello, Wörld! 123"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids).strip() == text


@pytest.mark.parametrize("index", [0, 1])
def test_task_rows(tokenizer, index):
    rows = read_jsonl(tiny_task_paths()[index])
    assert len(rows) == (2000, 128)[index]
    for r in rows:
        assert set(r) == {"prompt", "completion"}
        assert r["completion"].startswith(" ")
    # prompt and completion tokenize the same apart as together, and fit max_seq_len=64 easily
    for r in rows[:50]:
        apart = tokenizer(r["prompt"]).input_ids + tokenizer(r["completion"], add_special_tokens=False).input_ids
        assert apart == tokenizer(r["prompt"] + r["completion"]).input_ids
        assert len(apart) <= 48


def test_eval_questions_are_not_in_train():
    train, eval_ = tiny_task_paths()
    assert not {r["prompt"] for r in read_jsonl(train)} & {r["prompt"] for r in read_jsonl(eval_)}


def test_model_beats_uniform_on_heldout_text(model, tokenizer):
    lines = (Path(tiny_model_path()) / "heldout.txt").read_text().splitlines()[:16]
    batch = tokenizer(lines, return_tensors="pt", padding=True)
    labels = batch.input_ids.masked_fill(batch.attention_mask == 0, -100)
    with torch.no_grad():
        loss = model(**batch, labels=labels).loss.item()
    assert loss < 0.3 * math.log(model.config.vocab_size)  # uniform is log(V) = 6.5 nats; the model gets ~0.9
