"""Save one adapter as a PEFT LoRA directory: `adapter_config.json` and
`adapter_model.safetensors` with PEFT's key names, loadable by `PeftModel.from_pretrained`.

Every file is written atomically (`atomic_write`: a temporary file, fsync, rename), so a
kill at any instant leaves the old file or the new one, never half of one."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from typing import Iterable, Union

import torch

from .config import TrialConfig

# safetensors' names of the dtypes an adapter can have
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def peft_key(module_name: str, which: str) -> str:
    """PEFT's saved name for `lora_A`/`lora_B` of `module_name` (the adapter name is dropped)."""
    return f"base_model.model.{module_name}.{which}.weight"


def atomic_write(path: str, data: Union[bytes, Iterable[bytes]]) -> str:
    """Write `data` (bytes, or chunks of them) to `path` through a temporary file beside it,
    fsync and rename, then fsync the directory: a kill at any instant leaves the old file or
    the new one. Returns the SHA-256 of what was written, in hex."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path)[:64] + ".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in [data] if isinstance(data, (bytes, bytearray, memoryview)) else data:
                f.write(chunk)
                digest.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return digest.hexdigest()


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_peft_adapter(path: str, cfg: TrialConfig, weights: dict[str, torch.Tensor],
                       target_modules: list[str], base_model_name: str) -> dict[str, str]:
    """Write `weights` (PEFT key -> tensor) and a LoraConfig of `cfg` to `path`, each file
    atomically; returns the SHA-256 of each file written (file name -> hex digest)."""
    from peft import LoraConfig

    os.makedirs(path, exist_ok=True)
    config = LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=sorted(target_modules),
        use_rslora=cfg.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_name,
    )
    with tempfile.TemporaryDirectory(prefix=".staging-", dir=path) as staging:  # PEFT writes the config; it moves atomically
        config.save_pretrained(staging)
        with open(os.path.join(staging, "adapter_config.json"), "rb") as f:
            config_bytes = f.read()
    return {
        "adapter_model.safetensors": write_safetensors(os.path.join(path, "adapter_model.safetensors"), weights,
                                                       metadata={"format": "pt"}),
        "adapter_config.json": atomic_write(os.path.join(path, "adapter_config.json"), config_bytes),
    }


def write_safetensors(file: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write `tensors` (all of one dtype, on any device) as one safetensors file.

    An adapter is a few hundred small tensors: copied to the host one by one (as
    `safetensors.torch.save_file` needs), each copy waits for the device, and a pack of 16
    adapters adds that up to seconds. Here they are gathered on their device and cross once,
    into pinned memory (torch caches it between calls; a copy into fresh pageable memory is
    several times slower). The file is the
    format's header (JSON of dtype, shape and byte range per name, padded to 8 bytes)
    followed by the bytes in that order, written atomically; returns its SHA-256."""
    names = list(tensors)
    dtypes = {tensors[n].dtype for n in names}
    if len(dtypes) > 1 or not dtypes <= set(SAFETENSORS_DTYPES):
        raise ValueError(f"Expected tensors of one dtype among {list(SAFETENSORS_DTYPES)}, got {dtypes}.")
    flat = torch.cat([tensors[n].detach().reshape(-1) for n in names]) if names else torch.empty(0)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat) if flat.is_cuda else flat
    data = host.view(torch.uint8).numpy()
    header, offset = {"__metadata__": metadata}, 0
    for n in names:
        size = tensors[n].numel() * tensors[n].element_size()
        header[n] = {"dtype": SAFETENSORS_DTYPES[tensors[n].dtype], "shape": list(tensors[n].shape),
                     "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return atomic_write(file, [struct.pack("<Q", len(encoded)), encoded, memoryview(data)])
