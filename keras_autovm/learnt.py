"""The memory overhead fits learnt, kept on disk for the next fit.

A measured step that peaks over its plan teaches an overhead
(`PlanBook.learn`): TensorFlow's measured first step, a step that ran out
of memory, XLA's figure for a compiled step, an epoch's peak (the
callback's calibration). Each fit used to learn it
again: on an H200 under an 8 GiB cap, ResNet-152 at batch 264 with its
profile cached replanned twice after first steps over their limit, each
replan tracing the step again, and VGG-19 at 100 ran out of memory in its
first step in each of two fits (results/tensorflow/timing_batch/). So what
a fit learns is kept beside the model's cached profile (`key`), and the
next fit of the same model at the same batch size, budget and policy on
the same device plans with it from its first plan.

What is kept is the overhead the plan in force (the full batch's) was
made with, each time a plan is put in force (`Runtime`) and at each
epoch's end, or what the fit learnt where it then found no plan and
stopped: a fit that went back to a plan made with less keeps that plan's.
A model with no profile cached starts with none (`profiling.obtain`
forgets it); one whose profile is measured again at a larger batch keeps
it. No framework imports.
"""

import json
import math
import os
import warnings

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
    and a `remember` that keeps what it learns there; returns the
    overhead recalled (`NOTHING` for none)."""
    recalled = recall(path, key)
    plans.memory_scale, plans.memory_extra = recalled
    plans.remember = keeper(path, key, recalled)
    return recalled


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
