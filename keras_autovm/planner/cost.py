"""How long ops and copies take: a roofline estimate unless times are given.

Pure data, no framework imports.
"""

import dataclasses

DIRECTIONS = ("d2h", "h2d")


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Times for compute and host-device copies in one training step.

    An op's forward time is `op.fwd_time` when given, else the roofline
    estimate `max(flops / flops_per_s, mem_bytes / mem_bytes_per_s)` plus
    `op_overhead_s`. Its backward time is `op.bwd_time` when given, else
    `bwd_factor` times its forward time. Every compute time is then
    multiplied by `time_scale`, which is how a measured step time calibrates
    the model (see `scaled`), and forward times (recomputation included) by
    `fwd_scale` too, where the backend measures its forward pass apart
    (`scaled_forward`). Copies take `nbytes / bandwidth`.

    `max_in_flight_bytes` says how the backend's swaps behave: it bounds the
    bytes of device-to-host copies that may be outstanding; before a forward
    op starts, compute waits until the copies issued so far are within it
    (`None`: no bound).

    Args:
        flops_per_s: effective arithmetic throughput. Defaults to `40e12`
            (an H100/H200-class GPU at about 40% of its dense 16-bit peak).
        mem_bytes_per_s: effective device-memory bandwidth. Defaults to
            `2e12`.
        d2h_bytes_per_s: device-to-host copy bandwidth. Defaults to `50e9`
            (pinned PCIe Gen5; 55 GB/s was measured each way on an H200).
        h2d_bytes_per_s: host-to-device copy bandwidth. Defaults to `50e9`.
        bwd_factor: backward time as a multiple of forward time, used when
            an op's backward time is not given. Defaults to `2.0`.
        op_overhead_s: launch overhead added to each estimated op time.
            Defaults to `5e-6`.
        time_scale: multiplier applied to every compute time. Defaults to
            `1.0`.
        fwd_scale: a further multiplier on forward times (and so on
            recomputation), learnt from a measured forward pass. Defaults
            to `1.0`.
        max_in_flight_bytes: bound on outstanding device-to-host copy
            bytes, or `None`; `0` makes each forward op wait for every copy
            issued before it. Defaults to `None`.
        link_measured: whether the copy bandwidths were measured on this
            machine (shown in plan summaries). Defaults to `False`.
        replay_segments: whether the backend recomputes a chain of
            recomputed tensors by replaying the whole chain at its first
            backward use (torch's and TensorFlow's checkpointing, which
            then hold everything the chain's ops save until each op's
            backward), rather than one tensor at a time as it is needed
            (XLA). Defaults to `False`.
        holds_outputs: whether a step the plan leaves unchanged holds every
            layer output until the forward pass ends (Keras's functional
            model on an eager backend), so that freeing outputs earlier
            takes the mechanism's hooks. `keep_all` then plans the step
            unchanged where that fits. Defaults to `False`.
    """

    flops_per_s: float = 40e12
    mem_bytes_per_s: float = 2e12
    d2h_bytes_per_s: float = 50e9
    h2d_bytes_per_s: float = 50e9
    bwd_factor: float = 2.0
    op_overhead_s: float = 5e-6
    time_scale: float = 1.0
    fwd_scale: float = 1.0
    max_in_flight_bytes: float = None
    link_measured: bool = False
    replay_segments: bool = False
    holds_outputs: bool = False

    def __post_init__(self):
        for name in ("flops_per_s", "mem_bytes_per_s", "d2h_bytes_per_s",
                     "h2d_bytes_per_s", "time_scale", "fwd_scale"):
            _check_number(name, getattr(self, name), positive=True)
        if self.max_in_flight_bytes is not None:
            _check_number("max_in_flight_bytes", self.max_in_flight_bytes,
                          positive=False)
        for name in ("bwd_factor", "op_overhead_s"):
            _check_number(name, getattr(self, name), positive=False)

    def fwd_time(self, op):
        """Forward time of an op in seconds.

        Args:
            op: an `OpSpec`.

        Returns:
            Seconds, as a float.
        """
        return self._fwd_unscaled(op) * self.time_scale * self.fwd_scale

    def _fwd_unscaled(self, op):
        return op.fwd_time if op.fwd_time is not None else self._estimate(op)

    def bwd_time(self, op):
        """Backward time of an op in seconds.

        Args:
            op: an `OpSpec`.

        Returns:
            Seconds, as a float.
        """
        if op.bwd_time is not None:
            return op.bwd_time * self.time_scale
        return self.bwd_factor * self._fwd_unscaled(op) * self.time_scale

    def copy_time(self, nbytes, direction):
        """Time to copy `nbytes` between device and host.

        Args:
            nbytes: bytes to copy.
            direction: `"d2h"` (device to host) or `"h2d"`.

        Returns:
            Seconds, as a float.
        """
        if direction == "d2h":
            return nbytes / self.d2h_bytes_per_s
        if direction == "h2d":
            return nbytes / self.h2d_bytes_per_s
        raise ValueError(
            f"Argument `direction` must be one of {DIRECTIONS}, "
            f"received: direction={direction!r}"
        )

    def scaled(self, factor):
        """Returns a copy whose compute times are `factor` times longer.

        The Keras callback uses it to match the model to a measured step:
        `cost.scaled(measured / predicted)`. Copy bandwidths are left alone
        because they are measured separately.

        Args:
            factor: positive multiplier for compute times.

        Returns:
            A new `CostModel`.
        """
        _check_number("factor", factor, positive=True)
        return dataclasses.replace(self, time_scale=self.time_scale * factor)

    def scaled_forward(self, factor):
        """Returns a copy whose forward times (and so recomputation) are
        `factor` times longer, backward times unchanged: what a measured
        forward pass teaches (`Mechanism.forward_seconds`). An eager
        step's forward runs each layer's Python on top of its kernels,
        which a layer timed alone does not show.

        Args:
            factor: positive multiplier for forward times.

        Returns:
            A new `CostModel`.
        """
        _check_number("factor", factor, positive=True)
        return dataclasses.replace(self, fwd_scale=self.fwd_scale * factor)

    def _estimate(self, op):
        roofline = max(op.flops / self.flops_per_s,
                       op.mem_bytes / self.mem_bytes_per_s)
        return roofline + self.op_overhead_s


def _check_number(name, value, positive):
    # bool is an int subclass; `True` as a bandwidth is surely a mistake.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and value == value and value != float("inf")
    ok = ok and (value > 0 if positive else value >= 0)
    if not ok:
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(
            f"Argument `{name}` must be {kind} finite number, "
            f"received: {name}={value!r}"
        )
