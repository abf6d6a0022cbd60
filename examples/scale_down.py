"""Play an elastic scheduler's scale-down with the ckpt-ferry agents of the surviving nodes.

Before a node is taken away, every survivor must hold the checkpoint the shrunk job restarts
from. The scheduler:

0. (beforehand, when it picks the likely survivors: ``--register-standby``) makes each
   survivor a standby for the job (PUT /v1/standby/{job}), so every new durable step is
   copied there in the background and step 3 finds it already there,
1. asks each survivor's agent what bringing the checkpoint over costs (GET /v1/estimate),
2. pins the checkpoint on each (POST /v1/pins) so retention keeps it while this runs,
3. starts a prefetch on every survivor at once (POST /v1/prefetch), as one fan-out group
   (the store is read about once for all of them, not once each), and polls them,
4. commits the scale-down only when all are ``ready``; if one fails or the timeout passes,
   it cancels the others (DELETE /v1/prefetch/{id}) and aborts,
5. unpins either way.

    python examples/scale_down.py --job llama --survivors http://10.0.0.7:7070 \\
        http://10.0.0.8:7070 --token-file /etc/ferry/token --gpus 8 --gpu-hour-price 2.5

Exit status: 0 after "COMMIT scale-down", 1 after "ABORT scale-down", 2 on usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from agent.client import FerryClient, RpcError

FINAL = ("ready", "failed", "cancelled")
#: Errors of one RPC: an HTTP error answer, a connection problem, or a request timeout.
RPC_ERRORS = (RpcError, aiohttp.ClientError, TimeoutError)


@dataclass
class Survivor:
    url: str
    client: FerryClient
    node: str = ""
    estimate: dict[str, Any] = field(default_factory=dict)
    pinned: bool = False
    prefetch_id: str | None = None
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.node or self.url


class Abort(Exception):
    """The scale-down cannot be committed; the message says why."""


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _step(value: str) -> int | str:
    if value == "latest":
        return value
    if not value.isdecimal():
        raise argparse.ArgumentTypeError(f"expected a step number or 'latest', got {value!r}")
    return int(value)


def _positive(value: str) -> float:
    number = float(value)
    if not (number > 0 and math.isfinite(number)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value!r}")
    return number


def _non_negative(value: str) -> float:
    number = float(value)
    if not (number >= 0 and math.isfinite(number)):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {value!r}")
    return number


def _count(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value!r}")
    return number


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--job", required=True, help="the training job's name")
    p.add_argument("--step", type=_step, default="latest", help="a step number or 'latest'")
    p.add_argument(
        "--survivors",
        nargs="+",
        required=True,
        metavar="URL",
        help="agent URLs of the nodes that keep running the job (http://HOST:7070)",
    )
    p.add_argument("--token-file", type=Path, required=True, help="the agents' bearer token")
    p.add_argument("--gpus", type=_count, default=1, help="GPUs idle while the job migrates")
    p.add_argument("--gpu-hour-price", type=_non_negative, default=0.0, help="per GPU-hour")
    p.add_argument(
        "--timeout",
        type=_positive,
        default=600.0,
        help="seconds for the whole migration; also the pins' TTL (default 600)",
    )
    p.add_argument("--poll", type=_positive, default=0.5, help="status poll interval, seconds")
    p.add_argument(
        "--register-standby",
        action="store_true",
        help="only make the survivors standbys for the job (run it ahead of the decision)",
    )
    args = p.parse_args(argv)
    if len(set(args.survivors)) != len(args.survivors):
        p.error("--survivors lists the same URL twice")
    return args


def _table(rows: list[list[str]], right: set[int]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())


async def estimate_all(survivors: list[Survivor], args: argparse.Namespace) -> int:
    """Fill in every survivor's estimate; returns the (resolved) step."""
    step: int | str = args.step
    if step == "latest":  # resolve once, so every survivor estimates, pins and fetches one step
        first = await survivors[0].client.estimate(args.job, "latest")
        step = int(first["step"])
    answers = await asyncio.gather(
        *(
            s.client.estimate(args.job, step, gpus=args.gpus, gpu_hour_price=args.gpu_hour_price)
            for s in survivors
        ),
        return_exceptions=True,
    )
    failed = []
    for s, answer in zip(survivors, answers, strict=True):
        if isinstance(answer, BaseException):
            failed.append(f"{s.url}: estimate failed: {answer}")
        else:
            s.estimate, s.node = answer, str(answer["node"])
    if failed:
        raise Abort("; ".join(failed))
    assert isinstance(step, int)
    return step


def print_estimates(survivors: list[Survivor], job: str, step: int) -> None:
    print(f"job {job} step {step}: estimates of the survivors")
    rows = [["node", "bytes missing", "predicted s", "cost", "cooldown s"]]
    for s in survivors:
        e = s.estimate
        rows.append(
            [
                s.name,
                f"{_human(e['bytes_missing'])} of {_human(e['bytes_total'])}",
                f"{e['seconds']:.2f}",
                f"{e['cost']:.4f}",
                str(math.ceil(e["cooldown_seconds"])),
            ]
        )
    _table(rows, right={1, 2, 3, 4})
    cooldown = max(math.ceil(s.estimate["cooldown_seconds"]) for s in survivors)
    cost = sum(s.estimate["cost"] for s in survivors)
    print(f"total cost {cost:.4f}; scale-down cooldown (max over survivors) {cooldown} s\n")


async def pin_all(survivors: list[Survivor], job: str, step: int, ttl: float) -> None:
    answers = await asyncio.gather(
        *(s.client.pin(job, step, ttl_s=ttl) for s in survivors), return_exceptions=True
    )
    failed = []
    for s, answer in zip(survivors, answers, strict=True):
        if isinstance(answer, BaseException):
            failed.append(f"{s.name}: pin failed: {answer}")
        else:
            s.pinned = True
    if failed:
        raise Abort("; ".join(failed))
    print(f"pinned {job} step {step} on {len(survivors)} node(s) for {ttl:.0f} s")


async def start_all(survivors: list[Survivor], job: str, step: int, deadline_s: float) -> None:
    # one fan-out group: the survivors split the checkpoint's chunks, each reads its share
    # from the object store and serves it to the others (it is read about once in all)
    members = [s.url for s in survivors]
    group = len(members) > 1
    answers = await asyncio.gather(
        *(
            s.client.prefetch(
                job, step, deadline_s=deadline_s, fanout=(members, s.url) if group else None
            )
            for s in survivors
        ),
        return_exceptions=True,
    )
    failed = []
    for s, answer in zip(survivors, answers, strict=True):
        if isinstance(answer, BaseException):
            failed.append(f"{s.name}: prefetch refused: {answer}")
        else:
            s.prefetch_id = answer
    if failed:
        raise Abort("; ".join(failed))
    print("prefetching: " + ", ".join(f"{s.name}={s.prefetch_id}" for s in survivors))


def _progress_line(s: Survivor) -> str:
    st = s.status
    line = f"  {s.name}: {st['state']:<9} {_human(st['bytes_done'])} / {_human(st['bytes_total'])}"
    if st.get("eta_seconds") is not None:
        line += f"  eta {st['eta_seconds']:.1f} s"
    return line


async def wait_all(survivors: list[Survivor], deadline: float, poll: float) -> None:
    """Poll until every prefetch is ready; raises Abort on a failure or at the deadline."""
    shown: dict[str, tuple[str, int]] = {}
    while True:
        answers = await asyncio.gather(
            *(s.client.prefetch_status(str(s.prefetch_id)) for s in survivors),
            return_exceptions=True,
        )
        for s, answer in zip(survivors, answers, strict=True):
            if isinstance(answer, BaseException):
                raise Abort(f"{s.name}: status failed: {answer}")
            s.status = answer
            key = (answer["state"], answer["bytes_done"])
            if shown.get(s.url) != key:
                shown[s.url] = key
                print(_progress_line(s), flush=True)
        bad = [s for s in survivors if s.status["state"] in ("failed", "cancelled")]
        if bad:
            why = "; ".join(f"{s.name}: {s.status['state']}: {s.status['error']}" for s in bad)
            raise Abort(why)
        if all(s.status["state"] == "ready" for s in survivors):
            return
        if time.monotonic() >= deadline:
            late = [s.name for s in survivors if s.status["state"] != "ready"]
            raise Abort(f"timeout: not ready in time: {', '.join(late)}")
        await asyncio.sleep(min(poll, max(deadline - time.monotonic(), 0.0)))


async def cancel_unfinished(survivors: list[Survivor]) -> None:
    todo = [
        s for s in survivors if s.prefetch_id is not None and s.status.get("state") not in FINAL
    ]
    answers = await asyncio.gather(
        *(s.client.cancel_prefetch(str(s.prefetch_id)) for s in todo), return_exceptions=True
    )
    for s, answer in zip(todo, answers, strict=True):
        if isinstance(answer, BaseException):
            print(f"  {s.name}: cancel failed: {answer}", file=sys.stderr)
        else:
            s.status = answer
            print(f"  {s.name}: {answer['state']} ({answer['error']})")


async def unpin_all(survivors: list[Survivor], job: str, step: int) -> None:
    pinned = [s for s in survivors if s.pinned]
    answers = await asyncio.gather(
        *(s.client.unpin(job, step) for s in pinned), return_exceptions=True
    )
    for s, answer in zip(pinned, answers, strict=True):
        if isinstance(answer, BaseException):
            print(f"  {s.name}: unpin failed (it expires anyway): {answer}", file=sys.stderr)
        else:
            s.pinned = False
    if pinned:
        print(f"unpinned on {sum(not s.pinned for s in pinned)} of {len(pinned)} node(s)")


def print_measured(survivors: list[Survivor]) -> None:
    rows = [["node", "predicted s", "measured s", "downloaded", "chunks reused", "how"]]
    for s in survivors:
        st = s.status
        rows.append(
            [
                s.name,
                f"{s.estimate['seconds']:.2f}",
                f"{st['seconds']:.2f}" if st.get("seconds") is not None else "-",
                _human(sum(st["bytes_by_source"].values())),
                str(st["chunks_local"]),
                str(st.get("satisfied_by") or "-"),
            ]
        )
    _table(rows, right={1, 2, 3, 4})


async def register_standbys(args: argparse.Namespace, token: str) -> int:
    """Ahead of the decision: every survivor starts copying each new durable step."""
    failed = 0
    for url in args.survivors:
        async with FerryClient(url, token, timeout=30.0) as client:
            try:
                await client.standby(args.job)
                print(f"{url}: standby for {args.job}")
            except RPC_ERRORS as exc:
                print(f"{url}: cannot register: {exc}")
                failed += 1
    return 1 if failed else 0


async def run(args: argparse.Namespace, token: str) -> int:
    if args.register_standby:
        return await register_standbys(args, token)
    started = time.monotonic()
    deadline = started + args.timeout
    per_call = min(30.0, args.timeout)
    survivors = [Survivor(url, FerryClient(url, token, timeout=per_call)) for url in args.survivors]
    step: int | None = None
    try:
        try:
            step = await estimate_all(survivors, args)
            print_estimates(survivors, args.job, step)
            await pin_all(survivors, args.job, step, ttl=args.timeout)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Abort("timeout before the prefetches started")
            await start_all(survivors, args.job, step, deadline_s=remaining)
            await wait_all(survivors, deadline, args.poll)
        except (Abort, *RPC_ERRORS) as exc:
            print(f"cannot scale down: {exc}")
            await cancel_unfinished(survivors)
            print("ABORT scale-down", flush=True)
            return 1
        except asyncio.CancelledError:  # Ctrl-C: leave nothing running behind
            await cancel_unfinished(survivors)
            print("ABORT scale-down (interrupted)", flush=True)
            raise
        print()
        print_measured(survivors)
        print(f"all {len(survivors)} survivor(s) ready after {time.monotonic() - started:.2f} s")
        print("COMMIT scale-down", flush=True)
        return 0
    finally:
        if step is not None:
            await unpin_all(survivors, args.job, step)
        await asyncio.gather(*(s.client.close() for s in survivors))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        token = args.token_file.read_text(encoding="utf-8").strip()
    except OSError as exc:
        print(f"cannot read --token-file: {exc}", file=sys.stderr)
        return 2
    if not token:
        print(f"--token-file {args.token_file} is empty", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args, token))
    except KeyboardInterrupt:  # run() has cancelled the prefetches, unpinned, said ABORT
        return 1


if __name__ == "__main__":
    sys.exit(main())
