"""``ferry agent``, ``ferry estimate``, ``ferry plan`` and ``ferry demo``: the commands
about agents and training jobs rather than one store. It owns their parsers, the estimate
asked of an agent and the checkpoint-interval arithmetic; run.py hands ``ferry agent``'s
flags to agent.daemon and ``ferry demo``'s to demo.py."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.cli.args import (
    JOB_HELP,
    _non_negative_float,
    _non_negative_int,
    _positive_float,
    _positive_int,
    add_tls_args,
)
from agent.cli.shared import human
from transfer.errors import FerryError

if TYPE_CHECKING:
    from agent.cli.args import Commands


def add_agent(sub: Commands) -> None:
    p = sub.add_parser("agent", help="run the node agent (RPC; prefetch, estimates, pins)")
    p.add_argument("--config", type=Path, help="TOML file; every key also FERRY_<KEY>")
    p.add_argument(
        "--print-example-config",
        action="store_true",
        help="print a commented config file to start from, and exit",
    )


def add_estimate(sub: Commands) -> None:
    p = sub.add_parser("estimate", help="ask an agent what moving a checkpoint there costs")
    p.add_argument("agent_url", help="e.g. http://node-b:7070 (https:// for a TLS agent)")
    p.add_argument(
        "--token-file", type=Path, required=True, help="the agent's bearer token, in a file"
    )
    add_tls_args(p)
    p.add_argument("--job", required=True, help=JOB_HELP)
    p.add_argument("--step", default="latest", help="a step number, or 'latest' (default: latest)")
    p.add_argument(
        "--gpus",
        type=_non_negative_int,
        default=1,
        help="GPUs idle while the job migrates (default: 1)",
    )
    p.add_argument(
        "--gpu-hour-price",
        type=_non_negative_float,
        default=0.0,
        help="what one GPU-hour costs, for the estimate's cost (default: 0)",
    )
    p.add_argument("--json", action="store_true", help="print the estimate as one JSON object")


def add_plan(sub: Commands) -> None:
    p = sub.add_parser("plan", help="badput and the checkpoint interval that minimises it")
    p.add_argument(
        "--save-seconds", type=_positive_float, required=True, help="training stall per save"
    )
    p.add_argument("--step-seconds", type=_positive_float, required=True, help="one training step")
    p.add_argument(
        "--mtbi-hours", type=_positive_float, required=True, help="mean time between interruptions"
    )
    p.add_argument(
        "--interval-steps", type=_positive_int, help="the interval in use now, to compare"
    )
    p.add_argument("--restart-seconds", type=_non_negative_float, default=0.0)
    p.add_argument("--json", action="store_true")


def add_demo(sub: Commands) -> None:
    p = sub.add_parser("demo", help="run the whole flow on generated checkpoints")
    p.add_argument("--workdir", type=Path, help="keep everything here (default: a temp dir)")


async def cmd_estimate(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    import aiohttp

    from agent.rpc.client import BadTokenError, FerryClient, RpcError

    try:
        token = args.token_file.read_text().strip()
    except OSError as exc:  # (it said "[Errno 2] No such file or directory: 'nope.token'")
        raise FerryError(f"--token-file {args.token_file}: {exc.strerror or exc}") from None
    tls = {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}
    try:
        agent = FerryClient(args.agent_url, token, **tls)
    except BadTokenError as exc:
        raise FerryError(f"--token-file {args.token_file}: {exc}") from None
    async with agent as client:
        try:
            doc: dict[str, Any] = await client.estimate(
                args.job, args.step, gpus=args.gpus, gpu_hour_price=args.gpu_hour_price
            )
        except aiohttp.ClientSSLError as exc:  # (its text names the certificate's problem)
            raise FerryError(f"{client.base_url}: {exc}") from None
        except aiohttp.ClientConnectorError as exc:  # (aiohttp's own text named "ssl:default")
            err = exc.os_error
            why = os.strerror(err.errno) if err.errno else type(exc).__name__
            raise FerryError(f"{client.base_url}: cannot reach the agent ({why})") from None
        except (RpcError, aiohttp.ClientError, TimeoutError) as exc:
            raise FerryError(f"{client.base_url}: {str(exc) or type(exc).__name__}") from None
    gpus = f"{args.gpus} GPU" + ("" if args.gpus == 1 else "s")  # ("1 GPUs")
    line = (
        f"{doc['node']}: {args.job} step {doc['step']}: {human(doc['bytes_missing'])} to move "
        f"(stored bytes) for {human(doc['bytes_total'])} of checkpoint, ~{doc['seconds']:.1f}s "
        f"({doc.get('seconds_low', 0):.1f}-{doc.get('seconds_high', 0):.1f}s), cost "
        f"{_money(doc['cost'])} at {args.gpu_hour_price:g} per GPU-hour ({gpus}); "
        f"recommended scale-down cooldown {doc['cooldown_seconds']:.0f}s"
    )
    return doc, line


def cmd_plan(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    from agent.node.estimate import badput_fraction, optimal_interval_steps

    mtbi = args.mtbi_hours * 3600
    best = optimal_interval_steps(args.save_seconds, args.step_seconds, mtbi)
    doc: dict[str, Any] = {
        "optimal_interval_steps": best,
        "optimal_badput": badput_fraction(
            args.save_seconds, best * args.step_seconds, mtbi, args.restart_seconds
        ),
    }
    line = (
        f"save every {best:,} step{'s' if best != 1 else ''} "
        f"({_duration(best * args.step_seconds)}): badput "
        f"{_percent(doc['optimal_badput'])} of wall time"
    )
    if args.interval_steps:
        now = badput_fraction(
            args.save_seconds, args.interval_steps * args.step_seconds, mtbi, args.restart_seconds
        )
        doc["current_interval_steps"], doc["current_badput"] = args.interval_steps, now
        line += f"; every {args.interval_steps} steps (now): {_percent(now)}"
    if doc["optimal_badput"] >= 0.5:
        line += (
            "; the save and restart are long against the time between interruptions: "
            "shorten them (a faster tier, an async save) before tuning the interval"
        )
    return doc, line


def _duration(seconds: float) -> str:
    """``6.6 ms``, ``42 s``, ``18.6 min``, ``3.2 h``: never "0s" for an interval of 6 ms."""
    if seconds < 1:
        return f"{seconds * 1000:.2g} ms"
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _money(amount: float) -> str:
    """A cost in the unit of --gpu-hour-price: cents where it is 1 or more, else the first
    two significant digits (0.0029, never "0.00" for a cost that is not nothing, nor
    "9.7e-05": a fast estimate's cost was printed so, and a script reading digits failed)."""
    if amount >= 1 or amount <= 0:
        return f"{amount:,.2f}"
    return f"{amount:.{max(2, 1 - math.floor(math.log10(amount)))}f}"


def _percent(fraction: float) -> str:
    """A badput as a percentage, never rounded up to 100% (it never is)."""
    return ">99.99%" if fraction > 0.9999 else f"{fraction:.2%}"
