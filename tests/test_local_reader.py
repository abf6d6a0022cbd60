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


def test_a_narrowing_reads_only_the_bytes_it_narrows_to() -> None:
    value = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    item = item_of(value)
    stored = stored_tensor(item[:HEAD_BYTES])
    assert stored is not None

    def read(offsets: tuple[int, ...], lengths: tuple[int, ...]) -> Any:
        span = stored.span(offsets, lengths)
        data = bytearray(item[span.start : span.start + span.length])
        return span, torch.frombuffer(data, dtype=torch.float32).as_strided(span.size, span.stride)

    rows, got = read((2, 0), (3, 10))  # a row shard: one contiguous run of its bytes
    assert rows.contiguous and rows.length == 3 * 10 * 4 and torch.equal(got, value[2:5])
    cols, got = read((1, 3), (4, 5))  # a column shard: from its first byte to its last
    assert not cols.contiguous and cols.length == (3 * 10 + 5) * 4
    assert torch.equal(got, value[1:5, 3:8])
    assert stored.span((6, 0), (0, 10)).length == 0
