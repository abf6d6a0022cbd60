"""The agent's local socket (``local_socket``): a unix socket on which it serves
``POST /v1/pull`` to callers on this node who run as its own user (docs/SECURITY.md, "The
local socket").

Who may connect is the file's mode (600) and, per request, the kernel's word on the caller
(``SO_PEERCRED``: agent/rpc/middleware.py): only the agent's own uid, which could do what it
asks itself. The caller checks the same of the agent (``peer_uid``: agent/cli/viaagent.py),
so a socket someone else put at the path is never trusted. Only the standard library and
transfer.errors are imported here: the CLI imports this before anything else."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

from transfer.errors import FerryError

#: the socket file's mode: only the agent's user may connect (root too: the kernel lets it,
#: and the agent then refuses it by its uid)
MODE = 0o600


class LocalSocket:
    """A listening unix socket at ``path``, mode 600; ``close`` removes its file."""

    def __init__(self, path: Path) -> None:
        """A socket file nobody listens on (left by an agent that was killed) is replaced;
        one someone answers on, one that cannot be told, a path that is not a socket, or a
        directory other users may write into is a FerryError naming it (two agents on one
        socket would take each other's callers; a stranger's would take them all)."""
        self.path = path
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # (not group-writable)
        where = path.parent.stat()
        others_write = where.st_mode & 0o022 and not where.st_mode & stat.S_ISVTX
        if others_write or where.st_uid not in (os.geteuid(), 0):
            raise FerryError(f"local_socket {path}: other users may write into {path.parent} "
                             "(use a directory only the agent's user writes)")  # fmt: skip
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(mode):
                raise FerryError(f"local_socket {path}: exists and is not a socket")
            _refuse_unless_stale(path)
            path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # (made with the umask's mode, typically 755: no other user can connect, since
            # connecting needs write permission, until the chmod narrows it to 600; it
            # listens only after that)
            self.sock.bind(str(path))
            os.chmod(path, MODE)
            self._inode = path.lstat().st_ino
            self.sock.listen(128)
        except OSError as exc:
            self.sock.close()
            raise FerryError(f"local_socket {path}: {exc.strerror or exc}") from None

    def close(self) -> None:
        """Close it and remove its file if the file is still this socket's (a later agent
        may have taken the path: its file is left alone)."""
        self.sock.close()
        with contextlib.suppress(OSError):
            if self.path.lstat().st_ino == self._inode:
                self.path.unlink()


def _refuse_unless_stale(path: Path) -> None:
    """Return when nobody listens at ``path`` (the connection refused); else a FerryError."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        return
    except OSError as exc:  # (denied, a full backlog, a timeout: someone may be there)
        why = "cannot tell whether another agent serves there"
        if exc.errno in (errno.EACCES, errno.EPERM):
            why = "it is not this user's to replace"
        raise FerryError(f"local_socket {path}: {why} ({exc.strerror or exc})") from None
    finally:
        probe.close()
    raise FerryError(f"local_socket {path}: another agent serves there")


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
