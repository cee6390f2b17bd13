"""`AutoVM`: the Keras callback that plans and applies activation offloading."""

import math
import sys
import time
import warnings

import keras

from keras_autovm import budget as budget_lib
from keras_autovm import graph as graph_lib
from keras_autovm import mechanisms
from keras_autovm import planner
from keras_autovm import planning
from keras_autovm import report as report_lib
from keras_autovm import runtime as runtime_lib
from keras_autovm import wrapping

_POLICIES = tuple(planner.POLICIES)
# Replan when measured step time is off the prediction by more than this.
_REPLAN_RATIO = 1.25


class AutoVM(keras.callbacks.Callback):
    """Trains within a device-memory budget by keeping, swapping or
    recomputing each layer output.

    On train begin, AutoVM wraps the model's layers (`AutoVMWrapper`), and on
    the first training step, once the batch size is known, plans which layer
    outputs to keep on the GPU, swap to host memory (copied back ahead of the
    backward pass) or recompute, so that the predicted peak fits `budget`.
    It measures step time and peak memory each epoch, recalibrates its cost
    model and replans when the measurements move, and reports at the end.

    What each Keras backend can carry out: JAX keeps, swaps (XLA host
    offloading) and recomputes (`jax.checkpoint`); TensorFlow keeps,
    recomputes (`tf.recompute_grad`) and, once
    `keras_autovm.enable_managed_memory()` has been called, swaps by moving
    the pages of managed memory on a dedicated CUDA stream; torch keeps and
    recomputes (`torch.utils.checkpoint`). A plan that needs an action the
    backend lacks is not chosen by `"auto"`, and asking for it by name
    raises `NotImplementedError`.

    Without a GPU there is no device memory to manage: AutoVM warns and
    leaves training unchanged, unless `apply_without_gpu=True` (for tests
    and demonstrations; it then needs an absolute `budget`).

    Args:
        budget: device memory for training: bytes (int), a string such as
            `"16GiB"` or `"512MiB"`, a float in (0, 1] (a fraction of the
            GPU's memory) or `None` (all of it). Defaults to `None`.
        policy: `"auto"` (the fastest plan that fits) or one of
            `"keep_all"`, `"offload_all"`, `"greedy_offload"`,
            `"sqrt_recompute"`, `"sqrt_offload"`. Defaults to `"auto"`.
        verbose: 0 for silent, 1 to print the plan, a line per epoch and the
            report. Defaults to 1.
        profile_steps: steps per epoch timed to calibrate the cost model (the
            first step of each epoch is skipped: after a (re)plan it
            compiles). Defaults to 5.
        report_dir: a directory to write `report.json` and `timeline.png`
            into at the end of training; `None` writes no files. The report
            is also on `callback.report`. Defaults to `None`.
        apply_without_gpu: apply the plan even with no GPU present.
            Defaults to `False`.
        cost: a `keras_autovm.planner.CostModel`; `None` probes the GPU
            link once (native helper) for its bandwidths, or uses the
            defaults. Defaults to `None`.
        headroom: the share of `budget` kept free for memory the planner
            does not model (framework scratch buffers, fragmentation): plans
            must fit `budget * (1 - headroom)`. Defaults to 0.15.
        batch_size: the training batch size to plan for. `None` reads it
            from each batch, or, where the traced batch has no static size
            (TensorFlow's input pipelines), from the data `fit` was given.
            Defaults to `None`.

    Example:

    ```python
    model.fit(x, y, epochs=3,
              callbacks=[keras_autovm.AutoVM(budget="16GiB")])
    ```
    """

    def __init__(self, budget=None, policy="auto", verbose=1, profile_steps=5,
                 report_dir=None, apply_without_gpu=False, cost=None,
                 headroom=planning.DEFAULT_HEADROOM, batch_size=None):
        super().__init__()
        planning.check_headroom(headroom)
        _check_budget(budget)
        if policy not in _POLICIES:
            raise ValueError(
                f"`policy` must be one of {_POLICIES}. Received: policy={policy!r}"
            )
        if verbose not in (0, 1, 2):
            raise ValueError(f"`verbose` must be 0, 1 or 2. Received: verbose={verbose!r}")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(
                "`profile_steps` must be a positive int. "
                f"Received: profile_steps={profile_steps!r}"
            )
        if batch_size is not None and (not isinstance(batch_size, int)
                                       or isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError("`batch_size` must be a positive int or None. "
                             f"Received: batch_size={batch_size!r}")
        self.budget = budget
        self.headroom = headroom
        self.batch_size = batch_size
        self.policy = policy
        self.verbose = verbose
        self.profile_steps = profile_steps
        self.report_dir = report_dir
        self.apply_without_gpu = apply_without_gpu
        self.cost = cost
        self.report = None

    def on_train_begin(self, logs=None):
        # Allow reuse across fit calls.
        self._active, self._clone, self._shown = False, None, set()
        self._times, self._epochs, self._last = [], [], None
        self._mechanism = mechanisms.get()
        self._mechanism.uninstall(self.model)
        wrapping.unwrap(self.model)  # Whatever a failed fit left behind.
        if not self._mechanism.gpu_available() and not self.apply_without_gpu:
            warnings.warn(
                "AutoVM found no GPU: there is no device memory to manage, so "
                "training runs unchanged. Pass apply_without_gpu=True to apply "
                "the plan anyway.", stacklevel=2)
            return
        graph_lib.check_model(self.model)  # A clear error for subclassed models.
        self._cost = self.cost or planning.measured_cost(self._mechanism)
        self._budget_bytes = budget_lib.parse_budget(
            self.budget, self._mechanism.device_memory())
        self._graphs = {}
        # Planning runs inside traced steps, where `self.model` must not be
        # read: on JAX it syncs training state back into the model.
        self._target = self.model
        self._runtime = runtime_lib.Runtime(
            self._mechanism, self._make_plan, wrapping.inner_layers(self.model),
            batch_size=self.batch_size or _fit_batch_size())
        self._clone = wrapping.wrap(self.model, self._runtime)
        self._runtime.on_error = self._restore
        self._mechanism.install(self.model, self._runtime)
        self._jit_compile = self.model.jit_compile
        change = self._mechanism.prepare(self.model)
        if change and self.verbose:
            print(change)
        self.model.make_train_function(force=True)
        self._mechanism.reset_peak()
        self._active = True
        if self._runtime.batch_size:
            # Plan now when `fit` says the batch size: a budget no plan meets
            # fails here, before any training state is touched.
            try:
                self._runtime.plan_for(self._runtime.batch_size)
            except Exception:
                self._restore()
                raise

    def _make_plan(self, batch_size):
        """Plans for `batch_size`; called by the runtime inside the first step."""
        if batch_size not in self._graphs:
            self._graphs[batch_size] = graph_lib.build_graph(self._target, batch_size)
        plan = planning.plan_graph(self._graphs[batch_size], self._budget_bytes,
                                   self.policy, self._cost, self._mechanism,
                                   self.headroom)
        if self.verbose and (batch_size, plan.policy) not in self._shown:
            self._shown.add((batch_size, plan.policy))
            print(f"\nAutoVM plan for batch size {batch_size}:")
            plan.summary()
        return plan

    def on_train_batch_begin(self, batch, logs=None):
        if self._active:
            self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if not self._active or self._last is None:
            return
        if logs and "loss" in logs:
            float(logs["loss"])  # Wait for the step so its time is real.
        self._times.append(time.perf_counter() - self._last)

    def on_epoch_end(self, epoch, logs=None):
        if not self._active or self._runtime.plan is None:
            return
        # The first step of a plan compiles; time the ones after it.
        timed = self._times[1:1 + self.profile_steps]
        measured = sorted(timed)[len(timed) // 2] if timed else None
        plan = self._runtime.plan.plan
        record = {"epoch": epoch, "policy": plan.policy, "steps": len(self._times),
                  "step_time": measured, "predicted_step_time": plan.result.step_time,
                  "peak_bytes": self._mechanism.peak_memory(),
                  "predicted_peak_bytes": plan.result.peak_bytes,
                  "planned_bytes_moved": len(self._times) * (
                      plan.result.d2h_bytes + plan.result.h2d_bytes),
                  "replanned": False}
        self._epochs.append(record)
        if measured is not None and self._calibrate(measured, plan):
            record["replanned"] = True
        self._times = []
        if logs is not None and record["peak_bytes"] is not None:
            logs["autovm_peak_gib"] = record["peak_bytes"] / 2**30
        if self.verbose:
            print(report_lib.epoch_line(record, self._budget_bytes))

    def _calibrate(self, measured, plan):
        """Scales compute times to the measurement; replans if the plan changes."""
        ratio = measured / max(plan.result.step_time, 1e-12)
        if abs(math.log(ratio)) < math.log(_REPLAN_RATIO):
            return False
        self._cost = self._cost.scaled(ratio)
        try:
            new = self._make_plan(plan.graph.batch_size)
        except planner.PlanError as error:
            warnings.warn(f"AutoVM kept its plan: replanning failed: {error}",
                          stacklevel=2)
            return False
        self._runtime.replace(new)
        if new.actions != plan.actions:
            self.model.make_train_function(force=True)
            return True
        return False

    def _restore(self):
        """Gives the model back as it was before `on_train_begin`."""
        self._mechanism.uninstall(self._target)
        wrapping.unwrap(self._target, self._clone)
        if self._target.jit_compile != self._jit_compile:
            self._target.jit_compile = self._jit_compile
        self._target.train_function = None  # The next fit traces without AutoVM.
        self._active = False

    def on_train_end(self, logs=None):
        if not self._active:
            return
        self._restore()
        if self._runtime.plan is None:
            return
        stats = dict(self._runtime.stats)
        moved = self._mechanism.moved_bytes()
        if moved is not None:
            stats.update({f"measured_bytes_{k}": v for k, v in moved.items()})
        self.report = report_lib.Report(self._runtime.plan.plan, self._epochs,
                                        self._budget_bytes, stats)
        if self.verbose:
            self.report.summary()
        if self.report_dir:
            self.report.save(self.report_dir)


def _fit_batch_size():
    """The batch size of the `fit` call running this callback, if it says.

    Keras gives callbacks no batch size, and TensorFlow traces the training
    step with an unknown batch dimension; the data adapter of `fit`'s epoch
    iterator knows it (None for datasets of unknown batch size).
    """
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        iterator = frame.f_locals.get("epoch_iterator")
        adapter = getattr(iterator, "data_adapter", None)
        if adapter is not None:
            return adapter.batch_size
        frame = frame.f_back
    return None


def _check_budget(budget):
    """Rejects malformed budgets now, before any training is lost."""
    if budget is None or isinstance(budget, float):
        budget_lib.parse_budget(budget, device_bytes=1)
    else:
        budget_lib.parse_budget(budget)
