"""Cost models from what was measured on this machine.

The link bandwidths, from the native helper's `link_probe` when a GPU and
the helper are there, and from the backend's own pinned copies
(`Mechanism.measure_link`); otherwise the planner's defaults. Layer times
are measured by `keras_autovm.profiling`. Compute times are matched to
measured steps between epochs (`scaled_to_step`).
"""

import functools
import math
import warnings

from keras_autovm import planner


def measured_cost(mechanism):
    """A cost model whose link bandwidths were measured on this GPU.

    With a GPU and the native helper, the link is probed once per process
    (small buffers, well inside free memory), and the figures of the link
    the mechanism's swaps use are taken (`mechanism.copy_link`: pinned
    copies, or managed-memory page moves). Otherwise the defaults.
    """
    if not mechanism.gpu_available():
        return planner.CostModel()
    probe = _link_probe()
    if probe is None:
        return planner.CostModel()
    return cost_from_probe(probe, mechanism.copy_link)


def cost_from_probe(probe, link):
    """A `CostModel` with the median bandwidths of a native `link_probe`.

    Args:
        probe: the dict `keras_autovm.native.helper.link_probe()` returns.
        link: `"pinned"` or `"managed_prefetch"`.
    """
    return planner.CostModel(
        d2h_bytes_per_s=probe[f"{link}_d2h"]["median"] * 1e9,
        h2d_bytes_per_s=probe[f"{link}_h2d"]["median"] * 1e9, link_measured=True)


def measure_link(mechanism):
    """GB/s of each link figure measured on this GPU: the native probe's
    medians (pinned and managed-memory moves), then the backend's own pinned
    copies, both ways and both at once, which take precedence; `{}` without
    a GPU."""
    if not mechanism.gpu_available():
        return {}
    link = {}
    probe = _link_probe()
    for key, value in (probe or {}).items():
        if isinstance(value, dict) and "median" in value:
            link[key] = value["median"]
        elif key == "managed_first_eviction":  # One figure, GB/s too.
            link[key] = value
    link.update(mechanism.measure_link() or {})
    return link


@functools.lru_cache(maxsize=None)
def _link_probe():
    from keras_autovm import native
    if not native.available():
        return None
    try:
        return native.helper.link_probe(nbytes=64 << 20, repeats=3, device=0)
    except RuntimeError as error:
        warnings.warn(f"AutoVM could not probe the GPU link, so it plans with "
                      f"default bandwidths: {error}", stacklevel=3)
        return None


def scaled_to_step(cost, result, step, forward, tolerance):
    """`cost` with its compute times matched to a measured `step` time
    (seconds), where the prediction (`result`, a `SimResult`) is off by
    `tolerance` (a ratio) or more.

    Where the `forward` pass is measured apart (torch), the forward's times
    are scaled to it alone: a layer timed alone shows its kernels but not
    the Python an eager forward runs around it (ResNet-152 on an H100: the
    layers' forwards summed to 0.23 s, the step's forward took 0.43 s; their
    backwards 0.16 s against 0.13 s). The rest of the step then scales the
    backward, unless the plan copies tensors back in it: how long that
    backward waits for its copies is the plan's to predict, and a scale
    learnt from it would hide the copies behind a backward that is not
    there (docs/results.md).
    """
    def off(ratio):
        return abs(math.log(ratio)) >= math.log(tolerance)

    if not step:
        return cost
    # The forward's waits for the link are the plan's, not compute.
    waited = result.d2h_wait_time
    computed = result.forward_time - waited
    if not forward or not 0 < forward - waited < step or computed <= 0:
        ratio = step / max(result.step_time, 1e-12)
        return cost.scaled(ratio) if off(ratio) else cost
    ratio = (forward - waited) / computed
    predicted_rest = result.step_time - result.forward_time
    if off(ratio):
        cost = cost.scaled_forward(ratio)
        # Recomputation is forward work done in the backward.
        predicted_rest += (ratio - 1) * result.recompute_time
    if result.h2d_bytes or predicted_rest <= 0:
        return cost
    rest = (step - forward) / predicted_rest
    if off(rest):
        # `time_scale` scales both phases; the forward keeps its own.
        cost = cost.scaled(rest).scaled_forward(1 / rest)
    return cost


def median(values):
    """The median of measured `values`, or `None` if there are none or any
    is `None` (not measured)."""
    if not values or any(v is None for v in values):
        return None
    return sorted(values)[len(values) // 2]
