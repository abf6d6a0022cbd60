"""The manifest: one committed checkpoint part (job, step, node) and where its bytes live.

A manifest is the commit record: it is written last, create-only, after every pack it names
is durable. Everything read back is validated here before anyone acts on it, because a store
can be corrupted or hostile (paths escaping the destination, absurd sizes, unknown versions).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from transfer.errors import FormatError
from transfer.format.chunkid import HASH_NAME, is_chunk_id
from transfer.format.layout import check_pack_id
from transfer.format.names import check_name, check_step
from transfer.format.paths import check_relative_path

MANIFEST_FORMAT = "ckpt-ferry-manifest"
#: 2 added delta chunks ("base" on a chunk, the "bases" table); 3 lets a file's chunks have
#: any sizes up to chunk_size (cut at a DCP file's items: engine/chunkspans.py). A writer
#: writes 3 only for a manifest that needs it, so a part cut every chunk_size bytes stays
#: readable by the agents of version 2 beside it in a fleet being upgraded.
MANIFEST_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
FIXED_CHUNKS_BEFORE = 3  # versions below this cut every file every chunk_size bytes
MAX_CHAIN = 64  # decode steps a reader accepts for one chunk (writers use far fewer)
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 64 << 20  # bounds the memory one chunk may cost a reader
MAX_FILE_BYTES = 1 << 50
MAX_FILES = 1_000_000
MAX_MANIFEST_BYTES = 512 << 20


def needs_base(enc: str) -> bool:
    """The encoding grammar's one rule the format checks (the names themselves are the
    codec's, transfer/codec/encodings.py): a pipeline that starts with ``xor`` decodes
    against a base chunk, and only such a chunk names one."""
    return enc.split("+", 1)[0] == "xor"


#: ``extra`` key a push of one node's part of a multi-node save (``--part``) sets: the part
#: alone is not the step, whatever it holds (retention then takes the job for a multi-node
#: one, whose steps are whole only by a completion marker or the expected nodes' parts)
PART_EXTRA = "part"


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One chunk of a file: its content id, decoded size, and where its encoded bytes are."""

    id: str
    size: int
    enc: str
    pack: int  # index into Manifest.packs
    offset: int  # byte offset of the encoded chunk inside the pack
    stored: int  # encoded length in the pack
    base: str | None = None  # id of the chunk this one is a delta against


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    mode: int
    chunks: tuple[ChunkRef, ...]
    #: None: ``chunks`` cover the file end to end. Else where each chunk starts: a file
    #: known only in part (a step's common index, format/stepcommon.py), whose other bytes
    #: no chunk here describes; never written into a manifest
    starts: tuple[int, ...] | None = None

    def chunk_offsets(self) -> Iterator[tuple[int, ChunkRef]]:
        """(offset in the file, chunk) for each chunk, in order."""
        if self.starts is not None:
            yield from zip(self.starts, self.chunks, strict=True)
            return
        pos = 0
        for chunk in self.chunks:
            yield pos, chunk
            pos += chunk.size


@dataclass(frozen=True, slots=True)
class Manifest:
    job: str
    step: int
    node: str
    created_at: str
    chunk_size: int
    packs: tuple[str, ...]
    files: tuple[FileEntry, ...]
    #: chunks needed only as bases of delta chunks (transitively), with their locations
    bases: tuple[ChunkRef, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    #: SHA-256 of the bytes it was parsed from (None: made in memory): what a step's
    #: common index records of each part (format/stepcommon.py), whatever version wrote it
    digest: str | None = field(default=None, compare=False)

    def all_chunks(self) -> Iterator[ChunkRef]:
        for f in self.files:
            yield from f.chunks
        yield from self.bases

    @property
    def bytes_raw(self) -> int:
        return sum(f.size for f in self.files)

    def same_content(self, other: Manifest) -> bool:
        """True when both describe the same files with the same bytes (locations may differ)."""

        def shape(m: Manifest) -> list[tuple[str, int, int, list[str]]]:
            return sorted((f.path, f.size, f.mode, [c.id for c in f.chunks]) for f in m.files)

        return (self.job, self.step, self.node) == (other.job, other.step, other.node) and shape(
            self
        ) == shape(other)

    def fixed_chunks(self) -> bool:
        """Whether every file is cut every ``chunk_size`` bytes (format version 2's rule)."""
        return all(_fixed(f.chunks, self.chunk_size) for f in self.files)

    def to_json(self) -> bytes:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION if not self.fixed_chunks() else FIXED_CHUNKS_BEFORE - 1,
            "hash": HASH_NAME,
            "job": self.job,
            "step": self.step,
            "node": self.node,
            "created_at": self.created_at,
            "chunk_size": self.chunk_size,
            "packs": list(self.packs),
            "bases": [chunk_doc(c) for c in self.bases],
            "files": [
                {
                    "path": f.path,
                    "size": f.size,
                    "mode": f.mode,
                    "chunks": [chunk_doc(c) for c in f.chunks],
                }
                for f in self.files
            ],
            **({"extra": self.extra} if self.extra else {}),
        }
        return json.dumps(doc, separators=(",", ":")).encode()


def chunk_doc(c: ChunkRef) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "id": c.id,
        "size": c.size,
        "enc": c.enc,
        "pack": c.pack,
        "offset": c.offset,
        "stored": c.stored,
    }
    if c.base is not None:
        doc["base"] = c.base
    return doc


def int_field(doc: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = 1 << 62) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FormatError(f"{where}: field {key!r} must be an integer in {lo}..{hi}, got {value!r}")
    return value


def parse_chunk(doc: object, where: str, n_packs: int, version: int) -> ChunkRef:
    if not isinstance(doc, dict):
        raise FormatError(f"{where}: chunk must be an object")
    cid = doc.get("id")
    if not is_chunk_id(cid):
        raise FormatError(f"{where}: chunk id {cid!r} is not a {HASH_NAME} hex digest")
    enc = doc.get("enc")
    if not isinstance(enc, str) or not enc or len(enc) > 64:
        raise FormatError(f"{where}: chunk encoding {enc!r} is not a name")
    base = doc.get("base")
    if base is not None and (version < 2 or not is_chunk_id(base) or base == cid):
        raise FormatError(f"{where}: chunk {cid} has an invalid base {base!r}")
    if needs_base(enc) != (base is not None):
        raise FormatError(f"{where}: chunk {cid}: encoding {enc!r} and base disagree")
    return ChunkRef(
        id=cid,  # type: ignore[arg-type]  # checked by is_chunk_id
        size=int_field(doc, "size", where, 0, MAX_CHUNK_BYTES),
        enc=enc,
        pack=int_field(doc, "pack", where, 0, max(n_packs - 1, 0)) if n_packs else _no_pack(where),
        offset=int_field(doc, "offset", where),
        stored=int_field(doc, "stored", where, 0, MAX_CHUNK_BYTES + (1 << 20)),
        base=base,
    )


def _no_pack(where: str) -> int:
    raise FormatError(f"{where}: chunk refers to a pack but the manifest lists none")


def parse_manifest(raw: bytes) -> Manifest:
    """Parse and fully validate a manifest; raise FormatError naming the first problem."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest is {len(raw)} bytes, over the {MAX_MANIFEST_BYTES} limit")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"manifest is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise FormatError("not a ckpt-ferry manifest (missing or wrong 'format')")
    version = doc.get("version")
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise FormatError(
            f"manifest version {version!r} is not supported (this reader understands "
            f"versions {', '.join(map(str, READABLE_VERSIONS))}); upgrade ckpt-ferry"
        )
    if doc.get("hash") != HASH_NAME:
        raise FormatError(f"manifest hash {doc.get('hash')!r} is not supported ({HASH_NAME})")
    job = check_name("job", doc.get("job"))
    node = check_name("node", doc.get("node"))
    step = check_step(doc.get("step"))
    created_at = doc.get("created_at")
    if not isinstance(created_at, str):
        raise FormatError("manifest: 'created_at' must be a string")
    chunk_size = int_field(doc, "chunk_size", "manifest", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    packs_doc = doc.get("packs")
    if not isinstance(packs_doc, list):
        raise FormatError("manifest: 'packs' must be a list")
    packs = tuple(check_pack_id(p) for p in packs_doc)
    files_doc = doc.get("files")
    if not isinstance(files_doc, list) or len(files_doc) > MAX_FILES:
        raise FormatError(f"manifest: 'files' must be a list of at most {MAX_FILES}")
    files = [_parse_file(i, f, len(packs), version, chunk_size) for i, f in enumerate(files_doc)]
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            raise FormatError(f"manifest lists {f.path!r} twice")
        seen.add(f.path)
    _check_no_file_dir_clash(seen)
    bases_doc = doc.get("bases", [])
    if not isinstance(bases_doc, list) or (bases_doc and version < 2):
        raise FormatError("manifest: 'bases' must be a list (version 2 and later)")
    bases = tuple(parse_chunk(c, "manifest bases", len(packs), version) for c in bases_doc)
    extra = doc.get("extra", {})
    if not isinstance(extra, dict):
        raise FormatError("manifest: 'extra' must be an object")
    digest = hashlib.sha256(raw).hexdigest()
    manifest = Manifest(
        job, step, node, created_at, chunk_size, packs, tuple(files), bases, extra, digest
    )
    chain_depths(manifest)  # every base resolves, no cycles, bounded chains
    return manifest


def _parse_file(i: int, fdoc: object, packs: int, version: int, chunk_size: int) -> FileEntry:
    if not isinstance(fdoc, dict):
        raise FormatError(f"manifest file #{i}: must be an object")
    path = check_relative_path(fdoc.get("path"))
    where = f"manifest file {path!r}"
    size = int_field(fdoc, "size", where, 0, MAX_FILE_BYTES)
    mode = int_field(fdoc, "mode", where, 0, 0o7777) & 0o777  # never setuid/setgid/sticky
    chunks_doc = fdoc.get("chunks")
    if not isinstance(chunks_doc, list):
        raise FormatError(f"{where}: 'chunks' must be a list")
    chunks = tuple(parse_chunk(c, where, packs, version) for c in chunks_doc)
    if sum(c.size for c in chunks) != size:
        raise FormatError(f"{where}: chunk sizes do not add up to the file size {size}")
    if version < FIXED_CHUNKS_BEFORE and not _fixed(chunks, chunk_size):
        raise FormatError(f"{where}: chunks do not follow the chunk_size {chunk_size} rule")
    if any(not 0 < c.size <= chunk_size for c in chunks):
        raise FormatError(f"{where}: a chunk is empty or larger than chunk_size {chunk_size}")
    return FileEntry(path=path, size=size, mode=mode, chunks=chunks)


def _fixed(chunks: tuple[ChunkRef, ...], chunk_size: int) -> bool:
    """Fixed-size chunks at fixed offsets: all but the last exactly chunk_size."""
    return all(c.size == chunk_size for c in chunks[:-1]) and (
        not chunks or 0 < chunks[-1].size <= chunk_size
    )


def chain_depths(manifest: Manifest) -> dict[str, int]:
    """Decode steps per chunk id (0: no base). Raises FormatError when a base is missing
    from the manifest, the chain loops, or it is longer than MAX_CHAIN."""
    by_id: dict[str, ChunkRef] = {}
    for c in manifest.all_chunks():
        # the same content may be listed many times, but always with one location and base
        if by_id.setdefault(c.id, c) != c:
            raise FormatError(f"chunk {c.id} is listed with two different records")
    depth: dict[str, int] = {}
    for start in by_id:
        chain: list[str] = []
        cid: str | None = start
        while cid is not None and cid not in depth:
            if cid in chain or len(chain) > MAX_CHAIN:
                raise FormatError(f"chunk {start}: base chain loops or exceeds {MAX_CHAIN}")
            chain.append(cid)
            ref = by_id.get(cid)
            if ref is None:
                raise FormatError(f"chunk {chain[-2]}: its base {cid} is not in the manifest")
            cid = ref.base
        known = -1 if cid is None else depth[cid]
        for i, link in enumerate(reversed(chain)):
            depth[link] = known + 1 + i
        if depth[start] > MAX_CHAIN:
            raise FormatError(f"chunk {start}: base chain exceeds {MAX_CHAIN}")
    return depth


def _check_no_file_dir_clash(paths: set[str]) -> None:
    """A path may not be both a file and a parent directory of another file."""
    for path in paths:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            parent = "/".join(parts[:depth])
            if parent in paths:
                raise FormatError(f"manifest lists {parent!r} as a file and as a directory")
