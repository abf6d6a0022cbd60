"""What DCP's own load planner reads, for layouts the pure rule (``dcpshare``) does not cover.

``transfer.engine.dcpshare`` computes a share from ``.metadata`` alone, assuming the new
ranks hold sharded tensors as ``Shard(0)`` over a 1-D mesh. For anything else (2-D meshes,
tensor parallel, a custom layout) the truth is what torch's ``DefaultLoadPlanner`` plans for
the actual state_dict, so this helper runs that planner where the model lives and writes
the result as the explicit item list ``dcpshare.ranges_from_items`` reads.

torch is imported inside the functions: the rest of ckpt-ferry never needs it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transfer.engine.dcp import METADATA
from transfer.engine.dcpshare import Ranges, merge_ranges


def _containers_copied(obj: Any) -> Any:
    """``obj`` with every dict / list / tuple copied and the leaves shared: the planner's
    set-up replaces meta-device tensors inside the containers in place, and the caller's
    state_dict must stay as it was."""
    if isinstance(obj, dict):
        return {k: _containers_copied(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_containers_copied(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_containers_copied(v) for v in obj)
    return obj


def planned_ranges(
    state_dict: dict[str, Any], metadata_path_or_dir: str | os.PathLike[str]
) -> Ranges:
    """{storage file: merged byte ranges} that ``dcp.load(state_dict)`` on this rank reads
    with the default planner, from the checkpoint's ``.metadata`` (a file or its directory).

    Runs torch's ``DefaultLoadPlanner`` (set-up, then ``create_local_plan``; the default
    global plan leaves local plans unchanged) and maps each ReadItem through
    ``metadata.storage_data``: ``FileSystemReader`` reads every named item whole. No tensor
    data is read. Tensors may be on the meta device; torch's planner set-up then allocates
    uninitialised local tensors for them on the process group's default device (so a
    process group must be initialised, as it is wherever the model lives)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    path = Path(metadata_path_or_dir)
    root = path.parent if path.name == METADATA and path.is_file() else path
    metadata = FileSystemReader(str(root)).read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(_containers_copied(state_dict), metadata, is_coordinator=False)
    plan = planner.create_local_plan()
    items: list[tuple[str, int, int]] = []
    for read_item in plan.items:
        info = metadata.storage_data[read_item.storage_index]
        items.append((info.relative_path, int(info.offset), int(info.length)))
    return merge_ranges(items)


def write_items(ranges: Ranges, path: str | os.PathLike[str]) -> None:
    """Write ``ranges`` as the explicit JSON item list ``[{"path", "offset", "length"}, ...]``
    that ``dcpshare.ranges_from_items`` validates and reads back."""
    doc = [
        {"path": rel, "offset": start, "length": end - start}
        for rel, spans in sorted(ranges.items())
        for start, end in spans
    ]
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")
