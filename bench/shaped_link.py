"""Pull of save k+1 onto a node holding k, over a link shaped to a real network's rate.

On loopback both tools are CPU-bound; a real node reads its store over a NIC. Here the
client runs in a network namespace of its own, joined to the host by a veth pair shaped
with ``tc tbf`` each way (default 2 Gbit/s); SeaweedFS (tests/s3server.py) listens on the
host end. Then, alternating over ``--runs`` rounds, page cache dropped before each:

- ``s5cmd cp`` of save k+1 (uploaded beforehand, unshaped), and
- ``ferry pull`` of k+1 with ``--base-dir`` k (both pushed beforehand, k+1 delta-coded),

both inside the namespace, every restored tree compared byte for byte with the source.
Needs root (``ip netns``, ``tc``)::

    python -m bench.shaped_link --corpus /work/corpus            # full fine-tune pair
    python -m bench.shaped_link --corpus /work/corpus --rate 10gbit

writes bench/results/shaped_link.{json,md}. The link is removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import data  # noqa: E402
from bench._env import ferry_command, write_results  # noqa: E402
from bench._measure import check_same, drop_caches, tree_digest  # noqa: E402
from bench.peers import tool_env  # noqa: E402
from tests.s3server import S3Server  # noqa: E402

NS, HOST_IF, NS_IF = "ferryshape", "fshape-h", "fshape-n"
HOST_IP, NS_IP = "10.203.0.1", "10.203.0.2"
MB = 1e6


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


@contextlib.contextmanager
def shaped_link(rate: str) -> Iterator[None]:
    """A namespace joined to the host by a veth pair, ``rate`` each way."""
    with contextlib.suppress(subprocess.CalledProcessError):
        sh("ip", "netns", "del", NS)  # a leftover from an interrupted run
    sh("ip", "netns", "add", NS)
    try:
        sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        sh("ip", "link", "set", NS_IF, "netns", NS)
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", HOST_IF)
        sh("ip", "link", "set", HOST_IF, "up")
        inside = ("ip", "netns", "exec", NS)
        sh(*inside, "ip", "addr", "add", f"{NS_IP}/24", "dev", NS_IF)
        sh(*inside, "ip", "link", "set", NS_IF, "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        tbf = ("root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms")
        sh("tc", "qdisc", "add", "dev", HOST_IF, *tbf)  # host -> namespace: downloads
        sh(*inside, "tc", "qdisc", "add", "dev", NS_IF, *tbf)  # namespace -> host
        yield
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            sh("ip", "link", "del", HOST_IF)
        with contextlib.suppress(subprocess.CalledProcessError):
            sh("ip", "netns", "del", NS)


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    drop_caches()
    t = time.monotonic()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - t
    if done.returncode:
        raise SystemExit(f"failed: {shlex.join(argv)}\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--corpus", type=Path, required=True, help="python -m bench.corpus DIR")
    ap.add_argument("--variant", default="full")
    ap.add_argument("--rate", default="2gbit", help="tc rate each way (default 2gbit)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.shaped_link", *(argv or sys.argv[1:])])
    k, k1 = (args.corpus / args.variant / f"step_{s:06d}" for s in (20, 40))
    work = Path(tempfile.mkdtemp(prefix="ferry-shaped-"))
    server = S3Server(work / "s3", bind="0.0.0.0")
    (work / "s3").mkdir()
    try:
        ep = server.start()
        port = ep.url.rsplit(":", 1)[1]
        env = {"PATH": str(Path(sys.executable).parent) + ":/usr/sbin:/usr/bin:/bin"}
        env |= tool_env(ep, work / "rclone.conf") | {"PYTHONPATH": str(REPO)}
        ferry = ferry_command()
        store = f"s3://{ep.bucket}/ferry"
        for step, ckpt in ((20, k), (40, k1)):  # on the host, unshaped
            push = [*ferry, "push", str(ckpt), store, "--job", "j", "--node", "n0", "--init"]
            subprocess.run([*push, "--step", str(step)], env=env, check=True, capture_output=True)
        upload = ["s5cmd", "--endpoint-url", ep.url, "cp", f"{k1}/*", f"s3://{ep.bucket}/s5cmd/"]
        subprocess.run(upload, env=env, check=True, capture_output=True)
        digest = tree_digest(k1)
        shaped_env = env | {"AWS_ENDPOINT_URL": f"http://{HOST_IP}:{port}"}
        inside = ["ip", "netns", "exec", NS]
        samples: dict[str, list[float]] = {"s5cmd": [], "ferry": []}
        moved: dict[str, int] = {"s5cmd": data.tree_bytes(k1), "ferry": 0}
        with shaped_link(args.rate):
            for rnd in range(args.runs):
                order = ["s5cmd", "ferry"] if rnd % 2 == 0 else ["ferry", "s5cmd"]
                for tool in order:
                    dest = work / f"dest-{tool}"
                    if tool == "s5cmd":
                        url = shaped_env["AWS_ENDPOINT_URL"]
                        cmd = ["s5cmd", "--endpoint-url", url, "cp"]
                        cmd += [f"s3://{ep.bucket}/s5cmd/*", f"{dest}/"]
                    else:
                        cmd = [*ferry, "pull", store, str(dest), "--job", "j", "--step", "40",
                               "--base-dir", str(k), "--json"]  # fmt: skip
                    seconds, out = timed([*inside, *cmd], shaped_env)
                    if tool == "ferry":
                        moved["ferry"] = int(json.loads(out)["bytes_transferred"])
                    check_same(digest, dest, f"{tool} over the shaped link")
                    samples[tool].append(seconds)
                    print(f"  r{rnd + 1} {tool:<6} {seconds:6.2f} s", flush=True)
                    shutil.rmtree(dest)
        med = {t: statistics.median(v) for t, v in samples.items()}
        ratio = med["ferry"] / med["s5cmd"]
        now = datetime.datetime.now(datetime.UTC)
        raw = data.tree_bytes(k1)
        md = (
            f"# bench.shaped_link\n\n`{command}`\n\n{now:%Y-%m-%d %H:%M} UTC, link "
            f"{args.rate} each way (veth + tc tbf, client in a network namespace), "
            f"{args.variant} save k+1 of {raw / MB:,.0f} MB, median of {args.runs}\n\n"
            "| tool | median s | moved MB | ours / s5cmd |\n|---|---|---|---|\n"
            f"| s5cmd cp (k+1) | {med['s5cmd']:.2f} | {moved['s5cmd'] / MB:,.0f} | |\n"
            f"| ferry pull k+1 holding k | {med['ferry']:.2f} | {moved['ferry'] / MB:,.0f} "
            f"| {ratio:.2f}x |\n"
        )
        write_results(
            args.out_dir,
            "shaped_link",
            command,
            now.isoformat(timespec="seconds"),
            md,
            rate=args.rate,
            bytes_raw=raw,
            bytes_moved=moved,
            seconds=samples,
            median_s=med,
            ratio=ratio,
        )
        print(md)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
