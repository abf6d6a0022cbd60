"""What every command group's parser shares: the store, transfer and TLS flags (one per
tunable transfer/options.py declares), the value parsers argparse calls, the options read
back from the flags, and the usage error main reports as argparse does (exit 2)."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from transfer.format.names import MAX_STEP
from transfer.options import (
    SETTING_OF_FIELD,
    StoreSettings,
    TransferOptions,
    TransferSettings,
    knobs,
)

if TYPE_CHECKING:
    from transfer.store import StoreOptions

    Commands = argparse._SubParsersAction[argparse.ArgumentParser]


S = TypeVar("S")


class UsageError(Exception):
    """A command line argparse cannot judge alone: main prints it as a usage error (exit 2)."""


#: the help of every command's store URL (one wording: a newcomer reads it in each command)
STORE_URL_HELP = "the store: a directory (or file://DIR) or s3://BUCKET/PREFIX"
#: the help of a command's --job where it names the job (its steps are numbered within it)
JOB_HELP = "the job: the name its steps are stored under"


def add_store_args(p: argparse.ArgumentParser, *, writes: bool = True) -> None:
    p.add_argument("--endpoint-url", help="S3 endpoint (default: $AWS_ENDPOINT_URL)")
    _add_knobs(p, StoreSettings, writes)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def add_transfer_args(p: argparse.ArgumentParser, *, writes: bool = True) -> None:
    _add_knobs(p, TransferSettings, writes)


def _add_knobs(p: argparse.ArgumentParser, settings: type, writes: bool) -> None:
    """A flag per tunable the settings class declares (transfer/options.py). A command
    that only reads (``writes`` false) does not list the knobs only writing uses; it still
    accepts them, so one set of flags serves a script's push and pull alike."""
    for knob in knobs(settings):
        flag = "--" + knob.name.replace("_", "-")
        listed = writes or not knob.writes
        if knob.kind is bool:  # a switch: --delta / --no-delta
            on = f"{knob.help} (default {'on' if knob.default else 'off'})"
            p.add_argument(
                flag,
                action="store_true",
                default=knob.default,
                help=on if listed else argparse.SUPPRESS,
            )
            p.add_argument(
                "--no-" + flag[2:],
                dest=knob.name,
                action="store_false",
                help=f"{flag} off" if listed else argparse.SUPPRESS,
            )
        else:
            p.add_argument(
                flag,
                type=knob.kind,
                choices=knob.choices or None,
                default=knob.default,
                help=f"{knob.help} {knob.default_help()}" if listed else argparse.SUPPRESS,
            )


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-file", type=Path, help="verify an https agent against this CA bundle "
                   "(the agents' tls_ca_file; default: the system store)")  # fmt: skip
    p.add_argument("--cert-file", type=Path, help="client certificate, for an agent with "
                   "tls_client_auth (PEM; the key in it, or --key-file)")  # fmt: skip
    p.add_argument("--key-file", type=Path, help="the client certificate's key (PEM)")


#: the options' field names as their messages give them -> the flags that set them
_FLAG_OF = {field: "--" + key.replace("_", "-") for field, key in SETTING_OF_FIELD.items()}

#: what some messages open with (no field name) -> the flags that set it
_SUBJECT_FLAGS = {
    "window and workers": "--window and --workers",
    "attempts": "--attempts",
    "timeouts": "--connect/read-timeout-seconds",
}


def _options_error(exc: ValueError) -> UsageError:
    """A usage error naming the flags where an options error names fields
    (``--chunk-size-mib 0`` said "chunk_size must be within 4 KiB..64 MiB" and exited 1):
    field names anywhere, a subject only where the message opens with it, so prose such
    as the memory budget's "2 workers" stays as it is."""
    text = str(exc)
    for subject, flags in _SUBJECT_FLAGS.items():
        if re.match(rf"{subject}\b", text):
            text = flags + text[len(subject) :]
            break
    return UsageError(re.sub(r"\b[a-z]+_[a-z_]+\b", lambda m: _FLAG_OF.get(m[0], m[0]), text))


def transfer_options(args: argparse.Namespace) -> TransferOptions:
    """The transfer options the flags chose; a combination they cannot make is a usage
    error naming the flags."""
    try:
        return chosen(args, TransferSettings).to_options()
    except ValueError as exc:
        raise _options_error(exc) from None


def store_options(args: argparse.Namespace) -> StoreOptions:
    """The store options the command line chose, its pool sized to the window the command
    runs with (``--memory-mib`` may shrink ``--window``; the default window where a command
    has no transfer flags)."""
    from transfer.store import StoreOptions

    window = transfer_options(args).window if hasattr(args, "window") else TransferOptions.window
    try:
        settings = chosen(args, StoreSettings)
    except ValueError as exc:
        raise _options_error(exc) from None
    return StoreOptions.for_window(window, endpoint_url=args.endpoint_url, settings=settings)


def chosen(args: argparse.Namespace, settings: type[S]) -> S:
    """The settings the command line chose (each flag has its declared default)."""
    return settings(**{k.name: getattr(args, k.name) for k in knobs(settings)})


def parse_step(value: str) -> int:
    try:
        step = int(value)
    except ValueError:
        raise UsageError(f"--step must be a number or 'latest', not {value!r}") from None
    if not 0 <= step <= MAX_STEP:  # (a usage error too: exit 2, as for "abc")
        raise UsageError(f"--step must be within 0..{MAX_STEP} or 'latest', not {value!r}")
    return step


# The value parsers below keep their leading underscore: argparse prints a type's __name__
# when it raises ValueError ("invalid _positive_int value: 'x'"), and scripts and tests
# read those messages.


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be within (0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _duration(text: str) -> float:
    from transfer.retention import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _grace(text: str) -> float:
    from transfer.retention import parse_duration

    try:
        return parse_duration(text, allow_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    from transfer.retention import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
