"""The fused XOR + byte-plane kernel (transfer/codec/_planes.c) against a plain numpy
statement of the format's rules: the stored bytes of every existing store depend on it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.codec._planes import join, join_planes, split


def reference_split(data: bytes, base: bytes | None, width: int) -> bytes:
    """XOR over the common prefix, then byte planes of whole elements; the tail stays last."""
    x = bytearray(data)
    if base is not None:
        n = min(len(x), len(base))
        x[:n] = (np.frombuffer(data, np.uint8, n) ^ np.frombuffer(base, np.uint8, n)).tobytes()
    whole = len(x) - len(x) % width
    grid = np.frombuffer(bytes(x[:whole]), np.uint8).reshape(-1, width)
    return grid.T.tobytes() + bytes(x[whole:])


@given(
    st.binary(max_size=5000),
    st.one_of(st.none(), st.binary(max_size=5100)),
    st.sampled_from([1, 2, 4]),
)
@settings(max_examples=400, deadline=None)
def test_split_matches_the_reference_and_join_inverts_it(
    data: bytes, base: bytes | None, width: int
) -> None:
    planes = bytearray(len(data))
    split(data, base, planes, width)
    assert bytes(planes) == reference_split(data, base, width)
    back = bytearray(len(data))
    join(planes, base, back, width)
    assert bytes(back) == data


@given(
    st.binary(max_size=5000), st.binary(min_size=5000, max_size=5000), st.sampled_from([1, 2, 4])
)
@settings(max_examples=300, deadline=None)
def test_join_planes_unplanes_the_xor_of_two_plane_buffers(
    data: bytes, other: bytes, width: int
) -> None:
    """A delta's planes and its keyframe base's planes, unplaned together: the XOR of the
    two chunks (planes commute with XOR, tails included)."""
    other = other[: len(data)]
    a, b = reference_split(data, None, width), reference_split(other, None, width)
    out = bytearray(len(data))
    join_planes(a, b, out, width)
    assert bytes(out) == bytes(x ^ y for x, y in zip(data, other, strict=True))


def test_large_buffers_with_a_short_base() -> None:
    rng = np.random.default_rng(7)
    data = rng.bytes((4 << 20) + 3)
    base = rng.bytes((2 << 20) + 1)  # ends inside an element
    planes = bytearray(len(data))
    split(data, base, planes, 4)
    assert bytes(planes) == reference_split(data, base, 4)
    back = bytearray(len(data))
    join(memoryview(planes), base, back, 4)
    assert bytes(back) == data


def test_bad_arguments_are_refused() -> None:
    buf = bytearray(8)
    with pytest.raises(ValueError, match="width"):
        split(b"12345678", None, buf, 3)
    with pytest.raises(ValueError, match="length"):
        split(b"1234", None, buf, 4)
    with pytest.raises(ValueError, match="overlaps"):
        join(buf, None, buf, 4)
    with pytest.raises(TypeError):
        join(b"12345678", None, b"readonly", 4)
    with pytest.raises(ValueError, match="length"):
        join_planes(b"12345678", b"1234", buf, 4)
    with pytest.raises(ValueError, match="overlaps"):
        join_planes(b"12345678", buf, buf, 4)
