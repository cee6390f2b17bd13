"""What AutoVM did: the plan, predicted against measured, and its figures.

Memory words, as everywhere in AutoVM: the **budget** is what the user gave,
the **headroom** the share of it kept free, the **limit** (budget less
headroom) what a plan must fit.
"""

import json
import os
import warnings

from keras_autovm import plots
from keras_autovm.planner import format_bytes
from keras_autovm.planner import overhead_text

UNCALIBRATED = "uncalibrated: default device figures"


class Report:
    """The end-of-training report of an `AutoVM` callback.

    Args:
        plan: the last `keras_autovm.Plan` applied.
        epochs: one dict per epoch (`epoch_record`).
        budget: the budget in bytes, as the user gave it.
        stats: counts of what the mechanism carried out (segments run and
            replayed, traces checkpointed).
        model_name: the model's name, for the figures' titles. Defaults to
            `None`.
        backend: the Keras backend, for the figures' titles. Defaults to
            `None`.
    """

    def __init__(self, plan, epochs, budget, stats=None, model_name=None,
                 backend=None):
        self.plan = plan
        self.epochs = list(epochs)
        self.budget = budget
        self.stats = dict(stats or {})
        self.model_name = model_name
        self.backend = backend

    @property
    def headroom(self):
        """The share of the budget kept free."""
        return self.plan.headroom

    @property
    def limit(self):
        """The bytes the plan had to fit: the budget less the headroom."""
        return self.plan.budget

    def to_dict(self):
        """The report as JSON-serialisable data."""
        return {"model": self.model_name, "backend": self.backend,
                "budget_bytes": self.budget, "headroom": self.headroom,
                "limit_bytes": self.limit, "plan": self.plan.to_dict(),
                "epochs": self.epochs, "stats": self.stats}

    def summary(self, print_fn=print):
        """Prints the plan table and the line of each epoch, as printed
        during training."""
        print_fn("AutoVM report")
        self.plan.summary(print_fn=print_fn)
        for record in self.epochs:
            print_fn(epoch_line(record))

    def save(self, directory):
        """Writes `report.json`, `timeline.png` and `layers.png` into
        `directory` (the figures only where matplotlib is installed)."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "report.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        try:
            self.plot(os.path.join(directory, "timeline.png"))
            self.plot_layers(os.path.join(directory, "layers.png"))
        except ImportError as error:
            warnings.warn(f"AutoVM wrote no figures: {error}", stacklevel=2)

    def title(self):
        """Model, batch size, backend and policy, for figure titles."""
        parts = [self.model_name or "model",
                 f"batch size {self.plan.graph.batch_size}"]
        if self.backend:
            parts.append(self.backend)
        return ", ".join(parts + [f"policy {self.plan.policy}"])

    def measured_peak(self):
        """The highest peak the backend measured, or `None` (no GPU)."""
        peaks = [r["peak_bytes"] for r in self.epochs if r.get("peak_bytes")]
        return max(peaks) if peaks else None

    def plot(self, path=None):
        """Plots predicted device memory over one step: the budget, the
        headroom and the limit, forward and backward phases, and the
        measured peak where the backend measures it.

        Args:
            path: where to save a PNG; `None` returns the figure (for
                notebooks). Defaults to `None`.

        Returns:
            The matplotlib figure.
        """
        # XLA offers no reset: JAX's peak is the process's since it started.
        label = ("measured peak (the process's so far)" if self.backend == "jax"
                 else "measured peak")
        return plots.timeline(self.plan, self.budget, self.measured_peak(),
                              self.title(), path, peak_label=label)

    def plot_layers(self, path=None):
        """Plots, per layer output, its bytes and its action (keep, swap,
        recompute).

        Args:
            path: where to save a PNG; `None` returns the figure. Defaults
                to `None`.

        Returns:
            The matplotlib figure.
        """
        return plots.layers(self.plan, self.title(), path)


def epoch_record(epoch, epochs, plan, steps, step_time, peak_bytes, forward_time=None):
    """What one epoch measured against what its plan predicted.

    Args:
        epoch: Keras's 0-based epoch index (recorded 1-based, as Keras
            prints it).
        epochs: the epochs `fit` runs, or `None`.
        plan: the `Plan` in force during the epoch.
        steps: training steps run.
        step_time: the measured median step time in seconds, or `None`.
        peak_bytes: the measured device peak, or `None`.
        forward_time: the measured median forward pass in seconds, or
            `None` where the backend cannot see it apart (`Mechanism.forward_seconds`).

    Returns:
        A JSON-serialisable dict.
    """
    r = plan.result
    per_step = r.d2h_bytes + r.h2d_bytes
    return {"epoch": epoch + 1, "epochs": epochs, "policy": plan.policy,
            "batch_size": plan.graph.batch_size, "steps": steps,
            "step_time": step_time, "predicted_step_time": r.step_time,
            "forward_time": forward_time, "predicted_forward_time": r.forward_time,
            "calibrated": plan.calibrated, "peak_bytes": peak_bytes,
            "predicted_peak_bytes": r.peak_bytes,
            "budget_bytes": plan.device_budget, "headroom": plan.headroom,
            "memory_scale": plan.memory_scale, "memory_extra": plan.memory_extra,
            "limit_bytes": plan.budget,
            "planned_host_bytes_per_step": per_step,
            "planned_host_bytes_per_epoch": per_step * steps,
            "replanned": False}


def epoch_line(record):
    """One line on what an epoch measured against its plan's prediction."""
    def ms(seconds):
        return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
    of = f"/{record['epochs']}" if record.get("epochs") else ""
    predicted = ms(record["predicted_step_time"]) + " predicted"
    if not record.get("calibrated"):
        predicted += f" ({UNCALIBRATED})"
    peak = record.get("peak_bytes")
    peak = "n/a (no GPU)" if peak is None else format_bytes(peak)
    limit = record.get("limit_bytes")
    memory = "no limit" if limit is None else f"limit {format_bytes(limit)}"
    if limit is not None and record.get("budget_bytes") is not None:
        overhead = overhead_text(record.get("memory_scale", 1.0),
                                 record.get("memory_extra", 0))
        memory += (f" (budget {format_bytes(record['budget_bytes'])} less "
                   f"{record['headroom'] * 100:g}% headroom"
                   + (f", allowing a measured overhead of {overhead}" if overhead else "")
                   + ")")
    return (f"AutoVM epoch {record['epoch']}{of}: {record['policy']}; step "
            f"{ms(record['step_time'])} measured, {predicted}; peak {peak} "
            f"measured, {format_bytes(record['predicted_peak_bytes'])} "
            f"predicted, {memory}; planned host traffic "
            f"{format_bytes(record['planned_host_bytes_per_step'])} per step, "
            f"{format_bytes(record['planned_host_bytes_per_epoch'])} per epoch"
            + ("; replanned" if record.get("replanned") else ""))
