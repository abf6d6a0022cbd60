"""Chunk encodings: pure functions on buffers, bit-exact round trips.

Callers run them in worker threads; zstandard releases the GIL around (de)compression.
"""

from transfer.codec.encodings import KNOWN_ENCODINGS, check_encoding, decode, encode

__all__ = ["KNOWN_ENCODINGS", "check_encoding", "decode", "encode"]
