"""The gated MLP's fused SiLU(gate) * up (`kernels/swiglu.py`): its Triton kernels under
TRITON_INTERPRET=1 on CPU fp32 tensors against torch (output and both input gradients), and
the engine's swap of a real model's MLPs, which must leave the outputs and the state-dict
names as they were."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import use_triton_interpreter

use_triton_interpreter("swiglu")  # before the kernels are imported

from lora_sweep.kernels.swiglu import silu_mul  # noqa: E402
from lora_sweep.layers import FusedGatedMLP  # noqa: E402
from lora_sweep.model import fuse_gated_mlps  # noqa: E402


@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 96), (1, 1500), (0, 16)])
def test_kernels_equal_torch(shape):
    torch.manual_seed(0)
    gate = (3 * torch.randn(*shape)).requires_grad_(True)
    up = torch.randn(*shape, requires_grad=True)
    dout = torch.randn(*shape)
    want = F.silu(gate) * up
    want_grads = torch.autograd.grad(want, (gate, up), dout)
    got = silu_mul(gate, up)
    got_grads = torch.autograd.grad(got, (gate, up), dout)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="gate and up"):
        silu_mul(torch.randn(2, 8), torch.randn(2, 9))


def test_fused_mlps_keep_the_model_and_its_state_dict(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, attn_implementation="eager").requires_grad_(False)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    before, names = model(ids).logits, list(model.state_dict())
    assert fuse_gated_mlps(model) == model.config.num_hidden_layers
    assert sum(isinstance(m, FusedGatedMLP) for m in model.modules()) == model.config.num_hidden_layers
    assert list(model.state_dict()) == names
    torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
