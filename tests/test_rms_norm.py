"""The fused RMSNorm: its Triton kernels under TRITON_INTERPRET=1 on CPU fp32 tensors against
transformers' own module (output and input gradient), and the engine's swap of a real model's
norms, which must leave the model's outputs and state-dict names as they were."""

from __future__ import annotations

import pytest
import torch

from conftest import use_triton_interpreter

use_triton_interpreter("rmsnorm")  # before the kernels are imported

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from lora_sweep.kernels.reference import reference_rms_norm  # noqa: E402
from lora_sweep.kernels.rmsnorm import rms_norm  # noqa: E402
from lora_sweep.layers import FusedRMSNorm  # noqa: E402
from lora_sweep.model import fuse_rms_norms  # noqa: E402


@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 96), (1, 33), (0, 16)])
def test_kernels_equal_transformers_rmsnorm(shape):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(shape[-1]) + 0.5)
    hf.requires_grad_(False)
    x = torch.randn(*shape, requires_grad=True)
    dy = torch.randn(*shape)
    want = hf(x)
    (want_dx,) = torch.autograd.grad(want, x, dy)
    got = rms_norm(x, hf.weight, hf.variance_epsilon)
    (got_dx,) = torch.autograd.grad(got, x, dy)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(reference_rms_norm(x, hf.weight, hf.variance_epsilon), want)


def test_a_trainable_weight_is_refused():
    with pytest.raises(ValueError, match="frozen"):
        rms_norm(torch.randn(2, 8), torch.ones(8, requires_grad=True), 1e-6)


def test_fused_norms_keep_the_model_and_its_state_dict(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").requires_grad_(False)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    before, names = model(ids).logits, list(model.state_dict())
    replaced = fuse_rms_norms(model)
    assert replaced == 2 * model.config.num_hidden_layers + 1
    assert sum(isinstance(m, FusedRMSNorm) for m in model.modules()) == replaced
    assert list(model.state_dict()) == names
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
