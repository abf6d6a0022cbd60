"""Chunk encodings: a pipeline of reversible steps named by joining them with ``+``.

    raw                      the bytes as they are
    zstd                     one zstd frame (content size in the header)
    bp2+zstd, bp4+zstd       byte planes of 2-byte (bf16/fp16) or 4-byte (fp32) elements, zstd
    xor+zstd, xor+bp2+zstd,  XOR against the chunk's *base* (the same file offset in the base
    xor+bp4+zstd             checkpoint), then as above: needs the base's bytes to decode

The writer tries the candidates on small samples of the chunk, encodes it whole with the
best, and keeps the result only when it saves at least ``MIN_SAVING`` over raw, so random data
costs nothing extra. A reader refuses names it does not know.
"""

from __future__ import annotations

import threading

import zstandard

from transfer.codec.transforms import Buffer, from_planes, to_planes, xor_with_base
from transfer.errors import FormatError, UnknownEncodingError

RAW = "raw"
ZSTD = "zstd"
PLAIN_CANDIDATES = ("zstd", "bp4+zstd", "bp2+zstd")
DELTA_CANDIDATES = ("xor+bp4+zstd", "xor+bp2+zstd", "xor+zstd")
KNOWN_ENCODINGS = frozenset({RAW, *PLAIN_CANDIDATES, *DELTA_CANDIDATES})
MIN_SAVING = 0.01
SAMPLE_BYTES = 64 << 10  # per sample; two samples decide the encoding of a large chunk

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


def needs_base(enc: str) -> bool:
    return enc.split("+", 1)[0] == "xor"


def _transform(enc: str, data: Buffer, base: Buffer | None) -> Buffer:
    """Apply every step of ``enc`` except the final zstd."""
    for step in enc.split("+"):
        if step == "xor":
            assert base is not None
            data = xor_with_base(data, base)
        elif step in ("bp2", "bp4"):
            data = to_planes(data, int(step[2]))
    return data


def _sample_spans(size: int) -> list[tuple[int, int]]:
    """Where to sample a chunk: all of it when small, else 64 KiB at 1/4 and 3/4."""
    if size <= 2 * SAMPLE_BYTES:
        return [(0, size)]
    starts = (int(size * frac) // 8 * 8 for frac in (0.25, 0.75))
    return [(start, start + SAMPLE_BYTES) for start in starts]


def _pick(data: Buffer, base: Buffer | None, candidates: tuple[str, ...], level: int) -> str:
    """The candidate that compresses samples of ``data`` best (ties: the earlier one)."""
    cctx = _compressor(min(level, 1))
    spans = _sample_spans(len(data))
    best, best_size = candidates[0], None
    for enc in candidates:
        size = 0
        for lo, hi in spans:  # the base is sampled at the same offsets: XOR aligns them
            piece_base = base[lo:hi] if base is not None else None
            size += len(cctx.compress(_transform(enc, data[lo:hi], piece_base)))
        if best_size is None or size < best_size:
            best, best_size = enc, size
    return best


def encode(data: Buffer, zstd_level: int | None, base: Buffer | None = None) -> tuple[str, bytes]:
    """Return (encoding, payload). ``base``: the base chunk's bytes, to try delta coding.
    ``zstd_level=None`` stores raw."""
    raw = bytes(data)
    if zstd_level is None or not raw:
        return RAW, raw
    candidates = (DELTA_CANDIDATES + PLAIN_CANDIDATES) if base else PLAIN_CANDIDATES
    enc = _pick(raw, base, candidates, zstd_level) if len(candidates) > 1 else candidates[0]
    packed = _compressor(zstd_level).compress(_transform(enc, raw, base))
    if len(packed) <= len(raw) * (1 - MIN_SAVING):
        return enc, packed
    return RAW, raw


def encode_as(enc: str, data: Buffer, zstd_level: int, base: Buffer | None = None) -> bytes:
    """Payload of ``data`` in the given encoding (no choosing, no raw fallback)."""
    check_encoding(enc)
    if enc == RAW:
        return bytes(data)
    if needs_base(enc) and base is None:
        raise ValueError(f"encoding {enc!r} needs a base")
    return _compressor(zstd_level).compress(_transform(enc, bytes(data), base))


def decode(enc: str, payload: Buffer, size: int, base: Buffer | None = None) -> Buffer:
    """Decode one chunk to exactly ``size`` bytes, or raise (never return a short buffer)."""
    check_encoding(enc)
    if needs_base(enc) and base is None:
        raise FormatError(f"encoding {enc!r} needs the base chunk's bytes")
    out: Buffer
    if enc == RAW:
        out = payload
    else:
        try:
            declared = zstandard.frame_content_size(payload)
            if declared not in (size, -1):  # refuse before allocating what a header claims
                raise FormatError(f"zstd frame declares {declared} bytes, expected {size}")
            out = _decompressor().decompress(payload, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise FormatError(f"zstd payload does not decode: {exc}") from None
        for step in reversed(enc.split("+")[:-1]):
            if step == "xor":
                assert base is not None
                out = xor_with_base(out, base)
            else:
                out = from_planes(out, int(step[2]))
    if len(out) != size:
        raise FormatError(f"chunk decodes to {len(out)} bytes, expected {size}")
    return out
