"""What the command groups share when they run: the one check that a URL is a store, the
default node name, how sizes print, and the failure that still carries its report."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from transfer.units import format_size

if TYPE_CHECKING:
    from transfer.store.base import Store


class VerifyFailed(Exception):
    """The command ran and found something wrong (a bad chunk, a tier's errors): main
    prints the report (``--json``: the document) and exits 1."""

    def __init__(self, doc: dict[str, Any], text: str) -> None:
        super().__init__(text)
        self.doc, self.text = doc, text


def default_node() -> str:
    import socket

    return os.environ.get("FERRY_NODE") or socket.gethostname().split(".")[0] or "node"


async def require_store(store: Store, *, hint: str = "") -> None:
    """The one check that a URL given to a command is a ckpt-ferry store, before the
    command reads or writes anything there (a typo'd URL must not look like an empty store,
    nor a directory in use for something else become one): NotAStoreError naming
    ``ferry init`` (``hint`` appended), from ``require_store``."""
    from transfer.engine import catalog

    await catalog.require_store(store, hint=hint)


#: every size the CLI prints: decimal MB/GB (transfer/units.py; retention's tables too)
human = format_size


async def step_named(store: Store, job: str, text: str) -> int:
    """``--step``'s value as a step number: ``latest`` is the newest complete step, as for
    ``ferry pull --step latest`` (catalog.latest_step: pinning latest protects the step a
    pull of latest restores); CheckpointNotFoundError where none."""
    from agent.cli.args import parse_step
    from transfer.engine.catalog import latest_step

    if text != "latest":
        return parse_step(text)
    return await latest_step(store, job, ())
