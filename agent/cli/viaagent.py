"""`ferry pull` through this node's agent: with ``FERRY_LOCAL_SOCKET`` set (the agent's
``local_socket``), the pull is asked of the agent, which already has the tier's connections
open, buffers left from its restores and its write path probed (agent/rpc/routes/pull.py);
this process only shows its progress and its answer. Nothing of the engine or the stores
is imported on this path: the point is not to pay a one-shot process's start-up.

The pull runs here as it always did, after a one-line note, when no agent of this user
answers there, the store is not one of the agent's tiers, the agent sees other files at the
destination's path (another mount namespace), the agent is stopping, or a transfer or
store flag was given (the caller's own tuning)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import stat
import sys
from collections.abc import Iterator
from typing import Any, BinaryIO

from agent.cli.args import UsageError
from agent.cli.progress import TerminalProgress
from agent.daemon.localsocket import peer_uid
from transfer.errors import FerryError

#: how long the agent may take to answer the request's headers before the pull runs here
HEADERS_SECONDS = 30.0
#: how long the agent may say nothing during a pull (it sends a line every 5 s) before the
#: pull runs here
QUIET_SECONDS = 60.0
#: the variable naming the agent's local socket (the agent's own ``local_socket`` key)
SOCKET_VARIABLE = "FERRY_LOCAL_SOCKET"
#: flags the agent's pull takes from the caller; any other flag given (a transfer or store
#: tuning) is the caller's own choice, and the pull runs here with it
_PASSED = ("job", "step", "node", "expected_nodes", "fsync", "world_size", "ranks")


class AgentPullError(FerryError):
    """The agent's pull failed: its message, and the type of its error (``error_type``)."""

    def __init__(self, message: str, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def pull_through_agent(
    args: argparse.Namespace, defaults: argparse.Namespace
) -> tuple[dict[str, Any], str] | None:
    """The pull's (doc, line) as the agent did it, or None: pull here (why is said on
    stderr). ``defaults``: the parser's defaults, to tell which flags were given."""
    path = os.environ.get(SOCKET_VARIABLE)
    if not path or not args.store_url:  # (an empty URL: the pull here says what is wrong)
        return None
    _check_flags(args)
    tuned = _tuned(args, defaults)
    if tuned:
        _note(f"{', '.join(tuned)} given: pulling here, not through the agent at {path}")
        return None
    try:
        answer = _Answer(path, json.dumps(_body(args)).encode())
    except (OSError, NotTheAgent) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        _note(f"no agent of this user answers at {SOCKET_VARIABLE}={path} ({why}): pulling here")
        return None
    with answer:
        if answer.status != 200:
            error = _error_of(answer.body.read())
            if error.get("type") in _PULL_HERE or answer.status >= 500:
                _note(f"{error.get('error', answer.status)}: pulling here")
                return None
            raise AgentPullError(
                f"the agent at {path} refused the pull: {error.get('error', answer.status)}",
                str(error.get("type", "AgentPullError")),
            )
        shown = not args.json and sys.stderr.isatty()  # (as run.py's own progress)
        try:
            return _follow(_lines(answer.body), TerminalProgress() if shown else _Quiet(), path)
        except AgentPullError as exc:
            if exc.error_type == "AgentStoppedAfterPull":  # (the step is there, whole)
                _note(f"{exc}: checking {args.dest_dir} here (nothing is fetched again)")
                return None  # (a pull here finds the step there, every chunk checked)
            if exc.error_type not in _PULL_HERE:
                raise
            _note(f"{exc}: pulling here (what it had verified is kept)")
            return None
        except TimeoutError:
            _note(f"the agent at {path} said nothing for {QUIET_SECONDS:.0f}s: pulling here "
                  "(what it had verified is kept)")  # fmt: skip
            return None
        except KeyboardInterrupt:
            answer.close()  # (the agent cancels its pull: unless it had ended already)
            if os.path.isdir(args.dest_dir):
                _note(f"the agent had finished before the interruption: {args.dest_dir} is "
                      "whole")  # fmt: skip
            raise


#: what the agent answers when the pull is better done here (its error type): the store is
#: not its tier, it sees other files at the path, it is stopping; or the agent went away
#: (killed: the connection ended without an answer; or silent past QUIET_SECONDS)
_PULL_HERE = ("NotATier", "NotTheSameFiles", "AgentStopping", "AgentGone")


class NotTheAgent(Exception):
    """What answers at the socket is not a process of this user (someone else's socket)."""


def _check_flags(args: argparse.Namespace) -> None:
    """A flag's bad value is a usage error here as in a pull here (knobs only pushes read
    included: the agent never sees them)."""
    from agent.cli.args import chosen, transfer_options
    from transfer.options import StoreSettings

    transfer_options(args)
    try:
        chosen(args, StoreSettings)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _tuned(args: argparse.Namespace, defaults: argparse.Namespace) -> list[str]:
    """The flags given beyond what the agent's pull takes (the store and paths aside, and
    the knobs only writing uses, which a pull accepts and never reads)."""
    from transfer.options import StoreSettings, TransferSettings, knobs

    skip = {*_PASSED, "command", "store_url", "dest_dir", "base_dir", "items", "endpoint_url",
            "json"}  # fmt: skip
    skip |= {k.name for s in (TransferSettings, StoreSettings) for k in knobs(s) if k.writes}
    given = [
        (name, value)
        for name, value in sorted(vars(args).items())
        if name not in skip and value != getattr(defaults, name, value)
    ]
    return [("--no-" if value is False else "--") + name.replace("_", "-") for name, value in given]


def _body(args: argparse.Namespace) -> dict[str, Any]:
    from transfer.endpoint import endpoint_from_env  # (no store imported: see its module)

    def absolute(value: str | os.PathLike[str] | None) -> str | None:
        # (joined, not normalised: "link/.." is where the link leads, as for a pull here)
        return None if value is None else os.path.join(os.getcwd(), value)

    store_url = args.store_url
    if "://" not in store_url:  # a path: the agent's working directory is not ours
        store_url = absolute(store_url)
    dest = absolute(args.dest_dir)
    assert dest is not None
    return {
        "store_url": store_url,
        "endpoint_url": args.endpoint_url or endpoint_from_env()[0],
        "dest_dir": dest,
        "dest_seen": nearest_dir(dest),
        "base_dir": absolute(args.base_dir),
        "items": absolute(args.items),
        **{name: getattr(args, name) for name in _PASSED},
    }


def nearest_dir(path: str) -> list[Any]:
    """[the nearest directory of ``path`` that exists, its st_dev, its st_ino]: the caller
    sends it, the agent compares its own (another mount namespace sees another). Only a
    missing name is climbed past: a link that leads nowhere here is an OSError."""
    here = os.path.dirname(path)
    while not os.path.lexists(here):
        here = os.path.dirname(here)
    st = os.stat(here)
    return [here, st.st_dev, st.st_ino]


def _follow(
    lines: Iterator[dict[str, Any]], progress: TerminalProgress | _Quiet, path: str
) -> tuple[dict[str, Any], str]:
    """Show the agent's progress and notes; its answer, or its error raised here."""
    for line in lines:
        if "start" in line:
            total, what = line["start"]
            progress.start(int(total), str(what))
        elif "advance" in line:
            progress.started_ago(float(line.get("started_ago", 0.0)))
            progress.advance(int(line["advance"]))
        elif "say" in line:
            print(line["say"], file=sys.stderr, flush=True)
        elif "result" in line:
            progress.finish()
            doc = {**line["result"], "through_agent": path}
            return doc, f"{line['line']} (through the agent at {path})"
        elif "error" in line:
            progress.finish()
            if line.get("type") == "UsageError":
                raise UsageError(line["error"])
            raise AgentPullError(line["error"], str(line.get("type", "AgentPullError")))
    raise AgentPullError(f"the agent at {path} ended the pull without an answer (stopped?)",
                         "AgentGone")  # fmt: skip


def _lines(body: BinaryIO) -> Iterator[dict[str, Any]]:
    for raw in body:
        if raw.strip():
            yield json.loads(raw)


def _error_of(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _note(line: str) -> None:
    print(f"ferry pull: {line}", file=sys.stderr, flush=True)


class _Quiet:
    """No progress shown (--json, or stderr not a terminal): transfer.engine's NoProgress,
    without importing the engine to get it."""

    def start(self, total_bytes: int, what: str) -> None:
        pass

    def started_ago(self, seconds: float) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


class _Answer:
    """One HTTP/1.0 exchange over a unix socket (the agent's local_socket): the request
    sent, the status read; ``body`` is what follows the headers, up to the agent closing
    the connection (HTTP/1.0: no chunks to decode, no http.client and the email parser
    it imports to load). The socket must be this user's, and so must the process that
    listens on it (``peer_uid``): anyone else's is NotTheAgent."""

    def __init__(self, path: str, payload: bytes) -> None:
        st = os.stat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise NotTheAgent("not a socket")
        if st.st_uid != os.geteuid():
            raise NotTheAgent("the socket is another user's")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(HEADERS_SECONDS)  # (an agent that does not answer: pull here)
        try:
            self._sock.connect(path)
            if peer_uid(self._sock) != os.geteuid():  # (the kernel's word on the listener)
                raise NotTheAgent("another user's process listens there")
            self._sock.sendall(
                b"POST /v1/pull HTTP/1.0\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            self.body = self._sock.makefile("rb")
            status_line = self.body.readline().split()  # HTTP/1.0 200 OK
            while self.body.readline().strip():  # (the headers: nothing in them is needed)
                pass
            self._sock.settimeout(QUIET_SECONDS)  # (the agent sends a line every few s)
        except (OSError, NotTheAgent):
            self._sock.close()
            raise
        if len(status_line) < 2 or not status_line[1].isdigit():
            self.close()
            raise ConnectionError(f"not an HTTP answer: {b' '.join(status_line)[:80]!r}")
        self.status = int(status_line[1])

    def close(self) -> None:
        self.body.close()
        self._sock.close()

    def __enter__(self) -> _Answer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
