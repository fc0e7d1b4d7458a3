"""Quantities as people read them: one formatter per unit, shared by every report."""

from __future__ import annotations

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """Bytes in binary units, one decimal: 512 B, 1.5 KiB, 8.0 TiB."""
    value, unit = float(n), _BINARY[0]
    for unit in _BINARY:
        if abs(value) < 1024 or unit == _BINARY[-1]:
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"


def format_seconds(s: float) -> str:
    """Seconds with a unit that keeps three significant figures: 1.5 s, 12 ms, 340 µs."""
    for unit, f in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= f:
            return f"{s / f:.3g} {unit}"
    return f"{s / 1e-9:.3g} ns"


_XLA_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "P": 2**50}


def parse_xla_bytes(text: str) -> int:
    """A size as XLA's messages print it ("8.00T", "15.75G": binary multiples) in bytes."""
    number = text.rstrip("KMGTP")
    return round(float(number) * _XLA_UNITS[text[len(number):]])
