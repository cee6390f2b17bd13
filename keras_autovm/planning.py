"""`plan()`: a dry run of AutoVM's planning for a model, before training."""

import numbers

from keras_autovm import graph as graph_lib
from keras_autovm import mechanisms
from keras_autovm import planner
from keras_autovm.budget import parse_budget


def plan(model, batch_size, budget=None, policy="auto", cost=None):
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
    mechanism = mechanisms.get()
    budget_bytes = parse_budget(budget, mechanism.device_memory())
    return plan_graph(graph_lib.build_graph(model, int(batch_size)),
                      budget_bytes, policy, cost, mechanism)


def plan_graph(graph, budget_bytes, policy, cost, mechanism):
    """Plans a prepared graph with the actions `mechanism` can carry out."""
    return planner.make_plan(graph, budget_bytes, policy=policy,
                             cost=cost or planner.CostModel(),
                             allowed=mechanism.actions())
