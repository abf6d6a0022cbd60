"""Validation of file paths recorded in manifests.

A manifest may come from a hostile or corrupted store, so every path is checked before any
byte is written: relative, POSIX, no ``..``, no empty or ``.`` components, no NUL, bounded.
"""

from __future__ import annotations

from transfer.errors import FormatError

MAX_PATH_BYTES = 4096
MAX_COMPONENT_BYTES = 255


def check_relative_path(path: object) -> str:
    """Return ``path`` if it is a safe relative path inside a checkpoint, else raise."""
    if not isinstance(path, str) or not path:
        raise FormatError(f"unsafe file path {path!r}: must be a non-empty string")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(f"unsafe file path {path!r}: not valid UTF-8") from None
    if "\x00" in path or "\\" in path:
        raise FormatError(f"unsafe file path {path!r}: NUL or backslash")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise FormatError(f"unsafe file path {path[:64]!r}...: longer than {MAX_PATH_BYTES} bytes")
    if path.startswith("/"):
        raise FormatError(f"unsafe file path {path!r}: absolute paths are refused")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise FormatError(f"unsafe file path {path!r}: empty, '.' or '..' component")
        if len(part.encode()) > MAX_COMPONENT_BYTES:
            raise FormatError(f"unsafe file path {path!r}: component too long")
    return path
