"""The report's figures: memory over one step, and bytes and action per layer.

matplotlib is imported when a figure is drawn, not with the package. Given
a path, a figure is saved as a PNG (with the Agg backend, no display
needed); either way it is returned, which a notebook shows inline.
"""

from keras_autovm.planner import overhead_text

_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
# One colour per action, the same in both figures.
ACTION_COLORS = {"keep": "tab:blue", "swap": "tab:orange",
                 "recompute": "tab:green"}


def byte_unit(largest):
    """The binary unit whose numbers stay readable up to `largest` bytes:
    `(name, bytes)`."""
    return next(((name, size) for name, size in _BYTE_UNITS
                 if largest >= size), _BYTE_UNITS[-1])


def time_unit(largest):
    """The unit of seconds that suits `largest` seconds: `(name, seconds)`."""
    return next(((name, size) for name, size in _TIME_UNITS
                 if largest >= size), _TIME_UNITS[-1])


def timeline(plan, budget, measured_peak, title, path=None,
             peak_label="measured peak"):
    """Predicted device memory over one training step.

    Args:
        plan: the `Plan`; its `budget` is the limit.
        budget: the user's budget in bytes, or `None`.
        measured_peak: the peak the backend measured, or `None`.
        title: the figure's title.
        path: where to save a PNG, or `None`. Defaults to `None`.
        peak_label: the legend's words for `measured_peak`. Defaults to
            `"measured peak"`.

    Returns:
        The matplotlib figure.
    """
    plt = _pyplot(path)
    result = plan.result
    times, used = zip(*result.timeline)
    levels = [b for b in (budget, plan.budget, measured_peak, max(used))
              if b is not None]
    unit, size = byte_unit(max(levels))
    tname, tsize = time_unit(max(times[-1], result.step_time))
    fig, ax = plt.subplots(figsize=(10, 4))
    _phases(ax, result.op_events, tsize)
    ax.step([t / tsize for t in times], [b / size for b in used], where="post",
            color="tab:blue", label=f"predicted ({plan.policy})")
    if budget is not None:
        ax.axhline(budget / size, color="tab:red", ls="--", label="budget")
    if plan.budget is not None:
        ax.axhline(plan.budget / size, color="tab:orange", ls="-",
                   label="limit (budget less headroom)")
        if budget is not None and budget > plan.budget:
            overhead = overhead_text(plan.memory_scale, plan.memory_extra)
            ax.axhspan(plan.budget / size, budget / size, color="tab:red",
                       alpha=0.12, label=f"headroom ({plan.headroom * 100:g}%)"
                       + (f" and a measured overhead of {overhead}" if overhead else ""))
    if measured_peak is not None:
        ax.axhline(measured_peak / size, color="black", ls=":", label=peak_label)
    ax.set_ylim(0, max(levels) / size * 1.08)
    ax.set_xlabel(f"time in one training step ({tname}, predicted)")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title)
    # Outside the axes, so that it hides no line.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _finish(plt, fig, path)


def layers(plan, title, path=None):
    """Bytes of each layer output, coloured by the plan's action.

    Args:
        plan: the `Plan`.
        title: the figure's title.
        path: where to save a PNG, or `None`. Defaults to `None`.

    Returns:
        The matplotlib figure.
    """
    plt = _pyplot(path)
    tensors = plan.graph.tensors
    unit, size = byte_unit(max((t.nbytes for t in tensors), default=1))
    actions = [plan.actions.get(t.name, "keep") for t in tensors]
    fig, ax = plt.subplots(figsize=(max(6, min(16, 0.3 * len(tensors) + 3)), 4))
    ax.bar(range(len(tensors)), [t.nbytes / size for t in tensors],
           color=[ACTION_COLORS[a] for a in actions])
    from matplotlib.patches import Patch
    legend = [Patch(color=color, label=f"{action} ({actions.count(action)})")
              for action, color in ACTION_COLORS.items()]
    if len(tensors) <= 60:  # Beyond that the names are unreadable.
        ax.set_xticks(range(len(tensors)))
        ax.set_xticklabels([t.name for t in tensors], rotation=90,
                           fontsize="small")
    ax.set_xlabel("layer output, in forward order")
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_title(title)
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize="small")
    return _finish(plt, fig, path)


def _phases(ax, events, tsize):
    """Shades the forward and the backward part of the step."""
    for phase, label, color in (("fwd", "forward", "tab:cyan"),
                                ("bwd", "backward", "tab:purple")):
        spans = [(e.start, e.end) for e in events
                 if e.phase == phase or (phase == "bwd" and e.phase == "recompute")]
        if spans:
            ax.axvspan(min(s for s, _ in spans) / tsize,
                       max(e for _, e in spans) / tsize,
                       color=color, alpha=0.08, label=label)


def _pyplot(path):
    import matplotlib
    if path:
        matplotlib.use("Agg")
    from matplotlib import pyplot
    return pyplot


def _finish(plt, fig, path):
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    # Closed for pyplot, so that a notebook shows the returned figure once
    # (not again at the cell's end) and no figure piles up.
    plt.close(fig)
    return fig
