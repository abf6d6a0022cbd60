"""Tunables of the transfer engine, with defaults measured on this class of machine."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, cast

#: The per-part integrity headers a store may send with a write (S3: x-amz-checksum-crc32
#: or Content-MD5; a local store has its fsync and ignores it), first the default.
CHECKSUMS = ("crc32", "md5", "none")


#: how a restore may write (TransferOptions.write_path; engine/writepath.py)
WRITE_PATHS = ("auto", "warm", "direct", "buffered")

#: zstd's highest level (zstandard.MAX_COMPRESSION_LEVEL; negative levels are its fast modes)
ZSTD_MAX_LEVEL = 22


@dataclass(frozen=True)
class TransferOptions:
    #: fixed chunk size; chunks sit at the same file offsets in successive checkpoints
    chunk_size: int = 4 << 20
    #: bytes per multipart part / ranged GET; in-flight memory is about window x part_size
    part_size: int = 8 << 20
    #: a pack is completed once it holds this much; bounded by 10,000 parts on S3
    pack_size: int = 256 << 20
    #: parts (uploads) or ranges (downloads) in flight at once, across all files
    window: int = 16
    #: threads for hashing and (de)compression; they release the GIL
    workers: int = max(1, os.cpu_count() or 1)
    #: zstd level for chunks, None to store raw
    zstd_level: int | None = 1
    #: how many of the job's newest steps to deduplicate against
    dedupe_steps: int = 16
    #: delta-code changed chunks against the base checkpoint's chunk at the same offset
    delta: bool = True
    #: decode steps a restore of any chunk may need (a chunk whose base is already this deep
    #: is stored as a keyframe instead)
    max_chain: int = 4
    #: a changed chunk is stored as a delta only when that makes it at least this much
    #: smaller than the chunk coded on its own (keyframes.py says why)
    delta_min_saving: float = 0.25
    #: ... and only while a cold restore of it (its own payload and every base's, back to
    #: the keyframe) stays within this multiple of the chunk coded on its own
    max_cold_cost: float = 2.0
    #: how a restore writes (engine/writepath.py): "auto" (the default), buffered when it
    #: fits in the memory the node can spare (the load after it then reads memory) where
    #: an agent's start-up probes found the page cache at least as fast as warm's write
    #: and read-back
    #: (``page_cache_first``), else warm; "warm", O_DIRECT with each chunk read back into
    #: the page cache by the kernel as it lands, when it fits; "direct", O_DIRECT only
    #: (buffered in spells while the device falls behind: staging.py); "buffered", into
    #: the page cache. Measured from the pull's start to loaded tensors on two disks
    #: (docs/RELIABILITY.md, "How a restore writes")
    write_path: str = "auto"
    #: what ``auto`` found on this node: an agent's start-up probes wrote into the page
    #: cache at least as fast as warm writes to its disk and reads back, so ``auto``
    #: buffers a restore that fits
    #: (else, and in the one-shot CLI, which does not probe, ``auto`` goes warm)
    page_cache_first: bool = False

    def memory_estimate(self) -> int:
        """Bytes a transfer holds at its peak, whatever the checkpoint size: every part in
        flight twice (ours, and the HTTP client's copy of the body), the part being filled,
        and per worker a chunk, its base and its encoding."""
        return (2 * self.window + 1) * self.part_size + 3 * (self.workers + 1) * self.chunk_size

    def within_budget(self, budget: int) -> TransferOptions:
        """The same options with the window shrunk until memory_estimate() fits ``budget``."""
        fixed = self.part_size + 3 * (self.workers + 1) * self.chunk_size
        window = (budget - fixed) // (2 * self.part_size)
        if window < 1:
            least = -(-(fixed + 2 * self.part_size) // MiB)
            raise ValueError(
                f"a memory budget (--memory-mib, memory_mib) of {budget >> 20} MiB is too small "
                f"for {self.part_size >> 20} MiB parts and {self.workers} workers: they need "
                f"at least {least} MiB"
            )
        return dataclasses.replace(self, window=min(window, self.window))

    def __post_init__(self) -> None:
        if not 4096 <= self.chunk_size <= 64 << 20:
            raise ValueError("chunk_size must be within 4 KiB..64 MiB")
        if self.part_size < self.chunk_size:
            raise ValueError("part_size must be at least chunk_size")
        if self.pack_size < self.part_size or self.pack_size > self.part_size * 10_000:
            raise ValueError("pack_size must be within part_size..10,000 x part_size")
        if not 1 <= self.max_chain <= 32:
            raise ValueError("max_chain must be within 1..32")
        if not 0.0 <= self.delta_min_saving < 1.0:
            raise ValueError("delta_min_saving must be within 0..1 (0: any saving)")
        if self.max_cold_cost < 1.0:
            raise ValueError("max_cold_cost must be at least 1 (a multiple of a keyframe)")
        if self.write_path not in WRITE_PATHS:
            raise ValueError(
                f"write_path {self.write_path!r} is not one of {', '.join(WRITE_PATHS)}"
            )
        if self.window < 1 or self.workers < 1:
            raise ValueError("window and workers must be positive")
        if self.dedupe_steps < 0:
            raise ValueError("dedupe_steps must be 0 or more")
        if self.zstd_level is not None and self.zstd_level > ZSTD_MAX_LEVEL:
            # (zstandard refused it only at the first chunk, mid-push)
            raise ValueError(f"zstd_level must be at most {ZSTD_MAX_LEVEL}")


MiB = 1 << 20
_DEFAULT_TRANSFER = TransferOptions()


def _knob(
    default: int | float | bool | str,
    help: str,
    choices: tuple[str, ...] = (),
    *,
    writes: bool = False,
    default_text: str = "",
) -> Any:
    meta = {"help": help, "choices": choices, "writes": writes, "default_text": default_text}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Knob:
    """One tunable as both front doors show it: ``--name-with-dashes`` on the CLI, ``name``
    in its agent config table, ``FERRY_<TABLE>_<NAME>`` in the environment."""

    name: str
    kind: type  # int, float, str (one of ``choices``) or bool (a switch)
    default: int | float | bool | str
    help: str
    choices: tuple[str, ...]
    #: only writing to a store uses it (a push; S3's upload checksum): the commands that
    #: only read (pull, verify, ls, du) do not list it
    writes: bool = False
    #: what the default is when it is not one fixed value ("this machine's cores"); the
    #: value computed here is shown beside it
    default_text: str = ""

    def default_help(self) -> str:
        """``(default 16)``, or ``(default: this machine's cores, 2 here)``."""
        if self.default_text:
            return f"(default: {self.default_text}, {self.default} here)"
        return f"(default {self.default})"


def knobs(settings: type) -> list[Knob]:
    """The tunables a settings class declares (TransferSettings, StoreSettings), in order."""
    kinds = {"int": int, "float": float, "bool": bool, "str": str}
    return [
        Knob(
            f.name,
            kinds[str(f.type)],
            cast(int | float | bool | str, f.default),
            f.metadata["help"],
            f.metadata["choices"],
            f.metadata["writes"],
            f.metadata["default_text"],
        )
        for f in fields(settings)
    ]


#: the options' field names as their messages give them -> the TransferSettings key that
#: sets each (a flag and a config key are named from it: --chunk-size-mib, chunk_size_mib)
SETTING_OF_FIELD = {
    "chunk_size": "chunk_size_mib",
    "part_size": "part_size_mib",
    "pack_size": "pack_size_mib",
    **{k: k for k in ("chunk_size_mib", "zstd_level", "max_chain", "dedupe_steps")},
    **{k: k for k in ("delta_min_saving", "max_cold_cost")},
}


def named_as_settings(text: str) -> str:
    """An options error with its field names given as the settings' keys (``part_size must
    be at least chunk_size`` -> ``part_size_mib must be at least chunk_size_mib``)."""
    return re.sub(r"\b[a-z]+_[a-z_]+\b", lambda m: SETTING_OF_FIELD.get(m[0], m[0]), text)


@dataclass(frozen=True)
class TransferSettings:
    """The tunables in the units people set them in (MiB), declared once: the CLI's flags
    (``--chunk-size-mib``...), the agent's ``[transfer]`` table, its ``FERRY_TRANSFER_*``
    variables and the example config are all made from these fields (``knobs()``)."""

    chunk_size_mib: int = _knob(_DEFAULT_TRANSFER.chunk_size // MiB, "chunk size", writes=True)
    part_size_mib: int = _knob(_DEFAULT_TRANSFER.part_size // MiB, "multipart part / ranged GET")
    pack_size_mib: int = _knob(
        _DEFAULT_TRANSFER.pack_size // MiB, "a pack is closed at this size", writes=True
    )
    window: int = _knob(_DEFAULT_TRANSFER.window, "parts/ranges in flight")
    workers: int = _knob(
        _DEFAULT_TRANSFER.workers, "hash/codec threads", default_text="this machine's cores"
    )
    zstd_level: int = _knob(
        _DEFAULT_TRANSFER.zstd_level or 0, "zstd level; 0 stores raw", writes=True
    )
    dedupe_steps: int = _knob(
        _DEFAULT_TRANSFER.dedupe_steps,
        "a push dedupes against its node's newest this many parts",
        writes=True,
    )
    delta: bool = _knob(
        _DEFAULT_TRANSFER.delta, "delta-code changed chunks against the previous step", writes=True
    )
    max_chain: int = _knob(
        _DEFAULT_TRANSFER.max_chain,
        "most decode steps a restore may need (else a keyframe)",
        writes=True,
    )
    delta_min_saving: float = _knob(
        _DEFAULT_TRANSFER.delta_min_saving,
        "a delta is kept only if this much smaller than a keyframe",
        writes=True,
    )
    max_cold_cost: float = _knob(
        _DEFAULT_TRANSFER.max_cold_cost,
        "... and if a cold restore of it fetches at most this many keyframes",
        writes=True,
    )
    write_path: str = _knob(
        _DEFAULT_TRANSFER.write_path,
        "how restores write: auto (buffered if it fits where an agent's probe finds the page "
        "cache as fast as the disk, else warm), warm (O_DIRECT, read back into memory if it "
        "fits), direct (O_DIRECT) or buffered",
        WRITE_PATHS,
    )
    memory_mib: int = _knob(0, "cap on transfer buffers (shrinks window); 0: none")

    def to_options(self) -> TransferOptions:
        """Raises ValueError when the combination is invalid (e.g. parts smaller than chunks)."""
        if not 1 <= self.chunk_size_mib <= 64:  # (in its own unit: "4 KiB" cannot be set here)
            raise ValueError("chunk_size_mib must be within 1..64")
        options = TransferOptions(
            chunk_size=self.chunk_size_mib * MiB,
            part_size=self.part_size_mib * MiB,
            pack_size=self.pack_size_mib * MiB,
            window=self.window,
            workers=self.workers,
            zstd_level=self.zstd_level or None,
            dedupe_steps=self.dedupe_steps,
            delta=self.delta,
            max_chain=self.max_chain,
            delta_min_saving=self.delta_min_saving,
            max_cold_cost=self.max_cold_cost,
            write_path=self.write_path,
        )
        return options.within_budget(self.memory_mib * MiB) if self.memory_mib else options


@dataclass(frozen=True)
class StoreSettings:
    """How every store is talked to, declared once as TransferSettings is: the CLI's flags
    (``--checksum``, ``--attempts``...), the agent's ``[store]`` table, its
    ``FERRY_STORE_*`` variables and the example config are made from these fields.
    ``open_store`` hands them to whichever backend a URL picks."""

    checksum: str = _knob(
        CHECKSUMS[0],
        "per-part integrity header sent to S3: crc32, md5 or none",
        CHECKSUMS,
        writes=True,
    )
    # at a 10% fault rate all six tries of a request fail once in a million
    attempts: int = _knob(6, "tries per store request while it fails transiently")
    connect_timeout_seconds: float = _knob(10.0, "S3: seconds to open a connection")
    # with 6 tries a silently hung server fails a request within about 6 minutes
    read_timeout_seconds: float = _knob(60.0, "S3: seconds a connection may stay silent")

    def __post_init__(self) -> None:
        if self.checksum not in CHECKSUMS:
            raise ValueError(f"checksum {self.checksum!r} is not one of {', '.join(CHECKSUMS)}")
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if not (self.connect_timeout_seconds > 0 and self.read_timeout_seconds > 0):
            raise ValueError("timeouts must be positive")
