"""What a sweep is made of: one `JobSpec` (the shared base model and data) and many
`TrialConfig`s (one LoRA adapter's hyperparameters each).

Both validate themselves on construction, before any model is loaded. Checks that need
the model (does `rank` fit the layer? does `q_proj` exist?) live in `check_against_model`,
which the engine calls when a trial joins a job. Every failure is a `ConfigError` that
names the trial, the field, the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import os
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

LR_SCHEDULERS = ("linear", "cosine", "constant")
FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: optimizer and kernels hold floats in fp32
FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny: a smaller positive value flushes to 0
MAX_TRIAL_ID_CHARS = 512  # room for a long study name plus "-trial-<number>"
MAX_BATCH_SIZE = 65536  # samples one adapter draws per micro-step
MAX_GRADIENT_ACCUMULATION_STEPS = 4096  # micro-steps before an adapter's first optimizer step (and report)
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATIONS = ("nf4", "fp4", "int8")  # JobSpec.quantization's names (bitsandbytes' formats)
REPLICATED_BASE_MAX_SHARE = 0.25  # shard_base="auto": a base within this share of one GPU's memory stays whole


class ConfigError(ValueError):
    """An invalid trial or job setting. The message names the trial, the field, the value
    and the allowed range; `field` and `trial_id` are kept as attributes for tuners."""

    def __init__(self, message: str, *, field: str | None = None, trial_id: str | None = None):
        super().__init__(message)
        self.field = field
        self.trial_id = trial_id


def _who(trial_id: Optional[str]) -> str:
    return f"Trial {trial_id!r}: " if trial_id is not None else ""


def quantization_name(quantization: Any) -> Optional[str]:
    """"nf4", "fp4", "int8" or None: what `JobSpec.quantization` stores the base's linear weights as."""
    if quantization is None or isinstance(quantization, str):
        return quantization
    if getattr(quantization, "load_in_8bit", False):
        return "int8"
    if getattr(quantization, "load_in_4bit", False):
        return getattr(quantization, "bnb_4bit_quant_type", "fp4")
    return None


def _fail(trial_id, name, value, rule) -> ConfigError:
    return ConfigError(
        f"{_who(trial_id)}the value of `{name}` is {value!r}, but must be {rule}.",
        field=name,
        trial_id=trial_id,
    )


def _plain(v):
    """A NumPy scalar, 0-d array or 0-d torch tensor as the Python value of its kind
    (`np.int64` -> int, `np.float32` -> float, `np.bool_` -> bool, `np.str_` -> str); anything
    else unchanged. Tuners and NumPy code hand these over; configs store plain values, which
    serialise to JSON and unpickle with `torch.load(weights_only=True)`."""
    if isinstance(v, str):
        return str(v)  # np.str_ is a str subclass
    module = type(v).__module__
    if (module == "numpy" or module.startswith("torch")) and hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return v.item()
    return v


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _check_int(tid, name, v, lo, hi=None):
    rule = f"an integer with {lo} <= `{name}`" + (f" <= {hi}" if hi is not None else "")
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        raise _fail(tid, name, v, rule)


def _check_real(tid, name, v, rule, ok):
    if not _is_real(v) or not math.isfinite(float(v)) or not ok(float(v)):
        raise _fail(tid, name, v, rule)


def _fp32(v: float) -> bool:
    """Whether `v` keeps its meaning in fp32: 0, or a magnitude between fp32's smallest normal
    and largest finite number."""
    return v == 0 or FP32_TINY <= abs(v) <= FP32_MAX


_FP32_RANGE = f"{FP32_TINY:.4g} and {FP32_MAX:.4g} (float32's range)"


def check_trial_id(trial_id) -> str:
    """A trial_id as a non-empty string of at most MAX_TRIAL_ID_CHARS characters, encodable as
    UTF-8, and neither '.' nor '..'. Any such id has its own file name (`trial_file_name`)."""
    trial_id = _plain(trial_id)
    if not isinstance(trial_id, str):
        trial_id = str(trial_id)
    rule = f"a non-empty string of at most {MAX_TRIAL_ID_CHARS} characters, valid UTF-8, other than '.' and '..'"
    shown = trial_id if len(trial_id) <= 80 else trial_id[:77] + "..."
    try:
        trial_id.encode("utf-8")
        encodable = True
    except UnicodeEncodeError:
        encodable = False
    if not trial_id or len(trial_id) > MAX_TRIAL_ID_CHARS or trial_id in (".", "..") or not encodable:
        raise ConfigError(f"The value of `trial_id` is {shown!r}, but must be {rule}.", field="trial_id")
    return trial_id


_PLAIN_NAME = re.compile(r"[a-z0-9_][a-z0-9_.-]{0,63}")  # kept as it is: lower case (case-insensitive
# file systems), no leading '.' or '-', short, and without '+', which marks the hashed names below


def trial_file_name(trial_id: str) -> str:
    """The file or directory name of a trial's adapter and checkpoint, one-to-one with its id.

    An id made of lower-case letters, digits, '_', '.' and '-' (not leading '.' or '-') of up
    to 64 characters is its own name. Any other id gets a readable slug (its first 40
    characters, others replaced by '_') followed by '+' and 16 hex digits of the id's SHA-256:
    'a/b' -> 'a_b+...', which never equals a plain name (those have no '+')."""
    if _PLAIN_NAME.fullmatch(trial_id):
        return trial_id
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", trial_id[:40]).lstrip(".-")
    return f"{slug}+{hashlib.sha256(trial_id.encode('utf-8')).hexdigest()[:16]}"


def bounded_name(name: str, limit: int = MAX_TRIAL_ID_CHARS) -> str:
    """`name` if it has at most `limit` characters, else its head and a hash of the whole, within
    `limit`: for trial ids built from a tuner's study or experiment name."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{name[: limit - 17]}~{digest}"


@dataclass
class TrialConfig:
    """One LoRA adapter's hyperparameters: a single trial of the sweep.

    Field names and meanings follow PEFT's `LoraConfig` and transformers' `TrainingArguments`
    (`alpha` is `lora_alpha`: the LoRA term is scaled by alpha/rank, or alpha/sqrt(rank)
    with `use_rslora`). Values are checked on construction; a bad one raises `ConfigError`.
    """

    rank: int = field(default=16, metadata={"help": "LoRA rank r of every adapted layer."})
    alpha: float = field(default=32.0, metadata={"help": "PEFT's lora_alpha; scaling = alpha / rank."})
    dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch input, in [0, 1)."})
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak AdamW learning rate."})
    batch_size: int = field(default=1, metadata={"help": "Samples per micro-step for this adapter."})
    max_steps: int = field(default=200, metadata={"help": "Optimizer steps to train."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW decoupled weight decay, >= 0."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warm-up steps from lr 0."})
    lr_scheduler: Literal["linear", "cosine", "constant"] = field(
        default="linear", metadata={"help": "Decay after warm-up: linear or cosine to 0, or constant."}
    )
    max_grad_norm: Optional[float] = field(
        default=1.0, metadata={"help": "Clip this adapter's gradient norm; None or 0 disables."}
    )
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    use_rslora: bool = field(default=False, metadata={"help": "Scale by alpha/sqrt(rank) (rank-stabilised LoRA)."})
    target_modules: Optional[tuple[str, ...]] = field(
        default=None, metadata={"help": "Subset of the job's target modules; None means all of them."}
    )
    seed: int = field(default=0, metadata={"help": "Seeds the adapter init, data order and dropout masks."})
    max_seq_len: Optional[int] = field(
        default=None, metadata={"help": "This trial's sequence length, at most the job's; None: the job's."}
    )
    base_model: Optional[str] = field(
        default=None, metadata={"help": "Which of a sweep's bases it trains on, by name; None: the first."}
    )
    trial_id: Optional[str] = field(default=None, metadata={"help": "Unique name; the engine assigns one if None."})

    def __post_init__(self):
        for f in fields(self):  # NumPy / torch scalars -> Python values
            setattr(self, f.name, _plain(getattr(self, f.name)))
        if self.trial_id is not None:
            try:
                self.trial_id = check_trial_id(self.trial_id)
            except ConfigError as e:
                raise ConfigError(str(e), field="trial_id", trial_id=str(self.trial_id)) from None
        tid = self.trial_id
        _check_int(tid, "rank", self.rank, 1)
        _check_real(tid, "alpha", self.alpha, f"a finite number > 0 between {_FP32_RANGE}",
                    lambda v: v > 0 and _fp32(v))
        _check_real(tid, "dropout", self.dropout, "a number with 0 <= `dropout` < 1", lambda v: 0 <= v < 1)
        _check_real(tid, "learning_rate", self.learning_rate, f"a finite number > 0 between {_FP32_RANGE}",
                    lambda v: v > 0 and _fp32(v))
        _check_int(tid, "batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        _check_int(tid, "max_steps", self.max_steps, 1)
        _check_real(tid, "weight_decay", self.weight_decay, f"a finite number >= 0: 0 or between {_FP32_RANGE}",
                    lambda v: v >= 0 and _fp32(v))
        _check_int(tid, "warmup_steps", self.warmup_steps, 0)
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise _fail(tid, "lr_scheduler", self.lr_scheduler, f"one of {', '.join(LR_SCHEDULERS)}")
        if self.max_grad_norm is not None:
            _check_real(tid, "max_grad_norm", self.max_grad_norm,
                        f"None or a finite number >= 0: 0 or between {_FP32_RANGE}", lambda v: v >= 0 and _fp32(v))
        _check_int(tid, "gradient_accumulation_steps", self.gradient_accumulation_steps, 1,
                   MAX_GRADIENT_ACCUMULATION_STEPS)
        if not isinstance(self.use_rslora, bool):
            raise _fail(tid, "use_rslora", self.use_rslora, "True or False")
        if self.target_modules is not None:
            if isinstance(self.target_modules, str):
                self.target_modules = (self.target_modules,)
            if type(self.target_modules).__module__ == "numpy":  # an array of names
                self.target_modules = self.target_modules.tolist()
            if not isinstance(self.target_modules, (list, tuple)):
                raise _fail(tid, "target_modules", self.target_modules, "None or a non-empty list of module names")
            mods = tuple(self.target_modules)
            if not mods or not all(isinstance(m, str) and m for m in mods):
                raise _fail(tid, "target_modules", self.target_modules, "None or a non-empty list of module names")
            self.target_modules = tuple(str(m) for m in mods)  # np.str_ -> str
        _check_int(tid, "seed", self.seed, 0, 2**63 - 1)
        if self.max_seq_len is not None:
            _check_int(tid, "max_seq_len", self.max_seq_len, 1)
        if self.base_model is not None and not (isinstance(self.base_model, str) and self.base_model):
            raise _fail(tid, "base_model", self.base_model, "None or the name of one of the sweep's bases")
        if not _fp32(self.scaling):  # alpha / rank is a kernel argument in fp32
            raise _fail(tid, "alpha", self.alpha, f"such that the scaling alpha / rank ({self.scaling:.4g}) lies "
                        f"between {_FP32_RANGE}")
        # Normalise numeric types so that equal configs compare and serialise equal.
        self.alpha = float(self.alpha)
        self.dropout = float(self.dropout)
        self.learning_rate = float(self.learning_rate)
        self.weight_decay = float(self.weight_decay)
        if self.max_grad_norm is not None:
            self.max_grad_norm = float(self.max_grad_norm)

    @property
    def scaling(self) -> float:
        """The factor on the LoRA term, as PEFT computes it."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides) -> "TrialConfig":
        """Build from a tuner's flat dict. Unknown keys are an error naming the known ones."""
        values = {**values, **overrides}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"{_who(values.get('trial_id'))}unknown TrialConfig field(s) {unknown}; "
                f"known fields are {sorted(known)}.",
                field=unknown[0],
                trial_id=values.get("trial_id"),
            )
        return cls(**values)

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["target_modules"] is not None:
            d["target_modules"] = list(d["target_modules"])
        return d


ModelSource = Union[str, Callable[[], Any]]
DataSource = Union[str, Sequence[Mapping[str, Any]], Any]


@dataclass
class JobSpec:
    """What every trial of a sweep shares: the base model, the data and the step budget's shape.

    `base_model` is a hub id, a local directory saved with `save_pretrained`, or a zero-argument
    factory returning a `PreTrainedModel` (then `tokenizer` must be given). Data rows are
    `{"prompt", "completion"}` (loss on the completion only) or `{"text"}` (loss on all of it).
    """

    base_model: ModelSource = field(metadata={"help": "Hub id, local dir, or zero-arg model factory."})
    train_data: DataSource = field(metadata={"help": "Path (.jsonl/.json), list of dicts, or datasets.Dataset."})
    eval_data: Optional[DataSource] = field(default=None, metadata={"help": "Same forms; None: no eval loss."})
    max_seq_len: int = field(default=512, metadata={"help": "Longer samples are truncated (counted, warned once)."})
    target_modules: tuple[str, ...] = field(
        default=DEFAULT_TARGET_MODULES, metadata={"help": "Linear layer names (suffixes) that get adapters."}
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto", metadata={"help": "Base weights' dtype; auto: bf16 on CUDA, fp32 on CPU."}
    )
    device: str = field(default="auto", metadata={"help": "auto: cuda if available, else cpu."})
    eval_every: int = field(default=50, metadata={"help": "Evaluate (and report) every this many steps."})
    output_dir: str = field(default="lora_sweep_runs", metadata={"help": "Adapters and checkpoints go here."})
    tokenizer: Optional[Any] = field(default=None, metadata={"help": "Tokenizer or path; None: the model's."})
    eval_batch_size: int = field(default=16, metadata={"help": "Eval rows per adapter per forward."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Cap on eval rows; None: all."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute base activations."})
    max_tokens_per_microbatch: Optional[int] = field(
        default=None, metadata={"help": "Cap on padded tokens per forward; a step above it is split into "
                                "microbatches whose gradients accumulate. None: no cap (lowered on OOM)."})
    checkpoint_every: Optional[int] = field(
        default=None, metadata={"help": "Checkpoint each adapter every this many of its steps (and on "
                                "SIGTERM) under output_dir/checkpoints; a restart resumes from there."})
    padding: Literal["auto", "packed", "longest", "max_seq_len"] = field(
        default="auto",
        metadata={"help": "packed: all samples back to back in one row, no padding (attention kept within each "
                  "sample: FlashAttention's variable-length kernel on CUDA); longest / "
                  "max_seq_len: one row per sample, padded to the microbatch's longest sample or to max_seq_len "
                  "(then an adapter's arithmetic does not depend on its pack-mates, bit for bit). "
                  "auto: packed on CUDA (max_seq_len for a model with a sliding attention window shorter "
                  "than max_seq_len, which packed rows cannot keep), longest elsewhere."},
    )
    keep_checkpoints: bool = field(
        default=False, metadata={"help": "Keep the checkpoints of trials that leave unfinished (pruned, removed "
                                 "or failed); by default they are deleted when the trial leaves."})
    quantization: Optional[Any] = field(
        default=None, metadata={"help": "The base's linear layers in bitsandbytes' 4-bit (\"nf4\", \"fp4\") or "
                                "8-bit (\"int8\") form, or a transformers BitsAndBytesConfig; adapters stay "
                                "fp32 (QLoRA). Needs `lora-sweep[quantization]`. None: as `dtype` says; a "
                                "factory's model already quantized is taken as it is."})
    cuda_graphs: Union[bool, Literal["auto"]] = field(
        default="auto", metadata={"help": "On CUDA with packed samples: True captures the training step in CUDA "
                                  "graphs and replays it (the packed row padded to one of four token counts per "
                                  "power of two); False launches every kernel from Python, nothing padded; auto "
                                  "times both on the job's first steps and keeps the one that trains more tokens "
                                  "per second."})
    shard_base: Union[bool, Literal["auto"]] = field(
        default="auto", metadata={"help": "In a job over several ranks (torchrun, device groups): True shards the "
                                  "frozen base with FSDP2, each rank holding 1/d of it; False keeps a whole copy on "
                                  "every rank, so a step sends nothing between GPUs and keeps its CUDA graphs; auto "
                                  "keeps it whole on GPUs where its weights take at most a quarter of one GPU's "
                                  "memory, else shards it (on CPU ranks, which share one memory, it shards)."})

    def __post_init__(self):
        for f in fields(self):  # NumPy / torch scalars -> Python values; data, model and tokenizer as given
            if f.name not in ("base_model", "train_data", "eval_data", "tokenizer"):
                setattr(self, f.name, _plain(getattr(self, f.name)))
        if not (isinstance(self.base_model, str) or callable(self.base_model)):
            raise _fail(None, "base_model", self.base_model, "a hub id, a local directory or a zero-arg factory")
        if self.train_data is None:
            raise _fail(None, "train_data", None, "a path, a list of dicts or a datasets.Dataset")
        _check_int(None, "max_seq_len", self.max_seq_len, 2)
        if isinstance(self.target_modules, str):
            self.target_modules = (self.target_modules,)
        if type(self.target_modules).__module__ == "numpy":  # an array of names
            self.target_modules = self.target_modules.tolist()
        self.target_modules = tuple(_plain(m) for m in self.target_modules)
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise _fail(None, "target_modules", self.target_modules, "a non-empty list of module names")
        self.target_modules = tuple(str(m) for m in self.target_modules)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise _fail(None, "dtype", self.dtype, "one of auto, float32, bfloat16, float16")
        if not isinstance(self.device, str):
            raise _fail(None, "device", self.device, "a device string such as 'auto', 'cpu' or 'cuda:0'")
        if self.max_tokens_per_microbatch is not None:
            _check_int(None, "max_tokens_per_microbatch", self.max_tokens_per_microbatch, 1)
        if self.checkpoint_every is not None:
            _check_int(None, "checkpoint_every", self.checkpoint_every, 1)
        if self.padding not in ("auto", "packed", "longest", "max_seq_len"):
            raise _fail(None, "padding", self.padding, "one of auto, packed, longest, max_seq_len")
        _check_int(None, "eval_every", self.eval_every, 1)
        q = self.quantization
        if not (q is None or (isinstance(q, str) and q in QUANTIZATIONS) or type(q).__name__ == "BitsAndBytesConfig"):
            raise _fail(None, "quantization", q, f"None, one of {', '.join(QUANTIZATIONS)}, or a BitsAndBytesConfig")
        if q is not None and callable(self.base_model):
            raise ConfigError("`quantization` applies to a base loaded from a hub id or a directory; a `base_model` "
                              "factory returns its model as it is (quantize it there).", field="quantization")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "auto"):
            raise _fail(None, "cuda_graphs", self.cuda_graphs, "True, False or 'auto'")
        if not (isinstance(self.shard_base, bool) or self.shard_base == "auto"):
            raise _fail(None, "shard_base", self.shard_base, "True, False or 'auto'")
        for flag in ("gradient_checkpointing", "keep_checkpoints"):
            if not isinstance(getattr(self, flag), bool):
                raise _fail(None, flag, getattr(self, flag), "True or False")
        if not isinstance(self.output_dir, str):
            if not isinstance(self.output_dir, os.PathLike):
                raise _fail(None, "output_dir", self.output_dir, "a directory path")
            self.output_dir = os.fspath(self.output_dir)
        _check_int(None, "eval_batch_size", self.eval_batch_size, 1)
        if self.max_eval_samples is not None:
            _check_int(None, "max_eval_samples", self.max_eval_samples, 1)

    @property
    def model_name(self) -> str:
        """A printable name of the base model, used in PEFT's `base_model_name_or_path`."""
        if isinstance(self.base_model, str):
            return self.base_model
        return getattr(self.base_model, "__name__", type(self.base_model).__name__)


def shards_base(shard_base: Union[bool, str], weight_bytes: float, device_memory_bytes: Optional[float]) -> bool:
    """Whether a job over several ranks shards its frozen base (`JobSpec.shard_base`):
    "auto" shards unless the weights take at most `REPLICATED_BASE_MAX_SHARE` of one GPU's
    memory; `device_memory_bytes` is None for CPU ranks, which share one memory: they shard."""
    if shard_base != "auto":
        return bool(shard_base)
    return device_memory_bytes is None or weight_bytes > REPLICATED_BASE_MAX_SHARE * device_memory_bytes


def named_bases(spec: Union[JobSpec, Mapping[str, JobSpec]]) -> dict[str, JobSpec]:
    """A sweep's bases by name, as the integrations take them: one `JobSpec` is a single base
    named by its model (`JobSpec.model_name`); a mapping names each. A trial picks one with
    `TrialConfig.base_model` (the first when it names none)."""
    if isinstance(spec, JobSpec):
        return {spec.model_name: spec}
    if isinstance(spec, Mapping) and spec and all(isinstance(k, str) and k and isinstance(v, JobSpec)
                                                  for k, v in spec.items()):
        return dict(spec)
    raise TypeError(f"The value of `spec` is {spec!r}, but must be a lora_sweep.JobSpec or a non-empty dict of "
                    "base name -> JobSpec.")


def base_of(cfg: TrialConfig, bases: Mapping[str, JobSpec]) -> str:
    """The name of the base `cfg` trains on among `bases`; a name not among them is the
    trial's `ConfigError`."""
    if cfg.base_model is None:
        return next(iter(bases))
    if cfg.base_model not in bases:
        raise _fail(cfg.trial_id, "base_model", cfg.base_model, f"None or one of the sweep's bases {list(bases)}")
    return cfg.base_model


def check_against_model(cfg: TrialConfig, spec: JobSpec, module_shapes: Mapping[str, tuple[int, int]]) -> None:
    """Checks that need the model. `module_shapes` maps each adaptable module suffix to the
    smallest (in_features, out_features) seen under that name."""
    tid = cfg.trial_id
    wanted = cfg.target_modules or spec.target_modules
    allowed = [m for m in spec.target_modules if m in module_shapes]
    missing = [m for m in wanted if m not in allowed]
    if missing:
        raise _fail(
            tid, "target_modules", list(wanted),
            f"a subset of the job's adapted linear layers {allowed}"
            + (f" (not found or not targeted: {missing})" if missing else ""),
        )
    if cfg.max_seq_len is not None and cfg.max_seq_len > spec.max_seq_len:
        raise _fail(tid, "max_seq_len", cfg.max_seq_len, f"None or an integer with 1 <= `max_seq_len` <= "
                    f"{spec.max_seq_len} (the job's)")
    smallest = min(min(module_shapes[m]) for m in wanted)
    if cfg.rank > smallest:
        raise _fail(tid, "rank", cfg.rank, f"an integer with 1 <= `rank` <= {smallest} "
                    "(the smallest in/out dimension of the targeted layers)")
