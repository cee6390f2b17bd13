"""Times one layer call on torch, and the pinned link, with CUDA waits.

A layer call runs through `stateless_call` on detached copies of its
weights and inputs that require gradients; its backward is
`torch.autograd.grad` of the outputs, repeated on the retained graph, so its
time holds no forward, and what the timing itself costs a call is taken off
it (`grad_call_s`). Each run is waited for (queued back to back instead,
the forward's times fell far below the step's forward, whose Python is
Keras's as much as the layer's: docs/results.md). Everything
runs under `torch.random.fork_rng`: a random layer draws from the global
generators, which must not move.
"""

import contextlib
import time

import keras
import torch

from keras_autovm.mechanisms.timing import call_values
from keras_autovm.mechanisms.timing import link_gbps
from keras_autovm.mechanisms.timing import median_seconds
from keras_autovm.mechanisms.timing import variable_values

# Bytes per copy when measuring the link: large enough for the copy engines
# to reach their rate (measured: 55 GB/s from 64 MiB up on an H200).
LINK_BYTES = 64 << 20


def _wait(result=None):
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _leaf(x):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.detach().requires_grad_(True)
    return x


@contextlib.contextmanager
def measuring():
    """No autograd recording, and the global generators restored after."""
    with _fork_rng(), torch.no_grad():
        yield


def _fork_rng():
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=devices)


def time_call(operation, args, kwargs, repeats):
    """`(forward_s, backward_s)` of one layer call; see `Mechanism.time_call`."""
    with _fork_rng(), torch.enable_grad():
        tv, ntv = variable_values(operation)
        tv = [_leaf(x) for x in tv]
        args = keras.tree.map_structure(_leaf, args)
        wrt = tv + [x for x in keras.tree.flatten(args)
                    if isinstance(x, torch.Tensor) and x.requires_grad]

        def forward():
            return call_values(operation, tv, ntv, args, kwargs)

        fwd_s = median_seconds(forward, _wait, repeats)
        outputs = [x for x in keras.tree.flatten(forward())
                   if isinstance(x, torch.Tensor) and x.requires_grad]
        if not outputs or not wrt:
            return fwd_s, 0.0
        ones = [torch.ones_like(x) for x in outputs]

        def backward():
            return torch.autograd.grad(outputs, wrt, ones, retain_graph=True,
                                       allow_unused=True)

        # What the timing itself costs (a call into autograd's engine and
        # a wait) is no part of the layer's backward in a real step.
        return fwd_s, max(median_seconds(backward, _wait, repeats) - grad_call_s(), 0.0)


_GRAD_CALL_S = {}


def grad_call_s(repeats=5):
    """Seconds a backward timed as `time_call` times it takes for one
    multiply of one number: the timing's own cost, which a training step's
    one backward pass does not pay per layer. On an H100 it was 0.095 ms;
    ResNet-152's 516 layer backwards summed to 0.206 s, 0.157 s less it,
    against 0.127 s in the real step (`recipes/gpu_timing_harness.py`)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in _GRAD_CALL_S:
        x = torch.ones(1, device=device, requires_grad=True)
        y = x * 2.0
        ones = torch.ones_like(y)

        def backward():
            return torch.autograd.grad([y], [x], [ones], retain_graph=True,
                                       allow_unused=True)

        _GRAD_CALL_S[device] = sorted(median_seconds(backward, _wait, repeats)
                                      for _ in range(repeats))[repeats // 2]
    return _GRAD_CALL_S[device]


def mark():
    """A point in the step: a CUDA event on the current stream (where the
    device is when it reaches it), or the clock without CUDA."""
    if not torch.cuda.is_available():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end):
    """Seconds from one `mark` to a later one."""
    if isinstance(end, float):
        return end - start
    end.synchronize()  # Done once the step's loss was read back.
    return start.elapsed_time(end) / 1e3


def measure_link(repeats=3):
    """GB/s of pinned copies: to host, to device, and both at once on two
    streams (the two directions share the link's controller on some
    hosts); `None` without CUDA."""
    if not torch.cuda.is_available():
        return None
    n = LINK_BYTES
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    device2 = torch.empty_like(device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty_like(host).pin_memory()
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def on(stream, copy):
        with torch.cuda.stream(stream):
            copy()

    d2h = lambda: on(streams[0], lambda: host.copy_(device, non_blocking=True))  # noqa: E731
    h2d = lambda: on(streams[1], lambda: device2.copy_(host2, non_blocking=True))  # noqa: E731
    return link_gbps(n, d2h, h2d, lambda: (d2h(), h2d()), _wait, repeats)
