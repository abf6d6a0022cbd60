"""How a restore should write: from the pull's start to every tensor loaded, per write path.

The scheduler waits until the survivor's ranks have their state loaded, not until a pull
returns. A restore written buffered leaves its bytes in the page cache for the load; one
written with O_DIRECT is cheaper to write on some machines and makes the load read the
disk. This measures both ends together, on the disk the work directory is on:

- the save (a DCP directory: a real fine-tune, ``bench.gen_checkpoints`` or
  ``bench.corpus``) is pushed once to a local store (``--workdir``);
- each round, for each ``--write-path`` arm (order alternated): the page cache is dropped,
  a loader process imports torch and waits (its import is not timed), then the clock
  starts: ``ferry pull`` of the save with that write path; at its exit the loader
  ``dcp.load``s every tensor of the save into memory and reports; the restore is compared
  byte for byte with the save in the first round.

Printed per arm: medians of the pull, the load and their sum, the pull's CPU and system
seconds, the ratio to the first arm. Results in bench/results/write_path.md and .json.

How::

    python -m bench.write_path /work/series/full/step_000040            # 272 MB fine-tune
    python -m bench.write_path /work/corpus/full/step_000040 --runs 3   # 1.69 GB, 8 ranks
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._env import ferry_command, run_and_record  # noqa: E402
from bench._measure import (  # noqa: E402
    check_same,
    drop_caches,
    run_timed,
    throttled_disk,
    tree_digest,
)  # fmt: skip


def tensor_digest(state: dict) -> str:
    """BLAKE3 of every tensor's bytes, by name: what a load put in memory (the loader runs
    this after its clock stops; a test runs it on the state it saved)."""
    import blake3
    import torch

    h = blake3.blake3()
    for name in sorted(state):
        h.update(name.encode() + b"\0")
        h.update(state[name].detach().reshape(-1).view(torch.uint8).numpy())
    return str(h.hexdigest())


#: A fresh process that imports torch (flag "warm": see start_loader), waits for a line on
#: stdin, then loads every tensor of the DCP save named by argv[1] into memory and prints
#: the seconds the load took, the bytes loaded, its CPU seconds and the bytes it fetched
#: (-1: none, it read files); then (its clock stopped) the digest of what it loaded.
#: argv[1] is a directory, or "ferry+" and a JSON spec of FerryReader's arguments (store,
#: job, step, base_dir, endpoint_url): the load then reads the step from the store itself.
#: A directory is read by torch's FileSystemReader, or with flag "local" by ckpt-ferry's
#: LocalReader. Flag "shapes=DIR": the state_dict is made from DIR's .metadata and every
#: page of it written (as a training process's model and optimizer state are, before it
#: loads) after the go and before the clock starts; without it, the tensors are made in
#: the timed load, untouched, and the load pays their first page faults.
LOADER = (
    inspect.getsource(tensor_digest)
    + """
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
spec = json.loads(sys.argv[1][6:]) if sys.argv[1].startswith("ferry+") else None
flags = sys.argv[2:]
shapes = next((f[7:] for f in flags if f.startswith("shapes=")), None)
if spec is not None:  # imported before the clock, as a training process would have
    from transfer.engine.dcpreader_torch import FerryReader
Reader = FileSystemReader
if "local" in flags:
    from transfer.engine.dcplocal_torch import LocalReader as Reader
def state_of(md):
    return {k: torch.empty(v.size, dtype=v.properties.dtype)
            for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
if "warm" in flags:  # the load's own code run once: read in from disk now
    import tempfile
    with tempfile.TemporaryDirectory() as tiny:
        sd = {"w": torch.ones(8), "h": torch.ones(8, dtype=torch.bfloat16)}
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tiny), no_dist=True)
        dcp.load(sd, storage_reader=Reader(tiny), no_dist=True)
        tensor_digest(sd)
print("ready", flush=True)
sys.stdin.readline()
sd = None
if shapes is not None:  # the training process's state, in memory before its load
    sd = state_of(FileSystemReader(shapes).read_metadata())
    for tensor in sd.values():
        tensor.fill_(0)
t, cpu = time.monotonic(), time.process_time()
if spec is None:
    reader = Reader(sys.argv[1])
else:
    reader = FerryReader(spec["store"], spec["job"], spec["step"], base_dir=spec["base_dir"],
                         endpoint_url=spec["endpoint_url"])
if sd is None:  # (else .metadata is read once, by the load, as a training process's is)
    sd = state_of(reader.read_metadata())
dcp.load(sd, storage_reader=reader, no_dist=True)
moved = -1 if spec is None else reader.bytes_fetched
print(f"{time.monotonic() - t:.4f} {sum(x.numel() * x.element_size() for x in sd.values())}"
      f" {time.process_time() - cpu:.4f} {moved}", flush=True)
print(tensor_digest(sd), flush=True)
"""
)


@dataclasses.dataclass
class Loaded:
    seconds: float  # the load alone, timed in the loader
    nbytes: int  # of the tensors loaded
    digest: str  # tensor_digest of them
    at: float  # time.monotonic() here when the loader said it was done
    probed: Any = None  # what load's probe answered then
    cpu: float = 0.0  # the loader's CPU seconds over the load
    moved: int = -1  # bytes a FerryReader load fetched (-1: it read files)


def start_loader(
    save: Path | str,
    warm: bool = False,
    env: dict[str, str] | None = None,
    wrap: Sequence[str] = (),
    flags: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """A loader for ``save`` (need not exist yet), its torch imported: ready for ``load``.
    ``warm``: it has also saved and loaded a tiny checkpoint, so the code of a load is in
    memory, as in a process that has loaded before, and a page cache dropped after this
    leaves the load only the checkpoint's bytes to read (a fresh process's first load
    after a drop read ~50 MB of torch's code too, in 25 major page faults: 0.04-0.1 s of
    a 0.15-0.5 s load; warm, 0 faults and only the save's bytes). ``flags``: LOADER's
    others (``local``, ``shapes=DIR``)."""
    argv = [*wrap, sys.executable, "-c", LOADER, str(save), *(["warm"] if warm else []), *flags]
    loader = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert loader.stdout is not None
    if loader.stdout.readline().strip() != "ready":
        raise SystemExit("the loader did not start")
    return loader


def load(loader: subprocess.Popen[str], probe: Callable[[], Any] | None = None) -> Loaded:
    """Tell a started loader to load its save now; what it loaded. ``probe``: called the
    moment the load is done (before the loader digests it), its answer in ``Loaded.probed``."""
    assert loader.stdin is not None and loader.stdout is not None
    loader.stdin.write("go\n")
    loader.stdin.flush()
    timed = loader.stdout.readline().split()
    at = time.monotonic()
    probed = probe() if probe is not None else None
    digest = loader.stdout.readline().strip()
    if loader.wait(timeout=600) != 0 or len(timed) != 4 or int(timed[1]) <= 0:
        raise SystemExit(f"the loader failed or loaded nothing ({timed}, {digest!r})")
    seconds, nbytes, cpu, moved = float(timed[0]), int(timed[1]), float(timed[2]), int(timed[3])
    return Loaded(seconds, nbytes, digest, at, probed, cpu, moved)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("save", type=Path, help="a DCP save directory (.metadata + shards)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--arms", default="direct,warm,buffered,auto", help="write paths, first = 1.00x"
    )
    ap.add_argument("--workdir", type=Path, default=None, help="on the disk to measure")
    ap.add_argument("--disk-mbps", type=float, default=None,
                    help="throttle that disk to this many MB/s each way for the pulls and "
                         "loads (root: bench._measure.throttled_disk)")  # fmt: skip
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return ap.parse_args(argv)


def one_round(store: Path, dest: Path, arm: str, save_bytes: int) -> dict[str, Any]:
    drop_caches()
    loader = start_loader(dest)
    began = time.monotonic()
    cmd = [*ferry_command(), "pull", str(store), str(dest), "--job", "j", "--step", "1",
           "--write-path", arm]  # fmt: skip
    ran = run_timed(cmd, dict(os.environ), None)
    if ran.returncode != 0:
        raise SystemExit(f"ferry pull --write-path {arm} failed: {ran.stderr[-2000:]}")
    pulled = time.monotonic()
    loaded = load(loader)
    load_s, done = loaded.seconds, loaded.at
    return {
        "arm": arm, "pull": pulled - began, "load": load_s, "total": done - began,
        "pull_cpu": ran.cpu_user + ran.cpu_sys, "pull_sys": ran.cpu_sys,
        "loaded_bytes": loaded.nbytes, "save_bytes": save_bytes,
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms = args.arms.split(",")
    work = Path(tempfile.mkdtemp(prefix="ferry-write-path-", dir=args.workdir))
    try:
        store, dest = work / "store", work / "dest"
        push = [*ferry_command(), "push", str(args.save), str(store), "--job", "j",
                "--step", "1", "--node", "n0", "--init"]  # fmt: skip
        subprocess.run(push, check=True, stdout=subprocess.DEVNULL)
        digest = tree_digest(args.save)
        save_bytes = sum(size for size, _ in digest.values())
        rows = []
        with throttled_disk(work, args.disk_mbps * 1e6 if args.disk_mbps else None):
            for rnd in range(args.runs):
                shift = rnd % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    row = one_round(store, dest, arm, save_bytes) | {"round": rnd + 1}
                    if rnd == 0:
                        check_same(digest, dest, f"ferry pull --write-path {arm}")
                    shutil.rmtree(dest)
                    rows.append(row)
                    print(f"r{rnd + 1} {arm:<9} pull {row['pull']:6.2f} s (CPU "
                          f"{row['pull_cpu']:5.2f}, sys {row['pull_sys']:5.2f})  load "
                          f"{row['load']:5.2f} s  total {row['total']:6.2f} s",
                          flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"save": str(args.save), "save_bytes": save_bytes, "arms": arms, "rows": rows}
    return doc | {"disk_mbps": args.disk_mbps}


def report(doc: dict[str, Any]) -> str:
    def med(arm: str, key: str) -> float:
        return statistics.median(r[key] for r in doc["rows"] if r["arm"] == arm)

    first = doc["arms"][0]
    lines = [
        f"{doc['save']} ({doc['save_bytes'] / 1e6:,.0f} MB), medians of "
        f"{len(doc['rows']) // len(doc['arms'])}, page cache dropped before each"
        + (f"; the disk throttled to {doc['disk_mbps']:g} MB/s" if doc.get("disk_mbps") else ""),
        "",
        "| write path | pull s | load s | start -> loaded s | pull CPU s (sys) "
        f"| total / {first} |",
        "|---|---|---|---|---|---|",
    ]
    for arm in doc["arms"]:
        ratio = med(arm, "total") / med(first, "total")
        lines.append(
            f"| {arm} | {med(arm, 'pull'):.2f} | {med(arm, 'load'):.2f} | "
            f"{med(arm, 'total'):.2f} | {med(arm, 'pull_cpu'):.2f} ({med(arm, 'pull_sys'):.2f})"
            f" | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def _stem(args: argparse.Namespace) -> str:
    stem = f"write_path_{args.save.parent.parent.name}_{args.save.parent.name}"
    return stem + (f"_{args.disk_mbps:g}mbps" if args.disk_mbps else "")


def main(argv: list[str] | None = None) -> int:
    return run_and_record("bench.write_path", argv, parse_args, run, report, _stem)


if __name__ == "__main__":
    raise SystemExit(main())
