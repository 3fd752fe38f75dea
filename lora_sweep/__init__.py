"""lora_sweep: train many LoRA hyperparameter trials packed onto one shared base model."""

from .config import ConfigError, JobSpec, TrialConfig

__all__ = ["ConfigError", "JobSpec", "TrialConfig"]
__version__ = "0.1.0"
