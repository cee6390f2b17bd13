"""The two streams swap copies on: to host, and back to the device.

Two, so that the link carries both directions at once, as the planner's
simulator assumes: a copy back needed early in the backward does not queue
behind copies to host the forward left outstanding.

Both are made non-blocking (`CU_STREAM_NON_BLOCKING`, through the CUDA
driver). torch computes on the legacy default stream unless told otherwise,
and work queued there waits for everything queued before it on every
*blocking* stream, which is what `torch.cuda.Stream()` gives: on an H200 a
one-element kernel queued behind a 4.3 GB copy to host on such a stream
finished 78 ms later, when the copy did, and 0.12 ms later behind the same
copy on a non-blocking stream. So on a blocking stream a swap's copies hold
up compute queued after them, which the simulator does not model. Every
order the swap needs is made by events instead. Neither change moved
ResNet-152's step at 3x on a GPU (docs/results.md).
"""

import ctypes
import functools
import warnings

import torch

_CU_STREAM_NON_BLOCKING = 1


class Streams:
    """The copy streams of a fit: to host, and back to the device."""

    def __init__(self, to_host, to_device):
        self.to_host, self.to_device = to_host, to_device

    @classmethod
    def shared(cls):
        """The current device's pair, made once per process: the driver's
        streams are not handed back, and fits run one at a time."""
        return _pair(torch.cuda.current_device())

    def new_step(self):
        """Orders a step's copies to host after the copies back before it:
        both use the same slices of the host pool."""
        self.to_host.wait_stream(self.to_device)


@functools.lru_cache(maxsize=None)
def _pair(device):
    return Streams(non_blocking_stream(), non_blocking_stream())


@functools.lru_cache(maxsize=None)
def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def non_blocking_stream():
    """A new CUDA stream on the current device that the legacy default
    stream does not wait for; a `torch.cuda.Stream()` (with a warning)
    where the driver cannot make one. It lives as long as the process."""
    torch.cuda.current_stream().synchronize()  # The device's context is current.
    lib, handle = _driver(), ctypes.c_void_p()
    status = None if lib is None else lib.cuStreamCreate(ctypes.byref(handle),
                                                         _CU_STREAM_NON_BLOCKING)
    if status != 0:
        warnings.warn(f"AutoVM: the CUDA driver made no non-blocking stream (status "
                      f"{status}); copies to host may hold up the forward pass.")
        return torch.cuda.Stream()
    return torch.cuda.ExternalStream(handle.value)
