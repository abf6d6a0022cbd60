"""Reversible byte transforms used before zstd: XOR against a base, and byte planes.

Why they pay on checkpoints: from one save to the next a float keeps its sign, exponent and
high mantissa bits, so ``new XOR base`` is mostly zero bits in the high bytes. Splitting the
elements into byte planes (all first bytes, then all second bytes, ...) puts those zeros next
to each other, where zstd finds them. XOR beat integer difference here (1.70x vs 1.67x on
AdamW-like fp32 updates, measured in bench/) and needs no carry, so it is the one we use.

All functions take and return ``bytes``; numpy does the work at GB/s and releases the GIL.
"""

from __future__ import annotations

import numpy as np

Buffer = bytes | bytearray | memoryview


def xor_with_base(data: Buffer, base: Buffer) -> bytearray:
    """``data XOR base`` over their common prefix; the rest of ``data`` is kept as is.

    Self-inverse: ``xor_with_base(xor_with_base(d, b), b) == d`` for any lengths.
    """
    out = bytearray(data)
    n = min(len(out), len(base))
    if n:
        head = np.frombuffer(out, np.uint8, n)
        np.bitwise_xor(head, np.frombuffer(base, np.uint8, n), out=head)
    return out


def to_planes(data: Buffer, width: int) -> bytearray:
    """Byte planes of ``width``-byte elements; a tail shorter than one element stays last."""
    out = bytearray(data)
    whole = len(out) - len(out) % width
    if whole:
        grid = np.frombuffer(data, np.uint8, whole).reshape(-1, width)
        planes = np.frombuffer(out, np.uint8, whole).reshape(width, -1)
        for k in range(width):  # strided reads, contiguous writes: ~4 GB/s
            planes[k] = grid[:, k]
    return out


def from_planes(data: Buffer, width: int) -> bytearray:
    """Inverse of :func:`to_planes`."""
    out = bytearray(data)
    whole = len(out) - len(out) % width
    if whole:
        planes = np.frombuffer(data, np.uint8, whole).reshape(width, -1)
        flat = np.frombuffer(out, np.uint8, whole)
        for k in range(width):  # contiguous reads, strided writes: ~4 GB/s, vs 1.4 for .T
            flat[k::width] = planes[k]
    return out
