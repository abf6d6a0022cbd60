"""Chunk encodings: pure functions on buffers, bit-exact round trips.

Callers run them in worker threads; zstandard and numpy release the GIL for the heavy work.
"""

from transfer.codec.encodings import (
    KNOWN_ENCODINGS,
    RAW,
    DeltaPolicy,
    check_encoding,
    decode,
    encode,
    encode_as,
    needs_base,
    plane_width,
)

__all__ = [
    "KNOWN_ENCODINGS",
    "RAW",
    "DeltaPolicy",
    "check_encoding",
    "decode",
    "encode",
    "encode_as",
    "needs_base",
    "plane_width",
]
