"""What the backends' layer and link timings share.

`CallTimer` collects the times of distinct layer calls, `median_seconds`
times one run the way every timing here does, `call_values` and
`variable_values` call a layer on explicit variable values, and
`link_gbps` turns a backend's timed copies into the link figures a
`Profile` records (`Mechanism.measure_link`).
"""

import collections
import statistics
import time

import keras

from keras_autovm import internals


CallTime = collections.namedtuple(
    "CallTime", ["fwd_s", "bwd_s", "workspace_bytes"], defaults=(0,))
CallTime.__doc__ = """One layer call measured: its forward's and its backward's
seconds, and the most bytes it allocates for a moment above what it holds
before and after (0: not measured)."""


class CallTimer:
    """Times distinct layer calls as the profiling pass adds them.

    `add(key, operation, args, kwargs)` times one call with `time_call`
    (`Mechanism.time_call`'s signature); the caller adds each `key` once
    (`key in timer`). `results()` maps each key to its
    `(forward_s, backward_s)` or `CallTime`.
    """

    def __init__(self, time_call, repeats, progress=None):
        self._time_call = time_call
        self.repeats = repeats
        self.progress = progress
        self.times = {}

    def __contains__(self, key):
        return key in self.times

    def add(self, key, operation, args, kwargs):
        self.times[key] = self._time_call(operation, args, kwargs, self.repeats)
        if self.progress is not None:
            self.progress(len(self.times))

    def results(self):
        return dict(self.times)


# A run that takes this long is timed once: its time is well above the
# clock's and the launch noise, and profiling stays short.
LONG_RUN_S = 0.01


def median_seconds(run, wait, repeats):
    """Median wall time of `run()` over `repeats` runs (one run when the
    first took over `LONG_RUN_S`) after one warm-up (which compiles, where
    the backend compiles), each stopped after `wait(result)` says the device
    is done. The warm-up does not decide: a `tf.function` traces in its
    first call, tens of milliseconds for a call that then runs in one."""
    wait(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        wait(run())
        times.append(time.perf_counter() - start)
        if times[0] > LONG_RUN_S:
            break
    return statistics.median(times)


def call_values(operation, tv, ntv, args, kwargs):
    """Calls a layer on explicit variable values without changing it
    (`stateless_call`); a raw `keras.ops` operation has no variables."""
    if isinstance(operation, keras.layers.Layer):
        # `stateless_call` runs `call` directly, so passes on only what it takes.
        if not internals.call_takes_training(operation):
            kwargs = {k: v for k, v in kwargs.items() if k != "training"}
        outputs, _ = operation.stateless_call(tv, ntv, *args, **kwargs)
        return outputs
    return operation(*args, **kwargs)


def variable_values(operation):
    """The trainable and non-trainable variable values of a layer call."""
    if not isinstance(operation, keras.layers.Layer):
        return [], []
    return ([v.value for v in operation.trainable_variables],
            [v.value for v in operation.non_trainable_variables])


def link_gbps(nbytes, d2h, h2d, both, wait, repeats):
    """The link figures of copies of `nbytes` each way: `d2h()` to the host,
    `h2d()` to the device, `both()` the two at once, each timed by
    `median_seconds` with `wait`; GB/s under the pinned link's keys."""
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    at_once = gbps(median_seconds(both, wait, repeats))
    return {"pinned_d2h": gbps(median_seconds(d2h, wait, repeats)),
            "pinned_h2d": gbps(median_seconds(h2d, wait, repeats)),
            "pinned_both_d2h": at_once, "pinned_both_h2d": at_once}
