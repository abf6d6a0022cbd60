"""Choosing the delta base of a push, and where its bytes can be read locally."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from transfer.engine.catalog import Catalog
from transfer.errors import CheckpointNotFoundError, FormatError, NotFoundError
from transfer.format.manifest import ChunkRef, Manifest
from transfer.format.names import step_from_dirname

log = logging.getLogger(__name__)


@dataclass
class BasePlan:
    manifest: Manifest
    local_dir: Path | None  # a local copy to try first (every chunk is hash-checked)
    _at: dict[tuple[str, int], ChunkRef] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._at = {
            (f.path, offset): chunk
            for f in self.manifest.files
            for offset, chunk in f.chunk_offsets()
        }

    def chunk_at(self, path: str, offset: int) -> ChunkRef | None:
        """The base's chunk that starts at the same file offset (DCP writes the same layout
        each save, and the push cuts both at the same items: chunkspans.py)."""
        return self._at.get((path, offset))


async def choose_base(
    catalog: Catalog,
    ckpt_dir: Path,
    *,
    job: str,
    step: int,
    node: str,
    base_step: int | None,
    base_dir: Path | None,
) -> BasePlan | None:
    """The newest committed part of (job, node) before ``step``, or ``base_step``: found
    from the node's own steps (its head), never from a listing of every node's parts."""
    if base_step is not None:
        candidates = [base_step]
    else:
        candidates = sorted(s for s in await catalog.node_steps(job, node) if s < step)[::-1]
    for chosen in candidates:
        try:
            manifest = await catalog.manifest(job, chosen, node)
        except NotFoundError:
            if base_step is not None:
                raise CheckpointNotFoundError(
                    f"base step {base_step} of {job}/{node} is not committed"
                ) from None
            continue  # deleted since the head named it: the next older one
        except FormatError as exc:  # a delta is an optimisation: push a keyframe instead
            log.warning("cannot use step %s as delta base, pushing a keyframe: %s", chosen, exc)
            return None
        return BasePlan(manifest, base_dir or _sibling_with_step(ckpt_dir, chosen))
    return None


def _sibling_with_step(ckpt_dir: Path, step: int) -> Path | None:
    """A directory beside ``ckpt_dir`` whose name carries ``step`` (e.g. step_000100)."""
    parent = ckpt_dir.absolute().parent
    try:
        for candidate in parent.iterdir():
            if candidate.is_dir() and step_from_dirname(candidate.name) == step:
                return candidate
    except OSError:
        return None
    return None
