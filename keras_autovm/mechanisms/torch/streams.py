"""The two streams swap copies on: to host, and back to the device.

Two, so that the link carries both directions at once, as the planner's
simulator assumes: a copy back needed early in the backward does not queue
behind copies to host the forward left outstanding. torch makes its
streams non-blocking (the default stream does not wait for them), so every
order the swap needs is an event or `record_stream` (`swap.py`).
"""

import functools

import torch


class Streams:
    """The copy streams of a fit: to host, and back to the device."""

    def __init__(self, to_host, to_device):
        self.to_host, self.to_device = to_host, to_device

    @classmethod
    def shared(cls):
        """The current device's pair, made once per process (fits run one
        at a time)."""
        return _pair(torch.cuda.current_device())

    def new_step(self):
        """Orders a step's copies to host after the copies back before it:
        both use the same slices of the host pool."""
        self.to_host.wait_stream(self.to_device)


@functools.lru_cache(maxsize=None)
def _pair(device):
    return Streams(torch.cuda.Stream(device), torch.cuda.Stream(device))
