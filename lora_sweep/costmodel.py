"""How much GPU memory a packed job needs and how long one of its steps takes.

The planner needs both before any weights exist, so everything here is computed from a
transformers config (a Llama-style dense decoder: Llama, Qwen2, Mistral, ...), the dtype, the
sequence length and each trial's rank and batch size.

Memory per GPU of a job with adapters i = 1..n on d GPUs (PLoRA's model: parameters +
gradients + optimizer states + activations, under a load factor C of each GPU's memory):

    (base weights + one chunk of fp32 logits
     + sum_i 16 bytes * adapter_params_i            # fp32 weights, grads, AdamW m and v
     + base activations(sum_i tokens_i)            # with or without gradient checkpointing
     + LoRA activations(sum_i rank_i * tokens_i))  # the rank-r tensor S per adapted module
    / d + workspace  <=  C * gpu memory

On d > 1 GPUs the job is the engine's (lora_sweep/distributed.py): each GPU trains its own 1/d
of the trials, so their states and activations split d ways while each GPU's chunk of logits
does not. A base within a quarter of one GPU's memory stays whole on every GPU
(`JobSpec.shard_base`); a larger one is sharded: FSDP2 splits its decoder d ways but holds two
layers whole at a time (the one computing, the next one prefetched) and the LM head whole on
every GPU.

Step time (seconds) is linear in a few features, so that a handful of profiled steps fit it:

    overhead + per_adapter * n / d + weight bytes / HBM rate + base FLOPs / (d * rate)
    + LoRA FLOPs / (d * LoRA rate) + gathered bytes / link rate

Each GPU reads every layer's weights whole in every pass; with a sharded base it first receives
the (d - 1) / d of them it does not hold (FSDP's all-gathers, partly hidden behind compute).
The defaults come from a roofline of the GPU's peak bf16 FLOP/s and memory bandwidth (the
`GPUS` table, or `detect()` on this machine); `calibrate` replaces them with least-squares
fits of profiled steps (`profile_job`), jobs over several GPUs included.

    cm = CostModel.from_model("qwen2.5-7b", gpu="h100-sxm", max_seq_len=512)
    cm.fits([TrialConfig(rank=16, batch_size=8)], num_gpus=1)
    cm = calibrate(cm, profile_job(job))     # on the real machine, once
    cm.save("h100_qwen7b.json")
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from .config import DEFAULT_TARGET_MODULES, ConfigError, JobSpec, TrialConfig, quantization_name, shards_base

logger = logging.getLogger(__name__)

GB = 1e9  # every "GB" in this package is 10^9 bytes (GPU vendors' unit)

__all__ = [
    "GPU", "GPUS", "PRESETS", "Calibration", "CostModel", "ModelShape",
    "calibrate", "detect", "gpu_profile", "job_memory_model", "model_config_fields", "profile_job", "typical_steps",
]


# --------------------------------------------------------------------------- GPUs


@dataclass(frozen=True)
class GPU:
    """Peak numbers of one accelerator, the inputs of the roofline defaults."""

    name: str
    memory_gb: float
    bf16_tflops: float  # dense tensor-core peak, no sparsity
    hbm_gb_s: float  # memory bandwidth
    link_gb_s: float  # one direction of the GPU-to-GPU link (NVLink, else PCIe)


GPUS: dict[str, GPU] = {g.name: g for g in [
    GPU("a100-40gb", 40, 312, 1555, 300),
    GPU("a100-80gb", 80, 312, 2039, 300),
    GPU("h100-sxm", 80, 989, 3350, 450),
    GPU("h100-pcie", 80, 756, 2000, 64),
    GPU("h200", 141, 989, 4800, 450),
    GPU("l4", 24, 121, 300, 32),
    GPU("a10g", 24, 70, 600, 32),  # AWS's A10G runs well below the A10's 125 TFLOP/s
    GPU("rtx4090", 24, 165, 1008, 32),
]}


def gpu_profile(gpu: Union[str, GPU]) -> GPU:
    """Look a GPU up in `GPUS` by its row's name ("H100 SXM", "h100-sxm" and "h100_sxm" all
    work) or by the name CUDA reports for the device ("NVIDIA H100 80GB HBM3"), so that a
    results file's ``torch.cuda.get_device_name()`` finds its row on any machine.

    Args:
        gpu:
            A name from `GPUS`, a CUDA device name, ``"cpu"``, or a `GPU` (returned unchanged).

    Returns:
        The `GPU`.
    """
    if isinstance(gpu, GPU):
        return gpu
    key = str(gpu).lower().replace(" ", "-").replace("_", "-")
    if key == "cpu":
        return _cpu_profile()
    key = key if key in GPUS else _row_of_device_name(str(gpu))
    if key is None:
        raise ValueError(f"The value of `gpu` is {gpu!r}, but must be one of {sorted(GPUS)}, a CUDA device name "
                         "of one of them, or 'cpu'.")
    return GPUS[key]


def _row_of_device_name(name: str, memory_gb: Optional[float] = None) -> Optional[str]:
    """The `GPUS` row of a CUDA device name; `memory_gb` tells an A100's two sizes apart
    (else the name does)."""
    name = name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100-pcie" if "pcie" in name else "h100-sxm"
    if "a100" in name:
        large = memory_gb > 50 if memory_gb is not None else "80gb" in name
        return "a100-80gb" if large else "a100-40gb"
    if "a10g" in name:
        return "a10g"
    if "4090" in name:
        return "rtx4090"
    if "l4" in name.split():
        return "l4"
    return None


def detect(device: Any = None) -> GPU:
    """The profile of a CUDA device of this machine, or of the CPU.

    The name reported by ``torch.cuda.get_device_name`` picks the row of `GPUS`; the memory
    is the device's real total. An unknown GPU gets A100-like rates and a warning.

    Args:
        device:
            A device (``"cuda:1"``, a ``torch.device``); None: the first CUDA device, or the
            CPU when there is none.

    Returns:
        The `GPU` profile.
    """
    import torch

    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return _cpu_profile()
    index = device.index if device is not None and device.index is not None else 0
    name = torch.cuda.get_device_name(index)
    memory_gb = torch.cuda.get_device_properties(index).total_memory / GB
    key = _row_of_device_name(name, memory_gb)
    if key is None:
        warnings.warn(f"Unknown GPU {name.lower()!r}: using A100 rates until `calibrate` measures it.")
        key = "a100-80gb"
    return dataclasses.replace(GPUS[key], memory_gb=memory_gb)


def _cpu_profile() -> GPU:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 16 * GB
    return GPU("cpu", memory / GB, bf16_tflops=0.5, hbm_gb_s=50, link_gb_s=10)


# --------------------------------------------------------------------------- model shapes

PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "qwen2.5-32b": dict(model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


def model_config_fields(source: Any) -> dict:
    """The fields of a model's transformers config, from whatever names the model.

    Args:
        source:
            A ``PretrainedConfig``; a dict of its fields (``model_type`` defaults to
            ``"llama"``); a name in `PRESETS` such as ``"qwen2.5-7b"``; a local directory or
            hub id (read with ``AutoConfig.from_pretrained``: no weights are loaded); or a
            `JobSpec` whose ``base_model`` is one of the last two.

    Returns:
        The config as a dict.
    """
    if isinstance(source, JobSpec):
        if not isinstance(source.base_model, str):
            raise TypeError("The cost model cannot read the config of a `base_model` factory without building "
                            "the model; pass the model's config (or a preset name) as `model_config`.")
        source = source.base_model
    if isinstance(source, Mapping):
        return {"model_type": "llama", **source}
    if hasattr(source, "to_dict") and hasattr(source, "model_type"):  # a transformers config
        return source.to_dict()
    if isinstance(source, str) and source.lower() in PRESETS:
        return dict(PRESETS[source.lower()])
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoConfig

        try:
            return AutoConfig.from_pretrained(source).to_dict()
        except OSError as err:
            raise ValueError(f"Could not read a model config from {str(source)!r} ({err}). Pass a local "
                             f"directory, a preset ({', '.join(PRESETS)}) or a dict of config fields.") from err
    raise TypeError(f"Cannot read a model config from a {type(source).__name__}.")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that the cost model needs."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_dim: int  # attention heads * head_dim
    kv_dim: int  # key/value heads * head_dim
    vocab_size: int
    num_params: int  # every base weight, embeddings and LM head included
    linear_dims: dict[str, tuple[int, int]]  # one layer's adaptable linears: name -> (in, out)

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """Read the sizes from a model's config (any form `model_config_fields` takes)."""
        c = model_config_fields(config)
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if not c.get(k)]
        if missing:
            raise ValueError(f"The cost model needs a Llama-style decoder config, but {missing} are missing "
                             f"(model_type {c.get('model_type')!r}).")
        h, i, layers, heads = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["num_attention_heads"]
        head_dim = c.get("head_dim") or h // heads
        q, kv = heads * head_dim, (c.get("num_key_value_heads") or heads) * head_dim
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        qkv_bias = c.get("attention_bias", c["model_type"] == "qwen2")  # Qwen2 always has q/k/v biases
        per_layer = sum(a * b for a, b in dims.values()) + (q + 2 * kv if qkv_bias else 0) + 2 * h  # + 2 norms
        embeddings = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings", False) else 2)
        return cls(layers, h, i, q, kv, c["vocab_size"], layers * per_layer + embeddings + h, dims)

    def lora_dims(self, modules: Sequence[str]) -> int:
        """Sum of (in + out) over `modules` in one layer: LoRA parameters per layer per unit rank."""
        unknown = [m for m in modules if m not in self.linear_dims]
        if unknown:
            raise ConfigError(f"The value of `target_modules` contains {unknown}, but must be a subset of "
                              f"{list(self.linear_dims)} for the cost model.", field="target_modules")
        return sum(sum(self.linear_dims[m]) for m in modules)


# --------------------------------------------------------------------------- coefficients

# Roofline defaults: the fraction of a GPU's peak that a LoRA training step reaches.
BASE_MFU = 0.5  # large base GEMMs in bf16
LORA_MFU = 0.15  # rank-r GEMMs are thin (one side is r <= 128), far from the roofline
HBM_EFFICIENCY = 0.8
LINK_EFFICIENCY = 0.7
STEP_OVERHEAD_S = 0.02  # host work and kernel launches of one packed step
ADAPTER_OVERHEAD_S = 0.001  # each adapter's own optimizer step and bookkeeping

TIME_TERMS = ("overhead", "adapters", "weight_bytes", "base_flops", "lora_flops", "gathered_bytes")


@dataclass
class Calibration:
    """The coefficients of the step-time and memory models (what `calibrate` fits).

    Step time is ``time_coefs . features`` with features in `TIME_TERMS` order: 1, adapters,
    frozen-weight bytes read, base FLOPs, LoRA FLOPs and weight bytes gathered from the other
    GPUs (all per GPU), so the coefficients are seconds, seconds per adapter and inverse rates.
    """

    time_coefs: list[float]
    base_activation_scale: float = 1.0  # multiplies the analytic base activation bytes
    lora_activation_scale: float = 1.0  # multiplies the analytic LoRA activation bytes
    workspace_bytes: float = 0.0  # per GPU, beyond the model (allocator, cuBLAS workspace)
    trial_seconds: float = 0.0  # a trial's time outside steps: joining a job, saving its adapter
    source: str = "roofline"  # "roofline" or "calibrated from N steps"

    @classmethod
    def roofline(cls, gpu: GPU) -> "Calibration":
        """Defaults from the GPU's peak FLOP/s and bandwidths (see the `BASE_MFU` etc. constants)."""
        flops = gpu.bf16_tflops * 1e12
        return cls([STEP_OVERHEAD_S, ADAPTER_OVERHEAD_S, 1 / (gpu.hbm_gb_s * GB * HBM_EFFICIENCY),
                    1 / (flops * BASE_MFU), 1 / (flops * LORA_MFU), 1 / (gpu.link_gb_s * GB * LINK_EFFICIENCY)])

    @staticmethod
    def floor(gpu: GPU) -> list[float]:
        """The smallest physical time coefficients: no overheads, and every rate at the GPU's
        peak. A fit below them would claim the GPU ran faster than it can."""
        flops = gpu.bf16_tflops * 1e12
        return [0.0, 0.0, 1 / (gpu.hbm_gb_s * GB), 1 / flops, 1 / flops, 1 / (gpu.link_gb_s * GB)]

    def describe(self) -> str:
        """The coefficients in readable units."""
        c = self.time_coefs
        rate = lambda x: f"{1 / x:.3g}" if x > 0 else "inf"  # noqa: E731
        return (f"overhead {c[0] * 1e3:.2f} ms/step + {c[1] * 1e3:.2f} ms/adapter; base {rate(c[3] * 1e12)} TFLOP/s, "
                f"LoRA {rate(c[4] * 1e12)} TFLOP/s, HBM {rate(c[2] * GB)} GB/s, link {rate(c[5] * GB)} GB/s; "
                f"activations x{self.base_activation_scale:.2f} base, x{self.lora_activation_scale:.2f} LoRA, "
                f"workspace {self.workspace_bytes / GB:.2f} GB, {self.trial_seconds:.2f} s/trial outside steps "
                f"({self.source})")


# --------------------------------------------------------------------------- the cost model

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAPTER_BYTES_PER_PARAM = 16  # fp32 weight + fp32 grad + AdamW's two fp32 moments
LOGITS_BYTES = 4 * 2  # a chunk's fp32 logits and one fp32 temporary of the same size (logsumexp, softmax)


# Bytes per quantized weight: 4 bits plus an fp32 absmax per block of 64 (bitsandbytes' 4-bit
# formats without double quantisation), or a byte plus a row's fp32 scale (int8, the scale negligible).
QUANTIZED_BYTES_PER_PARAM = {"nf4": 0.5 + 4 / 64, "fp4": 0.5 + 4 / 64, "int8": 1.0}


@dataclass
class CostModel:
    """Memory and step time of packed jobs of one base model on one kind of GPU.

    A trial contributes ``batch_size * max_seq_len`` tokens to a step's memory (samples are
    at most `max_seq_len` long, so this is the worst case) and
    ``gradient_accumulation_steps * batch_size * mean_sample_tokens`` to its compute: on a GPU
    the engine packs samples back to back without padding, so a step computes on the samples'
    real tokens (`mean_sample_tokens` defaults to `max_seq_len`, the worst case). A trial that
    adapts only some of the job's `target_modules` counts with a proportionally smaller rank.

    Build one with `CostModel.from_model`; `calibrate` returns a copy fitted to measurements.
    """

    shape: ModelShape
    gpu: GPU
    max_seq_len: int = 512
    dtype: str = "bfloat16"  # of the frozen base weights and the activations
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES
    gradient_checkpointing: bool = False
    load_factor: float = 0.9  # PLoRA's C: the usable fraction of each GPU's memory
    loss_chunk_tokens: Optional[int] = None  # rows of logits the chunked loss holds; None: the engine's default
    mean_sample_tokens: Optional[float] = None  # a sample's mean length, for step times; None: max_seq_len
    calibration: Optional[Calibration] = None  # None: the roofline defaults of `gpu`
    quantization: Optional[str] = None  # "nf4", "fp4" or "int8": the decoder's linear weights (`JobSpec.quantization`)
    shard_base: Union[bool, str] = "auto"  # on d > 1 GPUs: FSDP2 or a whole base on each (`JobSpec.shard_base`)

    def __post_init__(self):
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"The value of `dtype` is {self.dtype!r}, but must be one of {sorted(_DTYPE_BYTES)}.")
        if self.quantization is not None and self.quantization not in QUANTIZED_BYTES_PER_PARAM:
            raise ValueError(f"The value of `quantization` is {self.quantization!r}, but must be None or one of "
                             f"{sorted(QUANTIZED_BYTES_PER_PARAM)}.")
        if not 0 < self.load_factor <= 1:
            raise ValueError(f"The value of `load_factor` is {self.load_factor}, but must be `0 < load_factor <= 1`.")
        if self.max_seq_len < 1:
            raise ValueError(f"The value of `max_seq_len` is {self.max_seq_len}, but must be `max_seq_len >= 1`.")
        if self.mean_sample_tokens is None:
            self.mean_sample_tokens = float(self.max_seq_len)
        if not 1 <= self.mean_sample_tokens <= self.max_seq_len:
            raise ValueError(f"The value of `mean_sample_tokens` is {self.mean_sample_tokens}, but must be "
                             f"`1 <= mean_sample_tokens <= max_seq_len` ({self.max_seq_len}).")
        self.target_modules = tuple(self.target_modules)
        self.shape.lora_dims(self.target_modules)  # unknown module names fail here
        if self.loss_chunk_tokens is None:  # as kernels.lm_loss.default_chunk_rows: 256 MiB of fp32 logits
            self.loss_chunk_tokens = max(16, min(4096, (1 << 26) // self.shape.vocab_size // 16 * 16))
        if self.calibration is None:
            self.calibration = Calibration.roofline(self.gpu)

    @classmethod
    def from_model(
        cls,
        model: Any,
        gpu: Union[str, GPU, None] = None,
        *,
        gpu_memory_gb: Optional[float] = None,
        max_seq_len: Optional[int] = None,
        dtype: Optional[str] = None,
        target_modules: Optional[Sequence[str]] = None,
        gradient_checkpointing: Optional[bool] = None,
        **kwargs: Any,
    ) -> "CostModel":
        """Build the cost model of a base model from its config alone.

        Example:

            .. code::

                cm = CostModel.from_model("llama-3.1-8b", gpu="h100-sxm", max_seq_len=1024)
                print(cm.memory_per_gpu([TrialConfig(rank=64, batch_size=4)], 1) / 1e9, "GB")

        Args:
            model:
                A `JobSpec` (its ``max_seq_len``, ``dtype``, ``target_modules`` and
                ``gradient_checkpointing`` become the defaults here), a transformers config,
                a dict of config fields, a name in `PRESETS`, a local directory or a hub id.
            gpu:
                A name in `GPUS`, a `GPU`, or None for this machine's (`detect`).
            gpu_memory_gb:
                Overrides the GPU's memory (e.g. a 40 GB slice of a larger GPU).
            max_seq_len:
                Longest sample in tokens; default the spec's, else 512.
            dtype:
                ``"bfloat16"``, ``"float16"``, ``"float32"`` or ``"auto"`` (bf16 on GPUs, fp32 on
                the CPU, as the engine does); default the spec's, else ``"auto"``.
            target_modules:
                The linear layers that get adapters; default the spec's, else all seven.
            gradient_checkpointing:
                Whether the engine recomputes base activations; default the spec's, else False.
            kwargs:
                Other `CostModel` fields: ``load_factor``, ``loss_chunk_tokens``,
                ``mean_sample_tokens`` (the data's mean sample length, for step times),
                ``calibration``.

        Returns:
            The `CostModel`.
        """
        spec = model if isinstance(model, JobSpec) else None
        gpu = detect() if gpu is None else gpu_profile(gpu)
        if gpu_memory_gb is not None:
            gpu = dataclasses.replace(gpu, memory_gb=float(gpu_memory_gb))

        def pick(value, name, default):  # the argument, else the spec's field, else the default
            if value is not None:
                return value
            return getattr(spec, name) if spec is not None else default

        dtype = pick(dtype, "dtype", "auto")
        if dtype == "auto":
            dtype = "float32" if gpu.name == "cpu" else "bfloat16"
        return cls(
            ModelShape.from_config(model), gpu,
            max_seq_len=pick(max_seq_len, "max_seq_len", 512),
            dtype=dtype,
            target_modules=tuple(pick(target_modules, "target_modules", DEFAULT_TARGET_MODULES)),
            gradient_checkpointing=pick(gradient_checkpointing, "gradient_checkpointing", False),
            **{"quantization": quantization_name(spec.quantization) if spec is not None else None,
               "shard_base": spec.shard_base if spec is not None else "auto", **kwargs},
        )

    # ---- per-token and per-step constants of the model

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def weight_bytes(self) -> float:
        """Bytes of the frozen base: every weight in `dtype`, but the decoder's linear weights in
        their quantized form where the base is quantized (the embeddings, norms and LM head
        stay in `dtype`, as bitsandbytes leaves them)."""
        if self.quantization is None:
            return self.shape.num_params * self.dtype_bytes
        linear = self.shape.num_layers * sum(a * b for a, b in self.shape.linear_dims.values())
        rest = self.shape.num_params - linear
        return linear * QUANTIZED_BYTES_PER_PARAM[self.quantization] + rest * self.dtype_bytes

    def shards_base(self, num_gpus: int) -> bool:
        """Whether a job on `num_gpus` GPUs shards the base (FSDP2) rather than keeping it
        whole on each GPU, as the engine decides (`config.shards_base`)."""
        return num_gpus > 1 and shards_base(self.shard_base, self.weight_bytes(),
                                            None if self.gpu.name == "cpu" else self.gpu.memory_gb * GB)

    def _decoder_weight_bytes(self) -> float:
        """Bytes of the weights that FSDP shards: all but the LM head, which every GPU holds whole."""
        return self.weight_bytes() - self.shape.vocab_size * self.shape.hidden_size * self.dtype_bytes

    @property
    def capacity_bytes(self) -> float:
        """Usable memory of one GPU: the load factor times its memory."""
        return self.load_factor * self.gpu.memory_gb * GB

    def _lora_dims(self) -> int:
        """LoRA parameters per unit rank over all layers and all of the job's target modules."""
        return self.shape.num_layers * self.shape.lora_dims(self.target_modules)

    def _base_activation_bytes_per_token(self) -> float:
        s, b = self.shape, self.dtype_bytes
        # What one decoder layer keeps for the backward pass, per token (frozen weights, so
        # nothing is kept for weight gradients; attention is flash/SDPA, so no seq x seq scores;
        # the fused LoRA kernels regenerate dropout masks, so no dropped copies of x):
        per_layer = (
            2 * 4 * s.hidden_size  # the two RMSNorms keep their input in fp32 (transformers upcasts)
            + b * 2 * s.hidden_size  # their outputs: inputs of q/k/v and of gate/up
            + b * (s.q_dim + 2 * s.kv_dim)  # q, k, v after RoPE, for the attention backward
            + b * s.q_dim  # attention output, the input of o_proj
            + b * 4 * s.intermediate_size  # gate, up, act(gate) and act(gate) * up (the input of down_proj)
        )
        head = 4 * s.hidden_size + b * s.hidden_size  # final norm's fp32 input; the loss's d/d(hidden)
        if self.gradient_checkpointing:  # layer inputs only, plus one layer being recomputed
            return s.num_layers * b * s.hidden_size + per_layer + head
        return s.num_layers * per_layer + head

    def _lora_activation_bytes_per_rank_token(self) -> float:
        # Each adapted module keeps S = dropout(x) @ A, a (tokens, rank) tensor, for dB = S^T dY.
        layers_kept = 1 if self.gradient_checkpointing else self.shape.num_layers
        return layers_kept * len(self.target_modules) * self.dtype_bytes

    def _base_flops_per_token(self) -> float:
        s = self.shape
        gemm_params = s.num_layers * sum(a * b for a, b in s.linear_dims.values()) + s.vocab_size * s.hidden_size
        attention = s.num_layers * 2 * s.q_dim * self.mean_sample_tokens  # QK^T and PV, causal: half the context
        # forward 2 FLOPs per weight; backward only the input gradients (the base is frozen),
        # another 2; attention's backward is ~2.5x its forward; recomputation adds a forward.
        recompute = 1 if self.gradient_checkpointing else 0
        return (4 + 2 * recompute) * gemm_params + (3.5 + recompute) * attention

    def _lora_flops_per_rank_token(self) -> float:
        # forward x@A, S@B: 2 FLOPs per parameter; backward dS, dB, dA, dx: 4 more
        return (6 + 2 * self.gradient_checkpointing) * self._lora_dims()

    # ---- the two job-level functions (everything else is built on these)

    def time_features(self, tokens: float, rank_tokens: float, num_adapters: float, num_gpus: int) -> np.ndarray:
        """The features of one step whose dot product with ``calibration.time_coefs`` is its time.

        Args:
            tokens:
                Tokens the step computes on (padding included).
            rank_tokens:
                Sum over adapters of (rank x that adapter's tokens).
            num_adapters:
                Adapters in the step.
            num_gpus:
                GPUs of the job.

        Returns:
            An array in `TIME_TERMS` order.
        """
        d = num_gpus
        passes = 2 + self.gradient_checkpointing  # forward, backward (+ recomputed forward)
        # every GPU computes its own trials' rows on every layer, gathered whole where sharded (FSDP)
        weight_bytes = self.shape.num_params * self.dtype_bytes * passes
        gathered = self._decoder_weight_bytes() * passes * (d - 1) / d if self.shards_base(d) else 0.0
        return np.array([
            1.0,
            num_adapters / d,
            weight_bytes,
            self._base_flops_per_token() * tokens / d,
            self._lora_flops_per_rank_token() * rank_tokens / d,
            gathered,
        ])

    def step_seconds(self, tokens: float, rank_tokens: float, num_adapters: float, num_gpus: int = 1) -> float:
        """Predicted wall time of one packed step.

        Args:
            tokens:
                Tokens the step computes on.
            rank_tokens:
                Sum over adapters of (rank x that adapter's tokens).
            num_adapters:
                Adapters in the step.
            num_gpus:
                GPUs of the job.

        Returns:
            Seconds.
        """
        features = self.time_features(tokens, rank_tokens, num_adapters, num_gpus)
        return float(features @ np.asarray(self.calibration.time_coefs))

    def memory_terms(self, tokens: float, rank_tokens: float, rank_sum: float, num_gpus: int) -> dict[str, float]:
        """Predicted peak memory of one GPU of a job, term by term, in bytes.

        Args:
            tokens:
                Tokens of the step (a micro-step: batch x sequence length per adapter).
            rank_tokens:
                Sum over adapters of (rank x that adapter's tokens).
            rank_sum:
                Sum of the adapters' ranks (their parameters, gradients and optimizer states).
            num_gpus:
                GPUs of the job: the trials' terms are split among them (each trial on one
                GPU); a sharded base's decoder too (FSDP: the LM head and two gathered layers
                are on each), while a base kept whole is on each; a chunk of logits and the
                workspace are on each.

        Returns:
            A dict with ``weights``, ``logits``, ``adapter_states``, ``base_activations``,
            ``lora_activations`` and ``workspace``; their sum is the peak.
        """
        d, cal = num_gpus, self.calibration
        decoder = self._decoder_weight_bytes()
        weights = self.weight_bytes() if not self.shards_base(d) else (
            self.weight_bytes() - decoder + decoder / d + 2 * decoder / self.shape.num_layers * (d - 1) / d)
        return {
            "weights": weights,
            "logits": self.loss_chunk_tokens * self.shape.vocab_size * LOGITS_BYTES,
            "adapter_states": rank_sum * self._lora_dims() * ADAPTER_BYTES_PER_PARAM / d,
            "base_activations": cal.base_activation_scale * tokens * self._base_activation_bytes_per_token() / d,
            "lora_activations": cal.lora_activation_scale * rank_tokens
            * self._lora_activation_bytes_per_rank_token() / d,
            "workspace": cal.workspace_bytes,
        }

    def peak_memory(self, tokens: float, rank_tokens: float, rank_sum: float, num_gpus: int = 1) -> float:
        """Predicted peak memory of one GPU in bytes: the sum of `memory_terms`."""
        return sum(self.memory_terms(tokens, rank_tokens, rank_sum, num_gpus).values())

    # ---- trials

    def effective_rank(self, trial: TrialConfig) -> float:
        """The trial's rank scaled by the share of the job's LoRA dimensions it adapts."""
        if trial.target_modules is None:
            return float(trial.rank)
        return trial.rank * self.shape.lora_dims(trial.target_modules) / self.shape.lora_dims(self.target_modules)

    def _totals(self, trials: Sequence[TrialConfig], for_time: bool) -> tuple[float, float, float]:
        """(tokens, rank_tokens, rank_sum) of a set of trials in one step."""
        tokens = rank_tokens = rank_sum = 0.0
        for t in trials:
            n = (t.batch_size * self.mean_sample_tokens * t.gradient_accumulation_steps if for_time
                 else t.batch_size * self.max_seq_len)
            r = self.effective_rank(t)
            tokens, rank_tokens, rank_sum = tokens + n, rank_tokens + r * n, rank_sum + r
        return tokens, rank_tokens, rank_sum

    def memory_per_gpu(self, trials: Sequence[TrialConfig], num_gpus: int = 1) -> float:
        """Predicted peak memory (bytes) of each GPU of a job packing `trials` on `num_gpus`.

        Args:
            trials:
                The trials of the job.
            num_gpus:
                GPUs of the job.

        Returns:
            Bytes per GPU.
        """
        return self.peak_memory(*self._totals(trials, for_time=False), num_gpus)

    def after_out_of_memory(self, trials: Sequence[TrialConfig], num_gpus: int = 1) -> "CostModel":
        """A copy corrected by a job of `trials` that ran out of memory: if the model predicted
        that they fit, its activation terms are scaled up (5% past the capacity) so that they no
        longer do. Admission then stops short of that pack.

        Args:
            trials:
                The trials of the job that ran out of memory.
            num_gpus:
                GPUs of the job.

        Returns:
            The corrected model (this one if it already predicted the failure).
        """
        terms = self.memory_terms(*self._totals(trials, for_time=False), num_gpus)
        activations = terms["base_activations"] + terms["lora_activations"]
        room = self.capacity_bytes - (sum(terms.values()) - activations)
        if activations <= 0 or room <= 0 or sum(terms.values()) > self.capacity_bytes:
            return self
        factor = 1.05 * room / activations  # the activations now fill the room left, and 5% more
        cal = dataclasses.replace(self.calibration, source=f"{self.calibration.source}, corrected by an out of memory",
                                  base_activation_scale=self.calibration.base_activation_scale * factor,
                                  lora_activation_scale=self.calibration.lora_activation_scale * factor)
        return dataclasses.replace(self, calibration=cal)

    def fits(self, trials: Sequence[TrialConfig], num_gpus: int = 1) -> bool:
        """Whether `trials` packed on `num_gpus` stay within the load factor of each GPU's memory."""
        return self.memory_per_gpu(trials, num_gpus) <= self.capacity_bytes

    def trial_budget(self, num_gpus: int = 1) -> float:
        """Bytes left for trials in a job on `num_gpus` GPUs, summed over them: the jobs whose
        ``sum(trial_memory)`` stays within it fit."""
        return num_gpus * (self.capacity_bytes - self.calibration.workspace_bytes) - self.static_memory(num_gpus)

    def static_memory(self, num_gpus: int = 1) -> float:
        """Bytes of a job without adapters (weights, logits), summed over its `num_gpus` GPUs;
        the per-GPU workspace comes on top."""
        return num_gpus * (self.peak_memory(0, 0, 0, num_gpus) - self.calibration.workspace_bytes)

    def trial_memory(self, trial: TrialConfig) -> float:
        """Bytes that `trial` adds to a job, summed over its GPUs (the model is linear in trials)."""
        return self.memory_per_gpu([trial], 1) - self.peak_memory(0, 0, 0, 1)

    def job_step_seconds(self, trials: Sequence[TrialConfig], num_gpus: int = 1) -> float:
        """Predicted time of one optimizer step of all `trials` packed on `num_gpus`."""
        tokens, rank_tokens, _ = self._totals(trials, for_time=True)
        return self.step_seconds(tokens, rank_tokens, len(trials), num_gpus)

    def fixed_step_seconds(self, num_gpus: int = 1) -> float:
        """The part of a step's time that does not depend on its adapters."""
        return self.step_seconds(0, 0, 0, num_gpus)

    def trial_step_seconds(self, trial: TrialConfig, num_gpus: int = 1) -> float:
        """What adding `trial` to a job adds to its step time (the model is linear in trials)."""
        return self.job_step_seconds([trial], num_gpus) - self.fixed_step_seconds(num_gpus)

    def trial_job_seconds(self, trial: TrialConfig, num_gpus: int = 1) -> float:
        """What `trial` adds to the duration of a job it joins: its step time for each of its
        steps, plus its time outside steps (``calibration.trial_seconds``)."""
        return self.trial_step_seconds(trial, num_gpus) * trial.max_steps + self.calibration.trial_seconds

    def job_seconds(self, trials: Sequence[TrialConfig], num_gpus: int = 1) -> float:
        """Predicted duration of a job that starts `trials` together; each leaves after its `max_steps`.

        The job runs ``max(max_steps)`` steps, each paying the fixed step time, and every trial
        adds its own step time for each of its steps, plus its time outside steps
        (``calibration.trial_seconds``: joining, saving its adapter).
        """
        if not trials:
            return 0.0
        steps = max(t.max_steps for t in trials)
        return self.fixed_step_seconds(num_gpus) * steps + sum(self.trial_job_seconds(t, num_gpus) for t in trials)

    def min_gpus(self, trial: TrialConfig, max_gpus: int) -> Optional[int]:
        """The fewest GPUs (1, 2, 4, ... or `max_gpus`) on which `trial` fits alone; None if none."""
        for d in gpu_counts(max_gpus):
            if self.fits([trial], d):
                return d
        return None

    def check_trial(self, trial: TrialConfig, num_gpus: int) -> None:
        """Raise a `ConfigError` naming the trial and the memory it needs if it cannot fit alone.

        Args:
            trial:
                The trial.
            num_gpus:
                All the GPUs that a job could use.

        Raises:
            ConfigError: if the trial does not fit alone on `num_gpus` GPUs.
        """
        if self.fits([trial], num_gpus):
            return
        need = self.memory_per_gpu([trial], num_gpus) * num_gpus
        terms = self.memory_terms(*self._totals([trial], for_time=False), 1)
        detail = ", ".join(f"{k.replace('_', ' ')} {v / GB:.1f}" for k, v in terms.items() if v > 0)
        raise ConfigError(
            f"{'Trial ' + repr(trial.trial_id) + ':' if trial.trial_id is not None else 'A trial'} needs "
            f"{need / GB:.1f} GB of GPU memory ({detail} GB) with rank "
            f"{trial.rank}, batch_size {trial.batch_size} and max_seq_len {self.max_seq_len}, but "
            f"{num_gpus} x {self.gpu.memory_gb:g} GB GPUs at load factor {self.load_factor:g} hold "
            f"{num_gpus * self.capacity_bytes / GB:.1f} GB. Lower `batch_size` or `rank`, or use "
            f"gradient checkpointing or more GPUs.",
            field="batch_size", trial_id=trial.trial_id,
        )

    # ---- persistence

    def to_dict(self) -> dict:
        """A JSON-able dict of the whole model (shape, GPU, settings, coefficients)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CostModel":
        d = dict(d)
        shape = dict(d.pop("shape"))
        shape["linear_dims"] = {k: tuple(v) for k, v in shape["linear_dims"].items()}
        return cls(ModelShape(**shape), GPU(**d.pop("gpu")), calibration=Calibration(**d.pop("calibration")),
                   **{k: tuple(v) if k == "target_modules" else v for k, v in d.items()})

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the model, calibration included, as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "CostModel":
        """Read a model written by `save`."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


def job_memory_model(spec: JobSpec, device: Any = None) -> Optional[CostModel]:
    """The memory model with which trials are admitted into a running job of `spec` on
    `device` (`lora_sweep.planner.fits_running_job`): the spec's model on that device's
    memory. The job corrects it when a step runs out of memory.

    Args:
        spec:
            The job's spec.
        device:
            The job's device (``"cuda:0"``, ``"cpu"``, a ``torch.device``); None: this
            machine's first GPU, else the CPU.

    Returns:
        The `CostModel`, or None (logged) when it cannot describe the base model: a model
        factory, a config that is not a Llama-style decoder, target modules it does not
        know. Then only the adapter cap limits a job.
    """
    if not isinstance(spec.base_model, str):
        logger.info("No memory model for a `base_model` factory; jobs are limited by their adapter cap only.")
        return None
    try:
        return CostModel.from_model(spec, detect(device))
    except ValueError as err:  # ConfigError included: modules the cost model does not know
        logger.info("No memory model for %s (%s); jobs are limited by their adapter cap only.", spec.model_name, err)
        return None


def gpu_counts(num_gpus: int) -> list[int]:
    """The GPU counts a job may use: 1, 2, 4, ... up to `num_gpus`, and `num_gpus` itself."""
    counts = [1 << k for k in range(num_gpus.bit_length()) if 1 << k <= num_gpus]
    return counts + ([num_gpus] if counts[-1] != num_gpus else [])


# --------------------------------------------------------------------------- calibration


def calibrate(cost_model: CostModel, step_stats: Sequence[Mapping[str, Any]], num_gpus: int = 1,
              trial_seconds: Optional[float] = None) -> CostModel:
    """Fit the step-time coefficients and the activation terms to profiled steps.

    Step time is linear in the features of `CostModel.time_features`, and peak memory is
    linear in the base and LoRA activation bytes plus a workspace constant, so both are least
    squares fits. Step time is fitted twice: first with three terms that a few steps of a few
    jobs determine (a per-step overhead, a per-adapter overhead, and one factor on the
    roofline's time of weights, base and LoRA FLOPs and communication), then with every
    term, pulled towards the first fit by a ridge term. So terms the steps cannot tell apart
    (the LoRA FLOPs and the tokens when rank and batch grow together; the per-step overhead
    and the weight reads on one GPU count) keep the roofline's proportions, while many varied
    steps recover each coefficient. Coefficients are kept non-negative.

    Example:

        .. code::

            cm = CostModel.from_model(spec, gpu=None)  # this machine
            cm = calibrate(cm, profile_job(PackedJob(spec, trials), steps=10))
            cm.save("calibration.json")

    Args:
        cost_model:
            The model to start from (its shape, dtype and sequence length must be the job's).
        step_stats:
            One dict per profiled step, as `PackedJob.step_stats` records them: ``tokens``,
            ``padded_tokens`` (used when present), ``rank_tokens``, ``num_adapters``,
            ``seconds``, ``rank_sum`` (the ranks of the step's adapters, summed) and
            ``peak_memory_bytes`` (None on CPU: then memory is not fitted); ``num_gpus`` in a
            dict overrides the argument. Steps marked ``one_off`` (a CUDA graph captured in
            them) are left out: their time is mostly the capture; so are those marked
            ``choosing`` (``cuda_graphs="auto"`` timing the kind of step the job may not keep).
        num_gpus:
            GPUs of the profiled job.
        trial_seconds:
            A trial's measured time outside steps (joining a job, saving its adapter: a job
            run to completion, less its steps, per trial); None keeps the current value.

    Returns:
        A copy of `cost_model` with the fitted `Calibration`.
    """
    step_stats = [s for s in step_stats if _runs_as_the_job_does(s)]
    if len(step_stats) < 2:
        raise ValueError(f"The length of `step_stats` is {len(step_stats)} (one-off and choosing steps left out), "
                         f"but must be at least 2.")
    cal = dataclasses.replace(cost_model.calibration, source=f"calibrated from {len(step_stats)} steps")
    if trial_seconds is not None:
        if trial_seconds < 0:
            raise ValueError(f"The value of `trial_seconds` is {trial_seconds}, but must be `trial_seconds >= 0`.")
        cal.trial_seconds = float(trial_seconds)

    def tokens_of(s):
        return s.get("padded_tokens") or s["tokens"]

    # step time: seconds = features . coefs
    features = np.array([cost_model.time_features(tokens_of(s), s["rank_tokens"], s["num_adapters"],
                                                  s.get("num_gpus", num_gpus)) for s in step_stats])
    seconds = np.array([s["seconds"] for s in step_stats], dtype=float)
    # First a fit that few steps determine: per-step and per-adapter overheads and one factor
    # on the roofline's time of everything else. Then the full fit, pulled towards it, so that
    # terms the profiled steps cannot tell apart keep the roofline's proportions.
    # No coefficient may fall below the GPU's peak rates: few steps whose terms grow together
    # could otherwise put all the time on one term and call another free.
    prior, floor = np.asarray(cal.time_coefs), np.asarray(Calibration.floor(cost_model.gpu))
    physics = features[:, 2:] @ prior[2:]
    c0, c1, factor = _ridge_fit(np.column_stack([features[:, :2], physics]), seconds,
                                np.array([prior[0], prior[1], 1.0]),
                                lower=np.array([0.0, 0.0, np.max(floor[2:] / prior[2:])]))
    start = np.concatenate([[c0, c1], factor * prior[2:]])
    cal.time_coefs = _ridge_fit(features, seconds, start, lower=floor).tolist()

    # memory: peak - (weights, logits, adapter states) = a * base act + b * lora act + workspace
    with_memory = [s for s in step_stats if s.get("peak_memory_bytes") is not None]
    if with_memory:
        if any("rank_sum" not in s for s in with_memory):
            raise ValueError("Fitting memory needs `rank_sum` in every step's stats (`profile_job` adds it).")
        unit = dataclasses.replace(cost_model, calibration=dataclasses.replace(
            cal, base_activation_scale=1.0, lora_activation_scale=1.0, workspace_bytes=0.0))
        rows, rest = [], []
        for s in with_memory:
            terms = unit.memory_terms(tokens_of(s), s["rank_tokens"], s["rank_sum"], s.get("num_gpus", num_gpus))
            rows.append([terms["base_activations"], terms["lora_activations"], GB])
            rest.append(s["peak_memory_bytes"] - terms["weights"] - terms["logits"] - terms["adapter_states"])
        prior = np.array([cal.base_activation_scale, cal.lora_activation_scale, cal.workspace_bytes / GB])
        base, lora, workspace = _ridge_fit(np.array(rows), np.array(rest), prior)
        cal.base_activation_scale, cal.lora_activation_scale, cal.workspace_bytes = base, lora, workspace * GB
    logger.info("Calibrated cost model: %s", cal.describe())
    return dataclasses.replace(cost_model, calibration=cal)


def _ridge_fit(features: np.ndarray, target: np.ndarray, prior: np.ndarray, strength: float = 1e-6,
               lower: np.ndarray | None = None) -> np.ndarray:
    """Least squares of ``features @ coefs = target`` with ``coefs >= lower`` (default 0),
    pulled towards `prior` in the directions the data do not determine; a column of zeros
    keeps its prior. Columns are normalised first, so the ridge strength is relative to the data."""
    from scipy.optimize import lsq_linear  # scipy comes with cvxpy

    lower = np.zeros(len(prior)) if lower is None else np.asarray(lower, dtype=float)
    scale = np.linalg.norm(features, axis=0)
    unseen = scale == 0  # a term no step has (communication on one GPU): it keeps its prior, within bounds
    if unseen.any():
        coefs = np.maximum(prior, lower)
        coefs[~unseen] = _ridge_fit(features[:, ~unseen], target, prior[~unseen], strength, lower[~unseen])
        return coefs
    a = features / scale  # unit columns; unknowns u = coefs * scale
    low = lower * scale
    weight = np.sqrt(strength)
    a_aug = np.vstack([a, weight * np.eye(len(prior))])
    b_aug = np.concatenate([target, weight * np.maximum(prior * scale, low)])  # a prior below the bound is lifted to it
    return lsq_linear(a_aug, b_aug, bounds=(low, np.inf)).x / scale


# --------------------------------------------------------------------------- profiling


def _runs_as_the_job_does(step: Mapping[str, Any]) -> bool:
    """Whether a step's time is one of the job's steps: it captured no CUDA graph (``one_off``)
    and was not timed for ``cuda_graphs="auto"``'s choice (``choosing``)."""
    return not step.get("one_off") and not step.get("choosing")


STALL_FACTOR = 3.0  # a step over this many times the median of its job's steps is a stall, not a step


def typical_steps(step_stats: Sequence[Mapping[str, Any]]) -> list:
    """The steps of one job that say how long its steps take: those that are not ``one_off``
    (a CUDA graph captured in them), not ``choosing`` (``cuda_graphs="auto"`` still timing
    eager steps against replayed ones: the job then runs only one kind), and not stalls (over
    `STALL_FACTOR` times the median of those steps: a kernel compiled for a new shape inside
    the step takes seconds). Give it one job's steps: the median stands for all of them."""
    steps = [s for s in step_stats if _runs_as_the_job_does(s)]
    if len(steps) < 3:
        return steps
    median = float(np.median([s["seconds"] for s in steps]))
    return [s for s in steps if s["seconds"] <= STALL_FACTOR * median]


def profile_job(job: Any, steps: int = 10, *, warmup: int = 1) -> list[dict]:
    """Run a `PackedJob` for a few steps and return their stats for `calibrate`.

    The engine records one dict per step in ``job.step_stats`` (tokens, rank-tokens, the
    ranks of the adapters in the step, wall time, peak memory); this runs ``job.step()``,
    drops the first `warmup` steps (allocations, kernel compilation) and returns the first
    `steps` of the rest that `typical_steps` keeps (not captures, not timed for
    ``cuda_graphs="auto"``'s choice, not stalls), running up to ``3 * steps + 8`` more to
    find them.

    Example:

        .. code::

            job = PackedJob(spec, [TrialConfig(rank=r, batch_size=b, max_steps=12) for r, b in grid])
            cm = calibrate(CostModel.from_model(spec), profile_job(job, steps=10))

    Args:
        job:
            A ``lora_sweep.engine.PackedJob`` (anything with ``step()`` and ``step_stats``).
            Give its trials a range of ranks and batch sizes: the fit needs steps that differ.
        steps:
            Steps to return.
        warmup:
            Steps to run and drop first.

    Returns:
        The step stats, one dict per step.
    """
    first = len(job.step_stats) + warmup
    last = first + 3 * steps + 8  # room for the eager and replayed steps "auto" times
    while len(typical_steps(job.step_stats[first:])) < steps and len(job.step_stats) < last and job.trials:
        job.step()
    stats = typical_steps(job.step_stats[first:])[:steps]
    if len(stats) < steps:
        warnings.warn(f"The job finished after {len(stats)} profiled steps, fewer than the {steps} asked for.")
    return stats
