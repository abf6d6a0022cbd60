"""The pure layers: names, paths, manifests and encodings (property-based where it pays)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.codec import decode, encode, encode_as
from transfer.errors import FormatError, UnknownEncodingError
from transfer.format.chunkid import chunk_id
from transfer.format.layout import manifest_key, pack_key, parse_manifest_key
from transfer.format.manifest import ChunkRef, FileEntry, Manifest, parse_manifest
from transfer.format.names import check_name, step_from_dirname
from transfer.format.paths import check_relative_path


@given(st.binary(max_size=200_000), st.sampled_from([None, 1, 3, 9]))
@settings(max_examples=150, deadline=None)
def test_every_encoding_round_trips_bit_exactly(data: bytes, level: int | None) -> None:
    enc, payload = encode(data, level)
    assert decode(enc, payload, len(data)) == data


def test_incompressible_data_is_stored_raw_at_no_cost() -> None:
    data = os.urandom(1 << 20)
    enc, payload = encode(data, 3)
    assert enc == "raw" and len(payload) == len(data)
    enc, payload = encode(bytes(1 << 20), 1)
    assert enc == "zstd" and len(payload) < 1000


@pytest.mark.parametrize("scale", [0.02, 1e-3])
def test_a_full_chunk_of_fp32_weights_is_coded_as_byte_planes(scale: float) -> None:
    # 64 KiB samples compressed whole put all four planes in one zstd block with one
    # Huffman table, and rated plain zstd best, where planes are ~8% smaller on the chunk
    values = np.random.default_rng(1).normal(0, scale, 1 << 20).astype(np.float32)
    data = values.tobytes()  # one 4 MiB chunk
    enc, payload = encode(data, 1)
    assert enc == "bp4+zstd"
    assert len(payload) < 0.95 * len(encode_as("zstd", data, 1))
    assert decode(enc, payload, len(data)) == data


def test_decode_refuses_unknown_encodings_and_wrong_sizes() -> None:
    with pytest.raises(UnknownEncodingError, match="upgrade"):
        decode("xor-delta-v9", b"abc", 3)
    enc, payload = encode(bytes(10_000), 1)
    with pytest.raises(FormatError, match="expected"):
        decode(enc, payload, 9_999)
    with pytest.raises(FormatError):
        decode("zstd", b"\x28\xb5\x2f\xfd garbage", 100)


@pytest.mark.parametrize("bad", ["", "..", "../a", "/etc/passwd", "a//b", "a/./b", "a\\b", "a\x00"])
def test_unsafe_relative_paths_are_refused(bad: str) -> None:
    with pytest.raises(FormatError, match="unsafe file path"):
        check_relative_path(bad)


@given(st.lists(st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True), min_size=1, max_size=5))
def test_accepted_paths_never_escape(parts: list[str]) -> None:
    path = "/".join(parts)
    try:
        check_relative_path(path)
    except FormatError:
        return
    resolved = os.path.normpath(os.path.join("/dest", path))
    assert resolved.startswith("/dest/")


def test_names_and_steps() -> None:
    assert check_name("job", "llama-70b_run.3") == "llama-70b_run.3"
    for bad in ["", ".hidden", "a/b", "a b", "x" * 129, "ü"]:
        with pytest.raises(FormatError):
            check_name("job", bad)
    assert step_from_dirname("step_000120") == 120
    assert step_from_dirname("global_step42") == 42
    assert step_from_dirname("latest") is None


def test_keys_sort_by_step_and_parse_back() -> None:
    keys = [manifest_key("j", s, "n") for s in (2, 10, 100)]
    assert sorted(keys) == keys
    assert parse_manifest_key(keys[1]) == ("j", 10, "n")
    assert parse_manifest_key("manifests/j/000000000000000010/.n.json.tmp-1") is None
    with pytest.raises(FormatError):
        pack_key("../../etc")


def sample_manifest() -> Manifest:
    a, b = chunk_id(b"a" * 4096), chunk_id(b"b" * 5)
    return Manifest(
        job="j",
        step=3,
        node="n",
        created_at="2026-11-30T00:00:00+00:00",
        chunk_size=4096,
        packs=("0" * 32,),
        files=(
            FileEntry(
                "x/y.bin",
                4101,
                0o644,
                (ChunkRef(a, 4096, "raw", 0, 0, 4096), ChunkRef(b, 5, "zstd", 0, 4096, 7)),
            ),
            FileEntry("empty", 0, 0o600, ()),
        ),
    )


def test_manifest_round_trips_through_json() -> None:
    m = sample_manifest()
    assert parse_manifest(m.to_json()) == m
    assert m.same_content(parse_manifest(m.to_json()))


def test_manifest_refuses_file_and_directory_clash_and_duplicates() -> None:
    import json

    doc = json.loads(sample_manifest().to_json())
    doc["files"][1]["path"] = "x"  # "x" is a file and the parent of "x/y.bin"
    with pytest.raises(FormatError, match="as a file and as a directory"):
        parse_manifest(json.dumps(doc).encode())
    doc["files"][1]["path"] = "x/y.bin"
    with pytest.raises(FormatError, match="twice"):
        parse_manifest(json.dumps(doc).encode())


def test_manifest_masks_special_mode_bits() -> None:
    import json

    doc = json.loads(sample_manifest().to_json())
    doc["files"][0]["mode"] = 0o4755
    assert parse_manifest(json.dumps(doc).encode()).files[0].mode == 0o755


@given(st.binary(max_size=300))
def test_garbage_manifests_raise_format_error_only(raw: bytes) -> None:
    with pytest.raises(FormatError):
        parse_manifest(raw)


def test_lookalike_values_are_refused() -> None:
    import json

    with pytest.raises(FormatError):
        check_name("job", "demo\n")  # a trailing newline must not pass an anchored regex
    for version in (True, 1.0, "1"):
        doc = json.loads(sample_manifest().to_json())
        doc["version"] = version
        with pytest.raises(FormatError, match="not supported"):
            parse_manifest(json.dumps(doc).encode())


def test_hostile_json_shapes_raise_format_error() -> None:
    with pytest.raises(FormatError):
        parse_manifest(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(FormatError):
        check_relative_path("bad\udc80name")


def test_zstd_header_claiming_a_huge_size_is_refused_before_allocating() -> None:
    import zstandard

    big = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    with pytest.raises(FormatError, match="declares"):
        decode("zstd", big, 100)


def test_chunks_must_follow_the_fixed_size_rule() -> None:
    import json

    doc = json.loads(sample_manifest().to_json())
    assert doc["version"] == 2  # fixed chunks: readable by the agents of version 2
    doc["chunk_size"] = 8192  # the first chunk (4096) is no longer a full chunk
    with pytest.raises(FormatError, match="chunk_size"):
        parse_manifest(json.dumps(doc).encode())


def test_version_3_cuts_files_anywhere_within_chunk_size() -> None:
    """Chunks cut at a DCP file's items (engine/chunkspans.py): any sizes up to
    chunk_size, in a version 3 manifest; a version 2 manifest may not claim them."""
    import dataclasses
    import json

    fixed = sample_manifest()
    a, b = fixed.files[0].chunks
    free = dataclasses.replace(
        fixed,
        chunk_size=8192,
        files=(dataclasses.replace(fixed.files[0], chunks=(a, b)), *fixed.files[1:]),
    )
    doc = json.loads(free.to_json())
    assert doc["version"] == 3
    assert parse_manifest(free.to_json()) == free
    doc["version"] = 2
    with pytest.raises(FormatError, match="chunk_size 8192 rule"):
        parse_manifest(json.dumps(doc).encode())
    doc["version"] = 3
    doc["chunk_size"] = 4096 * 2 - 1  # b fits, a does not
    doc["files"][0]["chunks"][0]["size"] = 4096 * 2
    doc["files"][0]["size"] = 4096 * 2 + 5
    with pytest.raises(FormatError, match="larger than chunk_size"):
        parse_manifest(json.dumps(doc).encode())
    doc = json.loads(free.to_json())
    doc["files"][0]["chunks"].insert(1, dict(doc["files"][0]["chunks"][1], size=0))
    with pytest.raises(FormatError, match="empty"):
        parse_manifest(json.dumps(doc).encode())


def test_delta_records_must_be_consistent() -> None:
    import json

    base_doc = json.loads(sample_manifest().to_json())
    a = base_doc["files"][0]["chunks"][0]["id"]
    b = base_doc["files"][0]["chunks"][1]["id"]

    doc = json.loads(json.dumps(base_doc))
    doc["files"][0]["chunks"][1]["base"] = a  # zstd chunk claiming a base
    with pytest.raises(FormatError, match="disagree"):
        parse_manifest(json.dumps(doc).encode())

    doc = json.loads(json.dumps(base_doc))
    doc["files"][0]["chunks"][1].update(enc="xor+bp4+zstd")  # delta without a base
    with pytest.raises(FormatError, match="disagree"):
        parse_manifest(json.dumps(doc).encode())

    doc = json.loads(json.dumps(base_doc))
    doc["files"][0]["chunks"][1].update(enc="xor+zstd", base="f" * 64)  # base nowhere
    with pytest.raises(FormatError, match="not in the manifest"):
        parse_manifest(json.dumps(doc).encode())

    # a loop hidden behind a duplicate id: b -> a, and a listed again as a delta on b
    doc = json.loads(json.dumps(base_doc))
    doc["files"][0]["chunks"][1].update(enc="xor+zstd", base=a)
    doc["bases"] = [dict(doc["files"][0]["chunks"][0], enc="xor+zstd", base=b)]
    with pytest.raises(FormatError, match=r"two different records|loops"):
        parse_manifest(json.dumps(doc).encode())


def test_memory_budget_shrinks_the_window_and_is_respected() -> None:
    from transfer.engine import TransferOptions

    opts = TransferOptions(chunk_size=4 << 20, part_size=8 << 20, window=16, workers=2)
    assert opts.memory_estimate() > 256 << 20
    fitted = opts.within_budget(128 << 20)
    assert fitted.window < opts.window and fitted.memory_estimate() <= 128 << 20
    assert opts.within_budget(1 << 40).window == 16  # a generous budget changes nothing
    with pytest.raises(ValueError, match="too small"):
        opts.within_budget(16 << 20)
