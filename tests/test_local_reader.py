"""LocalReader and the item parser under it (transfer/engine/dcplocal_torch.py,
dcpitem_torch.py): real ``dcp.save``s and ``torch.save``s of every dtype and layout a state
dict holds. Every plain tensor is read in place (the spy on torch's reader sees only the
byte items), the values equal torch's own load bit for bit, whatever the target's layout
or dtype, and an item that is not a plain tensor, or a file cut short, is never read as
one. Skipped when torch is not installed."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystemReader  # noqa: E402

from transfer.engine.dcpitem_torch import (  # noqa: E402
    HEAD_BYTES,
    _unpickle,
    stored_tensor,
    tensor_of_item,
)
from transfer.engine.dcplocal_torch import LocalReader  # noqa: E402
from transfer.errors import FormatError  # noqa: E402


def saved_state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(40, 8, generator=gen)
    return {
        "fp32": torch.randn(64, 33, generator=gen),
        "bf16": torch.randn(17, 5, generator=gen).to(torch.bfloat16),
        "fp16": torch.randn(9, generator=gen).half(),
        "fp64": torch.randn(3, 3, generator=gen).double(),
        "int64": torch.arange(-50, 50),
        "int8": torch.arange(-8, 8, dtype=torch.int8),
        "bool": torch.rand(31, generator=gen) > 0.5,
        "complex": torch.randn(4, dtype=torch.complex64, generator=gen),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(8, 4, generator=gen).t(),  # saved non-contiguous
        "view": big[10:20],  # a view into a bigger storage
        "as_other_dtype": torch.randn(6, 6, generator=gen),
        "into_a_transposed_target": torch.randn(5, 7, generator=gen),
        "extra": {"step": 5, "name": "run-a", "lrs": [0.1, 0.01]},  # byte items
    }


def fresh_targets(saved: dict[str, Any]) -> dict[str, Any]:
    """Tensors to load into: the saved shapes, other values; two of another layout or
    dtype than the saved one."""
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            out[key] = torch.full_like(value.contiguous(), 1 if value.dtype == torch.bool else 7)
        else:
            out[key] = {"step": 0, "name": "", "lrs": []}
    out["as_other_dtype"] = torch.zeros(6, 6, dtype=torch.bfloat16)
    out["into_a_transposed_target"] = torch.zeros(7, 5).t()
    return out


@pytest.fixture
def step(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    saved = saved_state()
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "step")), no_dist=True)
    return tmp_path / "step", saved


def load_with(reader: Any, saved: dict[str, Any]) -> dict[str, Any]:
    state = fresh_targets(saved)
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def test_every_plain_tensor_is_read_in_place_and_equals_torchs_own_load(
    step: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, saved = step
    want = load_with(FileSystemReader(path), saved)
    by_torch: list[str] = []
    torch_read = FileSystemReader.read_data

    def spy(self: Any, plan: Any, planner: Any) -> Any:
        by_torch.extend(item.storage_index.fqn for item in plan.items)
        return torch_read(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", spy)
    got = load_with(LocalReader(path), saved)
    assert sorted(by_torch) == ["extra.lrs", "extra.name", "extra.step"]  # byte items only
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].stride() == value.stride(), key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    assert torch.equal(got["transposed"], saved["transposed"])
    assert torch.equal(got["view"], saved["view"])
    assert torch.equal(got["into_a_transposed_target"], saved["into_a_transposed_target"])
    assert got["as_other_dtype"].dtype == torch.bfloat16
    assert torch.equal(got["as_other_dtype"], saved["as_other_dtype"].to(torch.bfloat16))


def test_a_file_cut_short_fails_the_load_naming_it(step: tuple[Path, dict[str, Any]]) -> None:
    path, saved = step
    (shard,) = path.glob("*.distcp")
    metadata = FileSystemReader(path).read_metadata()
    (fp32,) = (info for index, info in metadata.storage_data.items() if index.fqn == "fp32")
    os.truncate(shard, fp32.offset + 4096)  # inside its values
    cut = f"{shard.name}: ends at byte {fp32.offset + 4096}, inside fp32"
    with pytest.raises(CheckpointException, match=cut):  # (DCP's wrapper of every error)
        load_with(LocalReader(path), saved)


def test_a_hostile_metadata_is_refused_and_never_run(
    step: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step pulled from a store another node wrote: torch's reader would run its
    ``.metadata``; LocalReader builds DCP's metadata types only."""
    path, saved = step
    (path / ".metadata").write_bytes(pickle.dumps(_Boom(path.parent / "ran")))
    monkeypatch.chdir(path.parent)
    with pytest.raises(
        CheckpointException, match=r"\.metadata is not DCP metadata \(posix\.system"
    ):
        load_with(LocalReader(path), saved)
    assert not (path.parent / "ran").exists()


def item_of(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "value",
    [
        torch.randn(128, 64),
        torch.randn(3, 5).to(torch.bfloat16),
        torch.randn(6, 4).t(),
        torch.arange(100)[30:70:3],
        torch.tensor(True),
        torch.empty(0, 3, dtype=torch.float16),
    ],
    ids=["fp32", "bf16", "transposed", "strided view", "scalar", "empty"],
)
def test_a_torch_save_of_a_plain_tensor_is_read_over_its_own_bytes(value: Any) -> None:
    item = bytearray(item_of(value))
    got = tensor_of_item(item)
    assert got is not None
    assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value)
    if value.numel():
        before = bytes(item)
        got.zero_() if value.dtype != torch.bool else got.logical_not_()
        assert bytes(item) != before  # a view over the item's bytes, not a copy


def test_what_is_not_a_plain_tensor_is_left_to_torch_load() -> None:
    parameter = item_of(torch.nn.Parameter(torch.ones(4)))
    assert tensor_of_item(parameter) is None  # rebuilt by another function
    assert tensor_of_item(item_of({"w": torch.ones(2)})) is None  # not a tensor
    assert tensor_of_item(item_of(torch.ones(3, requires_grad=True).detach())) is not None
    good = item_of(torch.arange(1000, dtype=torch.int32))
    assert tensor_of_item(good[: len(good) // 2]) is None  # cut inside its data
    stored = stored_tensor(good[:HEAD_BYTES])
    assert stored is not None and stored.described  # torch writes sizes after the data
    torn = bytearray(good)
    torn[stored.data_end + 8] ^= 0xFF  # the size written after the data disagrees
    assert tensor_of_item(torn) is None


class _Boom:
    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.mark}",))


def test_a_hostile_data_pkl_is_never_run(tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    assert _unpickle(memoryview(pickle.dumps(_Boom(mark), protocol=2))) is None
    assert not mark.exists()


def test_a_narrowing_reads_from_its_first_element_to_its_last() -> None:
    value = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    item = item_of(value)
    stored = stored_tensor(item[:HEAD_BYTES])
    assert stored is not None

    def read(offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Any:
        span = stored.span(offsets, lengths, "v")
        data = bytearray(item[span.start : span.start + span.length])
        return span, torch.frombuffer(data, dtype=torch.float32).as_strided(span.size, span.stride)

    rows, got = read((2, 0), (3, 10))  # a row shard: one contiguous run of its bytes
    assert rows.contiguous and rows.length == 3 * 10 * 4 and torch.equal(got, value[2:5])
    cols, got = read((1, 3), (4, 5))  # a column shard: from its first byte to its last
    assert not cols.contiguous and cols.length == (3 * 10 + 5) * 4
    assert torch.equal(got, value[1:5, 3:8])
    assert stored.span((6, 0), (0, 10), "v").length == 0


def test_targets_whose_bits_mean_other_values_are_loaded_through_copy(tmp_path: Path) -> None:
    """A conjugate or negative view reads its memory as other values, and a tensor
    subclass may hold no memory of its own: bytes read straight into them were wrong
    values or ``Bad address`` (found in review); they take the bytes through ``copy_``."""
    from torch.testing._internal.two_tensor import TwoTensor

    saved = {"c": torch.tensor([1 + 2j, 3 - 4j]), "f": torch.tensor([1.0, -2.0]),
             "w": torch.arange(6.0)}  # fmt: skip
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")), no_dist=True)

    def targets() -> dict[str, Any]:
        return {"c": torch.zeros(2, dtype=torch.complex64).conj(),
                "f": torch._neg_view(torch.zeros(2)),
                "w": TwoTensor(torch.zeros(6), torch.zeros(6))}  # fmt: skip

    want, got = targets(), targets()
    dcp.load(want, storage_reader=FileSystemReader(tmp_path / "s"), no_dist=True)
    dcp.load(got, storage_reader=LocalReader(tmp_path / "s"), no_dist=True)
    assert got["c"].tolist() == want["c"].tolist() == saved["c"].tolist()
    assert got["f"].tolist() == want["f"].tolist() == saved["f"].tolist()
    assert torch.equal(got["w"].a, saved["w"]) and torch.equal(got["w"].b, saved["w"])


class _Targets:
    """The two calls of DCP's planner a reader makes, over named tensors."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def resolve_tensor(self, req: Any) -> Any:
        return self.tensors[req.storage_index.fqn]

    def commit_tensor(self, req: Any, tensor: Any) -> None:
        pass


@pytest.mark.parametrize(
    "offsets, lengths",
    [((0,), (8,)), ((2,), (4,)), ((0, 0), (4, 1))],
    ids=["longer", "past the end", "another rank of dims"],
)
def test_a_narrowing_past_the_stored_tensor_is_refused_naming_it(
    tmp_path: Path, offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> None:
    """A ``.metadata`` that does not describe its items (hand-edited, or another save's):
    LocalReader read the bytes after the tensor, the next item's among them, as values
    (found in review); it refuses, naming the item."""
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    saved = {"a": torch.arange(4.0), "b": torch.full((600,), 9.0)}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")), no_dist=True)
    reader = LocalReader(tmp_path / "s")
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    (index,) = (i for i in metadata.storage_data if i.fqn == "a")
    req = ReadItem(type=LoadItemType.TENSOR, dest_index=index,
                   dest_offsets=torch.Size([0] * len(lengths)), storage_index=index,
                   storage_offsets=torch.Size(offsets), lengths=torch.Size(lengths))  # fmt: skip
    target = torch.zeros(lengths)
    with pytest.raises(FormatError, match=r"^a: the load plan reads offsets .* does not describe"):
        reader.read_data(LoadPlan([req]), _Targets({"a": target}))  # type: ignore[arg-type]
    assert not target.any()


def test_a_hostile_pickle_changes_nothing_of_the_process(tmp_path: Path) -> None:
    """A pickle's BUILD sets attributes on what ``find_class`` gave it: a refused
    ``data.pkl`` broke every later float32 load of the process, a refused ``.metadata``
    made DCP's ``MetadataIndex`` unhashable and ``PosixPath`` join wrongly (found in
    review). Both are refused and leave everything as it was."""
    from pathlib import PosixPath

    from torch.distributed.checkpoint.metadata import MetadataIndex

    from transfer.engine.dcpmetadata_torch import metadata_from

    storage = b"\x80\x02ctorch\nFloatStorage\n}X\x05\x00\x00\x00dtypeX\x05\x00\x00\x00pwnedsb."
    assert _unpickle(memoryview(storage)) is None
    assert tensor_of_item(item_of(torch.arange(3.0))) is not None  # float32 still read
    metadata = (
        b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"
        b"N}X\x08\x00\x00\x00__hash__Ns\x86b"
        b"cpathlib\nPosixPath\nN}X\x0b\x00\x00\x00__truediv__cpathlib\nPurePosixPath\ns\x86b."
    )
    with pytest.raises(FormatError, match="sets attributes of MetadataIndex, PosixPath"):
        metadata_from(metadata, "step 10", "load-1")
    assert hash(MetadataIndex("a")) == hash(MetadataIndex("a"))
    assert PosixPath("/a") / "b" == PosixPath("/a/b")


def test_a_save_made_without_crcs_is_read_in_place() -> None:
    """torch's ``compute_crc32 = False`` writes 0 for every record's CRC: the records are
    still found by their sizes (they all fell back to torch.load, found in review)."""
    from torch.utils.serialization import config

    value = torch.arange(12.0).reshape(3, 4)
    before = config.save.compute_crc32
    config.save.compute_crc32 = False  # (pytest's monkeypatch deletes torch's config keys)
    try:
        item = bytearray(item_of(value))
    finally:
        config.save.compute_crc32 = before
    got = tensor_of_item(item)
    assert got is not None and torch.equal(got, value)


def test_a_directory_that_holds_no_save_fails_when_the_reader_is_made(tmp_path: Path) -> None:
    """Inside ``dcp.load`` a missing ``.metadata`` is two logged tracebacks and an
    AssertionError; the reader says it in one line when it is made."""
    with pytest.raises(FormatError, match=r"nope: no such directory$"):
        LocalReader(tmp_path / "nope")
    with pytest.raises(FormatError, match=r"has no \.metadata: not a DCP save"):
        LocalReader(tmp_path)


def test_a_shard_file_not_there_fails_naming_it(step: tuple[Path, dict[str, Any]]) -> None:
    path, saved = step
    (shard,) = path.glob("*.distcp")
    shard.unlink()
    with pytest.raises(CheckpointException, match=f"{shard.name}: not there, and .metadata"):
        load_with(LocalReader(path), saved)


def test_each_kind_of_head_is_parsed_once_and_every_item_lands_in_its_own_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save's items have few kinds of head (one per shape and dtype); LocalReader parses
    each kind once and reuses it for the rest, never for an item of another shape or dtype
    (a bf16 item beside an fp32 one of the same shape, a 3 x 4 beside a 4 x 3)."""
    import transfer.engine.dcpitem_torch as items

    gen = torch.Generator().manual_seed(3)
    saved: dict[str, Any] = {}
    for n in range(6):
        saved[f"w{n}"] = torch.randn(3, 4, generator=gen)
        saved[f"t{n}"] = torch.randn(4, 3, generator=gen)
        saved[f"h{n}"] = torch.randn(3, 4, generator=gen).to(torch.bfloat16)
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path / "s")), no_dist=True)
    parsed: list[int] = []
    parse = items.stored_tensor

    def counting(head: Any) -> Any:
        parsed.append(1)
        return parse(head)

    monkeypatch.setattr(items, "stored_tensor", counting)
    got = {key: torch.zeros_like(value) for key, value in saved.items()}
    dcp.load(got, storage_reader=LocalReader(tmp_path / "s"), no_dist=True)
    for key, value in saved.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert len(parsed) == 3  # fp32 3 x 4, fp32 4 x 3, bf16 3 x 4: one parse each


def test_copies_split_over_threads_fill_every_byte_and_a_short_file_fails_naming_it(
    step: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With threads copying (the threshold lowered so this small save goes that way, and
    pieces of 64 bytes so tensors are split between them) the load is torch's own, bit
    for bit; a read past a file's end, in a thread, fails the load naming the file."""
    import transfer.engine.dcplocal_torch as local

    path, saved = step
    want = load_with(FileSystemReader(path), saved)
    monkeypatch.setattr(local, "READ_THREADS", 3)
    monkeypatch.setattr(local, "THREADED_BYTES", 0)
    monkeypatch.setattr(local, "PIECE_BYTES", 64)
    got = load_with(LocalReader(path), saved)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
    (shard,) = path.glob("*.distcp")
    into = memoryview(bytearray(256))
    fd = os.open(shard, os.O_RDONLY)
    with (
        pytest.raises(FormatError, match=f"{shard.name}: ends at byte"),
        local._Copies(2) as copies,
    ):
        copies.add(fd, str(shard), into[:128], 0)
        copies.add(fd, str(shard), into[128:], shard.stat().st_size - 64)
        copies.adopt(fd)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with its reads made


def test_a_planner_that_stages_its_tensors_has_each_committed_before_the_next(
    step: tuple[Path, dict[str, Any]],
) -> None:
    """torch's documented pattern for a planner that post-processes: resolve_tensor hands a
    staging tensor it allocated, commit_tensor copies it into the state_dict. Each staging
    tensor is committed, filled, before the next is resolved (deferring every commit to the
    end would keep them all alive at once: found in review)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    path, saved = step
    want = load_with(FileSystemReader(path), saved)
    outstanding: list[int] = []

    class Staging(DefaultLoadPlanner):
        def resolve_tensor(self, read_item: Any) -> Any:
            target = super().resolve_tensor(read_item)
            outstanding.append(1)
            assert len(outstanding) == 1, "a staging tensor resolved before the last commit"
            return torch.empty_like(target, memory_format=torch.contiguous_format)

        def commit_tensor(self, read_item: Any, tensor: Any) -> None:
            super().resolve_tensor(read_item).copy_(tensor)
            outstanding.pop()

    got = fresh_targets(saved)
    dcp.load(got, storage_reader=LocalReader(path), planner=Staging(), no_dist=True)
    assert outstanding == []
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key


def test_the_collector_is_paused_for_the_read_and_left_as_it_was(
    step: tuple[Path, dict[str, Any]],
) -> None:
    """Paused while .metadata is unpickled and while the items are read (a full
    collection took up to a quarter of a warm load), on again after each, and left off
    for a caller that had it off."""
    import gc

    import transfer.engine.dcplocal_torch as local

    path, saved = step
    seen: list[tuple[str, bool]] = []
    read, unpickle = LocalReader._read_data, local.metadata_from

    def spy(self: Any, plan: Any, planner: Any) -> Any:
        seen.append(("read", gc.isenabled()))
        return read(self, plan, planner)

    def spy_metadata(*args: Any) -> Any:
        seen.append(("metadata", gc.isenabled()))
        return unpickle(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LocalReader, "_read_data", spy)
        patch.setattr(local, "metadata_from", spy_metadata)
        assert gc.isenabled()
        load_with(LocalReader(path), saved)
        assert seen == [("metadata", False), ("read", False)] and gc.isenabled()
        gc.disable()
        try:
            load_with(LocalReader(path), saved)
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_reads_close_together_are_one_preadv_and_every_buffer_gets_its_own_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's reads are batched (one preadv over the small gaps between them, a new one
    past a wide gap, over MAX_BUFFERS, or for the same bytes read twice) and each buffer
    gets exactly its own range of the file."""
    import transfer.engine.dcplocal_torch as local

    monkeypatch.setattr(local, "MAX_GAP", 100)
    monkeypatch.setattr(local, "MAX_BUFFERS", 7)
    data = os.urandom(20_000)
    (tmp_path / "f").write_bytes(data)
    ranges = [(0, 10), (10, 30), (90, 50), (140, 1), (400, 64), (470, 5), (470, 5),
              (480, 1), (490, 1), (500, 1), (510, 1), (19_990, 10)]  # fmt: skip
    reads = [(memoryview(bytearray(n)), at) for at, n in ranges]
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        batches = local._batches(fd, "f", list(reversed(reads)))
        # (0,10)(10,30) gap 50 (90,50)(140,1) | gap 259: (400,64) gap 6 (470,5) |
        # the same bytes again: (470,5) gap 5 (480,1) gap 9 (490,1) gap 9 (500,1) | seven
        # buffers: (510,1) | gap 19,479: (19990,10)
        assert [b.offset for b in batches] == [0, 400, 470, 510, 19_990]
        assert batches[0].parts[2] == 50  # a gap, read into scratch
        for batch in batches:
            assert len(batch.parts) <= 7
            local._read_batch(batch)
    finally:
        os.close(fd)
    for (at, n), (into, _) in zip(ranges, reads, strict=True):
        assert bytes(into) == data[at : at + n], (at, n)


def test_copies_close_every_descriptor_and_keep_the_loads_own_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: past MAX_OPEN, a file adopted while the reads before it failed was
    never closed; and a load that failed had its own error replaced by a read's."""
    import transfer.engine.dcplocal_torch as local

    monkeypatch.setattr(local._Copies, "MAX_OPEN", 1)
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"x" * 100)
    fa, fb = (os.open(tmp_path / name, os.O_RDONLY) for name in ("a", "b"))
    with pytest.raises(FormatError, match="a: ends at byte 100"), local._Copies(1) as copies:
        copies.add(fa, str(tmp_path / "a"), memoryview(bytearray(10)), 95)  # past its end
        copies.adopt(fa)
        copies.adopt(fb)  # (past MAX_OPEN: the reads so far are made first, and fail)
    for fd in (fa, fb):
        with pytest.raises(OSError):
            os.fstat(fd)  # closed
    fa = os.open(tmp_path / "a", os.O_RDONLY)
    with pytest.raises(ValueError, match="the load's own"), local._Copies(1) as copies:
        copies.add(fa, str(tmp_path / "a"), memoryview(bytearray(10)), 95)
        copies.adopt(fa)
        raise ValueError("the load's own")
    with pytest.raises(OSError):
        os.fstat(fa)
