"""``ferry``: push, pull, ls and verify checkpoints against a store URL (and a demo).

Exit codes: 0 success, 1 failure (one-line reason on stderr), 2 usage error.
With ``--json`` exactly one JSON object is printed on stdout.

This module is the parser (each command group adds its own subcommands), the dispatch, how
an outcome is printed, and SIGTERM and broken-pipe handling. The commands live in their
groups: push_pull.py (init, push, pull), store_view.py (ls, du, verify), retention_pins.py
(retention, pin, unpin), agent_tools.py (agent, estimate, plan, demo); what they share is in
args.py (flags, value parsers, options) and shared.py.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

from agent.cli import agent_tools, push_pull, retention_pins, store_view
from agent.cli.args import UsageError
from agent.cli.args import store_options as _store_options  # tests import it from here
from agent.cli.shared import VerifyFailed
from transfer.errors import FerryError

if TYPE_CHECKING:  # the commands import what they need when they run: `ferry --help` is fast
    from agent.cli.args import Commands
    from transfer.engine.progress import Progress
    from transfer.store.base import Store


S = TypeVar("S")


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (and where the usage is), not after
    a screenful of every option; subcommands' parsers are of this class too."""

    #: the command line being parsed (build_parser): a required option's error names it,
    #: not the typo the user made of it
    line: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        commands = tuple(_subcommands(self))
        options = list(self._option_string_actions)
        hint = _did_you_mean(message, options, _Parser.line, commands)
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


#: argparse's words for a value it does not know (its choices listed quoted or, since
#: CPython gh-86357, not), for options it does not know, and for required ones not given
_BAD_CHOICE = re.compile(r"invalid choice: '?([^' ]*)'? \(choose from (.*)\)$")
_BAD_OPTIONS = re.compile(r"unrecognized arguments: (.*)$")
_MISSING = re.compile(r"the following arguments are required: (.*)$")


def _did_you_mean(
    message: str, options: list[str], line: tuple[str, ...] = (), commands: tuple[str, ...] = ()
) -> str:
    """ ", did you mean 'pull'?" for a typo'd command or option close to a known one (a
    newcomer's `ferry pul` got the list of every command and no pointer into it); for a
    required option missing, the option given in ``line`` that looks like a typo of it
    (`--jbo x` was told only that --job is required). ``commands``: the parser's own
    subcommands, where it has them (the message's list is read only for other choices)."""
    if found := _BAD_CHOICE.search(message):
        listed = [w.strip(" '") for w in found[2].split(",")]
        word, known = found[1], list(commands) or listed
    elif found := _BAD_OPTIONS.search(message):
        word = next((w for w in found[1].split() if w.startswith("--")), "")
        word, known = word.split("=", 1)[0], [o for o in options if o.startswith("--")]
    elif found := _MISSING.search(message):
        missing = [m for m in found[1].split(", ") if m.startswith("--")]
        given = (w.split("=", 1)[0] for w in line if w.startswith("--"))
        for typo in (w for w in given if w not in options):
            if close := difflib.get_close_matches(typo, missing, n=1, cutoff=0.6):
                return f" ({typo!r} is not an option: did you mean {close[0]!r}?)"
        return ""
    else:
        return ""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6) if word else []
    return f"; did you mean {close[0]!r}?" if close else ""


#: each command group's parser, by the commands it adds (in `ferry --help`'s order)
_GROUPS: dict[tuple[str, ...], Callable[[Commands], None]] = {
    ("init",): push_pull.add_init,
    ("push",): push_pull.add_push,
    ("pull",): push_pull.add_pull,
    ("ls", "du"): store_view.add_listings,
    ("agent",): agent_tools.add_agent,
    ("estimate",): agent_tools.add_estimate,
    ("plan",): agent_tools.add_plan,
    ("demo",): agent_tools.add_demo,
    ("retention",): retention_pins.add_retention,
    ("pin", "unpin"): retention_pins.add_pins,
    ("verify",): store_view.add_verify,
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command; given the command line, of only the command it names
    (every command's flags cost ~10 ms of each start, which `ferry pull` through the
    agent exists to spare). A line naming none, or an unknown one, or asking the top
    level's help (`ferry -h pull`), gets every command's, so that the help lists them and
    a typo is told its choices. (The top level's options take no value: its first word
    that is not an option is the command.)"""
    _Parser.line = tuple(argv or ())
    parser = _Parser(prog="ferry", description=__doc__.split("\n")[0].replace("``", ""))
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = cast("Commands", parser.add_subparsers(dest="command", required=True))
    # the command, or the top level's help (which names no group) if that comes first
    named = next((a for a in argv or () if a in ("-h", "--help") or a[:1] != "-"), None)
    wanted = [add for names, add in _GROUPS.items() if named in names]
    for add in wanted or _GROUPS.values():
        add(sub)
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name, none for a subcommand's own parser (argparse keeps
    them in its subparsers action)."""
    subs = (a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return cast("dict[str, argparse.ArgumentParser]", next(subs, {}))


class _Version(argparse.Action):
    """``--version``, looked up only when asked: importlib.metadata at every parser build
    cost each ``ferry agent`` ~1 MiB of RSS (the soak's bound caught it)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("ckpt-ferry")
        except PackageNotFoundError:  # (run from a source tree that was never installed)
            found = "(not installed)"
        print(f"ferry {found}")
        parser.exit()


def _progress(args: argparse.Namespace) -> Progress:
    from agent.cli.progress import TerminalProgress
    from transfer.engine.progress import NoProgress

    return TerminalProgress() if not args.json and sys.stderr.isatty() else NoProgress()


_COMMANDS: dict[str, Callable[[Store, argparse.Namespace], Awaitable[tuple[dict[str, Any], str]]]]
_COMMANDS = {
    "init": push_pull.cmd_init,
    "pin": retention_pins.cmd_pin,
    "unpin": retention_pins.cmd_pin,
    # the progress display is chosen here, as the output is; `_progress` is looked up when
    # the command runs (a test replaces it)
    "push": lambda store, args: push_pull.cmd_push(store, args, _progress(args)),
    "pull": lambda store, args: push_pull.cmd_pull(store, args, _progress(args)),
    "ls": store_view.cmd_ls,
    "du": store_view.cmd_du,
    "verify": store_view.cmd_verify,
    "retention": retention_pins.cmd_retention,
}


async def _run(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from transfer.store import open_store

    if args.store_url.startswith("memory://"):
        # an in-process store ends with this process: a push would "succeed" into nothing
        raise UsageError(
            f"{args.store_url}: an in-process (memory://) store lives only as long as one "
            "command; use a path, file:// or s3:// (memory:// is for code and tests)"
        )
    store = open_store(args.store_url, _store_options(args))
    try:
        return await _COMMANDS[args.command](store, args)
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    """The ``ferry`` command. Its one broken-pipe rule: output cut short by its reader
    (``ferry ls | head -1``) ends the command quietly, as a tool killed by SIGPIPE does. A
    ``FerryError`` no command's own handler said (``ferry demo`` or ``ferry agent`` in a
    clone never installed) is one line too."""
    try:
        return _main(argv)
    except FerryError as exc:  # (one no command's own handler said: the C extension not built)
        print(f"ferry: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # what is still buffered would fail again at exit: send it nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + 13  # SIGPIPE


class _Terminated(Exception):
    """SIGTERM arrived: the command was cancelled and its cleanups ran."""


def _run_terminable(command: Coroutine[Any, Any, S]) -> S:
    """``asyncio.run``, with SIGTERM cancelling the command the way Ctrl-C does, so its
    cleanups run (a push releases its lease, removes a local store's temp files and leaves
    its S3 uploads for the same push to complete) instead of the process vanishing
    mid-write."""
    import asyncio
    import signal

    terminated = False

    async def run() -> S:
        nonlocal terminated
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None

        def on_term() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_term)
        try:
            return await command
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        return asyncio.run(run())
    except asyncio.CancelledError:
        if terminated:
            raise _Terminated() from None
        raise


def _through_agent(
    args: argparse.Namespace, defaults: argparse.Namespace
) -> tuple[dict[str, Any], str] | None:
    """The pull done by this node's agent (agent/cli/viaagent.py), or None; SIGTERM ends
    it as it ends a pull here (the agent cancels its pull when this process goes)."""
    import signal

    from agent.cli.viaagent import pull_through_agent

    def on_term(*_: object) -> None:
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return pull_through_agent(args, defaults)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _after_stop(command: str) -> str:
    """What to say after a command was stopped: a push stopped as it commits may have
    committed (seen in a newcomer's trial), so it says how to tell."""
    if command != "push":
        return ""
    return (
        ": the step is committed only if `ferry ls` lists it; the same push again "
        "finishes it, or says it is committed already (an S3 upload it began is kept for "
        "that: `ferry retention` aborts one never finished)"
    )


def _main(argv: list[str] | None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (said by the subcommand: argparse's own message names the top level)
        _subcommands(parser)[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "pull":  # through this node's agent, when one serves the store
        defaults = parser.parse_args(["pull", "-", "-", "--job", "-"])
        return _answer(args, lambda: _through_agent(args, defaults) or _run_terminable(_run(args)))
    import asyncio  # only now: `ferry --help` never needs it (~0.1 s of start-up)

    if args.command == "agent":
        from agent.daemon.run import run_agent  # the agent's config is the daemon's, not the CLI's

        return run_agent(args.config, print_example_config=args.print_example_config)
    if args.command in ("estimate", "plan"):
        try:
            doc, line = (
                asyncio.run(agent_tools.cmd_estimate(args))
                if args.command == "estimate"
                else agent_tools.cmd_plan(args)
            )
        except (FerryError, ValueError, OSError) as exc:
            print(f"ferry {args.command}: error: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(doc) if args.json else line)
        return 0
    if args.command == "demo":
        from agent.cli.demo import main as demo

        return demo(args.workdir, keep=args.workdir is not None)
    return _answer(args, lambda: _run_terminable(_run(args)))


def _answer(args: argparse.Namespace, command: Callable[[], tuple[dict[str, Any], str]]) -> int:
    """Run a store command; print its answer, or its error in one line, as the exit code
    says."""
    try:
        doc, line = command()
    except UsageError as exc:
        print(f"ferry {args.command}: error: {exc} (see ferry {args.command} --help)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None  # (as argparse's own usage errors)
    except VerifyFailed as exc:
        if args.json:
            print(json.dumps(exc.doc))
        print(exc.text, file=sys.stderr)
        return 1
    except (FerryError, ValueError, OSError) as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        if args.json:
            kind = getattr(exc, "error_type", type(exc).__name__)  # (the agent's, for its pull)
            print(json.dumps({"ok": False, "error": msg, "error_type": kind}))
        print(f"ferry {args.command}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ferry {args.command}: interrupted{_after_stop(args.command)}", file=sys.stderr)
        return 130
    except _Terminated:
        print(f"ferry {args.command}: terminated (SIGTERM); stopped cleanly"
              f"{_after_stop(args.command)}", file=sys.stderr)  # fmt: skip
        return 128 + 15
    if args.json:
        print(json.dumps(doc))
    else:
        print(line)
    return 0
