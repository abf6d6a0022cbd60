"""Reversible byte transforms used before zstd: XOR against a base, and byte planes.

Why they pay on checkpoints: from one save to the next a float keeps its sign, exponent and
high mantissa bits, so ``new XOR base`` is mostly zero bits in the high bytes. Splitting the
elements into byte planes (all first bytes, then all second bytes, ...) puts those zeros next
to each other, where zstd finds them. XOR beat integer difference here (1.70x vs 1.67x on
AdamW-like fp32 updates, measured in bench/) and needs no carry, so it is the one we use.

The exact meaning (the on-store format depends on it; docs/FORMAT.md):
- XOR runs over the common prefix of the data and its base; the rest of the data is kept.
- Planes of ``width``-byte elements: byte k of element i goes to ``k * n + i`` (n whole
  elements); a tail shorter than one element stays last, as it is.

Both steps run fused, in one pass without the GIL, in ``_planes.c`` (``split`` encodes,
``join`` decodes); tests/test_planes.py checks it against a plain numpy statement of the
rules above.
"""

from __future__ import annotations

Buffer = bytes | bytearray | memoryview
