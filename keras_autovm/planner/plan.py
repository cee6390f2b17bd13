"""A plan: one action per tagged tensor, prefetch triggers, and its forecast.

Pure data, no framework imports.
"""

import dataclasses

from .graph import ACTIONS

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n):
    """Formats a byte count in binary units with two decimals.

    Args:
        n: number of bytes.

    Returns:
        A string such as `"1.50 GiB"`, `"12.00 MiB"` or `"512 B"`.
    """
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


class PlanError(ValueError):
    """No plan fits the memory budget.

    Args:
        message: what failed; the smallest feasible budget is appended.
        min_budget: the smallest budget, in bytes, that a plan reaches.

    Attributes:
        min_budget: as given.
    """

    def __init__(self, message, min_budget):
        self.min_budget = int(min_budget)
        super().__init__(
            f"{message} The smallest feasible budget is "
            f"{format_bytes(self.min_budget)} ({self.min_budget} bytes)."
        )


@dataclasses.dataclass
class Plan:
    """What to do with every tagged tensor, and what that is predicted to cost.

    Args:
        graph: the `Graph` planned for.
        actions: dict tensor name -> `"keep"`, `"swap"` or `"recompute"`,
            one entry per tensor of the graph.
        prefetch: dict swapped tensor name -> op name whose backward start
            triggers the copy back to the device.
        policy: name of the policy that made the plan.
        budget: the limit in bytes the predicted peak had to fit, or `None`
            for no limit. Planned through `keras_autovm.plan()` or `AutoVM`,
            it is the user's budget less the headroom.
        cost: the `CostModel` used.
        result: the `SimResult` of simulating the plan.
        notes: list of strings: what is not managed and why.
        segments: tuple of tuples of op names, in forward order: chains the
            backward replays as a whole (recompute policies). Defaults to
            `()`.
        device_budget: the budget the user gave, in bytes, when the limit
            was derived from it; else `None`. Defaults to `None`.
        headroom: the share of `device_budget` kept free, when given.
            Defaults to `None`.
        memory_scale: how much more memory than predicted plans were
            measured to use; the limit is the budget less the headroom,
            divided by it. Defaults to `1.0`.
        memory_extra: the bytes beyond its prediction a plan was measured
            to use; the limit is then the budget less the headroom, less
            it, where that leaves less. Defaults to `0`.
        unchanged: whether the step runs as the framework runs it, with no
            hook of AutoVM's: a `keep_all` plan that fits holding every
            layer output (`CostModel.holds_outputs`: torch), or, on JAX, a
            plan keeping everything whose compiled step fits by XLA's memory
            analysis (set when the step is traced). Defaults to `False`.
        refused: the `PlanError` of a budget no plan meets by the
            planner's model of memory, carried by a keep-all plan whose
            step the mechanism measures by the framework's own figure
            before it runs (`Mechanism.checks_own_step`: JAX, by XLA's
            memory analysis); raised then unless that step fits. `None`
            otherwise. Defaults to `None`.
        region_runs: whether the plan's recompute units are runs of regions
            between cuts of the forward pass (`units.region_units`), which
            the backend makes again by name (JAX under jit); such a plan
            has no `segments`. Defaults to `False`.
    """

    graph: object
    actions: dict
    prefetch: dict
    policy: str
    budget: object
    cost: object
    result: object
    notes: list = dataclasses.field(default_factory=list)
    segments: tuple = ()
    device_budget: int = None
    headroom: float = None
    memory_scale: float = 1.0
    memory_extra: int = 0
    unchanged: bool = False
    refused: object = None
    region_runs: bool = False

    @property
    def fits(self):
        """Whether the predicted peak is within the limit."""
        return self.budget is None or self.result.peak_bytes <= self.budget

    @property
    def calibrated(self):
        """Whether the predicted times rest on measurements of this run:
        compute times matched to a measured step, or measured op times.
        Until then they come from the default device figures."""
        return self.cost.time_scale != 1.0 or self.cost.fwd_scale != 1.0 or any(
            op.fwd_time is not None for op in self.graph.ops)

    def counts(self):
        """Returns a dict action -> number of tensors given that action."""
        counts = {action: 0 for action in ACTIONS}
        for action in self.actions.values():
            counts[action] += 1
        return counts

    def summary(self, print_fn=print, line_length=98):
        """Prints one row per tagged tensor and the predicted costs.

        Args:
            print_fn: function called with each line. Defaults to `print`.
            line_length: total width of the table. Defaults to `98`.
        """
        widths = _column_widths(line_length)
        print_fn("=" * line_length)
        print_fn(_row(("Tensor", "Layer", "Bytes", "Action", "Prefetch at",
                       "Stall"), widths))
        print_fn("-" * line_length)
        stalls = self.result.stalls
        for t in self.graph.tensors:
            action = self.actions.get(t.name, "keep")
            stall = stalls.get(t.name)
            print_fn(_row((t.name, t.producer, format_bytes(t.nbytes), action,
                           self.prefetch.get(t.name, "-"),
                           _format_time(stall) if stall else "-"), widths))
        print_fn("=" * line_length)
        for line in self._footer():
            print_fn(line)
        print_fn("=" * line_length)

    def _footer(self):
        r = self.result
        counts = ", ".join(f"{n} {a}" for a, n in self.counts().items())
        times = (f"Predicted step time: {_format_time(r.step_time)} "
                 f"(recompute {_format_time(r.recompute_time)}, "
                 f"stall {_format_time(r.stall_time)})")
        if not self.calibrated:
            times += "; uncalibrated: default device figures"
        lines = [
            f"Policy: {self.policy} ({counts})",
            "Memory: " + memory_line(self.device_budget, self.headroom, self.budget,
                                     self.memory_scale, self.memory_extra),
            f"Predicted peak: {format_bytes(r.peak_bytes)}"
            + ("" if self.fits else "  (over the limit)"),
            times,
            f"Host traffic per step: {format_bytes(r.d2h_bytes)} to host, "
            f"{format_bytes(r.h2d_bytes)} to device",
            f"Costs: {self.cost_source()}",
        ]
        return lines + [f"Note: {note}" for note in self.notes]

    def cost_source(self):
        """Where the predicted times come from: `"measured"` layer times or
        the `"roofline (uncalibrated)"` estimate, and the link's."""
        timed = sum(op.fwd_time is not None for op in self.graph.ops)
        if timed == len(self.graph.ops) and timed:
            compute = "measured"
        elif timed:
            compute = f"measured ({timed} of {len(self.graph.ops)} layers, the rest roofline)"
        elif self.cost.time_scale != 1.0 or self.cost.fwd_scale != 1.0:
            compute = "roofline scaled to measured steps"
        else:
            compute = "roofline (uncalibrated)"
        link = "measured" if self.cost.link_measured else "default bandwidths"
        return f"compute {compute}, link {link}"

    def to_dict(self):
        """Returns the plan and its forecast as JSON-serialisable data."""
        r = self.result
        return {
            "policy": self.policy,
            "budget_bytes": self.device_budget,
            "headroom": self.headroom,
            "memory_scale": self.memory_scale,
            "memory_extra": self.memory_extra,
            "limit_bytes": self.budget,
            "fits": self.fits,
            "unchanged": self.unchanged,
            "refused": None if self.refused is None else str(self.refused),
            "region_runs": self.region_runs,
            "calibrated": self.calibrated,
            "counts": self.counts(),
            "tensors": [
                {"name": t.name, "layer": t.producer, "nbytes": t.nbytes,
                 "action": self.actions.get(t.name, "keep"),
                 "prefetch": self.prefetch.get(t.name),
                 "stall_time": r.stalls.get(t.name, 0.0)}
                for t in self.graph.tensors
            ],
            "segments": [list(s) for s in self.segments],
            "notes": list(self.notes),
            "predicted": {
                "peak_bytes": r.peak_bytes,
                "peak_time": r.peak_time,
                "peak_live": [list(x) for x in r.peak_live],
                "step_time": r.step_time,
                "compute_time": r.compute_time,
                "recompute_time": r.recompute_time,
                "stall_time": r.stall_time,
                "d2h_wait_time": r.d2h_wait_time,
                "d2h_bytes": r.d2h_bytes,
                "h2d_bytes": r.h2d_bytes,
            },
            "cost": dataclasses.asdict(self.cost),
            "cost_source": self.cost_source(),
            "batch_size": self.graph.batch_size,
            "persistent_bytes": self.graph.persistent_bytes,
        }


def overhead_text(memory_scale=1.0, memory_extra=0):
    """The measured memory overhead a limit allows for, in words: `"1.43x"`,
    `"2.94 GiB"`, `"1.43x or 2.94 GiB, whichever leaves less"`, or `""`
    for none."""
    parts = ([f"{memory_scale:.2f}x"] if memory_scale != 1.0 else []) + (
        [format_bytes(memory_extra)] if memory_extra else [])
    return " or ".join(parts) + (", whichever leaves less" if len(parts) > 1 else "")


def memory_line(budget, headroom, limit, memory_scale=1.0, memory_extra=0):
    """Names the three memory figures: the budget the user gave, the
    headroom kept free of it, and the limit a plan must fit.

    Args:
        budget: the user's budget in bytes, or `None` when the limit was
            given directly.
        headroom: the share of `budget` kept free, or `None`.
        limit: the limit in bytes, or `None` for no limit.
        memory_scale: the measured memory overhead the limit was divided
            by (`1.0`: none).
        memory_extra: the measured overhead in bytes the limit was
            lowered by, where that left less (`0`: none).

    Returns:
        A string such as `"budget 6.00 MiB, headroom 15% (921.60 KiB),
        limit 5.10 MiB"`.
    """
    if limit is None:
        return "no limit"
    if budget is None:
        return f"limit {format_bytes(limit)}"
    overhead = overhead_text(memory_scale, memory_extra)
    overhead = f", measured overhead {overhead}" if overhead else ""
    return (f"budget {format_bytes(budget)}, headroom {headroom * 100:g}% "
            f"({format_bytes(budget * headroom)}){overhead}, "
            f"limit {format_bytes(limit)}")


def _column_widths(line_length):
    # Tensor, layer, bytes, action, prefetch at, stall.
    shares = (0.24, 0.22, 0.12, 0.11, 0.19, 0.12)
    widths = [max(6, int(line_length * s)) for s in shares]
    widths[0] += max(0, line_length - sum(widths))
    return widths


def _row(cells, widths):
    parts = []
    for cell, width in zip(cells, widths):
        text = str(cell)
        if len(text) >= width:
            text = text[: width - 2] + "…"
        parts.append(text.ljust(width))
    return "".join(parts).rstrip()


def _format_time(seconds):
    if seconds == 0:
        return "0 s"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"
