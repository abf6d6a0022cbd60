"""Encodings v1: ``raw`` (bytes as they are) and ``zstd`` (one zstd frame).

The writer keeps zstd only when it saves at least ``MIN_SAVING`` of the chunk, so random
data costs nothing extra to store or to decode. Later encodings (byte planes, deltas against a
base chunk) register here under new names; a reader refuses names it does not know.
"""

from __future__ import annotations

import threading

import zstandard

from transfer.errors import FormatError, UnknownEncodingError

RAW = "raw"
ZSTD = "zstd"
KNOWN_ENCODINGS = frozenset({RAW, ZSTD})
MIN_SAVING = 0.01

# ZstdCompressor/Decompressor objects are not thread-safe: one per worker thread.
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("cctx", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx  # type: ignore[no-any-return]


def check_encoding(enc: str) -> None:
    if enc not in KNOWN_ENCODINGS:
        raise UnknownEncodingError(
            f"chunk encoding {enc!r} is unknown to this reader (knows {sorted(KNOWN_ENCODINGS)});"
            " upgrade ckpt-ferry"
        )


def encode(data: bytes | memoryview, zstd_level: int | None) -> tuple[str, bytes]:
    """Return (encoding, payload): zstd when it pays, else raw. ``None`` disables zstd."""
    raw = bytes(data)
    if zstd_level is None or not raw:
        return RAW, raw
    packed = _compressor(zstd_level).compress(raw)
    if len(packed) <= len(raw) * (1 - MIN_SAVING):
        return ZSTD, packed
    return RAW, raw


def decode(enc: str, payload: bytes | memoryview, size: int) -> bytes:
    """Decode one chunk to exactly ``size`` bytes, or raise (never return a short buffer)."""
    check_encoding(enc)
    if enc == RAW:
        out = bytes(payload)
    else:
        try:
            declared = zstandard.frame_content_size(payload)
            if declared not in (size, -1):  # refuse before allocating what a header claims
                raise FormatError(f"zstd frame declares {declared} bytes, expected {size}")
            out = _decompressor().decompress(payload, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd payload does not decode: {exc}") from None
    if len(out) != size:
        raise FormatError(f"chunk decodes to {len(out)} bytes, expected {size}")
    return out
