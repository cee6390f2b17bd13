"""Parsing the `budget` argument: bytes, "16GiB"-style strings, or fractions."""

import numbers
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(budget, device_bytes=None, argument="budget"):
    """Turns a budget into bytes.

    Args:
        budget: an int (bytes), a string such as `"16GiB"`, `"512MiB"` or
            `"2.5GB"`, a float in (0, 1] (a fraction of `device_bytes`), or
            `None` (all of `device_bytes`).
        device_bytes: the device's memory in bytes, or `None` when unknown
            (no GPU). Needed only for `None` and fractions.
        argument: the argument name used in error messages.

    Returns:
        The budget in bytes, an int.
    """
    if budget is None or isinstance(budget, float):
        return _relative_budget(budget, device_bytes, argument)
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Integral, str)):
        raise ValueError(
            f"`{argument}` must be an int (bytes), a string such as '16GiB', "
            f"a float in (0, 1] or None. Received: {argument}={budget!r}"
        )
    if isinstance(budget, str):
        return _parse_string(budget, argument)
    if budget <= 0:
        raise ValueError(
            f"`{argument}` must be a positive number of bytes. "
            f"Received: {argument}={budget!r}"
        )
    return int(budget)


def _relative_budget(fraction, device_bytes, argument):
    if fraction is not None and not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"A float `{argument}` is a fraction of device memory and must be "
            f"in (0, 1]. Received: {argument}={fraction!r}"
        )
    if device_bytes is None:
        raise ValueError(
            f"`{argument}={fraction!r}` is relative to the GPU's memory, but no "
            "GPU was found. Pass an absolute budget such as '8GiB'."
        )
    return int(device_bytes * (1.0 if fraction is None else fraction))


def _parse_string(text, argument):
    match = _PATTERN.match(text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(
            f"`{argument}` string must be a number and a unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), such as '16GiB'. "
            f"Received: {argument}={text!r}"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(
            f"`{argument}` must be at least one byte. Received: {argument}={text!r}"
        )
    return int(value)
