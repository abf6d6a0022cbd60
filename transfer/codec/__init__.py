"""Chunk encodings: pure functions on buffers, bit-exact round trips.

Callers run them in worker threads; zstandard and numpy release the GIL for the heavy work.
"""

from transfer.codec.encodings import (
    KNOWN_ENCODINGS,
    RAW,
    DeltaPolicy,
    check_encoding,
    choose,
    decode,
    decode_on_keyframe,
    encode,
    encode_as,
    encode_chosen,
    pairs_with_keyframe,
    plane_width,
    sample_spans,
)
from transfer.format.manifest import needs_base  # the grammar's base rule lives in the format

__all__ = [
    "KNOWN_ENCODINGS",
    "RAW",
    "DeltaPolicy",
    "check_encoding",
    "choose",
    "decode",
    "decode_on_keyframe",
    "encode",
    "encode_as",
    "encode_chosen",
    "needs_base",
    "pairs_with_keyframe",
    "plane_width",
    "sample_spans",
]
