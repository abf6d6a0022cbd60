"""What a pull is asked to restore (``PullPlan``) and what it tells its caller as it goes
(``PullEvents``); where it finds the chunks is transfer/engine/sources.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from transfer.engine.parts import merge_parts
from transfer.engine.progress import NoProgress, Progress
from transfer.engine.ratelimit import RateLimit
from transfer.engine.share import Share
from transfer.engine.sources import Location
from transfer.format.manifest import FileEntry, Manifest


@dataclass(frozen=True)
class PullPlan:
    """One restore. ``step``: None for the latest; ``node``: that node's part only (else
    every part, which together must be the whole save). ``manifests``: the step's
    manifests when the caller has resolved them already (catalog.resolve_checkpoint):
    they are not read again; ``files``: those manifests' files merged (``merged_files``),
    when the caller merged them already: not merged again. ``share``: restore only that
    share of the step (share.py): the chunks that cover its ranges, of which only the
    ranges are written; the copy records what it holds. ``fsync``: flush every file
    before the rename (else the restore is renamed into place with a durable marker and
    settled later: settle.py). ``rate_limit``: a cap on the bytes moved per second, from
    the store and the chunk sources alike; here rather than in TransferOptions because it
    belongs to this restore (a background one is capped, a foreground one beside it is
    not) and is one object that restores share (several background restores stay under
    one cap together), where the options are plain numbers a process sets once.
    ``expected_nodes``: the job's nodes, whose parts make a step whole without its
    completion marker (catalog.resolve_checkpoint, when ``manifests`` is None)."""

    job: str
    step: int | None
    node: str | None = None
    manifests: list[Manifest] | None = None
    files: list[FileEntry] | None = None
    share: Share | None = None
    fsync: bool = False
    rate_limit: RateLimit | None = None
    expected_nodes: tuple[str, ...] = ()


def merged_files(manifests: list[Manifest]) -> list[FileEntry]:
    """The one file list of a step's parts (parts.merge_parts): what a pull restores."""
    return [f for f, _ in merge_parts(manifests)]


def _ignore_landed(cid: str, where: Location) -> None:
    pass


def _ignore_moved(origin: str, nbytes: int) -> None:
    pass


def _ignore_waiting(lock: Path, holder: str, waited: float) -> None:
    pass


@dataclass(frozen=True)
class PullEvents:
    """What a pull tells its caller as it goes; each does nothing unless given.
    ``progress``: the bytes restored, whatever their source. ``landed(id, (file, offset,
    size))``: a chunk written and verified in the staging dir (told from a worker thread;
    a fan-out serves it from there). ``moved(origin, n)``: bytes as they move, from
    ``"store"`` or the chunk source's origin (live progress per source). ``waiting(lock,
    holder, seconds)``: the pull waits for another restore into the same destination
    before it starts (``lock``: the file it holds, ``holder``: its pid and host if known),
    told at once and every minute while it waits."""

    progress: Progress = field(default_factory=NoProgress)
    landed: Callable[[str, Location], None] = _ignore_landed
    moved: Callable[[str, int], None] = _ignore_moved
    waiting: Callable[[Path, str, float], None] = _ignore_waiting
