"""Sizes and rates as ``ferry`` prints them: one formatter, in decimal units (1 MB = 1000**2
bytes), for every command's output: push, pull (their rates too), ls, verify, du,
retention plans. Here, beside the layers, so the CLI and retention share it (typed
sizes, ``parse_size``, accept both decimal and binary units)."""

from __future__ import annotations

_UNITS = ("B", "KB", "MB", "GB", "TB")


def format_rate(nbytes: float, seconds: float) -> str:
    """``4.2 MB/s``, ``310.0 KB/s``: a small transfer's rate in the unit that shows it (a
    fixed MB/s printed "0 MB/s" for a step of a few KB); ``-`` when no time was measured."""
    if not seconds > 0:
        return "-"
    return f"{format_size(nbytes / seconds)}/s"


def format_size(nbytes: float | None) -> str:
    """``512 B``, ``4.2 MB``, ``1,234.5 TB``; ``-`` for None (unknown)."""
    if nbytes is None:
        return "-"
    n = float(nbytes)
    for unit in _UNITS:
        if abs(n) < 1000 or unit == _UNITS[-1]:
            return f"{int(n)} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")
