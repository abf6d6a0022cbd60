"""Where a push cuts files (transfer/engine/chunkspans.py): at a DCP save's items, found
without torch or ``.metadata``, and every chunk_size bytes where there are none."""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import zipfile
from pathlib import Path

import pytest

from transfer.engine import push
from transfer.engine.catalog import load_manifest
from transfer.engine.chunkspans import (
    GROUP_BYTES,
    chunk_spans,
    fixed_spans,
    item_ends,
    scan_item_ends,
    spans,
)
from transfer.engine.dcpshare import parse_metadata
from transfer.errors import SourceChangedError
from transfer.format.layout import manifest_key
from transfer.format.manifest import Manifest
from transfer.options import TransferOptions
from transfer.store import open_store

KiB = 1 << 10
CHUNK = 64 * KiB


def archive(payload: bytes, name: str = "archive/data/0") -> bytes:
    """A zip holding ``payload`` stored, as torch.save's records are (no zip64 record)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
        z.writestr(name, payload)
    return out.getvalue()


def tiles(cut: list[tuple[int, int]], size: int) -> bool:
    return sum(n for _, n in cut) == size and all(
        a + n == b for (a, n), (b, _) in itertools.pairwise(cut)
    )


def test_small_items_get_chunks_of_their_own_and_big_ones_are_grouped_at_item_bounds() -> None:
    """Small items (step counters, param_groups, replicated LayerNorms: what every rank
    may read) in chunks of small items only, up to GROUP_BYTES; bigger ones grouped up to
    chunk_size at item bounds, one larger than chunk_size cut alone from its start; the
    tail cut every chunk_size. (Page-sized items: the cuts need no moving.)"""
    chunk = 1 << 20
    P = 4096
    sizes = [P, P, 75 * P, 100 * P, P, 3 * chunk + P, 125 * P, 150 * P, P]
    ends = list(itertools.accumulate(sizes))
    size = ends[-1] + chunk + 7
    cut = spans(size, ends, chunk)
    assert tiles(cut, size)
    big = ends[4]
    assert cut == [
        (0, 2 * P),  # two small items
        (2 * P, 175 * P),  # two big ones
        (177 * P, P),  # small
        (big, chunk), (big + chunk, chunk), (big + 2 * chunk, chunk), (big + 3 * chunk, P),
        (ends[5], 125 * P), (ends[6], 150 * P),  # together they would pass chunk_size
        (ends[7], P),  # small
        (ends[8], chunk), (ends[8] + chunk, 7),  # after the last item
    ]  # fmt: skip


def test_cuts_fall_on_pages_and_a_small_item_never_shares_a_big_ones_chunk() -> None:
    """Items at any offsets: every cut but the file's end is page-aligned (a restore
    writes chunks with O_DIRECT), and each small item lies in one chunk of at most
    GROUP_BYTES and a page on each side, so a rank that reads it fetches no big item."""
    KB = 1000
    sizes = [2 * KB, 1500, 700 * KB, 2153, 740_905, 2153, 2153, 3 * KB, 2_881_065, 1261,
             5_000_000, 157_225, 40_489, 3945]  # fmt: skip
    ends = list(itertools.accumulate(sizes))
    size = ends[-1] + 5000
    cut = spans(size, ends, 4 << 20)
    assert tiles(cut, size)
    assert all(o % 4096 == 0 for o, _ in cut)
    for lo, hi in itertools.pairwise([0, *ends]):
        holding = [(o, n) for o, n in cut if o < hi and lo < o + n]
        if hi - lo < GROUP_BYTES:
            assert len(holding) == 1 and holding[0][1] <= GROUP_BYTES + 2 * 4096, (lo, hi)


def test_items_group_up_to_their_limit_and_no_further() -> None:
    for item, limit in ((4 * KiB, GROUP_BYTES), (256 * KiB, 4 << 20)):
        ends = [item * (i + 1) for i in range(300)]
        cut = spans(ends[-1], ends, 4 << 20)
        assert tiles(cut, ends[-1])
        assert all(n <= limit and n % item == 0 for _, n in cut)
        assert len(cut) == -(-300 // (limit // item))


@pytest.mark.parametrize("chunk", [4 * KiB, 16 * KiB, GROUP_BYTES, 4 << 20])
def test_no_chunk_is_larger_than_chunk_size_whatever_the_items(chunk: int) -> None:
    """Small chunk sizes (tests, tiny saves) are below GROUP_BYTES: a group of items, or
    one item between the two sizes, must still fit one chunk."""
    sizes = [100, 3 * KiB, 5 * KiB, 20 * KiB, 40 * KiB, 63 * KiB, 64 * KiB, 200 * KiB, 7]
    ends = list(itertools.accumulate(sizes * 3))
    cut = spans(ends[-1] + 12345, ends, chunk)
    assert tiles(cut, ends[-1] + 12345)
    assert all(0 < n <= chunk for _, n in cut)


def test_without_items_a_file_is_cut_every_chunk_size_bytes(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    (tmp_path / "__0_0.distcp").write_bytes(data)  # a DCP name, but not archives
    (tmp_path / "weights.bin").write_bytes(archive(b"x" * 70_000))  # archives, not a DCP name
    for name in ("__0_0.distcp", "weights.bin"):
        path = tmp_path / name
        size = path.stat().st_size
        assert chunk_spans(path, size, CHUNK) == fixed_spans(size, CHUNK)
    assert spans(0, [], CHUNK) == []


def test_archives_back_to_back_are_found_and_a_planted_end_record_is_not(tmp_path: Path) -> None:
    """A tensor's bytes may hold an end record's signature, even one whose fields look
    right: an item ends only where the archive that starts at the last end ends."""
    fake_end = b"PK\x05\x06" + bytes(4) + (2).to_bytes(2, "little") * 2 + bytes(10)
    items = [archive(b"a" * 100_000 + fake_end + b"b" * 50_000), archive(b"c" * 3000),
             archive(fake_end * 3), archive(b"d" * 200_000)]  # fmt: skip
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"".join(items) + b"trailing bytes, no archive")
    ends, pos = [], 0
    for item in items:
        pos += len(item)
        ends.append(pos)
    size = path.stat().st_size
    assert scan_item_ends(path, size) == ends
    assert chunk_spans(path, size, CHUNK) == spans(size, ends, CHUNK)


def test_many_byte_items_are_searched_through_in_small_windows() -> None:
    """Items that are not tensors (a flattened optimizer's settings: thousands of ~1 KB
    byte items first in the file) are searched through for their ends: each reads a
    little past itself, not a 16 MiB window (that read 37 GB of a 100 MB save)."""
    items = [archive(b"%d" % i, name="archive/data.pkl") for i in range(500)]
    items.append(archive(bytes(8 << 20)))
    data = b"".join(items)
    read = [0]

    def read_at(offset: int, n: int) -> bytes:
        read[0] += n
        return data[offset : offset + n]

    ends = list(itertools.accumulate(len(item) for item in items))
    assert item_ends(read_at, len(data)) == ends
    assert read[0] < 10 * len(data), read[0]


def test_a_file_cut_short_mid_item_keeps_the_whole_items_and_one_that_shrinks_is_named(
    tmp_path: Path,
) -> None:
    items = [archive(b"e" * 90_000), archive(b"f" * 90_000)]
    path = tmp_path / "__1_0.distcp"
    path.write_bytes(items[0] + items[1][:-30])  # the last item torn
    assert scan_item_ends(path, path.stat().st_size) == [len(items[0])]
    with pytest.raises(SourceChangedError, match="shrank"):
        scan_item_ends(path, path.stat().st_size + 10)  # the size the push scanned
    path.unlink()
    with pytest.raises(SourceChangedError, match="vanished"):
        scan_item_ends(path, 100)


def test_a_real_dcp_save_is_cut_at_its_items_as_metadata_places_them(
    tmp_path: Path, local_url: str
) -> None:
    """A single-process save of a model and its AdamW state (tensors and the optimizer's
    non-tensor items): the ends found without .metadata are the ends it records, and a push
    cuts there, writing a version 3 manifest."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Embedding(300, 64), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 4096))  # fmt: skip
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optim.step()
    save = tmp_path / "step_000010"
    dcp.save({"model": model.state_dict(), "optim": optim.state_dict()}, checkpoint_id=save)
    parsed = parse_metadata((save / ".metadata").read_bytes())
    recorded: dict[str, list[int]] = {}
    for path, offset, length in parsed.storage.values():
        recorded.setdefault(path, []).append(offset + length)
    assert recorded.keys() == {"__0_0.distcp"}
    shard = save / "__0_0.distcp"
    found = scan_item_ends(shard, shard.stat().st_size)
    assert found == sorted(recorded["__0_0.distcp"]) and len(found) > 10
    options = TransferOptions(chunk_size=CHUNK, part_size=1 << 20)

    async def pushed() -> tuple[bytes, Manifest]:
        store = open_store(local_url)
        try:
            await push(store, save, job="j", step=10, node="n", options=options)
            raw = await store.get(manifest_key("j", 10, "n"))
            return raw, await load_manifest(store, "j", 10, "n")
        finally:
            await store.close()

    raw, manifest = asyncio.run(pushed())
    assert json.loads(raw)["version"] == 3
    entry = next(f for f in manifest.files if f.path == "__0_0.distcp")
    size = shard.stat().st_size
    assert [(o, c.size) for o, c in entry.chunk_offsets()] == spans(size, found, CHUNK)
    assert len(entry.chunks) > len(fixed_spans(size, CHUNK))
    # every small item (what every rank may read) lies in one chunk of small items
    chunks = [(o, c.size) for o, c in entry.chunk_offsets()]
    assert all(o % 4096 == 0 for o, _ in chunks)
    for lo, hi in itertools.pairwise([0, *found]):
        holding = [n for o, n in chunks if o < hi and lo < o + n]
        if hi - lo < GROUP_BYTES:
            assert len(holding) == 1 and holding[0] <= GROUP_BYTES + 2 * 4096, (lo, hi)
