"""The exceptions every layer raises.

Callers branch on the class, never on message text: "not found" must stay distinguishable
from "could not tell" (a GC that confuses the two deletes live data).
"""

from __future__ import annotations


class FerryError(Exception):
    """Base class: anything ckpt-ferry reports to a user as a one-line reason."""


class FormatError(FerryError):
    """A manifest or store descriptor is malformed, hostile, or of an unknown version."""


class UnknownEncodingError(FormatError):
    """A chunk uses an encoding this reader does not implement."""


class IntegrityError(FerryError):
    """Stored bytes do not match their recorded hash: corruption or a torn write."""

    def __init__(self, message: str, bad_chunks: list[str] | None = None) -> None:
        super().__init__(message)
        self.bad_chunks = bad_chunks or []


class StoreError(FerryError):
    """A storage backend failed (network, permissions, server error)."""


class NotFoundError(StoreError):
    """The object, bucket or directory does not exist."""


class StoreUnavailableError(StoreError):
    """Every try of a request failed as a store that is down or unreachable fails (the
    network, a server error, a flaky mount): worth trying again later, unlike a refusal."""


class StoreMissingError(NotFoundError):
    """The store itself is not there (its directory: an NFS mount not mounted yet, or its
    bucket): maybe for now, unlike a missing object of a store that is there."""


class RangeNotSatisfiableError(StoreError):
    """A ranged read reaches past the end of the object (a truncated pack)."""


class AlreadyExistsError(StoreError):
    """A create-only write found the key already present."""


class AccessDeniedError(StoreError):
    """Credentials were missing or rejected, or the caller may not do this."""


class SourceChangedError(FerryError):
    """The checkpoint being pushed is still being written: a file changed while it was read,
    or files its commit marker names are missing or short. Nothing was committed; push it
    again once it settles."""


class CheckpointNotFoundError(FerryError):
    """No committed checkpoint matches the request."""


class NotAStoreError(CheckpointNotFoundError):
    """The URL holds no store descriptor: it was never made a store (``ferry init``)."""


class StoreNotEmptyError(FerryError):
    """A new store was asked for where other objects are already stored."""


class IncompleteStepError(FerryError):
    """A step's parts are all in, and together they still lack a file (or bytes of one)
    its ``.metadata`` names: a torn part. The step is never reported complete."""


class DestinationError(FerryError):
    """The pull destination is unusable (not empty, not writable, out of space)."""
