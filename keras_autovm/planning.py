"""`plan()`: a dry run of AutoVM's planning for a model, before training."""

import functools
import math
import numbers
import warnings

from keras_autovm import graph as graph_lib
from keras_autovm import mechanisms
from keras_autovm import planner
from keras_autovm.budget import parse_budget


# Share of the budget kept free for what the planner does not model: the
# framework's scratch buffers and fragmentation. Measured on VGG-19 with JAX
# (results/gpu_vgg19_memory.json), XLA assigned 7% to 18% more than planned.
DEFAULT_HEADROOM = 0.15


def plan(model, batch_size, budget=None, policy="auto", cost=None,
         headroom=DEFAULT_HEADROOM):
    """Plans which layer outputs to keep, swap to host or recompute.

    A dry run: nothing is trained and the model is not changed. The plan is
    made for the active Keras backend, which decides the actions available
    (JAX: keep, swap, recompute; TensorFlow and torch: keep, recompute).

    Args:
        model: a built Sequential or Functional Keras model.
        batch_size: the training batch size, a positive int.
        budget: device memory for training: bytes (int), a string such as
            `"16GiB"` or `"512MiB"`, a float in (0, 1] (a fraction of the
            GPU's memory) or `None` (all of the GPU's memory). Defaults to
            `None`.
        policy: `"auto"` (the fastest plan that fits) or one of
            `"keep_all"`, `"offload_all"`, `"greedy_offload"`,
            `"sqrt_recompute"`. Defaults to `"auto"`.
        cost: a `keras_autovm.planner.CostModel` (compute speed and link
            bandwidths); `None` uses the defaults. Defaults to `None`.
        headroom: the share of `budget` kept free for memory the planner
            does not model (framework scratch buffers, fragmentation): plans
            must fit `budget * (1 - headroom)`. Defaults to 0.15.

    Returns:
        A `keras_autovm.planner.Plan`; `Plan.summary()` prints it.

    Raises:
        keras_autovm.PlanError: no plan meets `budget`; the message and
            `min_budget` give the smallest feasible budget.

    Example:

    ```python
    model = keras.applications.VGG19(weights=None)
    p = keras_autovm.plan(model, batch_size=256, budget="16GiB")
    p.summary()
    ```
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) \
            or batch_size <= 0:
        raise ValueError(
            f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}"
        )
    check_headroom(headroom)
    mechanism = mechanisms.get()
    budget_bytes = parse_budget(budget, mechanism.device_memory())
    return plan_graph(graph_lib.build_graph(model, int(batch_size)),
                      budget_bytes, policy, cost or measured_cost(mechanism),
                      mechanism, headroom)


def measured_cost(mechanism):
    """A cost model whose link bandwidths were measured on this GPU.

    With a GPU and the native helper, the link is probed once per process
    (small buffers, well inside free memory): pinned copies for mechanisms
    that copy (JAX's offloads), managed-memory prefetches for those that
    move pages (TensorFlow managed memory). Otherwise the defaults.
    """
    if not mechanism.gpu_available():
        return planner.CostModel()
    probe = _link_probe()
    if probe is None:
        return planner.CostModel()
    return cost_from_probe(probe, pages=mechanism.SWAPS_BY_OPS)


def cost_from_probe(probe, pages):
    """A `CostModel` with the median bandwidths of a native `link_probe`."""
    kind = "managed_prefetch" if pages else "pinned"
    return planner.CostModel(
        d2h_bytes_per_s=probe[f"{kind}_d2h"]["median"] * 1e9,
        h2d_bytes_per_s=probe[f"{kind}_h2d"]["median"] * 1e9)


@functools.lru_cache(maxsize=None)
def _link_probe():
    from keras_autovm import native
    if not native.available():
        return None
    try:
        return native.native.link_probe(nbytes=64 << 20, repeats=3, device=0)
    except RuntimeError as error:
        warnings.warn(f"AutoVM could not probe the GPU link, so it plans with "
                      f"default bandwidths: {error}", stacklevel=3)
        return None


def check_headroom(headroom):
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) \
            or not 0 <= headroom < 1:
        raise ValueError("`headroom` must be a number in [0, 1). "
                         f"Received: headroom={headroom!r}")


def plan_graph(graph, budget_bytes, policy, cost, mechanism, headroom):
    """Plans a prepared graph with the actions `mechanism` can carry out.

    `"auto"` chooses among the actions the mechanism recommends; a policy
    named explicitly may use any action the mechanism can carry out.
    """
    allowed = mechanism.auto_actions() if policy == "auto" else mechanism.actions()
    usable = int(budget_bytes * (1 - headroom))
    try:
        return planner.make_plan(graph, usable, policy=policy,
                                 cost=cost or planner.CostModel(), allowed=allowed)
    except planner.PlanError as error:
        if not headroom:
            raise
        # State the minimum in the user's terms: the budget they would pass.
        least = math.ceil(error.min_budget / (1 - headroom)) + 1
        raise planner.PlanError(
            f"No plan fits budget={planner.format_bytes(budget_bytes)}: plans must "
            f"fit {planner.format_bytes(usable)} after {headroom:.0%} headroom, "
            f"and the least any {policy!r} plan needs is "
            f"{planner.format_bytes(error.min_budget)}.", least) from None
