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

    def __init__(self, to_host, to_device, event=None):
        self.to_host, self.to_device = to_host, to_device
        self._event = event or torch.cuda.Event  # Makes an event.
        self._marks = {}  # id(stream) -> the event `order_after` records again

    def order_after(self, stream, other):
        """Work queued on `stream` from now on runs after the work `other`
        has queued so far.

        `stream.wait_stream(other)` makes a new event each call; a swap
        orders each copy after the compute that made or freed its block,
        hundreds of times a step. The wait takes the event as last
        recorded, so one event per stream, recorded again each time, does,
        while one thread at a time orders each stream: the forward's
        thread `to_host`, autograd's backward thread `to_device`, and a
        step's forward and backward do not overlap.

        Args:
            stream: the stream that waits (`to_host` or `to_device`).
            other: the stream whose queued work it waits for.
        """
        mark = self._marks.get(id(stream))
        if mark is None:
            mark = self._marks[id(stream)] = self._event()
        mark.record(other)
        stream.wait_event(mark)

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


def run_on(stream, work, back):
    """`work()` with `stream` current, then `back` current again.

    What `torch.cuda.stream(stream)` does for a step that computes on one
    stream, `back`, known already: the context looks up the current stream
    on entry, which makes a Python `Stream` each time, hundreds of times a
    step.

    Args:
        stream: the copy stream `work` queues its copy on.
        work: a function of no arguments.
        back: the stream current before, made current again.

    Returns:
        What `work()` returns.
    """
    torch.cuda.set_stream(stream)
    try:
        return work()
    finally:
        torch.cuda.set_stream(back)


def copy_on(stream, target, source, back):
    """Queues `target.copy_(source)` on `stream`, then makes `back` current
    again (`run_on`); returns the event that marks the copy's end."""
    return run_on(stream, lambda: _copy_and_mark(target, source, stream), back)


def _copy_and_mark(target, source, stream):
    target.copy_(source, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return event
