"""The share of a DCP checkpoint a resized job's ranks read (transfer.engine.dcpshare), held
against torch itself: DCP's own DefaultLoadPlanner on a real 8-rank save, and a real 4-rank
load from sparse copies holding nothing but each survivor's share.

The torch tests skip when torch is not installed; the drill save is made once per session
(shared by pytest-xdist workers through a file lock) and takes ~10-15 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import pytest

from transfer.engine.dcpplan_torch import write_items
from transfer.engine.dcpshare import (
    MAX_ITEMS,
    Layout,
    Ranges,
    merge_ranges,
    parse_ranks,
    ranges_from_items,
    share_bytes,
    share_ranges,
)
from transfer.errors import FerryError, FormatError

# ---------------------------------------------------------------- pure: no torch


@pytest.mark.parametrize(
    ("text", "ranks"),
    [
        ("0", (0,)),
        ("0,1", (0, 1)),
        ("2-3", (2, 3)),
        ("0,2-3", (0, 2, 3)),
        (" 3 , 1 - 2 ", (1, 2, 3)),
        ("1,1-2,2", (1, 2)),
        ("5-5", (5,)),
    ],
)
def test_parse_ranks(text: str, ranks: tuple[int, ...]) -> None:
    assert parse_ranks(text) == ranks


@pytest.mark.parametrize(
    "text", ["", "x", "1-", "-1", "1,,2", "1.5", "1-2-3", "0x1", "\u0663", "3-2", "99999999"]
)
def test_parse_ranks_refuses_garbage(text: str) -> None:
    with pytest.raises(FerryError, match=r"^ranks: ") as info:
        parse_ranks(text)
    assert "\n" not in str(info.value)


def test_layout_validation() -> None:
    assert Layout(4, (0, 1)).ranks == (0, 1)
    assert Layout(1, (0,)).world_size == 1
    bad: list[tuple[Any, Any]] = [
        (0, (0,)),
        (-1, (0,)),
        (True, (0,)),
        (2.0, (0,)),
        (4, ()),
        (4, [0, 1]),
        (4, (4,)),
        (4, (-1,)),
        (4, (1, 1)),
        (4, (True,)),
        (1 << 21, (0,)),
    ]
    for world, ranks in bad:
        with pytest.raises(FerryError) as info:
            Layout(world, ranks)
        assert "\n" not in str(info.value), (world, ranks)


def test_ranges_from_items_merges_and_round_trips(tmp_path: Path) -> None:
    doc = [
        {"path": "b/__1_0.distcp", "offset": 10, "length": 5},
        {"path": "__0_0.distcp", "offset": 100, "length": 50},
        {"path": "__0_0.distcp", "offset": 0, "length": 10},
        {"path": "__0_0.distcp", "offset": 10, "length": 20},  # touches: merged
        {"path": "__0_0.distcp", "offset": 120, "length": 10},  # inside: merged
        {"path": "__0_0.distcp", "offset": 500, "length": 0},  # empty: dropped
    ]
    ranges = ranges_from_items(doc)
    assert ranges == {"__0_0.distcp": ((0, 30), (100, 150)), "b/__1_0.distcp": ((10, 15),)}
    assert share_bytes(ranges) == 85
    write_items(ranges, tmp_path / "items.json")
    assert ranges_from_items(json.loads((tmp_path / "items.json").read_text())) == ranges


@pytest.mark.parametrize(
    "doc",
    [
        {"path": "a", "offset": 0, "length": 1},
        [["a", 0, 1]],
        [{"path": "a", "offset": 0}],
        [{"path": "a", "offset": 0, "length": 1, "extra": 1}],
        [{"path": "../a", "offset": 0, "length": 1}],
        [{"path": "x/../../a", "offset": 0, "length": 1}],
        [{"path": "/etc/passwd", "offset": 0, "length": 1}],
        [{"path": "a\x00b", "offset": 0, "length": 1}],
        [{"path": "", "offset": 0, "length": 1}],
        [{"path": 7, "offset": 0, "length": 1}],
        [{"path": "a", "offset": -1, "length": 1}],
        [{"path": "a", "offset": 0, "length": -1}],
        [{"path": "a", "offset": 1.0, "length": 1}],
        [{"path": "a", "offset": True, "length": 1}],
        [{"path": "a", "offset": "0", "length": 1}],
        [{"path": "a", "offset": 1 << 63, "length": 1}],
        [{"path": "a", "offset": (1 << 63) - 1, "length": 1}],
    ],
)
def test_ranges_from_items_refuses_bad_items(doc: object) -> None:
    with pytest.raises(FormatError) as info:
        ranges_from_items(doc)
    assert "\n" not in str(info.value)


def test_ranges_from_items_bounds_the_item_count() -> None:
    item = {"path": "a", "offset": 0, "length": 1}
    with pytest.raises(FormatError, match="at most"):
        ranges_from_items([item] * (MAX_ITEMS + 1))


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        random.Random(0).randbytes(4096),
        pickle.dumps({"state_dict_metadata": {}, "storage_data": {}}),
        pickle.dumps([1, 2, 3]),
        pickle.dumps(None),
        b"cos\nsystem\n(S'echo pwned > /tmp/dcpshare-pwned'\ntR.",  # inert: never run
        b"\x80\x04K\x01.",  # a valid pickle of 1
        b"\x80\x05\x95" + b"\xff" * 8,  # a frame claiming 2**64 bytes
    ],
)
def test_garbage_metadata_is_a_format_error(blob: bytes) -> None:
    with pytest.raises(FormatError, match="not DCP metadata this ferry understands") as info:
        share_ranges(blob, Layout(4, (0,)))
    assert "\n" not in str(info.value)
    assert not Path("/tmp/dcpshare-pwned").exists()


# ---------------------------------------------------------------- against real torch


def _drill() -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.checkpoint")
    from tests import dcp_drill

    return dcp_drill


@pytest.fixture(scope="module")
def save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8-rank drill save: under xdist one worker makes it for all (file lock in the
    session's shared temp root); alone, in this session's temp dir."""
    drill = _drill()
    from filelock import FileLock

    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        root = tmp_path_factory.mktemp("dcpdrill")
    else:
        root = tmp_path_factory.getbasetemp().parent
    with FileLock(str(root / "dcp_drill.lock")):
        out = root / "dcp_drill_save"
        if not (out / ".metadata").exists():
            drill.save_drill(out.with_name("dcp_drill_save.tmp"), world_size=8, seed=0)
            out.with_name("dcp_drill_save.tmp").rename(out)
    return out


@pytest.fixture(scope="module")
def meta(save: Path) -> bytes:
    return (save / ".metadata").read_bytes()


@pytest.fixture(scope="module")
def full_w4(save: Path) -> dict[str, Any]:
    """The reference: 4 ranks loading from the whole save."""
    return dict(_drill().load_drill({r: save for r in range(4)}, 4))


def _storage_items(save: Path) -> dict[tuple[str, tuple[int, ...] | None], Any]:
    """{(fqn, chunk offsets): (_StorageInfo, chunk sizes or None)} via torch's own unpickle."""
    md = pickle.loads((save / ".metadata").read_bytes())
    out = {}
    for key, info in md.storage_data.items():
        offsets = None if key.offset is None else tuple(key.offset)
        sizes = None
        for chunk in getattr(md.state_dict_metadata[key.fqn], "chunks", ()):
            if tuple(chunk.offsets) == offsets:
                sizes = tuple(chunk.sizes)
        out[key.fqn, offsets] = (info, sizes)
    return out


def _union(*shares: Ranges) -> Ranges:
    return merge_ranges(
        (path, a, b - a) for share in shares for path, spans in share.items() for a, b in spans
    )


def test_split_rule_is_dtensors(full_w4: dict[str, Any]) -> None:
    """The rule's Shard(0) split is DTensor's in this torch: ceil(n / W) rows per rank, the
    last shorter or empty (512, 10 and 3 rows over 4 real ranks)."""
    from transfer.engine.dcpshare import _rows

    shapes = full_w4["local_shapes"]
    assert [shapes[r]["proj_w"] for r in range(4)] == [(3, 64), (3, 64), (3, 64), (1, 64)]
    assert [shapes[r]["tiny"] for r in range(4)] == [(1,), (1,), (1,), (0,)]
    for rank in range(4):
        for name, rows in (("emb", 512), ("proj_w", 10), ("proj_b", 10), ("tiny", 3)):
            start, end = _rows(rows, 4, rank)
            assert shapes[rank][name][0] == end - start, (name, rank)
        assert shapes[rank]["gain"] == (64,)  # Replicate(): whole on every rank


@pytest.mark.filterwarnings("ignore:torch.distributed is unavailable or uninitialized")
def test_the_4_rank_load_reproduces_the_saved_state(save: Path, full_w4: dict[str, Any]) -> None:
    """The reference itself is right: every tensor the 4 ranks loaded equals what torch
    reads from the save in one process without a template (the drill's fresh model had
    other weights, so nothing passes by leaving them alone)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    saved, _ = flatten_state_dict(_load_state_dict_from_keys(checkpoint_id=str(save)))
    tensors = 0
    for part in ("model", "optim"):
        for key, got in full_w4[part].items():
            want = saved[f"{part}.{key}"]
            if isinstance(want, torch.Tensor):
                assert torch.equal(got, want), key
                tensors += 1
            else:
                assert got == want, key
    assert tensors == 6 + 5 * 3


def test_pure_rule_equals_dcps_planner_on_a_real_4_rank_load(
    full_w4: dict[str, Any], meta: bytes
) -> None:
    """Each of the 4 real gloo ranks ran DefaultLoadPlanner on its own state_dict (the one
    it then loaded): the pure rule, from .metadata alone, names the same bytes."""
    for rank in range(4):
        assert share_ranges(meta, Layout(4, (rank,))) == full_w4["planned"][rank], rank
    both = _union(full_w4["planned"][0], full_w4["planned"][1])
    assert share_ranges(meta, Layout(4, (0, 1))) == both


def test_pure_rule_equals_dcps_planner_for_every_world_size(save: Path, meta: bytes) -> None:
    """W = 1, 2, 3, 5, 8, every rank, and 3 ranks of a scale-up to 16 (fake process group):
    the same ranges, exactly, including ranks whose share of a small tensor is empty (tiny:
    3 rows over 4 or more ranks). plan_drill also plans each layout with the state_dict on
    the meta device, and hands back a mismatch marker instead of the ranges if that planned
    anything else."""
    worlds = (1, 2, 3, 5, 8)
    layouts = [(w, r) for w in worlds for r in range(w)] + [(16, 0), (16, 7), (16, 15)]
    planned = _drill().plan_drill(save, layouts)
    for world, rank in layouts:
        pure = share_ranges(meta, Layout(world, (rank,)))
        assert pure == planned[world, rank], (world, rank)
    for world in worlds:
        everyone = _union(*(planned[world, r] for r in range(world)))
        assert share_ranges(meta, Layout(world, tuple(range(world)))) == everyone


def test_scale_down_share_is_about_half(save: Path, meta: bytes) -> None:
    """8 -> 4: new ranks {0, 1} read old ranks 0-3's chunks of the 512-row tensors plus
    every replicated and non-tensor item; nothing reads the saved empty chunks."""
    total = sum(f.stat().st_size for f in save.glob("*.distcp"))
    share = share_ranges(meta, Layout(4, (0, 1)))
    assert ".metadata" not in share
    assert 0.4 * total < share_bytes(share) < 0.6 * total
    items = _storage_items(save)
    emb = {k: v for k, v in items.items() if k[0] == "model.emb"}
    for (_, offsets), (info, _) in emb.items():
        assert offsets is not None
        inside = any(
            a <= info.offset and info.offset + info.length <= b
            for a, b in share.get(info.relative_path, ())
        )
        assert inside == (offsets[0] < 256), (offsets, info)
        assert inside == (info.relative_path in {f"__{r}_0.distcp" for r in range(4)})
    everyone = share_ranges(meta, Layout(4, (0, 1, 2, 3)))
    empty = [info for info, sizes in items.values() if sizes is not None and 0 in sizes]
    assert empty, "the drill's 10- and 3-row tensors leave the last old ranks empty chunks"
    read = [i for i, _ in items.values() if i not in empty]
    assert share_bytes(everyone) == sum(i.length for i in read)


def test_split_by_node_puts_each_ranks_file_on_its_node(save: Path, tmp_path: Path) -> None:
    nodes = _drill().split_by_node(save, tmp_path / "nodes", ranks_per_node=2)
    assert [sorted(p.name for p in d.iterdir()) for d in nodes] == [
        [".metadata", "__0_0.distcp", "__1_0.distcp"],
        ["__2_0.distcp", "__3_0.distcp"],
        ["__4_0.distcp", "__5_0.distcp"],
        ["__6_0.distcp", "__7_0.distcp"],
    ]


def _sparse_copy(nodes: list[Path], dest: Path, share: Ranges) -> None:
    """What a survivor holds after fetching only its share: ``.metadata`` whole, every
    storage file at full length, the share's bytes written and every other byte a hole."""
    held = {p.name: p for d in nodes for p in d.iterdir()}
    dest.mkdir(parents=True)
    (dest / ".metadata").write_bytes(held[".metadata"].read_bytes())
    for name, src in held.items():
        if name == ".metadata":
            continue
        with src.open("rb") as fin, (dest / name).open("wb") as fout:
            fout.truncate(src.stat().st_size)
            for start, end in share.get(name, ()):
                fin.seek(start)
                fout.seek(start)
                fout.write(fin.read(end - start))


@pytest.fixture(scope="module")
def survivors(
    save: Path, meta: bytes, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """Survivor A (new ranks 0, 1) and B (2, 3) of an 8 -> 4 scale-down, each a sparse copy
    of its share gathered from the old nodes' local disks."""
    root = tmp_path_factory.mktemp("survivors")
    nodes = _drill().split_by_node(save, root / "nodes")
    a, b = root / "A", root / "B"
    _sparse_copy(nodes, a, share_ranges(meta, Layout(4, (0, 1))))
    _sparse_copy(nodes, b, share_ranges(meta, Layout(4, (2, 3))))
    return a, b


def test_sparse_copies_hold_only_the_share(
    save: Path, meta: bytes, survivors: tuple[Path, Path]
) -> None:
    a, _ = survivors
    share = share_ranges(meta, Layout(4, (0, 1)))
    for src in save.glob("*.distcp"):
        data, orig = (a / src.name).read_bytes(), src.read_bytes()
        assert len(data) == len(orig)
        keep = bytearray(len(orig))
        for start, end in share.get(src.name, ()):
            keep[start:end] = orig[start:end]
        assert data == bytes(keep), src.name


def test_survivors_load_from_their_shares_like_from_the_whole_save(
    full_w4: dict[str, Any], survivors: tuple[Path, Path]
) -> None:
    import torch

    a, b = survivors
    got = _drill().load_drill({0: a, 1: a, 2: b, 3: b}, 4)
    for part in ("model", "optim"):
        assert sorted(got[part]) == sorted(full_w4[part])
        for key, want in full_w4[part].items():
            if isinstance(want, torch.Tensor):
                assert torch.equal(got[part][key], want), key
                assert want.numel() == 0 or want.abs().sum() > 0, key  # real data, not holes
            else:
                assert got[part][key] == want, key
    assert int(got["optim"]["state.emb.step"]) == 2  # the saved step, not the fresh init's
    assert got["loss"] == full_w4["loss"]
    assert got["loss_after"] == full_w4["loss_after"]


def test_a_rank_reading_the_other_survivors_copy_fails_loudly(
    survivors: tuple[Path, Path],
) -> None:
    """New rank 0 pointed at B's copy finds holes where its shards are: torch.load of the
    zeros fails (weights-only unpickler, 'Unsupported operand 0') and DCP raises a
    CheckpointException on every rank. It must never load zeros silently."""
    drill = _drill()
    a, b = survivors
    with pytest.raises(drill.DrillError) as info:
        drill.load_drill({0: b, 1: a, 2: b, 3: b}, 4)
    text = str(info.value)
    assert "rank 0:" in text and "CheckpointException" in text
    assert "UnpicklingError" in text and "(RANK 0)" in text


def test_hostile_variants_of_a_real_metadata_are_format_errors(save: Path, meta: bytes) -> None:
    assert share_ranges(meta, Layout(4, (0,)))  # the real one parses
    md = pickle.loads(meta)
    key = next(k for k in md.storage_data if k.fqn == "model.emb")
    info = md.storage_data[key]
    variants = [meta[: len(meta) // 2], meta[:-1]]
    md.storage_data[key] = type(info)("../../etc/passwd", info.offset, info.length)
    variants.append(pickle.dumps(md))
    md.storage_data[key] = type(info)(info.relative_path, -5, info.length)
    variants.append(pickle.dumps(md))
    del md.storage_data[key]
    variants.append(pickle.dumps(md))  # a chunk every W=4 rank 0 needs, with no storage
    for blob in variants:
        with pytest.raises(FormatError) as exc:
            share_ranges(blob, Layout(4, (0,)))
        assert "\n" not in str(exc.value)
