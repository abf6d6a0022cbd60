"""Play an elastic scheduler's scale-down with the ckpt-ferry agents of the surviving nodes.

Before a node is taken away, every survivor must hold the checkpoint the shrunk job restarts
from. The scheduler:

0. (beforehand, when it picks the likely survivors: ``--register-standby``) makes each
   survivor a standby for the job (PUT /v1/standby/{job}), so every new durable step is
   copied there in the background and step 3 finds it already there,
1. asks each survivor's agent what bringing the checkpoint over costs (GET /v1/estimate),
2. pins the checkpoint on each (POST /v1/pins) so retention keeps it while this runs,
3. starts a prefetch on every survivor at once (POST /v1/prefetch), as one fan-out group
   (the store is read about once for all of them, not once each), and waits for them
   (each status request a long poll: GET /v1/prefetch/{id}?wait=),
4. commits the scale-down only when all are ``ready``; if one fails or the timeout passes,
   it cancels the others (DELETE /v1/prefetch/{id}) and aborts,
5. unpins either way.

    python examples/scale_down.py --job llama --survivors http://10.0.0.7:7070 \\
        http://10.0.0.8:7070 --token-file /etc/ferry/token --gpus 8 --gpu-hour-price 2.5

``--new-world-size W``: the shrunk job runs W ranks, survivor i (in the order given) ranks
i*W/S .. (i+1)*W/S - 1 of them; each survivor then estimates and fetches only the share its
ranks read (``layout``), and a survivor holding its own part of the step (training wrote it
there) receives only what that share lacks, beside its own files.

Agents serving TLS: https:// URLs, ``--ca-file`` (the CA their certificates chain to), and
``--cert-file``/``--key-file`` when they require a client certificate (``tls_client_auth``).

Exit status: 0 after "COMMIT scale-down", 1 after "ABORT scale-down", 2 on usage errors.

``--world-size N`` plays the same scale-down on this machine instead, with no agents and the
``ferry`` CLI only (it needs torch): 8 gloo ranks on loopback save a real DCP checkpoint
(DTensor ``Shard(0)`` parameters + AdamW state) onto 4 nodes' disks (2 ranks each, node0
also ``.metadata``), every node pushes its part (``ferry push --part``), the 2 survivors pull
only the share their N/2 new ranks each read (``ferry pull --world-size N --ranks ...``,
against a full pull), and N ranks ``dcp.load`` from the survivors' copies and from the whole
save: every tensor equal, the same losses.

    python examples/scale_down.py --world-size 4
    python examples/scale_down.py --world-size 4 --chunk-size-mib 1   # finer chunks
    python examples/scale_down.py --world-size 2 --width 2048         # 13 MB save, ~20 s

A share is fetched in whole chunks (ferry push's ``--chunk-size-mib``, 4 by default), so it
saves bytes only where the rank files are several chunks long: ``--width`` sets their size.

Exit status: 0 when the two loads agree, 1 when not, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from agent.cli.args import (  # the CLI's own parsers
    _non_negative_float,
    _non_negative_int,
    _positive_float,
)
from agent.rpc.client import FerryClient, RpcError
from agent.rpc.tls import TlsError
from transfer.units import format_size

FINAL = ("ready", "failed", "cancelled")
#: Errors of one RPC: an HTTP error answer, a connection problem, or a request timeout.
RPC_ERRORS = (RpcError, aiohttp.ClientError, TimeoutError)


@dataclass
class Survivor:
    url: str
    client: FerryClient
    node: str = ""
    estimate: dict[str, Any] = field(default_factory=dict)
    #: (world size, ranks) this node runs after the scale-down; None: the whole step
    layout: tuple[int, list[int]] | None = None
    pinned: bool = False
    prefetch_id: str | None = None
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.node or self.url


class Abort(Exception):
    """The scale-down cannot be committed; the message says why."""


def _human(n: float) -> str:
    """Decimal units, as every ``ferry`` command prints them (transfer/units.py)."""
    return format_size(n)


def _step(value: str) -> int | str:
    if value == "latest":
        return value
    if not value.isdecimal():
        raise argparse.ArgumentTypeError(f"expected a step number or 'latest', got {value!r}")
    return int(value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0] if __doc__ else None,
        epilog="--world-size N instead: the local 8 -> N ranks drill (--world-size 4 --help)",
    )
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
    p.add_argument(
        "--ca-file",
        type=Path,
        help="verify https:// agents against this CA bundle (default: the system store)",
    )
    p.add_argument(
        "--cert-file",
        type=Path,
        help="client certificate (PEM) for agents with tls_client_auth = true",
    )
    p.add_argument("--key-file", type=Path, help="the client certificate's key (PEM)")
    p.add_argument(
        "--gpus", type=_non_negative_int, default=1, help="GPUs idle while the job migrates"
    )
    p.add_argument("--gpu-hour-price", type=_non_negative_float, default=0.0, help="per GPU-hour")
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="seconds for the whole migration; also the pins' TTL (default 600)",
    )
    p.add_argument(
        "--poll", type=_positive_float, default=0.5, help="status poll interval, seconds"
    )
    p.add_argument(
        "--new-world-size",
        type=int,
        metavar="W",
        help="the shrunk job's world size: each survivor fetches only the share its ranks "
        "read (survivor i of S, in the order given, runs ranks i*W/S .. (i+1)*W/S - 1)",
    )
    p.add_argument(
        "--register-standby",
        action="store_true",
        help="only make the survivors standbys for the job (run it ahead of the decision)",
    )
    args = p.parse_args(argv)
    if len(set(args.survivors)) != len(args.survivors):
        p.error("--survivors lists the same URL twice")
    if args.new_world_size is not None and args.new_world_size < len(args.survivors):
        p.error(f"--new-world-size {args.new_world_size} leaves a survivor without a rank "
                f"({len(args.survivors)} survivors)")  # fmt: skip
    return args


def layouts(world_size: int, survivors: int) -> list[tuple[int, list[int]]]:
    """Survivor i's ranks of a world of ``world_size``: a contiguous block, as even as can be."""
    return [
        (world_size, list(range(i * world_size // survivors, (i + 1) * world_size // survivors)))
        for i in range(survivors)
    ]


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
            s.client.estimate(
                args.job, step, gpus=args.gpus, gpu_hour_price=args.gpu_hour_price, layout=s.layout
            )
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
    # (to move may exceed the step: a delta-coded step onto a node without its base moves
    # the base's chunks too)
    rows = [["node", "to move / step", "predicted s", "cost", "cooldown s"]]
    for s in survivors:
        e = s.estimate
        ranks = "" if s.layout is None else f" (ranks {s.layout[1][0]}-{s.layout[1][-1]})"
        rows.append(
            [
                s.name + ranks,
                f"{_human(e['bytes_missing'])} / {_human(e['bytes_total'])}",
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
    # (members prefetching shares: each member is told every member's, to split by them)
    members = [s.url for s in survivors]
    group = len(members) > 1
    shares = {s.url: s.layout for s in survivors if s.layout is not None} or None
    answers = await asyncio.gather(
        *(
            s.client.prefetch(
                job,
                step,
                deadline_s=deadline_s,
                fanout=(members, s.url) if group else None,
                layout=s.layout,
                fanout_layouts=shares if group else None,
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
    """Until every prefetch is ready (a progress line per change, every ``poll`` seconds);
    raises Abort on a failure or at the deadline. Each status request is a long poll
    (``wait``): the last prefetch's end is seen when it happens, not up to ``poll`` later."""
    shown: dict[str, tuple[str, int]] = {}
    while True:
        asked = time.monotonic()
        wait = min(poll, max(deadline - asked, 0.0), 30.0)  # (the agent's longest wait)
        answers = await asyncio.gather(
            *(s.client.prefetch_status(str(s.prefetch_id), wait) for s in survivors),
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
        # (an agent from before the long poll answers at once: keep to the interval)
        await asyncio.sleep(max(0.0, min(asked + poll, deadline) - time.monotonic()))


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


def tls_files(args: argparse.Namespace) -> dict[str, Path | None]:
    """FerryClient's TLS arguments: the CA the agents' certificates chain to, and the
    client certificate an agent with ``tls_client_auth`` requires."""
    return {"ca_file": args.ca_file, "cert_file": args.cert_file, "key_file": args.key_file}


async def register_standbys(args: argparse.Namespace, token: str) -> int:
    """Ahead of the decision: every survivor starts copying each new durable step."""
    failed = 0
    for url in args.survivors:
        async with FerryClient(url, token, timeout=30.0, **tls_files(args)) as client:
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
    survivors = [
        Survivor(url, FerryClient(url, token, timeout=per_call, **tls_files(args)))
        for url in args.survivors
    ]
    if args.new_world_size is not None:
        for s, layout in zip(survivors, layouts(args.new_world_size, len(survivors)), strict=True):
            s.layout = layout
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


# ---------------------------------------------------------------- --world-size: a local drill

REPO = Path(__file__).resolve().parents[1]
SAVED_RANKS = 8  # the drill always saves with 8 ranks, 2 per node on 4 nodes
RANKS_PER_NODE = 2
SURVIVORS = ("A", "B")
DRILL_JOB, DRILL_STEP = "drill", 100
# emb 512 x W fp32 + its 2 AdamW moments: 2048 -> ~1.6 MB per rank file (13 MB in all),
# 16384 -> ~12.6 MB (100 MB). A share is fetched in whole chunks, so it saves only when the
# rank files are several chunks long (a real one is GBs).
DEFAULT_WIDTH = 16384


def _drill_requested(argv: list[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return any(a == "--world-size" or a.startswith("--world-size=") for a in args)


def _new_world_size(value: str) -> int:
    number = int(value)
    if number not in (2, 4, 6):
        raise argparse.ArgumentTypeError(
            f"expected 2, 4 or 6 (2 survivors of 8 saved ranks, N/2 ranks each), got {value!r}"
        )
    return number


def parse_drill_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="The elastic scale-down drill on this machine: 8 ranks save a DCP "
        "checkpoint, 2 surviving nodes pull their shares with the ferry CLI, N ranks resume."
    )
    p.add_argument(
        "--world-size", type=_new_world_size, required=True, help="the new world size: 2, 4 or 6"
    )
    p.add_argument(
        "--width",
        type=int,
        default=DEFAULT_WIDTH,
        help=f"model width: ~6 KiB of save per unit (default {DEFAULT_WIDTH}: ~100 MB)",
    )
    p.add_argument(
        "--chunk-size-mib",
        type=int,
        help=f"ferry push's chunk size, whole MiB (default: ferry's own, {_cli_chunk_mib()})",
    )
    p.add_argument("--workdir", type=Path, help="keep the save, nodes and store here (new dir)")
    args = p.parse_args(argv)
    if args.width < 1 or (args.chunk_size_mib is not None and args.chunk_size_mib < 1):
        p.error("--width and --chunk-size-mib must be positive")
    if args.workdir is not None and args.workdir.exists() and any(args.workdir.iterdir()):
        p.error(f"--workdir {args.workdir} is not empty")
    return args


def _cli_chunk_mib() -> int:
    from transfer.options import TransferOptions

    return TransferOptions().chunk_size >> 20


def _ferry(cwd: Path, *args: str) -> dict[str, Any]:
    """Run ``ferry ARGS --json`` (as ``python -m agent``, the same CLI) in ``cwd``, echoing
    the command as a user would type it; returns its JSON answer."""
    print("  $ ferry " + " ".join(args), flush=True)
    cmd = [sys.executable, "-m", "agent", *args, "--json"]
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise Abort(f"ferry {args[0]} failed ({done.returncode}): {done.stderr.strip()}")
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


def _ranks_of(world_size: int) -> dict[str, tuple[int, ...]]:
    """{survivor: the new ranks it runs}: the first half of the new world on A, the rest on B."""
    half = world_size // 2
    return {name: tuple(range(i * half, (i + 1) * half)) for i, name in enumerate(SURVIVORS)}


def _ranks_flag(ranks: tuple[int, ...]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def save_on_nodes(root: Path, width: int) -> tuple[Path, list[Path]]:
    """8 gloo ranks save the drill checkpoint into root/save; it is then split into the 4
    nodes' directories (root/nodes/node0..3) as their local disks would hold it."""
    # the test suite's drill (tests/dcp_drill.py) is what spawns the ranks; an example importing
    # from tests/ is a stopgap (agent.rpc.client is the only other import), acceptable for now
    sys.path.insert(0, str(REPO))
    from tests.dcp_drill import save_drill, split_by_node

    started = time.monotonic()
    save_drill(root / "save", SAVED_RANKS, width=width)
    nodes = split_by_node(root / "save", root / "nodes", RANKS_PER_NODE)
    print(
        f"{SAVED_RANKS} ranks saved step {DRILL_STEP} in {time.monotonic() - started:.1f} s: "
        f"{SAVED_RANKS} rank files of ~{_human(_rank_file_size(root / 'save'))} + .metadata,\n"
        f"split onto {len(nodes)} nodes ({RANKS_PER_NODE} ranks each, node0 also .metadata)\n"
    )
    return root / "save", nodes


def _rank_file_size(save: Path) -> int:
    return max(f.stat().st_size for f in save.glob("*.distcp"))


def push_nodes(root: Path, nodes: list[Path], chunk_mib: int | None) -> None:
    _ferry(root, "init", "store")  # a local directory as the store (s3://... in real life)
    flag = [] if chunk_mib is None else ["--chunk-size-mib", str(chunk_mib)]
    size = f"{chunk_mib} MiB chunks" if chunk_mib else f"{_cli_chunk_mib()} MiB chunks, the default"
    print(f"every node pushes its part ({size}):")
    for k, node_dir in enumerate(nodes):
        got = _ferry(
            root,
            "push", str(node_dir.relative_to(root)), "store", "--job", DRILL_JOB,
            "--step", str(DRILL_STEP), "--node", f"n{k}", "--part", *flag,
        )  # fmt: skip
        print(f"    {_human(got['bytes_raw'])} raw, {_human(got['bytes_transferred'])} sent")
    print()


def pull_shares(root: Path, world_size: int) -> dict[str, dict[str, Any]]:
    """{survivor or "full": its pull's JSON}: each survivor pulls the share its new ranks
    read into root/<survivor>; "full" is a whole pull (root/full), for comparison."""
    print(f"the 2 survivors pull the shares their ranks read at world size {world_size}:")
    pulls = {}
    for name, ranks in _ranks_of(world_size).items():
        pulls[name] = _ferry(
            root,
            "pull", "store", name, "--job", DRILL_JOB, "--step", str(DRILL_STEP),
            "--world-size", str(world_size), "--ranks", _ranks_flag(ranks),
        )  # fmt: skip
    print("and, for comparison, a full pull:")
    pulls["full"] = _ferry(
        root, "pull", "store", "full", "--job", DRILL_JOB, "--step", str(DRILL_STEP)
    )
    print()
    return pulls


def print_pulls(pulls: dict[str, dict[str, Any]], world_size: int, raw: int) -> None:
    print(f"bytes per pull, against the step's {_human(raw)} raw:")
    rows = [["pull", "ranks", "share", "chunks covering it", "moved (compressed)"]]
    ranks = _ranks_of(world_size)

    def cell(n: int) -> str:
        return f"{_human(n)} {n / raw:.2f}x"

    for name, got in pulls.items():
        share = got["share"] or {"bytes": got["bytes_raw"], "chunk_bytes": got["bytes_raw"]}
        rows.append(
            [
                f"survivor {name}" if name in ranks else "full",
                _ranks_flag(ranks[name]) if name in ranks else "all",
                cell(share["bytes"]),
                cell(share["chunk_bytes"]),
                cell(got["bytes_transferred"]),
            ]
        )
    _table(rows, right={2, 3, 4})


def print_chunk_note(
    save: Path, pulls: dict[str, dict[str, Any]], chunk_mib: int, raw: int
) -> None:
    """What fetching in whole chunks costs: the chunks a share cuts through come whole."""
    file_size = _rank_file_size(save)
    per_file = file_size / (chunk_mib << 20)
    beyond = max(
        g["share"]["chunk_bytes"] - g["share"]["bytes"] for g in pulls.values() if g["share"]
    )
    whole_files = "\n  files this small cost a share nearly every file it touches, whole."
    print(
        f"note: a share comes in whole {chunk_mib} MiB chunks and the rank files are "
        f"~{_human(file_size)} ({per_file:.1f} chunks),\n"
        f"  so the chunks covering a share hold up to {beyond / raw:.2f}x of the step beyond it"
        + (":" + whole_files if per_file <= 2 else ".")
    )
    print("  Smaller chunks (--chunk-size-mib 1) or bigger files (--width) cut that; real rank")
    print("  files are GBs. 'moved' is what was read from the store: compressed (the AdamW")
    print("  moments of rows no batch touched are zeros), neighbouring reads merged.\n")


def _differences(want: dict[str, Any], have: dict[str, Any]) -> list[str]:
    """The state keys (model.*, optim.*) whose values differ between two loads."""
    bad = []
    for kind in ("model", "optim"):
        for key in want[kind].keys() | have[kind].keys():
            a, b = want[kind].get(key), have[kind].get(key)
            same = a.equal(b) if hasattr(a, "equal") and hasattr(b, "equal") else a == b
            if not same:
                bad.append(f"{kind}.{key}")
    return sorted(bad)


def load_both(root: Path, save: Path, world_size: int, width: int) -> bool:
    """N ranks dcp.load from the survivors' copies and from the whole save; True if equal."""
    from tests.dcp_drill import load_drill

    ranks = _ranks_of(world_size)
    from_copies = {r: root / name for name, rs in ranks.items() for r in rs}
    started = time.monotonic()
    resharded = load_drill(from_copies, world_size, width=width)
    reference = load_drill(dict.fromkeys(range(world_size), save), world_size, width=width)
    bad = _differences(reference, resharded)
    count = len(reference["model"]) + len(reference["optim"])
    print(
        f"{world_size} ranks dcp.load from the survivors' copies and from the whole save "
        f"({time.monotonic() - started:.1f} s):"
    )
    print(f"  every tensor equal: {'yes' if not bad else 'NO'} ({count} state entries)")
    if bad:
        print("  differ: " + ", ".join(bad))
    for what, key in (("loss", "loss"), ("loss after one more step", "loss_after")):
        print(f"  {what}: {resharded[key]:.6f} (whole save: {reference[key]:.6f})")
    same_loss = all(resharded[k] == reference[k] for k in ("loss", "loss_after"))
    return not bad and same_loss


def run_drill(args: argparse.Namespace) -> int:
    started = time.monotonic()
    print(
        f"scale-down drill: {SAVED_RANKS} ranks save, {args.world_size} resume on "
        f"{len(SURVIVORS)} survivors ({args.world_size // 2} each); width {args.width}\n"
    )
    with tempfile.TemporaryDirectory(prefix="ferry-drill-") as tmp:
        root = (args.workdir or Path(tmp)).resolve()
        root.mkdir(parents=True, exist_ok=True)
        try:
            save, nodes = save_on_nodes(root, args.width)
            push_nodes(root, nodes, args.chunk_size_mib)
            pulls = pull_shares(root, args.world_size)
            raw = sum(p.stat().st_size for p in save.iterdir())
            print_pulls(pulls, args.world_size, raw)
            print_chunk_note(save, pulls, args.chunk_size_mib or _cli_chunk_mib(), raw)
            equal = load_both(root, save, args.world_size, args.width)
        except (Abort, RuntimeError) as exc:  # RuntimeError: dcp_drill's DrillError (a rank failed)
            print(f"drill failed: {exc}", file=sys.stderr, flush=True)
            return 1
    print(f"\n{'OK' if equal else 'FAILED'}: drill done in {time.monotonic() - started:.1f} s")
    return 0 if equal else 1


def main(argv: list[str] | None = None) -> int:
    if _drill_requested(argv):
        return run_drill(parse_drill_args(argv))
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
    except TlsError as exc:  # --ca-file / --cert-file unreadable or not a certificate
        print(str(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # run() has cancelled the prefetches, unpinned, said ABORT
        return 1


if __name__ == "__main__":
    sys.exit(main())
