"""Shared fixtures: tiny random Llama and Qwen2 models saved with `save_pretrained`, a
character-level tokenizer, and a small prompt/completion task. All offline, all CPU."""

from __future__ import annotations

import os

# The Triton kernels run in Triton's interpreter on CPU tensors. It must be on before any
# @triton.jit function is defined, i.e. before the first import of lora_sweep's kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Nothing is downloaded: a name that is not a saved model fails at once instead of retrying the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib  # noqa: E402
import importlib  # noqa: E402
import random  # noqa: E402
import string  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

CHARS = string.ascii_lowercase + string.digits + " =+-:>."


def use_triton_interpreter(*kernel_modules: str):
    """For a test module that runs Triton kernels on CPU tensors, before it imports them: turn
    the interpreter on (even where TRITON_INTERPRET=0, on a GPU machine; it is read when a
    kernel is decorated) and reload the named `lora_sweep.kernels` modules an earlier test
    imported compiled, in the order given (helpers before their users). Skips the module
    without Triton; returns the triton module."""
    os.environ["TRITON_INTERPRET"] = "1"
    triton = pytest.importorskip("triton")
    for name in kernel_modules:
        if f"lora_sweep.kernels.{name}" in sys.modules:
            importlib.reload(sys.modules[f"lora_sweep.kernels.{name}"])
    return triton


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's CPU threads set to `n` inside the block. A reference trained here to compare
    with what another process trained runs on as many threads as it did (a Ray actor of one
    CPU, a worker started with OMP_NUM_THREADS=1): how a CPU splits a reduction over threads
    moves fp32 results by ~1e-6."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def save_tiny_model(model_type: str, tokenizer, path, seed: int, **config) -> str:
    """A random GQA decoder of `model_type` (2 layers of width 48 unless `config` says otherwise),
    saved with `save_pretrained` beside its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    cfg = AutoConfig.for_model(model_type, **{**fields, **config})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def char_tokenizer():
    return make_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, char_tokenizer):
    return save_tiny_model("llama", char_tokenizer, tmp_path_factory.mktemp("tiny_llama"), seed=0,
                           tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory, char_tokenizer):
    return save_tiny_model("qwen2", char_tokenizer, tmp_path_factory.mktemp("tiny_qwen"), seed=1,
                           tie_word_embeddings=True)


@pytest.fixture(scope="session")
def toy_data():
    return make_toy_rows(64, seed=0), make_toy_rows(12, seed=1)


@pytest.fixture
def out_of_memory_when(monkeypatch):
    """Make training microbatches run out of memory: `out_of_memory_when(rule)` patches the
    engine's private `PackedJob._adapter_losses` (the forward of one microbatch) so that it
    raises the error a CUDA out-of-memory raises whenever ``rule(job, padded_tokens)`` holds."""
    from lora_sweep.engine import PackedJob

    forward = PackedJob._adapter_losses

    def install(rule):
        def adapter_losses(job, adapters, groups, train):
            padded_tokens = job._padded_tokens(list(enumerate(groups)))
            if train and rule(job, padded_tokens):
                raise torch.OutOfMemoryError("out of memory (injected by the test)")
            return forward(job, adapters, groups, train)

        monkeypatch.setattr(PackedJob, "_adapter_losses", adapter_losses)

    return install
