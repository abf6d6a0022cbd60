"""The agent's local socket (``local_socket``): its API on a unix socket, for callers on this
node who run as the agent's own user (docs/SECURITY.md, "The local socket").

Who may connect is the file's mode (600: the agent's user, and root) and, per request, the
kernel's word on the caller (``SO_PEERCRED``: agent/rpc/middleware.py): a caller of the
agent's user could do what it asks itself, so no token is needed there, and nothing is
granted to anyone else."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

from agent.daemon.config import ConfigError

#: the socket file's mode: only the agent's user (and root) may connect
MODE = 0o600


class LocalSocket:
    """A listening unix socket at ``path``, mode 600; ``close`` removes its file."""

    def __init__(self, path: Path) -> None:
        """A socket file left by an agent that is gone is replaced; one an agent still
        answers on, or a path that is not a socket, is a ConfigError naming it (two agents
        on one socket would take each other's callers)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(mode):
                raise ConfigError(f"local_socket {path}: exists and is not a socket")
            if _answers(path):
                raise ConfigError(f"local_socket {path}: another agent serves there")
            path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # (made with the umask's mode, typically 755: no other user can connect, since
            # connecting needs write permission, until the chmod narrows it to 600)
            self.sock.bind(str(path))
            os.chmod(path, MODE)
            self._inode = path.lstat().st_ino
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            raise ConfigError(f"local_socket {path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        """Close it and remove its file if the file is still this socket's (a later agent
        may have taken the path: its file is left alone)."""
        self.sock.close()
        with contextlib.suppress(OSError):
            if self.path.lstat().st_ino == self._inode:
                self.path.unlink()


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def peer_uid(sock: Any) -> int | None:
    """The user id of the process at the other end of a unix socket (the kernel's word,
    taken when it connected), or None for any other socket."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)
