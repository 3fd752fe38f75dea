"""lora_sweep: train many LoRA hyperparameter trials packed onto one shared base model.

    import lora_sweep as ls
    job = ls.PackedJob(spec, [ls.TrialConfig(rank=8), ls.TrialConfig(rank=16)])
    for event in job.run():    # ls.Report / ls.Finished / ls.Failed
        print(event)
"""

from .config import ConfigError, JobSpec, TrialConfig
from .engine import Failed, Finished, PackedJob, Report

__all__ = ["ConfigError", "JobSpec", "TrialConfig", "PackedJob", "Report", "Finished", "Failed"]
__version__ = "0.1.0"
