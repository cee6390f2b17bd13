"""What AutoVM did: the plan, predicted against measured, and a memory plot."""

import json
import os

from keras_autovm.planner import format_bytes


class Report:
    """The end-of-training report of an `AutoVM` callback.

    Args:
        plan: the last `keras_autovm.Plan` applied.
        epochs: one dict per epoch of measurements (step time, peak bytes).
        budget: the budget in bytes.
        stats: counts of what the mechanism carried out (segments run and
            replayed, traces checkpointed).
    """

    def __init__(self, plan, epochs, budget, stats=None):
        self.plan = plan
        self.epochs = list(epochs)
        self.budget = budget
        self.stats = dict(stats or {})

    def to_dict(self):
        """The report as JSON-serialisable data."""
        return {"budget_bytes": self.budget, "plan": self.plan.to_dict(),
                "epochs": self.epochs, "stats": self.stats}

    def summary(self, print_fn=print):
        """Prints the plan table and predicted against measured figures."""
        print_fn("AutoVM report")
        self.plan.summary(print_fn=print_fn)
        for record in self.epochs:
            print_fn(epoch_line(record, self.budget))

    def save(self, directory):
        """Writes `report.json` and `timeline.png` into `directory`."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "report.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        self.plot(os.path.join(directory, "timeline.png"))

    def plot(self, path=None):
        """Plots predicted device memory over one step against the budget.

        Args:
            path: where to save a PNG; `None` returns the figure (for
                notebooks). Defaults to `None`.

        Returns:
            The matplotlib figure.
        """
        import matplotlib
        if path:
            matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        times, used = zip(*self.plan.result.timeline)
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.step([t * 1e3 for t in times], [b / 2**30 for b in used], where="post",
                label=f"predicted ({self.plan.policy})")
        ax.axhline(self.budget / 2**30, color="red", ls="--", label="budget")
        peaks = [r["peak_bytes"] for r in self.epochs if r.get("peak_bytes")]
        if peaks:
            ax.axhline(max(peaks) / 2**30, color="black", ls=":", label="measured peak")
        ax.set_xlabel("time in one training step (ms, predicted)")
        ax.set_ylabel("device memory (GiB)")
        ax.legend(loc="upper right")
        fig.tight_layout()
        if path:
            fig.savefig(path, dpi=100)
            plt.close(fig)
        return fig


def epoch_line(record, budget):
    """One line on what an epoch measured."""
    def ms(seconds):
        return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
    peak = record.get("peak_bytes")
    peak = "n/a (no GPU)" if peak is None else format_bytes(peak)
    return (f"AutoVM epoch {record['epoch'] + 1}: {record['policy']}, step "
            f"{ms(record['step_time'])} measured / {ms(record['predicted_step_time'])} "
            f"predicted, peak {peak} measured / "
            f"{format_bytes(record['predicted_peak_bytes'])} predicted, budget "
            f"{format_bytes(budget)}, planned host traffic "
            f"{format_bytes(record['planned_bytes_moved'])}"
            + (", replanned" if record.get("replanned") else ""))
