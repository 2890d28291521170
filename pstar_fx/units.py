"""Byte quantities: parsing "8GiB" and printing 8589934592 as "8.00 GiB"."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, name: str = "device_memory") -> int:
    """Bytes from an int or a string such as "512MiB", "1.5GB", "4096"; `name` is the option's, for the errors."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int or a string like '8GiB', not {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
        return _at_most_exabytes(value, name, value)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be an int or a string like '8GiB', not {type(value).__name__}")
    m = _PATTERN.match(value)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"{name}: cannot read {value!r} as a size: use bytes or a number with one of "
                         "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (for example '8GiB')")
    n = float(m.group(1)) * _UNITS[unit]
    if not n >= 1:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return _at_most_exabytes(int(min(n, 2.0 ** 63)), name, value)


MAX_BYTES = 2 ** 60      # an exbibyte: more than any machine has, and within the 64-bit counts torch's calls take


def _at_most_exabytes(n: int, name: str, value) -> int:
    if n > MAX_BYTES:
        raise ValueError(f"{name}: {value!r} is more than any machine has (at most {MAX_BYTES} bytes, 1 EiB); "
                         "give the memory the machine has, or None for no limit where the option allows it")
    return n


def format_bytes(n: int) -> str:
    """Human-readable, deterministic: 1536 -> '1.50 KiB'."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
