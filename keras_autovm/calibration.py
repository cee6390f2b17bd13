"""Cost models from what was measured on this machine.

The link bandwidths, from the native helper's `link_probe` when a GPU and
the helper are there, and from the backend's own pinned copies
(`Mechanism.measure_link`); otherwise the planner's defaults. Layer times
are measured by `keras_autovm.profiling`.
"""

import functools
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
