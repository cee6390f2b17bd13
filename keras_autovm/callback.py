"""`AutoVM`: the Keras callback that plans and applies activation offloading.

The callback only decides when things happen: it checks its arguments, plans
before training (so that a budget no plan meets fails first), has
`patches.apply` change the model for the fit and `Patches.close` undo it,
times the steps and writes the report. Planning is `budget.PlanBook`'s, the
plan is applied by `runtime.Runtime` and the backend's mechanism.
"""

from __future__ import annotations

import time
import warnings

import keras

from keras_autovm import budget as budget_lib
from keras_autovm import calibration
from keras_autovm import console as console_lib
from keras_autovm import internals
from keras_autovm import learnt
from keras_autovm import mechanisms
from keras_autovm import patches as patches_lib
from keras_autovm import planner
from keras_autovm import profile_cache
from keras_autovm import profiling
from keras_autovm import report as report_lib
from keras_autovm import summaries
from keras_autovm.model_graph import functional_of
from keras_autovm.runtime import Runtime

_POLICIES = tuple(planner.POLICIES)
# Replan when measured step time is off the prediction by more than this.
_REPLAN_RATIO = 1.25
# Replan when the measured peak is over the predicted one by more than this.
_PEAK_RATIO = 1.05


class AutoVM(keras.callbacks.Callback):
    """Trains within a device-memory budget by keeping, swapping or
    recomputing each layer output.

    On train begin, AutoVM wraps the model's layers (`AutoVMWrapper`), and on
    the first training step, once the batch size is known, plans which layer
    outputs to keep on the GPU, swap to host memory (copied back ahead of the
    backward pass) or recompute, so that the predicted peak fits `budget`.
    It measures step time and peak memory each epoch, recalibrates its cost
    model and replans when the measurements move, and reports at the end.

    What each Keras backend can carry out: JAX keeps, recomputes
    (`jax.checkpoint`) and swaps, by host copies in an unjitted step;
    TensorFlow keeps, recomputes (`tf.recompute_grad`) and swaps, by copies
    to host memory that the backward pass reads back, or, once
    `keras_autovm.enable_managed_memory()` has been called, by moving the
    pages of managed memory on a dedicated CUDA stream; torch keeps,
    recomputes (`torch.utils.checkpoint`) and swaps, through saved-tensor
    hooks, a pinned host pool and a copy stream. `"auto"` chooses swaps
    only where they were measured to lower the peak on a GPU (torch, and
    TensorFlow's managed memory); a named swap policy runs on every
    backend. See docs/mechanisms.md.

    Without a GPU there is no device memory to manage: AutoVM warns and
    leaves training unchanged, unless `apply_without_gpu=True` (for tests
    and demonstrations; it then needs an absolute `budget`).

    Args:
        budget: device memory for training: bytes (int), a string such as
            `"16GiB"` or `"512MiB"`, a float in (0, 1] (a fraction of the
            GPU's memory) or `None` (all of it). Defaults to `None`.
        policy: `"auto"` (the fastest plan that fits) or one of
            `"hybrid"`, `"keep_all"`, `"offload_all"`, `"greedy_offload"`,
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
            must fit `budget * (1 - headroom)`. A number in [0, 1), or
            `None`: the backend's default, 0.05 on torch and 0.15 on JAX
            and TensorFlow. Defaults to `None`.
        batch_size: the training batch size to plan for. `None` reads it
            from each batch, or, where the traced batch has no static size
            (TensorFlow's input pipelines), from the data `fit` was given.
            Defaults to `None`.
        log_dir: a directory to write TensorBoard summaries into, under
            `<log_dir>/autovm`: per epoch the predicted and measured peak,
            step times, host traffic and replans, and the plan as text.
            `None` uses the `log_dir` of a `keras.callbacks.TensorBoard`
            in the same `fit`, if any. Defaults to `None`.

    Example:

    ```python
    model.fit(x, y, epochs=3,
              callbacks=[keras_autovm.AutoVM(budget="16GiB")])
    ```
    """

    def __init__(self, budget: int | str | float | None = None,
                 policy: str = "auto", verbose: int = 1, profile_steps: int = 5,
                 report_dir: str | None = None, apply_without_gpu: bool = False,
                 cost: planner.CostModel | None = None,
                 headroom: float | None = None,
                 batch_size: int | None = None, profile="auto",
                 log_dir: str | None = None):
        super().__init__()
        budget_lib.check_headroom(headroom)
        _check_budget(budget)
        if policy not in _POLICIES:
            raise ValueError(
                f"`policy` must be one of {_POLICIES}. Received: policy={policy!r}")
        if verbose not in (0, 1, 2):
            raise ValueError(f"`verbose` must be 0, 1 or 2. Received: verbose={verbose!r}")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(
                "`profile_steps` must be a positive int. "
                f"Received: profile_steps={profile_steps!r}")
        if batch_size is not None and (not isinstance(batch_size, int)
                                       or isinstance(batch_size, bool) or batch_size < 1):
            raise ValueError("`batch_size` must be a positive int or None. "
                             f"Received: batch_size={batch_size!r}")
        profiling.check_setting(profile)
        self.profile = profile
        self.budget = budget
        self.headroom = headroom
        self.batch_size = batch_size
        self.policy = policy
        self.verbose = verbose
        self.profile_steps = profile_steps
        self.report_dir = report_dir
        self.apply_without_gpu = apply_without_gpu
        self.cost = cost
        self.log_dir = log_dir
        self.report = None
        self.measured = None  # The `Profile` planned with, once known.
        self._runtime = None

    @property
    def plan(self) -> planner.Plan | None:
        """The plan in force (for the full batch size), or `None` before the
        first plan is made and when AutoVM is not applied (no GPU)."""
        if self._runtime is None or self._runtime.current is None:
            return None
        return self._runtime.current.plan

    def on_train_begin(self, logs=None):
        # A fit left without a hook to undo its changes (interrupted between
        # Keras's guarded calls) is undone now, before this one makes its own.
        if getattr(self, "_patches", None) is not None:
            self._patches.close()
        # Allow reuse across fit calls.
        self._runtime, self._patches, self._shown = None, None, set()
        self._times, self._forwards, self._epochs, self._last = [], [], [], None
        self._summaries, self._learnt_at = None, None
        self._console = console_lib.Console(self.verbose)
        self._console.fit_begins(self.params)
        self._mechanism = mechanisms.get()
        if not self._mechanism.gpu_available() and not self.apply_without_gpu:
            warnings.warn(
                "AutoVM found no GPU: there is no device memory to manage, so "
                "training runs unchanged. Pass apply_without_gpu=True to apply "
                "the plan anyway.", stacklevel=2)
            return
        # Our own reference: on JAX, reading `self.model` inside a traced step
        # syncs training state back into the model.
        self._target = self.model
        try:
            functional_of(self._target)
        except ValueError as error:  # A subclassed model: nothing to read.
            warnings.warn(f"AutoVM leaves the model unchanged and training goes "
                          f"on without it: {error}", stacklevel=2)
            return
        self._budget_bytes = budget_lib.parse_budget(
            self.budget, self._mechanism.device_memory())
        self._headroom = budget_lib.headroom_for(self.headroom, self._mechanism)
        fit = internals.running_fit()
        batch_size = self.batch_size or internals.batch_size_of(fit.get("epoch_iterator"))
        cost = self.cost or calibration.measured_cost(self._mechanism)
        if (self.profile == "auto" and batch_size
                and not budget_lib.needs_input_shapes(self._target)):
            self._check_feasible(batch_size, cost)
        self.measured, self._profile_source = profiling.for_fit(
            self.profile, self._target, batch_size, self._mechanism,
            verbose=self.verbose and (self.params or {}).get("verbose", 1) in (1, "auto"),
            limit_bytes=int(self._budget_bytes * (1 - self._headroom)))
        if self.measured is not None:
            cost = self.measured.cost(cost, self._mechanism.copy_link)
        plans = budget_lib.PlanBook(
            self._target, self._budget_bytes, self._headroom, self.policy, cost,
            self._mechanism, announce=self._announce if self.verbose else None,
            profile=self.measured)
        recalled = self._recall(plans, batch_size)
        self._runtime = Runtime(self._mechanism, plans,
                                patches_lib.inner_layers(self._target),
                                batch_size=batch_size, warn=self._console.warn)
        if recalled:
            self._runtime.stats.update(recalled_memory_scale=plans.memory_scale,
                                       recalled_memory_extra=plans.memory_extra)
        if self._runtime.batch_size:
            # Plan now when `fit` says the batch size: a budget no plan meets
            # fails here, before anything is changed.
            try:
                self._runtime.plan_for(self._runtime.batch_size)
            except planner.PlanError as error:
                if recalled:
                    error.args = (f"{error.args[0]} {recalled}",)
                raise
        self._patches = patches_lib.guard_fit(fit)
        self._patches.on_close(learnt.on_stop(self._runtime.plans))
        self._applied = False
        self._summaries = _summary_writer(self.log_dir, fit.get("callbacks"))

    def _recall(self, plans, batch_size):
        """Gives `plans` the memory overhead kept by the last fit of this
        model at this batch size, budget and policy, where its profile is
        the cache's, and has it keep what this fit learnt where it stops for
        want of a plan (`keras_autovm.learnt`). Returns a sentence saying so
        where one was kept, else `""`."""
        self._learnt_at = None
        if self._profile_source not in ("measured", "cache"):
            return ""
        path = profile_cache.learnt_path(profile_cache.cache_path(
            self._mechanism.device_name(), self._mechanism.backend,
            profile_cache.fingerprint(self._target), batch_size))
        key = learnt.key(plans.budget_bytes, plans.headroom, plans.policy,
                         getattr(self._target, "jit_compile", None))
        self._learnt_at = path, key
        recalled = learnt.attach(plans, path, key)
        if recalled == learnt.NOTHING:
            return ""
        said = (f"AutoVM plans with a memory overhead of "
                f"{planner.overhead_text(*recalled)}, kept by an earlier fit of "
                f"this model at this batch size and budget in {path}; delete that "
                f"file to learn it again.")
        self._console.print(said)
        return said

    def _check_feasible(self, batch_size, cost):
        """Raises the `PlanError` of a budget no plan meets before layers
        are timed: whether any plan fits does not depend on layer times,
        and timing under such a budget can itself run out of memory."""
        budget_lib.PlanBook(self._target, self._budget_bytes, self._headroom,
                            self.policy, cost, self._mechanism).plan(batch_size)

    def on_epoch_begin(self, epoch, logs=None):
        if self._patches is None:
            return
        self._console.flush()  # The last epoch's line, after its bar.
        # Reset at the start, not at the end, of an epoch: a callback or user
        # reading the peak at or after an epoch's end then sees that epoch's.
        self._peak_resets = self._mechanism.reset_peak()
        if self._applied:
            return
        self._applied = True
        message = patches_lib.apply(self._target, self._runtime, self._mechanism,
                                    self._patches)
        if message:
            self._console.print(message)

    def _announce(self, plan):
        if (plan.graph.batch_size, plan.policy) not in self._shown:
            self._shown.add((plan.graph.batch_size, plan.policy))
            lines = [f"AutoVM plan for batch size {plan.graph.batch_size}:"]
            plan.summary(print_fn=lines.append)
            self._console.print("\n".join(lines))

    def on_train_batch_begin(self, batch, logs=None):
        if self._patches is not None:
            self._last = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._patches is None or self._last is None:
            return
        if logs and "loss" in logs:
            float(logs["loss"])  # Wait for the step so its time is real.
        if self._runtime.untimed_steps:  # A measured step, or compiling.
            self._runtime.untimed_steps -= 1
        else:
            self._times.append(time.perf_counter() - self._last)
            self._forwards.append(self._mechanism.forward_seconds())
        self._console.batch_ended()

    def on_epoch_end(self, epoch, logs=None):
        if self._patches is None or self.plan is None:
            return
        self._console.epoch_ended()
        # The first step of a plan compiles; time the ones after it.
        measured = calibration.median(self._times[1:1 + self.profile_steps])
        forward = calibration.median(self._forwards[1:1 + self.profile_steps])
        plan = self.plan
        record = report_lib.epoch_record(
            epoch, (self.params or {}).get("epochs"), plan, len(self._times),
            measured, self._mechanism.peak_memory(), forward_time=forward)
        self._epochs.append(record)
        # A peak counts only if it was reset at the start (JAX's is the
        # process's running peak, profiling included).
        peak = record["peak_bytes"] if self._peak_resets else None
        if self._calibrate(measured, peak, plan, forward):
            record["replanned"] = True
        self._times, self._forwards = [], []
        if logs is not None and record["peak_bytes"] is not None:
            logs["autovm_peak_gib"] = record["peak_bytes"] / 2**30
        self._console.print_later(report_lib.epoch_line(record))
        if self._summaries:
            self._summaries.epoch(epoch, record, plan, self._mechanism.moved_bytes())

    def _calibrate(self, measured, peak, plan, forward=None):
        """Scales compute times to the measured step time (where the
        forward pass is measured apart, each phase to its own), and learns
        how far the measured peak is over the predicted one; replans when
        either moved, and retraces if the plan changes. A replan that fails
        keeps the plan and the memory overhead it was planned with, and the
        times just measured (`_keep`)."""
        plans = self._runtime.plans
        old = plans.cost, plans.memory_scale
        plans.cost = calibration.scaled_to_step(plans.cost, plan.result, measured,
                                                forward, _REPLAN_RATIO)
        if peak is not None and peak > plan.result.peak_bytes * _PEAK_RATIO:
            plans.memory_scale = max(plans.memory_scale,
                                     peak / max(plan.result.peak_bytes, 1))
        if (plans.cost, plans.memory_scale) == old:
            return False
        try:
            new = plans.plan(plan.graph.batch_size)
        except planner.PlanError as error:
            self._keep(plan, old)
            self._kept(plan, error)
            return False
        stayed = self._stayed(plan, new, peak)
        if stayed is not None:  # Same actions: nothing to trace again.
            self._mechanism.keep_traced(plan, stayed)
            self._runtime.repredict(plan, stayed)
            return False
        self._mechanism.keep_traced(plan, new)
        if new.refused is not None:  # Only tracing could tell: keep what runs.
            self._keep(plan, old)
            self._console.warn(f"AutoVM kept its plan: replanning failed: {new.refused}")
            return False
        self._runtime.replace(new)
        # A step that ran unchanged and now runs under AutoVM (or back) is
        # a new plan too, though every tensor is still kept.
        if new.actions != plan.actions or new.unchanged != plan.unchanged:
            patches_lib.retrace(self._target, self._patches, self._runtime)
            return True
        return False

    def _keep(self, plan, old):
        """A replan failed and `plan` stays, with the memory overhead it was
        planned with (`old`: the cost and memory scale before calibrating).
        The compute times just measured stay learnt, and `plan` is predicted
        again with them, so its next epoch is judged against what it now
        costs and a later replan starts from them."""
        plans = self._runtime.plans
        plans.memory_scale = old[1]
        if plans.cost == old[0]:
            return
        kept = planner.repredicted(plan, plans.cost)
        self._mechanism.keep_traced(plan, kept)
        self._runtime.repredict(plan, kept)

    def _kept(self, plan, error):
        """Says that a replan failed and `plan` stays. A plan whose measured
        step ran within its limit (TensorFlow) is said once a fit, without
        the `PlanError`'s smallest budget: it trains, where no other plan
        fits the overhead another plan's step showed (`first_step`)."""
        runtime = self._runtime
        if not runtime.ran_within_limit(plan):
            self._console.warn(f"AutoVM kept its plan: replanning failed: {error}")
        elif not runtime.kept_said:
            runtime.kept_said = True
            self._console.warn(
                "AutoVM kept its plan, whose measured step ran within its limit: "
                "with the memory overhead learnt from the steps of other plans, "
                "no plan fits; that stays so for this fit.")

    def _stayed(self, plan, new, peak):
        """`plan` predicted again with the cost just learnt
        (`planner.repredicted`), where it stays in force instead of the
        replan `new`; else `None`. It stays where its epoch peaked within
        the budget, short of the allocator's limit, and `new` is not
        predicted faster; the overhead learnt is kept for the plans made
        later. On an H200, ResNet-152's plan at batch 264 under an 8 GiB cap
        ran 2.6 s steps within the budget; the plan the overhead learnt in
        its epoch led to filled the cap, and the one after it ran 31 to 49
        s steps (results/tensorflow/rerun/)."""
        plans = self._runtime.plans
        if (peak is None or peak > plans.budget_bytes or new.actions == plan.actions
                or self._mechanism.fills_allocator(peak)):
            return None
        stayed = planner.repredicted(plan, plans.cost)
        if new.result.step_time < stayed.result.step_time:
            return None
        stats = self._runtime.stats
        stats["replans_declined"] = stats.get("replans_declined", 0) + 1
        self._console.print_later(
            f"AutoVM kept its plan: it ran within the budget, and the new plan "
            f"is predicted at {new.result.step_time:.3g} s a step against its "
            f"{stayed.result.step_time:.3g} s.")
        return stayed

    def on_train_end(self, logs=None):
        if self._patches is None:
            return
        self._console.flush()
        self._patches.close()
        self._patches = None
        if self.plan is None:
            return
        stats = dict(self._runtime.stats, **self._mechanism.stats,
                     profile=self._profile_source,
                     memory_scale=self._runtime.plans.memory_scale,
                     memory_extra=self._runtime.plans.memory_extra)
        if self.measured is not None:
            stats["profile_s"] = self.measured.profile_s
        moved = self._mechanism.moved_bytes()
        if moved is not None:
            stats.update({f"measured_bytes_{k}": v for k, v in moved.items()})
        self.report = report_lib.Report(
            self.plan, self._epochs, self._budget_bytes, stats,
            model_name=self._target.name, backend=keras.backend.backend())
        if self.verbose:
            lines = []
            self.report.summary(print_fn=lines.append)
            self._console.print("\n".join(lines))
        if self.report_dir:
            self.report.save(self.report_dir)


def _summary_writer(log_dir, callbacks):
    """AutoVM's TensorBoard summaries: into `log_dir`, or beside those of a
    `keras.callbacks.TensorBoard` in the same fit; `None` for neither."""
    if log_dir is None:
        log_dir = next((cb.log_dir for cb in getattr(callbacks, "callbacks", ())
                        if isinstance(cb, keras.callbacks.TensorBoard)), None)
    return None if log_dir is None else summaries.EpochSummaries(log_dir)


def _check_budget(budget):
    """Rejects malformed budgets now, before any training is lost."""
    if budget is None or isinstance(budget, float):
        budget_lib.parse_budget(budget, device_bytes=1)
    else:
        budget_lib.parse_budget(budget)
