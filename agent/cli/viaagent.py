"""`ferry pull` through this node's agent: with ``FERRY_LOCAL_SOCKET`` set (the agent's
``local_socket``), the pull is asked of the agent, which already has the tier's connections
open, buffers left from its restores and its write path probed (agent/rpc/routes/pull.py);
this process only shows its progress and its answer. Standard library only, and imported
before the engine is: the point is not to pay a one-shot process's start-up.

When no agent answers there, or the agent does not serve the store asked for (not one of
its tiers), the pull runs here as it always did, after a one-line note."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from agent.cli.args import UsageError
from agent.cli.progress import TerminalProgress
from transfer.errors import FerryError

if TYPE_CHECKING:
    from transfer.engine.progress import Progress

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
    if not path:
        return None
    tuned = _tuned(args, defaults)
    if tuned:
        _note(f"{', '.join(tuned)} given: pulling here, not through the agent at {path}")
        return None
    try:
        answer = _Answer(path, json.dumps(_body(args)).encode())
    except OSError as exc:
        _note(f"no agent answers at {SOCKET_VARIABLE}={path} ({exc.strerror or exc}): "
              "pulling here")  # fmt: skip
        return None
    with answer:
        if answer.status != 200:
            error = _error_of(answer.body.read())
            if answer.status == 404 and error.get("type") == "NotATier":
                _note(f"{error.get('error')}: pulling here")
                return None
            raise AgentPullError(
                f"the agent at {path} refused the pull: {error.get('error', answer.status)}",
                str(error.get("type", "AgentPullError")),
            )
        shown = not args.json and sys.stderr.isatty()  # (as run.py's own progress)
        return _follow(_lines(answer.body), TerminalProgress() if shown else _Quiet(), path)


def _tuned(args: argparse.Namespace, defaults: argparse.Namespace) -> list[str]:
    """The flags given beyond what the agent's pull takes (the store and paths aside)."""
    skip = {*_PASSED, "command", "store_url", "dest_dir", "base_dir", "items", "endpoint_url",
            "json"}  # fmt: skip
    return [
        "--" + name.replace("_", "-")
        for name, value in sorted(vars(args).items())
        if name not in skip and value != getattr(defaults, name, value)
    ]


def _body(args: argparse.Namespace) -> dict[str, Any]:
    from transfer.endpoint import endpoint_from_env  # (no store imported: see its module)

    def absolute(value: os.PathLike[str] | None) -> str | None:
        return None if value is None else os.path.abspath(value)

    store_url = args.store_url
    if "://" not in store_url:  # a path: the agent's working directory is not ours
        store_url = os.path.abspath(store_url)
    return {
        "store_url": store_url,
        "endpoint_url": args.endpoint_url or endpoint_from_env()[0],
        "dest_dir": absolute(args.dest_dir),
        "base_dir": absolute(args.base_dir),
        "items": absolute(args.items),
        **{name: getattr(args, name) for name in _PASSED},
    }


def _follow(
    lines: Iterator[dict[str, Any]], progress: Progress, path: str
) -> tuple[dict[str, Any], str]:
    """Show the agent's progress and notes; its answer, or its error raised here."""
    for line in lines:
        if "start" in line:
            total, what = line["start"]
            progress.start(int(total), str(what))
        elif "advance" in line:
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
    raise AgentPullError(
        f"the agent at {path} ended the pull without an answer (its log says why)",
        "AgentPullError",
    )


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
    """No progress shown (--json, or stderr not a terminal)."""

    def start(self, total_bytes: int, what: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


class _Answer:
    """One HTTP/1.0 exchange over a unix socket (the agent's local_socket): the request
    sent, the status read; ``body`` is what follows the headers, up to the agent closing
    the connection (HTTP/1.0: no chunks to decode, no http.client and the email parser
    it imports to load). No timeout: a long pull is quiet between progress lines."""

    def __init__(self, path: str, payload: bytes) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
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
        except OSError:
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
