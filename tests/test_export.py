"""The adapter file writer against safetensors' own reader."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lora_sweep.export import write_safetensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_written_file_loads_back_with_safetensors(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(7 * 5 + 3 * 11 + 1 + 4 * 6, generator=g).to(dtype)
    tensors = {  # views of one buffer, as an adapter's weights are, one of them transposed
        "base_model.model.q_proj.lora_A.weight": flat[:35].view(7, 5),
        "base_model.model.q_proj.lora_B.weight": flat[35:68].view(11, 3).t(),
        "scalar_like": flat[68:69].view(1),
        "base_model.model.down_proj.lora_A.weight": flat[69:].view(4, 6),
    }
    path = tmp_path / "adapter_model.safetensors"
    write_safetensors(str(path), tensors, metadata={"format": "pt"})

    loaded = load_file(str(path))
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert loaded[name].dtype == dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_mixed_dtypes_are_refused(tmp_path):
    with pytest.raises(ValueError, match="one dtype"):
        write_safetensors(str(tmp_path / "x.safetensors"),
                          {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)}, metadata={})
