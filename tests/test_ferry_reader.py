"""FerryReader: ``dcp.load`` straight from a store, no disk in the path. Real DCP saves of a
model trained with AdamW, pushed by the CLI into a local and an S3 store: the load is
bit-exact cold and holding the earlier step (whose unchanged chunks are read there), reads
only what its plan names, and a corrupt chunk, a hostile ``.metadata`` or a step that is
not a DCP save each end in one clear error. Skipped when torch is not installed."""

from __future__ import annotations

import asyncio
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest

from agent.cli.run import main as ferry
from tests.conftest import open_test_store
from transfer.engine.catalog import load_manifest
from transfer.errors import FerryError, IntegrityError
from transfer.format.layout import pack_key

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
FerryReader = pytest.importorskip("transfer.engine.dcpreader_torch").FerryReader
ALONE = pytest.importorskip("transfer.engine.dcpreader_torch").ALONE

SMALL_CHUNKS = ["--chunk-size-mib", "1", "--part-size-mib", "1", "--pack-size-mib", "1"]


def model_and_optimizer() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(4096, 256), torch.nn.Linear(256, 512), torch.nn.Linear(512, 512)
    )
    model[0].weight.requires_grad_(False)  # a frozen part: its chunks repeat step to step
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def train(model: Any, opt: Any, steps: int) -> None:
    gen = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        loss = model(torch.randint(0, 4096, (8, 16), generator=gen)).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def state_of(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.fixture
def series(store_url: str, tmp_path: Path) -> tuple[str, Path, dict[str, Any]]:
    """Steps 20 and 40 of a real training run, pushed (40 delta-coded against 20); the
    node's copy of step 20; the state step 40 saved."""
    model, opt = model_and_optimizer()
    hot = tmp_path / "hot"
    for step in (20, 40):
        train(model, opt, 5)
        dcp.save(
            state_of(model, opt), storage_writer=dcp.FileSystemWriter(str(hot / f"step_{step:06d}"))
        )
        args = ["push", str(hot / f"step_{step:06d}"), store_url, "--job", "t", "--node", "n"]
        assert ferry([*args, *SMALL_CHUNKS]) == 0
    return store_url, hot / "step_000020", state_of(model, opt)


def fresh_state() -> dict[str, Any]:
    """A state to load into: the same shapes, other values (one step of other training)."""
    model, opt = model_and_optimizer()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    train(model, opt, 1)
    return state_of(model, opt)


def assert_same(got: Any, want: Any, where: str = "") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_same(got[key], want[key], f"{where}/{key}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    else:
        assert got == want, where


@pytest.mark.parametrize("held", [False, True], ids=["cold", "holding k"])
def test_a_load_from_the_store_is_bit_exact(
    series: tuple[str, Path, dict[str, Any]], held: bool
) -> None:
    store_url, k, saved = series
    state = fresh_state()
    with FerryReader(store_url, "t", 40, base_dir=k if held else None) as reader:
        dcp.load(state, storage_reader=reader, no_dist=True)
    assert_same(state, saved)
    restored = reader.last_restore
    assert restored is not None and restored.bytes_raw > 0
    if held:  # the frozen embedding's chunks are read from the node's step 20, not fetched
        assert restored.chunks_local > 0
        assert restored.bytes_fetched < restored.bytes_raw
    else:
        assert restored.chunks_local == 0


def test_a_partial_state_fetches_only_what_its_plan_reads(
    series: tuple[str, Path, dict[str, Any]],
) -> None:
    store_url, _, saved = series
    whole = fresh_state()
    with FerryReader(store_url, "t", 40) as reader:
        dcp.load(whole, storage_reader=reader, no_dist=True)
        everything = reader.last_restore
    part = {"model": {"2.weight": torch.zeros(512, 512)}}  # one tensor of the model
    with FerryReader(store_url, "t", 40) as reader:
        dcp.load(part, storage_reader=reader, no_dist=True)
        one = reader.last_restore
    assert torch.equal(part["model"]["2.weight"], saved["model"]["2.weight"])
    # 1 MB of 512x512 fp32 is what the plan reads; chunks cut through at its ends add <= 2 MiB
    assert one.bytes_raw <= 512 * 512 * 4 + (2 << 20) < everything.bytes_raw / 2


@pytest.mark.parametrize("held", [False, True], ids=["cold", "holding k"])
def test_a_corrupt_chunk_fails_the_load_naming_it(
    series: tuple[str, Path, dict[str, Any]], held: bool
) -> None:
    """One error, the chunk's (holding k, the local reuse and the fetch run side by side
    in a TaskGroup: its ExceptionGroup came out whole). The chunk is a changed one of the
    largest storage file (fetched holding k too): a byte flipped mid-pack landed, as packs
    are laid out, in ``.metadata``'s chunk now and then, and DCP then fails in
    read_metadata, with its own wording around the same message."""
    store_url, k, _ = series

    async def flip_a_changed_chunk_of_step_40() -> None:
        store = open_test_store(store_url)
        try:
            m = await load_manifest(store, "t", 40, "n")
            m20 = await load_manifest(store, "t", 20, "n")
            was = {(f.path, i): c.id for f in m20.files for i, c in enumerate(f.chunks)}
            entry = max(m.files, key=lambda f: f.size)
            # changed since step 20: fetched, holding k too
            chunk = next(c for i, c in enumerate(entry.chunks) if was.get((entry.path, i)) != c.id)
            key = pack_key(m.packs[chunk.pack])
            data = bytearray(await store.get(key))
            data[chunk.offset + chunk.stored // 2] ^= 0x01
            await store.put(key, bytes(data))
        finally:
            await store.close()

    asyncio.run(flip_a_changed_chunk_of_step_40())
    base = k if held else None
    reader = FerryReader(store_url, "t", 40, base_dir=base)
    with reader, pytest.raises(BaseException) as failed:
        dcp.load(fresh_state(), storage_reader=reader, no_dist=True)
    # DCP wraps each rank's error: {rank: (the exception, its frames)}
    error = failed.value.failures[0][0]
    assert isinstance(error, IntegrityError) and str(error).startswith("chunk "), repr(error)


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        import os

        return (os.system, ("touch BOOM_FILE",))


def _boom_through_an_allowed_module() -> bytes:
    """Protocol 4 names a global as (module, dotted name): os.system, one dot away from a
    module DCP's metadata lives in (it imports os)."""
    module, name = b"torch.distributed.checkpoint.filesystem", b"os.system"
    return (
        b"\x80\x04"
        + b"\x8c" + bytes([len(module)]) + module
        + b"\x8c" + bytes([len(name)]) + name
        + b"\x93" + b"\x8c\x0ftouch BOOM_FILE" + b"\x85R."
    )  # fmt: skip


@pytest.mark.parametrize(
    "pickled, named",
    [
        (pickle.dumps(_Boom()), "posix.system"),
        (_boom_through_an_allowed_module(), "torch.distributed.checkpoint.filesystem.os.system"),
    ],
    ids=["os.system", "os.system through an allowed module"],
)
def test_a_hostile_metadata_is_refused_and_never_run(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pickled: bytes, named: str
) -> None:
    save = tmp_path / "step_000010"
    dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(str(save)), no_dist=True)
    (save / ".metadata").write_bytes(pickled)
    assert ferry(["push", str(save), store_url, "--job", "h", "--node", "n"]) == 0
    monkeypatch.chdir(tmp_path)
    with FerryReader(store_url, "h", 10) as reader, pytest.raises(BaseException) as failed:
        dcp.load({"w": torch.zeros(4)}, storage_reader=reader, no_dist=True)
    assert f"h step 10: .metadata is not DCP metadata ({named} is not" in str(failed.value)
    assert not (tmp_path / "BOOM_FILE").exists()


class _FailsAtFirstTensor(dcp.DefaultLoadPlanner):  # type: ignore[misc]
    def commit_tensor(self, read_item: Any, tensor: Any) -> None:
        raise RuntimeError("the caller's planner failed")


def test_a_load_that_fails_in_the_caller_ends_its_fetch_first(
    series: tuple[str, Path, dict[str, Any]],
) -> None:
    """The planner fails at the first item: read_data returns (raises) only once the
    fetch has ended; no thread of it goes on reading the store behind the caller's back."""
    store_url, k, _ = series
    with FerryReader(store_url, "t", 40, base_dir=k) as reader:
        with pytest.raises(BaseException, match="the caller's planner failed"):
            dcp.load(fresh_state(), storage_reader=reader, planner=_FailsAtFirstTensor(),
                     no_dist=True)  # fmt: skip
        # (before the reader's close, which would end a fetch still running)
        left = [t.name for t in threading.enumerate() if t.name.startswith("ferry-mem")]
        assert left == [], left
        assert reader.last_restore is None  # (it never finished)


def test_mistakes_fail_in_one_line_before_the_load(
    series: tuple[str, Path, dict[str, Any]], tmp_path: Path
) -> None:
    store_url, _, _ = series
    with pytest.raises(FerryError, match="no committed checkpoint for job 'nosuch' step 40"):
        FerryReader(store_url, "nosuch", 40)
    with pytest.raises(FerryError, match="no committed checkpoint for job 't' step 41"):
        FerryReader(store_url, "t", 41)
    with pytest.raises(FerryError, match=r"base directory .* does not exist"):
        FerryReader(store_url, "t", 40, base_dir=tmp_path / "step_000020")
    with pytest.raises(TypeError, match="step must be an int or None, not str '40'"):
        FerryReader(store_url, "t", "40")  # type: ignore[arg-type]
    reader = FerryReader(store_url, "t")  # the newest
    assert reader.step == 40
    reader.close()
    reader.close()  # again: nothing
    with pytest.raises(BaseException, match="this FerryReader is closed: make a new one"):
        dcp.load(fresh_state(), storage_reader=reader, no_dist=True)


def test_a_step_without_metadata_says_so(store_url: str, tmp_path: Path) -> None:
    save = tmp_path / "step_000010"
    save.mkdir()
    (save / "weights.bin").write_bytes(b"\x01" * 1000)
    assert ferry(["push", str(save), store_url, "--job", "p", "--node", "n"]) == 0
    with FerryReader(store_url, "p", 10) as reader, pytest.raises(BaseException) as failed:
        dcp.load({"w": torch.zeros(4)}, storage_reader=reader, no_dist=True)
    assert "p step 10 has no .metadata: not a DCP save" in str(failed.value)


def test_alone_survives_a_trip_to_a_spawned_worker() -> None:
    """ALONE is told by identity: reader arguments pickled to a worker keep meaning it."""
    assert pickle.loads(pickle.dumps(ALONE)) is ALONE
