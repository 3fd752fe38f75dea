"""lora_sweep: train many LoRA hyperparameter trials packed onto one shared base model.

    import lora_sweep as ls
    job = ls.PackedJob(spec, [ls.TrialConfig(rank=8), ls.TrialConfig(rank=16)])
    for event in job.run():    # ls.Report / ls.Finished / ls.Failed
        print(event)

Only the configs load on import; the engine (torch, transformers) and the planner load on
first use, so light processes such as Ray Tune's trial proxies stay light.
"""

import importlib

from .config import ConfigError, JobSpec, TrialConfig

_LAZY = {
    "PackedJob": "engine", "Report": "engine", "Finished": "engine", "Failed": "engine",
    "plan": "planner", "Plan": "planner", "PlannedJob": "planner", "FailedTrial": "planner",
    "admit": "planner", "pack_microbatches": "planner",
    "CostModel": "costmodel", "calibrate": "costmodel", "detect": "costmodel", "profile_job": "costmodel",
}

__all__ = ["ConfigError", "JobSpec", "TrialConfig", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'lora_sweep' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
