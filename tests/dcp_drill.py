"""A real elastic DCP drill for the tests: N gloo ranks on loopback save a small model whose
parameters are DTensors ``Shard(0)`` over a 1-D mesh (plus AdamW state), and W ranks load it
back resharded.

Each rank is its own process, forked from a forkserver that imported torch once (8 fresh
interpreters importing torch on 2 cores took ~25 s of a 40 s save). A rank's failure is
caught and reported with that rank's traceback, the others get a short grace and are then
killed, and every run is bounded by TIMEOUT_S: nothing hangs a test.

The parent side (``save_drill``, ``load_drill``, ``plan_drill``, ``split_by_node``) imports
torch only to read results back; the workers (``_worker_*``) do the distributed work.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

TIMEOUT_S = 120.0
PLAN_BATCH = 2  # planning processes at once: more processes than cores only thrash
GRACE_S = 15.0  # after one rank fails, how long the others get to fail or finish on their own
LR = 1e-2
BATCH = (3, 0, 511, 7, 300, 12, 100, 4)  # fixed token ids into the 512-row embedding
_DISTCP = re.compile(r"__(\d+)_(\d+)\.distcp")
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "tests.dcp_drill",
]


class DrillError(RuntimeError):
    """A drill rank failed: the message carries the failing ranks' error text."""


# ---------------------------------------------------------------- parent side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _context() -> Any:
    """A forkserver that imports torch once: every rank is forked from it, so 8 ranks on 2
    cores do not pay 8 torch imports (~25 s of the drill when each rank spawned a fresh
    interpreter)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _run_ranks(mode: str, world_size: int, work: Path, args: dict[str, Any]) -> None:
    """Run ``world_size`` worker processes for ``mode`` and wait for all of them; raise
    DrillError with the failing ranks' errors (killing the rest) on failure or timeout."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "args.json").write_text(json.dumps(args))
    ctx, port = _context(), _free_port()
    procs = [
        ctx.Process(target=_worker_main, args=(mode, str(work), rank, world_size, port))
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        _wait_ranks(procs, work)
    finally:
        for proc in procs:
            if proc.exitcode is None and proc.pid is not None:
                proc.kill()
            if proc.pid is not None:
                proc.join()


def _wait_ranks(procs: list[Any], work: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    failed_at: float | None = None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            break
        time.sleep(0.05)
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if not bad:
        return
    texts = []
    for rank in bad:
        err = work / f"error_{rank}.txt"
        if err.exists():
            texts.append(f"rank {rank}: {err.read_text()}")
        elif procs[rank].exitcode is None:
            texts.append(
                f"rank {rank}: still running after the others failed or the "
                f"{TIMEOUT_S:.0f} s timeout: killed"
            )
        else:
            log = (work / f"log_{rank}.txt").read_text(errors="replace")[-4000:]
            texts.append(f"rank {rank}: exit {procs[rank].exitcode}\n{log}")
    raise DrillError("\n".join(texts))


def save_drill(dir: Path, world_size: int = 8, seed: int = 0, width: int = 64) -> None:
    """``world_size`` ranks train 2 AdamW steps and ``dcp.save`` model + optimizer into
    ``dir`` with the default FileSystemWriter (``.metadata`` + ``__<rank>_0.distcp``)."""
    dir = Path(dir)
    work = dir.parent / f".{dir.name}.work"
    _run_ranks("save", world_size, work, {"dir": str(dir), "seed": seed, "width": width})
    shutil.rmtree(work, ignore_errors=True)


def load_drill(
    dirs_by_rank: Mapping[int, Path | dict[str, Any]],
    world_size: int,
    width: int = 64,
    reader: str = "torch",
) -> dict[str, Any]:
    """``world_size`` ranks each ``dcp.load`` a fresh model + AdamW (sharded over the new
    world size) from the directory given for its rank, or from a store through FerryReader
    (a dict of its arguments: store, job, step, and ``env``, set in the rank first: the
    store's credentials). A directory is read by torch's FileSystemReader, or (``reader=
    "local"``) by ckpt-ferry's LocalReader. Returns rank 0's view: ``model`` and
    ``optim`` ({flattened key: full tensor or value}), ``loss`` (forward on BATCH at the
    loaded weights), ``loss_after`` (after one more AdamW step: depends on the optimizer
    state), ``planned`` ({rank: DCP's planned byte ranges for that rank's load}) and
    ``local_shapes`` ({rank: {parameter: its local shard's shape}}) and, for FerryReader
    ranks, ``restored`` ({rank: (chunk bytes covering its plan, bytes it fetched)})."""
    import torch

    if sorted(dirs_by_rank) != list(range(world_size)):
        raise ValueError(f"dirs_by_rank must name ranks 0..{world_size - 1}")
    paths = [Path(d) for d in dirs_by_rank.values() if not isinstance(d, dict)]
    parent = paths[0].parent if paths else Path(tempfile.gettempdir())
    work = parent / f".load.{os.getpid()}.{time.monotonic_ns()}.work"
    dirs = {str(r): d if isinstance(d, dict) else str(d) for r, d in dirs_by_rank.items()}
    try:
        args = {"dirs": dirs, "out": str(work / "result.pt"), "width": width, "reader": reader}
        _run_ranks("load", world_size, work, args)
        result: dict[str, Any] = torch.load(work / "result.pt", weights_only=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def plan_drill(save_dir: Path, layouts: list[tuple[int, int]]) -> dict[tuple[int, int], Any]:
    """{(world size, rank): byte ranges DCP's DefaultLoadPlanner reads} for loading the
    drill save into each layout, under torch's fake process group (no communication, no
    data read). A process never plans two layouts of one world size: DTensor caches
    sharding by mesh shape, so a second mesh of the same size would keep the first's rank."""
    save_dir = Path(save_dir)
    groups: list[list[tuple[int, int]]] = []
    for layout in layouts:
        group = next((g for g in groups if all(w != layout[0] for w, _ in g)), None)
        if group is None:
            groups.append([layout])
        else:
            group.append(layout)
    work = save_dir.parent / f".plan.{os.getpid()}.{time.monotonic_ns()}.work"
    out: dict[tuple[int, int], Any] = {}
    try:
        for first in range(0, len(groups), PLAN_BATCH):
            batch = groups[first : first + PLAN_BATCH]
            args = {"dir": str(save_dir), "groups": batch}
            _run_ranks("plan", len(batch), work / str(first), args)
            for i in range(len(batch)):
                for world, rank, raw in json.loads(
                    (work / str(first) / f"plan_{i}.json").read_text()
                ):
                    out[world, rank] = {p: tuple(map(tuple, rs)) for p, rs in raw.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _rank_of_files(save_dir: Path) -> dict[str, int]:
    """{storage file: saving rank}, from the file names, checked against the metadata: the
    i-th non-empty ``Shard(0)`` chunk of every sharded tensor can only have been written by
    rank i, so it must live in ``__<i>_*.distcp``."""
    import pickle

    meta = pickle.loads((save_dir / ".metadata").read_bytes())
    ranks: dict[str, int] = {}
    for path in {info.relative_path for info in meta.storage_data.values()}:
        match = _DISTCP.fullmatch(path)
        if match is None:
            raise AssertionError(f"unexpected storage file name {path!r}")
        ranks[path] = int(match.group(1))
    for fqn, md in meta.state_dict_metadata.items():
        chunks = [c for c in getattr(md, "chunks", ()) if all(c.sizes)]
        if len(chunks) < 2:
            continue
        for rank, chunk in enumerate(sorted(chunks, key=lambda c: tuple(c.offsets))):
            keys = [k for k in meta.storage_data if k.fqn == fqn and k.offset == chunk.offsets]
            path = meta.storage_data[keys[0]].relative_path
            if ranks[path] != rank:
                raise AssertionError(f"{fqn} chunk {rank} is in {path}, not rank {rank}'s file")
    return ranks


def split_by_node(save_dir: Path, out_root: Path, ranks_per_node: int = 2) -> list[Path]:
    """Copy a save into per-node directories as node-local disks would hold it: node k gets
    the storage files of ranks k*ranks_per_node .. (k+1)*ranks_per_node - 1, and node 0 also
    ``.metadata``. Returns the node directories in node order."""
    save_dir, out_root = Path(save_dir), Path(out_root)
    ranks = _rank_of_files(save_dir)
    nodes = max(ranks.values()) // ranks_per_node + 1
    dirs = [out_root / f"node{k}" for k in range(nodes)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    for path, rank in sorted(ranks.items()):
        shutil.copyfile(save_dir / path, dirs[rank // ranks_per_node] / path)
    shutil.copyfile(save_dir / ".metadata", dirs[0] / ".metadata")
    return dirs


# ---------------------------------------------------------------- worker side


def _build(mesh: Any, seed: int, width: int = 64) -> tuple[Any, Any]:
    """The drill model and its AdamW, every parameter a DTensor on ``mesh``: ``Shard(0)``
    for emb (512 rows), proj_w / proj_b (10 rows: not divisible by 8) and tiny (3 rows: fewer
    than the ranks), ``Replicate()`` for gain; ``offset`` is a plain tensor buffer."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(seed)

    def param(shape: tuple[int, ...], placement: Any) -> Any:  # a DTensor Parameter
        full = torch.randn(*shape, generator=gen)
        return torch.nn.Parameter(distribute_tensor(full, mesh, [placement]))

    class DrillNet(torch.nn.Module):
        offset: torch.Tensor  # a buffer

        def __init__(self) -> None:
            super().__init__()
            self.emb = param((512, width), Shard(0))
            self.proj_w = param((10, width), Shard(0))
            self.proj_b = param((10,), Shard(0))
            self.tiny = param((3,), Shard(0))
            self.gain = param((width,), Replicate())
            self.register_buffer("offset", torch.randn(4, generator=gen))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.emb.full_tensor()[idx] * self.gain.full_tensor()
            out = h @ self.proj_w.full_tensor().T + self.proj_b.full_tensor()
            extra = (self.tiny.full_tensor() ** 2).sum() + self.offset.sum()
            loss: torch.Tensor = out.logsumexp(-1).mean() + extra
            return loss

    model = DrillNet()
    return model, torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)


def _step(model: Any, optim: Any) -> float:
    import torch

    loss = model(torch.tensor(BATCH))
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(loss.item())


def _init_dist() -> tuple[int, int, Any]:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    return rank, world, init_device_mesh("cpu", (world,))


def _worker_save(args: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    _, _, mesh = _init_dist()
    model, optim = _build(mesh, args["seed"], args["width"])
    for _ in range(2):
        _step(model, optim)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    save(state, storage_writer=FileSystemWriter(args["dir"]))


def _full(value: Any) -> Any:
    """A state value as rank-independent data: DTensors gathered (a collective: every rank
    calls this in the same order), plain tensors cloned."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def _worker_load(args: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    from transfer.engine.dcpplan_torch import planned_ranges

    rank, world, mesh = _init_dist()
    # different weights: the load must replace them
    model, optim = _build(mesh, seed=12345, width=args["width"])
    model_sd, optim_sd = get_state_dict(model, optim)  # materialises AdamW state
    state = {"model": model_sd, "optim": optim_sd}
    src = args["dirs"][str(rank)]
    restored = None
    if isinstance(src, dict):  # straight from a store
        from transfer.engine.dcpreader_torch import FerryReader

        os.environ.update(src["env"])
        planned = None
        from transfer.engine.dcpreader_torch import ALONE

        alone = bool(src.get("alone"))  # each rank reads for itself, DCP without collectives
        group = ALONE if alone else None
        with FerryReader(src["store"], src["job"], src["step"], process_group=group) as reader:
            if src.get("interrupt_coordinator") and rank == 0:  # a fault no store can cause

                def interrupted() -> bytes:
                    raise KeyboardInterrupt("injected")

                reader._read_metadata_file = interrupted  # type: ignore[method-assign]
            load(state, storage_reader=reader, no_dist=alone)
        assert reader.last_restore is not None
        restored = (reader.last_restore.bytes_raw, reader.bytes_fetched)
    else:
        planned = planned_ranges(state, src)
        if args.get("reader") == "local":
            from transfer.engine.dcplocal_torch import LocalReader

            load(state, storage_reader=LocalReader(src))
        else:
            load(state, storage_reader=FileSystemReader(src))
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    model_sd, optim_sd = get_state_dict(model, optim)
    flat_model, _ = flatten_state_dict(model_sd)
    flat_optim, _ = flatten_state_dict(optim_sd)
    result: dict[str, Any] = {
        "model": {k: _full(v) for k, v in sorted(flat_model.items())},
        "optim": {k: _full(v) for k, v in sorted(flat_optim.items())},
    }
    result["loss"] = _step(model, optim)
    with torch.no_grad():
        result["loss_after"] = float(model(torch.tensor(BATCH)).item())
    shards = {k: tuple(v.to_local().shape) for k, v in model.named_parameters()}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (planned, shards, restored))
    result["planned"] = {r: g[0] for r, g in enumerate(gathered)}
    result["local_shapes"] = {r: g[1] for r, g in enumerate(gathered)}
    result["restored"] = {r: g[2] for r, g in enumerate(gathered)}
    if rank == 0:
        torch.save(result, args["out"])


def _on_meta(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a meta-device one of the same global shape and
    placement: a state_dict that holds no data (what planned_ranges must accept)."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _on_meta(v) for k, v in obj.items()}
    if isinstance(obj, DTensor):
        local = torch.empty_like(obj.to_local(), device="meta")
        return DTensor.from_local(
            local, obj.device_mesh, obj.placements, shape=obj.shape, stride=obj.stride()
        )
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj, device="meta")
    return obj


def _worker_plan(args: dict[str, Any]) -> None:
    """Some (world size, rank) layouts in turn under the fake process group: build the
    model as that rank would, and ask DCP's planner what it reads, for the real state_dict
    and for the same on the meta device (which must plan the same reads)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from transfer.engine.dcpplan_torch import planned_ranges

    index = int(os.environ["RANK"])
    out = []
    for world, rank in args["groups"][index]:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            model, optim = _build(init_device_mesh("cpu", (world,)), seed=1)
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd}
            ranges = planned_ranges(state, args["dir"])
            meta = planned_ranges(_on_meta(state), args["dir"])
            out.append((world, rank, ranges if meta == ranges else {"meta differs": meta}))
        finally:
            dist.destroy_process_group()
    Path(os.environ["DRILL_WORK"], f"plan_{index}.json").write_text(json.dumps(out))


def _worker_main(mode: str, work_dir: str, rank: int, world: int, port: int) -> None:
    """One rank (a forked child): output to its log, any error's traceback to its error file
    (exit code 1), the process group always torn down."""
    import traceback

    work = Path(work_dir)
    log = os.open(work / f"log_{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", DRILL_WORK=work_dir)
    args = json.loads((work / "args.json").read_text())
    code = 0
    try:
        import torch

        torch.set_num_threads(1)
        {"save": _worker_save, "load": _worker_load, "plan": _worker_plan}[mode](args)
    except BaseException:
        (work / f"error_{rank}.txt").write_text(traceback.format_exc())
        code = 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
