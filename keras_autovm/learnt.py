"""The memory overhead a fit learnt before it found no plan, kept on disk
for the next fit.

A measured step that peaks over its plan teaches an overhead
(`PlanBook.learn`): TensorFlow's measured first step, a step that ran out
of memory, XLA's figure for a compiled step, an epoch's peak (the
callback's calibration). Where what a fit learnt leaves no plan, `fit`
stops with a `PlanError`, often minutes in: on an H200 under an 8 GiB cap,
VGG-19 at batch 100 ran out of memory in its first step and was refused in
each of four fits (results/tensorflow/timing_batch/,
results/tensorflow/kept_overhead/). So that overhead is kept beside the
model's cached profile (`key`), and the next fit of the same model at the
same batch size, budget and policy on the same device plans with it from
its first plan: refused in `on_train_begin`, in seconds, where it leaves
no plan.

Only a fit that stopped so keeps anything. A fit that trains leaves the
file as it found it, so the next fit takes the same path: on the same
GPU, VGG-19 at 96 trained after its first step peaked over its plan and
was replanned, and the next fit, planning with that overhead from its
first step, ran its smaller plan first and ran out of memory there
(results/tensorflow/kept_overhead/; why a process's first step needs
more was not traced: it also tries cuDNN's algorithms, whose scratch
takes what memory is free).

A model with no profile cached starts with none (`profiling.obtain`
forgets it); one whose profile is measured again at a larger batch keeps
it. No framework imports.
"""

import json
import math
import os
import warnings

from keras_autovm.planner import PlanError

_FORMAT = 1
NOTHING = (1.0, 0)


def key(budget_bytes, headroom, policy, jit_compile):
    """What an overhead is kept under, besides the model, batch size and
    device of its file: the budget and headroom, the policy, and whether
    the step is compiled by XLA (on TensorFlow, XLA's overhead is 1.5x to
    1.7x, against 1.09x to 1.35x without)."""
    return f"{int(budget_bytes)}|{float(headroom):g}|{policy}|{jit_compile}"


def _entries(path):
    try:
        with open(path) as f:
            data = json.load(f)
        return dict(data["learnt"]) if data.get("format") == _FORMAT else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def recall(path, key):
    """`(memory_scale, memory_extra)` kept at `path` under `key` by an
    earlier fit; `NOTHING` where none was, or the file is damaged."""
    try:
        scale, extra = _entries(path)[key]
        scale, extra = float(scale), int(extra)
    except (KeyError, TypeError, ValueError, OverflowError):
        return NOTHING
    if not (math.isfinite(scale) and scale >= 1.0 and extra >= 0):
        return NOTHING
    return scale, extra


def keep(path, key, memory_scale, memory_extra):
    """Writes an overhead to `path` under `key`, beside the others there."""
    entries = _entries(path)
    entries[key] = [float(memory_scale), int(memory_extra)]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"format": _FORMAT, "learnt": entries}, f, indent=1)
        os.replace(tmp, path)  # A reader never sees half a file.
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def forget(path):
    """Removes what was kept at `path`: no profile was cached beside it."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def attach(plans, path, key):
    """Gives `plans` (a `PlanBook`) the overhead kept at `path` under `key`,
    and a `remember` that keeps an overhead there (`PlanBook.keep_learnt`);
    returns the overhead recalled (`NOTHING` for none)."""
    recalled = recall(path, key)
    plans.memory_scale, plans.memory_extra = recalled
    plans.remember = keeper(path, key, recalled)
    return recalled


def on_stop(plans):
    """For `Patches.on_close`: keeps the overhead `plans` (a `PlanBook`)
    learnt where the fit stopped because no plan fit what it learnt
    (a `PlanError`), else nothing (see the module's docstring)."""
    def stopped(error):
        while error is not None:
            if isinstance(error, PlanError):
                plans.keep_learnt()
                return
            # Keras re-raises a layer call's error as another (a
            # `RuntimeError` for a `PlanError`), from inside its handler.
            error = error.__cause__ or error.__context__
    return stopped


def keeper(path, key, recalled=NOTHING):
    """A `PlanBook.remember`: keeps the overhead it is given at `path`
    under `key` where it differs from the last kept (at first,
    `recalled`). A cache it cannot write to is said once, and training
    goes on."""
    kept = [recalled]

    def remember(memory_scale, memory_extra):
        now = (float(memory_scale), int(memory_extra))
        if now == kept[0] or kept[0] is None:
            return
        try:
            keep(path, key, *now)
            kept[0] = now
        except OSError as error:
            kept[0] = None  # Not tried again.
            warnings.warn(f"AutoVM could not keep the memory overhead it learnt for "
                          f"the next fit in {path}: {error}", stacklevel=2)
    return remember
