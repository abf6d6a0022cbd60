"""What the node can spare (transfer/engine/writepath.py spare_memory, cgroup_room): the
host's MemAvailable less a reserve, and inside a container what its memory cgroup's limit
leaves less a margin for the agent's own memory; cgroup v2 and v1 files as the kernel
writes them, in fake cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

import transfer.engine.writepath as writepath
from transfer.engine.writepath import cgroup_room, spare_memory

MIB, GIB = 1 << 20, 1 << 30


def meminfo(tmp_path: Path, total: int, available: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {total // 1024} kB\nMemAvailable: {available // 1024} kB\n")
    return path


def cgroup_dir(where: Path, files: dict[str, str]) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (where / name).write_text(text)


def test_cgroup_v2_limit_less_the_working_set(tmp_path: Path) -> None:
    root, own = tmp_path / "fs", tmp_path / "cgroup"
    own.write_text("0::/kubepods/pod1/agent\n")
    cgroup_dir(root / "kubepods/pod1/agent", {
        "memory.max": f"{GIB}\n", "memory.current": f"{300 * MIB}\n",
        "memory.stat": f"anon {150 * MIB}\ninactive_file {100 * MIB}\n",
    })  # fmt: skip
    assert cgroup_room(root, own) == (GIB, GIB - 200 * MIB)
    (root / "kubepods/pod1/agent/memory.max").write_text("max\n")
    assert cgroup_room(root, own) is None  # no limit


def test_cgroup_v1_and_a_containers_own_root(tmp_path: Path) -> None:
    root, own = tmp_path / "fs", tmp_path / "cgroup"
    own.write_text("9:pids:/x\n4:memory:/process_api/abc\n1:cpu:/\n")
    v1 = {
        "memory.limit_in_bytes": f"{2 * GIB}\n", "memory.usage_in_bytes": f"{GIB}\n",
        "memory.stat": f"cache {GIB}\ntotal_inactive_file {512 * MIB}\n",
    }  # fmt: skip
    cgroup_dir(root / "memory/process_api/abc", v1)
    assert cgroup_room(root, own) == (2 * GIB, 2 * GIB - 512 * MIB)
    (root / "memory/process_api/abc/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_room(root, own) is None  # v1's "no limit"
    # inside a container the path it is named by is not mounted: its own tree is the root
    cgroup_dir(root / "memory", v1)
    (root / "memory/process_api/abc/memory.limit_in_bytes").unlink()
    assert cgroup_room(root, own) == (2 * GIB, 2 * GIB - 512 * MIB)
    assert cgroup_room(root, tmp_path / "nope") is None


def test_a_container_spares_what_its_limit_leaves_less_a_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = meminfo(tmp_path, total=64 * GIB, available=60 * GIB)
    monkeypatch.setattr(writepath, "cgroup_room", lambda: None)
    assert spare_memory(host) == int((60 * GIB - int(6.4 * GIB)) * 0.5)  # the host's rule
    # a 1 GiB pod using 200 MiB: 824 MiB left, 256 MiB of it the agent's own: half of 568
    monkeypatch.setattr(writepath, "cgroup_room", lambda: (GIB, GIB - 200 * MIB))
    assert spare_memory(host) == 284 * MIB
    monkeypatch.setattr(writepath, "cgroup_room", lambda: (GIB, 100 * MIB))
    assert spare_memory(host) == 0  # full: nothing to spare, never negative
