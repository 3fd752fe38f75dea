"""Shared fixtures: tiny random Llama and Qwen2 models saved with `save_pretrained`, a
character-level tokenizer, and a small prompt/completion task. All offline, all CPU."""

from __future__ import annotations

import os

# The Triton kernels run in Triton's interpreter on CPU tensors. It must be on before any
# @triton.jit function is defined, i.e. before the first import of lora_sweep's kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import string  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

CHARS = string.ascii_lowercase + string.digits + " =+-:>."


def make_char_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: i + 4 for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import processors
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")


def make_toy_rows(n: int, seed: int) -> list[dict]:
    """Reverse a short random word: 'rev abc =' -> 'cba'. Lengths vary, so padding is exercised."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase[:8]) for _ in range(rng.randint(2, 7)))
        rows.append({"prompt": f"rev {word} =", "completion": word[::-1]})
    return rows


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, char_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(char_tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg), char_tokenizer, tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory, char_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=len(char_tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    return _save(Qwen2ForCausalLM(cfg), char_tokenizer, tmp_path_factory.mktemp("tiny_qwen"))


@pytest.fixture(scope="session")
def toy_data():
    return make_toy_rows(64, seed=0), make_toy_rows(12, seed=1)
