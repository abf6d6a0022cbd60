"""Demotion's data path: copy one committed step from a tier to the next, and check that a
step is really there before the colder copy is all that is left.

A copy moves packs byte for byte under their own ids (ids are random, so they cannot
collide with the destination's) and then the manifests unchanged, create-only, then the
completion marker: the same order as a push, so a crash leaves no visible partial step.
Copied packs are not deduplicated against the destination's own packs; the agent normally
pushes every step to every tier, and a copy is only the repair for one that is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.engine.catalog import list_parts, load_manifest, open_catalog
from transfer.engine.parts import without_common_index
from transfer.errors import AlreadyExistsError, FerryError, NotFoundError
from transfer.format import layout
from transfer.format.manifest import parse_manifest
from transfer.store.base import Store

#: bytes per part when copying a pack (well above S3's 5 MiB minimum)
COPY_PART_BYTES = 16 << 20


@dataclass
class CopyResult:
    packs_copied: int = 0
    bytes_copied: int = 0
    manifests_copied: int = 0


async def copy_step(src: Store, dst: Store, job: str, step: int) -> CopyResult:
    """Copy every committed part of (job, step), and its completion marker, from ``src``."""
    result = CopyResult()
    await open_catalog(dst, create=True)
    nodes = [c.node for c in await list_parts(src, job, step)]
    if not nodes:
        raise NotFoundError(f"{src.url} holds no part of {job} step {step}")
    kept_theirs = False  # a part ``dst`` holds already, perhaps of another save
    for node in nodes:
        key = layout.manifest_key(job, step, node)
        raw = await src.get(key)
        manifest = parse_manifest(raw)
        for pack_id in manifest.packs:
            copied = await _copy_pack(src, dst, pack_id)
            result.packs_copied += copied > 0
            result.bytes_copied += copied
        try:
            await dst.put(key, raw, create_only=True)
            result.manifests_copied += 1
        except AlreadyExistsError:  # manifests are immutable: theirs stays
            kept_theirs |= await dst.get(key) != raw  # (not ours: another save of the step)
    marker = layout.completion_key(job, step)
    try:
        doc = await src.get(marker)
    except NotFoundError:
        return result
    if kept_theirs:  # (the index says where src's parts keep the items: not dst's)
        doc = without_common_index(doc)
    with contextlib.suppress(AlreadyExistsError):
        await dst.put(marker, doc, create_only=True)
    return result


async def _copy_pack(src: Store, dst: Store, pack_id: str) -> int:
    """Bytes copied; 0 when ``dst`` already holds the pack."""
    key = layout.pack_key(pack_id)
    size = (await src.head(key)).size
    try:
        if (await dst.head(key)).size == size:
            return 0
    except NotFoundError:
        pass
    upload = await dst.begin_upload(key)
    try:
        for number, offset in enumerate(range(0, max(size, 1), COPY_PART_BYTES), start=1):
            end = min(offset + COPY_PART_BYTES, size)
            data = await src.get(key, offset, end) if end > offset else b""
            await upload.write_part(number, offset, data)
        await upload.complete()
    except BaseException:
        await upload.abort()
        raise
    return size


async def step_problems(
    store: Store, job: str, step: int, nodes: Sequence[str], need_marker: bool
) -> list[str]:
    """Why (job, step) is not safely in ``store``; empty when every part in ``nodes`` is
    committed there, readable, and every pack it needs exists and is long enough for the
    chunks it holds (a structural check: ``ferry verify`` re-reads and hashes the bytes)."""
    problems = []
    if need_marker and not await store.exists(layout.completion_key(job, step)):
        problems.append(f"{job} step {step} has no completion marker in {store.url}")
    for node in nodes:
        try:
            manifest = await load_manifest(store, job, step, node)
        except FerryError as exc:
            problems.append(f"{job} step {step} node {node}: {exc}")
            continue
        needed: dict[str, int] = {}
        for chunk in manifest.all_chunks():
            pack_id = manifest.packs[chunk.pack]
            needed[pack_id] = max(needed.get(pack_id, 0), chunk.offset + chunk.stored)
        for pack_id, length in needed.items():
            try:
                size = (await store.head(layout.pack_key(pack_id))).size
            except NotFoundError:
                problems.append(f"{job} step {step} node {node}: pack {pack_id} is missing")
                continue
            if size < length:
                problems.append(
                    f"{job} step {step} node {node}: pack {pack_id} has {size} bytes, "
                    f"its chunks need {length}"
                )
    return problems
