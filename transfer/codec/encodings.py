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
from collections.abc import Callable, Sequence

import zstandard

from transfer.codec.transforms import Buffer
from transfer.directio import ThreadBuffers
from transfer.errors import FerryError, FormatError, UnknownEncodingError
from transfer.format.manifest import needs_base


class NotBuiltError(FerryError, ImportError):
    """The C extension is missing: a FerryError (the CLI says it in one line) and an
    ImportError (as code that imports ckpt-ferry expects of a missing piece)."""


try:
    from transfer.codec._planes import join, join_planes, split
except ModuleNotFoundError:  # a clone run where it lies, never installed: one line, not a trace
    raise NotBuiltError(
        "ckpt-ferry's C extension (transfer/codec/_planes.c) is not built: install it first "
        "(`source scripts/env.sh`, or `pip install -e .`)"
    ) from None

RAW = "raw"
ZSTD = "zstd"
PLAIN_CANDIDATES = ("zstd", "bp4+zstd", "bp2+zstd")
DELTA_CANDIDATES = ("xor+bp4+zstd", "xor+bp2+zstd", "xor+zstd")
KNOWN_ENCODINGS = frozenset({RAW, *PLAIN_CANDIDATES, *DELTA_CANDIDATES})
MIN_SAVING = 0.01
SAMPLE_BYTES = 64 << 10  # per sample; two samples decide the encoding of a large chunk
MIN_SAMPLE_BYTES = 8 << 10  # per sample of a chunk under 512 KiB (sample_spans)

# ZstdCompressor/Decompressor objects are not thread-safe: one per worker thread.
_local = threading.local()
#: each thread's planes and scratch, handed back to the process's pool when it ends
_scratch_buffers = ThreadBuffers()


#: Level 1 (the default) with a 64-entry hash table and 7-byte minimum matches. Byte planes
#: of trained weights and of their deltas are mostly entropy-coded literals: level 1's 8 K
#: table spends its time on cache misses hunting for short matches that barely pay. On the
#: corpus (``python -m bench.zstd_params --variant full|bf16|frozen``), one thread, median
#: MB/s: keyframe planes 972 vs 583 (full), 813 vs 405 (bf16), 934 vs 585 (frozen); delta
#: planes 630 vs 549, 913 vs 852, 2,024 vs 1,896; and a little smaller every time (full:
#: 0.8415 vs 0.8471 and 0.5680 vs 0.5723 of raw). Decoding is as fast (bf16 deltas -8%).
#: Any zstd reader decodes it: the format does not change.
LEVEL1_PARAMS = {"hash_log": 6, "min_match": 7}


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("cctx", {})
    if level not in cache:
        cache[level] = make_compressor(level)
    return cache[level]


def make_compressor(level: int) -> zstandard.ZstdCompressor:
    """The writer's zstd compressor for ``level`` (level 1: tuned for checkpoint planes)."""
    if level != 1:
        return zstandard.ZstdCompressor(level=level, write_content_size=True)
    params = zstandard.ZstdCompressionParameters.from_level(
        1, write_content_size=True, **LEVEL1_PARAMS
    )
    return zstandard.ZstdCompressor(compression_params=params)


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


def _steps(enc: str) -> tuple[bool, int]:
    """(XOR with the base?, plane width: 1 for none) of an encoding's steps before zstd."""
    steps = enc.split("+")[:-1]
    width = 1
    for step in steps:
        if step in ("bp2", "bp4"):
            width = int(step[2])
    return "xor" in steps, width


def _scratch(size: int, name: str = "scratch") -> memoryview:
    """This thread's reusable buffer ``name`` of ``size`` bytes (contents undefined)."""
    return _scratch_buffers.view(name, size)


def _transform(enc: str, data: Buffer, base: Buffer | None) -> Buffer:
    """Apply every step of ``enc`` except the final zstd, in one fused pass (XOR with the
    base and byte planes: transfer/codec/_planes.c). The result is this thread's scratch
    buffer when there is a step to apply: consume it before the next call."""
    xor, width = _steps(enc)
    if not xor and width == 1:
        return data
    out = _scratch(len(data))
    split(data, base if xor else None, out, width)
    return out


def sample_spans(size: int) -> list[tuple[int, int]]:
    """Where to sample a chunk: all of it when small (up to four samples' bytes), else two
    samples at 1/4 and 3/4 of 1/32 of it each, within MIN_SAMPLE_BYTES..SAMPLE_BYTES.

    Why a share of the chunk: a DCP file cut at its items (engine/chunkspans.py) is ~5x
    the chunks of fixed 4 MiB ones, and two fixed 64 KiB samples of each made the samples
    the largest part of the push's added CPU (a delta push of the corpus's 1.69 GB save:
    +0.9 of +1.2 CPU-s). A 4 MiB chunk's samples are as before."""
    piece = min(SAMPLE_BYTES, max(MIN_SAMPLE_BYTES, size // 32 // 8 * 8))
    if size <= 4 * piece:  # (the sample at 3/4 must end within the chunk)
        return [(0, size)]
    starts = (int(size * frac) // 8 * 8 for frac in (0.25, 0.75))
    return [(start, start + piece) for start in starts]


def _planes_of(piece: Buffer, enc: str) -> list[memoryview]:
    """A transformed sample cut at its plane boundaries, to be compressed one by one.

    Why: a whole chunk's planes are each 1 MiB (fp32, 4 MiB chunk), so every zstd block
    (128 KiB) lies inside one plane and gets a Huffman table of its own; a 64 KiB sample's
    planes share one block and one table, which the three noisy planes swamp. Compressed
    whole, samples of a full fine-tune's fp32 chunks rated plain zstd best 45 times in 50
    where byte planes were 8% smaller on the whole chunk."""
    width = plane_width(enc)
    view = memoryview(piece)
    m = len(view) // width
    if width == 1 or m == 0:
        return [view]
    return [view[k * m : (k + 1) * m] for k in range(width - 1)] + [view[(width - 1) * m :]]


def _sample_sizes(
    data: Buffer,
    base_samples: Sequence[Buffer] | None,
    candidates: tuple[str, ...],
    level: int,
) -> tuple[dict[str, int], int]:
    """Compressed size of samples of ``data`` under each candidate, and the bytes sampled.
    ``base_samples``: the base's bytes at the same spans (XOR aligns them)."""
    cctx = _compressor(min(level, 1))
    spans = sample_spans(len(data))
    sizes: dict[str, int] = {}
    for enc in candidates:
        size = 0
        for i, (lo, hi) in enumerate(spans):
            piece_base = base_samples[i] if base_samples is not None else None
            piece = _transform(enc, data[lo:hi], piece_base)
            size += sum(len(cctx.compress(plane)) for plane in _planes_of(piece, enc))
        sizes[enc] = size
    return sizes, sum(hi - lo for lo, hi in spans)


#: Asked, when a delta candidate beats every plain one on the samples, whether to keep it:
#: (estimated delta bytes, estimated bytes of the chunk coded on its own) -> keep?
DeltaPolicy = Callable[[int, int], bool]


def plane_width(enc: str) -> int:
    """The element width an encoding splits into byte planes (1: none)."""
    return _steps(enc)[1]


def _candidates(delta: bool, width: int | None) -> tuple[str, ...]:
    candidates = (DELTA_CANDIDATES + PLAIN_CANDIDATES) if delta else PLAIN_CANDIDATES
    if width is None:
        return candidates
    return tuple(enc for enc in candidates if plane_width(enc) == width)


def encode(
    data: Buffer,
    zstd_level: int | None,
    base: Buffer | None = None,
    delta_pays: DeltaPolicy | None = None,
    width: int | None = None,
) -> tuple[str, bytes]:
    """Return (encoding, payload). ``base``: the base chunk's bytes, to try delta coding;
    ``delta_pays`` may turn a delta down (the writer's keyframe policy). ``width``: try only
    the candidates of that plane width (a writer that knows the neighbouring chunks' choice:
    the samples then cost a third). ``zstd_level=None`` stores raw."""
    if zstd_level is None or not len(data):
        return RAW, bytes(data)
    spans = sample_spans(len(data))
    samples = [memoryview(base)[lo:hi] for lo, hi in spans] if base else None
    enc = choose(data, zstd_level, samples, delta_pays, width)
    return encode_chosen(enc, data, zstd_level, base)


def choose(
    data: Buffer,
    zstd_level: int,
    base_samples: Sequence[Buffer] | None = None,
    delta_pays: DeltaPolicy | None = None,
    width: int | None = None,
) -> str:
    """The encoding for ``data``, decided on samples (see ``encode``). ``base_samples``: the
    base chunk's bytes at ``sample_spans(len(data))``, to try delta coding: a writer can read
    only those, and the whole base only when a delta is chosen."""
    candidates = _candidates(base_samples is not None, width)
    enc = candidates[0]
    if len(candidates) > 1:
        view = memoryview(data)  # slices of it are views: no copy of the chunk
        sizes, sampled = _sample_sizes(view, base_samples, candidates, zstd_level)
        enc = min(candidates, key=sizes.__getitem__)  # ties: the earlier one
        if needs_base(enc) and delta_pays is not None:
            plain = min((c for c in candidates if not needs_base(c)), key=sizes.__getitem__)
            scale = len(view) / sampled
            if not delta_pays(int(sizes[enc] * scale), int(sizes[plain] * scale)):
                enc = plain
    return enc


def encode_chosen(
    enc: str, data: Buffer, zstd_level: int, base: Buffer | None = None
) -> tuple[str, bytes]:
    """(encoding, payload) of ``data`` in ``enc`` (its base's bytes when it is a delta), or
    raw when that saves less than MIN_SAVING (random data costs nothing extra)."""
    packed = encode_as(enc, data, zstd_level, base)
    if len(packed) <= len(data) * (1 - MIN_SAVING):
        return enc, packed
    return RAW, bytes(data)


def encode_as(enc: str, data: Buffer, zstd_level: int, base: Buffer | None = None) -> bytes:
    """Payload of ``data`` in the given encoding (no choosing, no raw fallback)."""
    check_encoding(enc)
    if enc == RAW:
        return bytes(data)
    if needs_base(enc) and base is None:
        raise ValueError(f"encoding {enc!r} needs a base")
    return _compressor(zstd_level).compress(_transform(enc, memoryview(data), base))


def decode(
    enc: str,
    payload: Buffer,
    size: int,
    base: Buffer | None = None,
    out: memoryview | None = None,
) -> Buffer:
    """Decode one chunk to exactly ``size`` bytes, or raise (never return a short buffer).

    ``out``: a writable buffer of ``size`` bytes to decode into (a restore reuses one per
    thread: no allocation, no page faults per chunk); the result is then a view of it.
    Without it a new buffer is returned. A ``raw`` chunk is returned as ``payload`` itself.
    """
    check_encoding(enc)
    if needs_base(enc) and base is None:
        raise FormatError(f"encoding {enc!r} needs the base chunk's bytes")
    if enc == RAW:
        if len(payload) != size:
            raise FormatError(f"chunk decodes to {len(payload)} bytes, expected {size}")
        return payload
    if out is None:
        out = memoryview(bytearray(size))
    elif len(out) != size:
        raise ValueError(f"out holds {len(out)} bytes, the chunk {size}")
    xor, width = _steps(enc)
    if not xor and width == 1:
        _decompress_into(payload, out)
        return out
    planes = _scratch(size)  # decompressed planes, then joined (and XORed) into out
    _decompress_into(payload, planes)
    join(planes, base if xor else None, out, width)
    return out


def pairs_with_keyframe(enc: str, size: int, base_enc: str, base_size: int) -> bool:
    """Whether ``decode_on_keyframe`` decodes a chunk in ``enc`` straight from its base's
    stored payload: a delta and a zstd keyframe of one plane width and one size."""
    if not needs_base(enc) or needs_base(base_enc) or size != base_size:
        return False
    return base_enc != RAW and _steps(enc)[1] == _steps(base_enc)[1]


def decode_on_keyframe(
    enc: str,
    payload: Buffer,
    size: int,
    base_enc: str,
    base_payload: Buffer,
    out: memoryview | None = None,
) -> Buffer:
    """Decode delta chunk ``payload`` into ``out`` against its base given as the base's
    stored keyframe payload (``pairs_with_keyframe`` must hold; ``out`` as in
    ``decode``): both are decompressed
    into plane order and unplaned together, XORed on the way (_planes.join_planes), so
    the base is never unplaned into a buffer of its own: one pass over memory less per
    chunk in a cold restore of a delta-coded step."""
    check_encoding(enc)
    check_encoding(base_enc)
    if not pairs_with_keyframe(enc, size, base_enc, size):
        raise ValueError(f"{enc!r} does not decode on a {base_enc!r} keyframe")
    if out is None:
        out = memoryview(bytearray(size))
    elif len(out) != size:
        raise ValueError(f"out holds {len(out)} bytes, the chunk {size}")
    delta_planes, base_planes = _scratch(size), _scratch(size, "base_scratch")
    _decompress_into(payload, delta_planes)
    _decompress_into(base_payload, base_planes)
    join_planes(delta_planes, base_planes, out, _steps(enc)[1])
    return out


def _decompress_into(payload: Buffer, out: memoryview) -> None:
    """Decompress one zstd frame of exactly ``len(out)`` bytes into ``out``."""
    size = len(out)
    try:
        declared = zstandard.frame_content_size(payload)
        if declared not in (size, -1):  # refuse before writing what a header claims
            raise FormatError(f"zstd frame declares {declared} bytes, expected {size}")
        with _decompressor().stream_reader(payload) as reader:
            got = 0
            while got < size and (n := reader.readinto(out[got:])):
                got += n
            if got != size or reader.read(1):
                raise FormatError(f"chunk decodes to {got}+ bytes, expected {size}")
    except zstandard.ZstdError as exc:
        raise FormatError(f"zstd payload does not decode: {exc}") from None
