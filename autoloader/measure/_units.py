"""Sizes and durations, read from and written for people."""

from __future__ import annotations

import math
import re

from autoloader._exceptions import InvalidInputError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "memory_budget") -> int:
    """Return a size in bytes from an int or a string such as ``"6GiB"`` or ``"512MB"``.

    ``K``/``M``/``G``/``T`` and ``KiB``... are powers of 1024; ``KB``/``MB``/``GB``/``TB``
    are powers of 1000.

    Raises:
        InvalidInputError: the value is not a positive size.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise InvalidInputError(
            f"{name} must be a number of bytes (int) or a string such as '6GiB', "
            f"but got {type(value).__name__} {value!r}."
        )
    if isinstance(value, int):
        number = value
    else:
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidInputError(
                f"{name} {value!r} is not a size; write it as bytes or with a unit, "
                "e.g. '6GiB', '512MiB' or '2GB'."
            )
        number = math.floor(float(match.group(1)) * _UNITS[unit])
    if number <= 0:
        raise InvalidInputError(f"{name} must be positive but got {value!r}.")
    return number


def format_bytes(size: float) -> str:
    """Return ``size`` bytes in binary units, e.g. ``"1.5 GiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def format_seconds(seconds: float) -> str:
    """``0.0123`` as ``"12.3 ms"``; 10 s and more in seconds."""
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"
