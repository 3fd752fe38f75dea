"""Loss curves of a sweep: every trial's train and eval loss against its steps, in one PNG.

A sweep is read as curves: which learning rates diverge, which still fall at the last step.

    curves = LossCurves()
    for event in job.run():
        curves.add(event)           # keeps the Reports, ignores the rest
    curves.save("lora_sweep_runs/demo/loss_curves.png")
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any


class LossCurves:
    """The `train_loss` and `eval_loss` of every trial's reports, by step."""

    def __init__(self):
        self.points: dict[str, list[tuple[int, dict]]] = defaultdict(list)  # trial_id -> [(step, metrics)]

    def add(self, event: Any) -> None:
        """Record an engine `Report` (other events are ignored)."""
        from .engine import Report

        if isinstance(event, Report):
            self.points[event.trial_id].append((event.step, event.metrics))

    def save(self, path: str) -> str:
        """Draw train loss (left) and eval loss (right, if the job has eval data) against steps,
        one line per trial in the same colour on both sides, and save a PNG.

        Args:
            path:
                Where to write the image (its folder is created).

        Returns:
            `path`.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        metrics = [m for m in ("train_loss", "eval_loss")
                   if any(m in values for points in self.points.values() for _, values in points)]
        fig, axes = plt.subplots(1, max(1, len(metrics)), figsize=(5.5 * max(1, len(metrics)), 4), squeeze=False)
        colors = plt.get_cmap("tab20").colors
        for ax, metric in zip(axes[0], metrics):
            for k, (trial_id, points) in enumerate(sorted(self.points.items())):
                steps = [step for step, values in points if metric in values]
                losses = [values[metric] for _, values in points if metric in values]
                ax.plot(steps, losses, marker=".", color=colors[k % len(colors)], label=trial_id)
            ax.set_xlabel("step")
            ax.set_ylabel(metric.replace("_", " "))
            ax.grid(alpha=0.3)
        if len(self.points) <= 20:  # beyond that a legend hides the curves
            axes[0][-1].legend(fontsize=7, loc="upper right")
        fig.suptitle(f"{len(self.points)} trials", fontsize=9)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
