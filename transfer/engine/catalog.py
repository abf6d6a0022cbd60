"""What a store holds: its descriptor, and the committed manifests by job, step and node."""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from transfer.errors import (
    AlreadyExistsError,
    CheckpointNotFoundError,
    FormatError,
    NotFoundError,
)
from transfer.format import layout
from transfer.format.manifest import Manifest, parse_manifest
from transfer.format.names import check_name
from transfer.store.base import Store


@dataclass(frozen=True)
class CheckpointInfo:
    job: str
    step: int
    node: str
    manifest_bytes: int


async def open_catalog(store: Store, *, create: bool) -> bool:
    """Check the store descriptor (creating it when ``create``). False: not a store yet."""
    await store.check()
    try:
        raw = await store.get(layout.STORE_DESCRIPTOR_KEY)
    except NotFoundError:
        if not create:
            return False
        descriptor = json.dumps(layout.store_descriptor()).encode()
        try:
            await store.put(layout.STORE_DESCRIPTOR_KEY, descriptor, create_only=True)
            return True
        except AlreadyExistsError:  # a concurrent first push won the race
            raw = await store.get(layout.STORE_DESCRIPTOR_KEY)
    try:
        doc = json.loads(raw)
    except ValueError:
        raise FormatError(f"{layout.STORE_DESCRIPTOR_KEY} is not JSON") from None
    layout.check_store_descriptor(doc)
    return True


async def list_checkpoints(store: Store, job: str | None = None) -> list[CheckpointInfo]:
    """Committed manifests, sorted by (job, step, node). Strays and temp files are ignored."""
    found = []
    for obj in await store.list(layout.manifest_prefix(job)):
        parsed = layout.parse_manifest_key(obj.key)
        if parsed is not None:
            found.append(CheckpointInfo(*parsed, manifest_bytes=obj.size))
    found.sort(key=lambda c: (c.job, c.step, c.node))
    return found


async def load_manifest(store: Store, job: str, step: int, node: str) -> Manifest:
    key = layout.manifest_key(job, step, node)
    manifest = parse_manifest(await store.get(key))
    if (manifest.job, manifest.step, manifest.node) != (job, step, node):
        raise FormatError(f"{key} describes {manifest.job}/{manifest.step}/{manifest.node}")
    return manifest


async def resolve_manifests(
    store: Store, job: str, step: int | None, node: str | None = None
) -> list[Manifest]:
    """The manifests of one checkpoint: every node's part, or only ``node``'s.

    ``step=None`` means the newest step that has a part (of ``node``, when given).
    """
    check_name("job", job)
    if not await open_catalog(store, create=False):
        raise CheckpointNotFoundError(f"{store.url} holds no checkpoints (no store descriptor)")
    entries = [
        c
        for c in await list_checkpoints(store, job)
        if (step is None or c.step == step) and (node is None or c.node == node)
    ]
    if not entries:
        what = f"job {job!r}" + (f" step {step}" if step is not None else "")
        what += f" node {node!r}" if node else ""
        raise CheckpointNotFoundError(f"no committed checkpoint for {what} in {store.url}")
    chosen = max(c.step for c in entries)
    return [await load_manifest(store, c.job, c.step, c.node) for c in entries if c.step == chosen]


def step_is_complete(
    parts: Collection[str],
    has_marker: bool,
    expected_nodes: Sequence[str],
    job_writes_markers: bool,
) -> bool:
    """The one rule for "is this step whole" (the prefetcher, the listing and retention all
    ask it): its completion marker, or every expected node's part (the node that would have
    written the marker may have died just after its own part); without expected nodes (a
    single-node view), any part, unless the job writes markers: then it is a multi-node job
    and one part is not the step."""
    if has_marker:
        return True
    if expected_nodes:
        return set(expected_nodes) <= set(parts)
    return not job_writes_markers


async def complete_steps(store: Store, job: str, expected_nodes: Sequence[str]) -> set[int]:
    """The steps of ``job`` in ``store`` that are whole by step_is_complete, from one listing
    of its parts and one of its completion markers."""
    parts: dict[int, set[str]] = {}
    for c in await list_checkpoints(store, job):
        parts.setdefault(c.step, set()).add(c.node)
    markers = {
        parsed[1]
        for obj in await store.list(f"{layout.COMPLETE_PREFIX}{job}/")
        if (parsed := layout.parse_completion_key(obj.key)) is not None and parsed[0] == job
    }
    return {
        step
        for step, nodes in parts.items()
        if step_is_complete(nodes, step in markers, expected_nodes, bool(markers))
    }


async def is_complete(store: Store, job: str, step: int, expected_nodes: Sequence[str]) -> bool:
    """Whether (job, step) is whole in ``store`` (complete_steps, for one step)."""
    return step in await complete_steps(store, job, expected_nodes)


async def latest_complete_step(store: Store, job: str, expected_nodes: Sequence[str]) -> int:
    """The newest step of ``job`` that is complete in ``store``: an incomplete multi-node
    checkpoint (a node still uploading, or dead) is never "latest"."""
    whole = await complete_steps(store, job, expected_nodes)
    if not whole:
        raise CheckpointNotFoundError(f"no complete checkpoint of job {job!r} in {store.url}")
    return max(whole)


async def resolve_checkpoint(
    store: Store, job: str, step: int | None, expected_nodes: Sequence[str]
) -> list[Manifest]:
    """The manifests of the checkpoint a prefetch (or an estimate of one) means by ``step``:
    ``None`` is the newest step that is complete (latest_complete_step) when the job's nodes
    are known, else the newest step with any part (resolve_manifests)."""
    if step is None and expected_nodes:
        step = await latest_complete_step(store, job, expected_nodes)
    return await resolve_manifests(store, job, step)
