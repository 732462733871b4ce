"""Byte counts for people: binary units (GiB) by default, decimal (TB) where the field quotes them."""

from __future__ import annotations

_BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_DECIMAL = ("B", "kB", "MB", "GB", "TB", "PB")


def _scaled(value: float, base: int, names: tuple[str, ...]) -> str:
    for name in names[:-1]:
        if abs(value) < base:
            return f"{value:,.1f} {name}" if name != "B" else f"{int(value):,} B"
        value /= base
    return f"{value:,.1f} {names[-1]}"


def binary_bytes(count: int | float) -> str:
    return _scaled(float(count), 1024, _BINARY)


def decimal_bytes(count: int | float) -> str:
    return _scaled(float(count), 1000, _DECIMAL)
