"""The user's state directory, where the one-shot CLI keeps what outlives a command (a
push's resume log: journal.py) and finds what this node's agent left for it (its write
probe's choice: writechoice.py). Its own module: the CLI's start imports it, and journal.py
brings sqlite3."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/ckpt-ferry`` (default ``~/.local/state/ckpt-ferry``); raises
    RuntimeError where neither that nor a home directory is known."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "ckpt-ferry"
