"""lora_sweep: train many LoRA hyperparameter trials packed onto one shared base model.

    import lora_sweep as ls
    job = ls.PackedJob(spec, [ls.TrialConfig(rank=8), ls.TrialConfig(rank=16)])
    for event in job.run():    # ls.Report / ls.Finished / ls.Failed
        print(event)
"""

from .config import ConfigError, JobSpec, TrialConfig
from .costmodel import CostModel, calibrate, detect, profile_job
from .engine import Failed, Finished, PackedJob, Report
from .planner import FailedTrial, Plan, PlannedJob, admit, pack_microbatches, plan

__all__ = [
    "ConfigError", "JobSpec", "TrialConfig",
    "PackedJob", "Report", "Finished", "Failed",
    "plan", "Plan", "PlannedJob", "FailedTrial", "admit", "pack_microbatches",
    "CostModel", "calibrate", "detect", "profile_job",
]
__version__ = "0.1.0"
