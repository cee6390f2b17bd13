"""`plan()`: a dry run of AutoVM's planning for a model, before training."""

from __future__ import annotations

import numbers

import keras

from keras_autovm import budget as budget_lib
from keras_autovm import calibration
from keras_autovm import mechanisms
from keras_autovm import planner
from keras_autovm import profiling


def plan(model: keras.Model, batch_size: int,
         budget: int | str | float | None = None, policy: str = "auto",
         cost: planner.CostModel | None = None,
         headroom: float | None = None,
         profile=None,
         input_shape: tuple | list | dict | None = None) -> planner.Plan:
    """Plans which layer outputs to keep, swap to host or recompute.

    A dry run: nothing is trained and the model is not changed. The plan is
    made for the active Keras backend, which decides the actions available
    (every backend keeps, swaps and recomputes; `"auto"` chooses swaps on
    torch, and on TensorFlow in managed mode, not on JAX or with
    TensorFlow's explicit copies).

    Args:
        model: a built Sequential or Functional Keras model.
        batch_size: the training batch size, a positive int.
        budget: device memory for training: bytes (int), a string such as
            `"16GiB"` or `"512MiB"`, a float in (0, 1] (a fraction of the
            GPU's memory) or `None` (all of the GPU's memory). Defaults to
            `None`.
        policy: `"auto"` (the fastest plan that fits) or one of
            `"hybrid"`, `"keep_all"`, `"offload_all"`, `"greedy_offload"`,
            `"sqrt_recompute"`, `"sqrt_offload"`. Defaults to `"auto"`.
        cost: a `keras_autovm.planner.CostModel` (compute speed and link
            bandwidths); `None` uses the link measured on this GPU, or the
            defaults. Defaults to `None`.
        headroom: the share of `budget` kept free for memory the planner
            does not model (framework scratch buffers, fragmentation): plans
            must fit `budget * (1 - headroom)`. A number in [0, 1), or
            `None`: the backend's default, 0.05 on torch and 0.15 on JAX
            and TensorFlow. Defaults to `None`.
        profile: measured layer and link costs: a
            `keras_autovm.profiling.Profile` or the path of its JSON (as
            `AutoVM` caches them, or `profiling.measure` returns); `None`
            plans with roofline estimates. Defaults to `None`.
        input_shape: the shape of one sample (no batch dimension), needed
            when the model's inputs have unknown dimensions besides the
            batch, such as a text backbone's sequence length: `(128,)`. For
            several inputs, a list (in `model.inputs` order) or a dict by
            input name. `None` uses the model's own input shapes. Defaults
            to `None`.

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
            f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}")
    budget_lib.check_headroom(headroom)
    mechanism = mechanisms.get()
    headroom = budget_lib.headroom_for(headroom, mechanism)
    budget_bytes = budget_lib.parse_budget(budget, mechanism.device_memory())
    measured = None if profile is None else profiling.load(profile)
    if measured is not None:
        profiling.warn_if_foreign(measured, model, mechanism.backend)
    cost = cost or calibration.measured_cost(mechanism)
    if measured is not None:
        cost = measured.cost(cost, mechanism.copy_link)
    return budget_lib.plan_within(
        budget_lib.graph_for(model, int(batch_size), mechanism, measured, input_shape),
        budget_bytes, headroom, policy, cost, mechanism)
