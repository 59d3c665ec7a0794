"""Exceptions raised by tensorwire, one class per error kind of the Rust crates.

Every class derives from :class:`TensorwireError`, and where a builtin exception means the same
thing, from it too (``KeyNotFoundError`` is a ``KeyError``, ``TimeoutError`` a builtin
``TimeoutError``, ``PeerClosedError`` a ``ConnectionError``), so generic handlers keep working.
"""

import builtins

__all__ = [
    "TensorwireError",
    "NotFoundError",
    "PeerNotFoundError",
    "KeyNotFoundError",
    "PayloadMissingError",
    "UnsupportedError",
    "OutOfBoundsError",
    "AccessDeniedError",
    "PeerClosedError",
    "ProducerGoneError",
    "TimeoutError",
    "CapacityError",
    "InvalidArgumentError",
    "InvalidTensorError",
    "MismatchError",
    "DestinationTooSmallError",
    "ChecksumError",
    "ProtocolError",
    "BackendError",
    "InternalError",
    "KeyExistsError",
    "CorruptError",
    "StoreIoError",
    "LeaseEndedError",
    "LeaseConsumedError",
    "LeaseExpiredError",
    "StoppedError",
    "RefusedError",
    "RequestFailedError",
]


class TensorwireError(Exception):
    """Base class of every tensorwire error."""


class NotFoundError(TensorwireError, LookupError):
    """Something looked up does not exist (a region, a transfer, a peer)."""


class PeerNotFoundError(NotFoundError):
    """No session with that peer engine."""


class KeyNotFoundError(NotFoundError, KeyError):
    """The store key is not stored (never put, removed, consumed, expired or evicted)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return Exception.__str__(self)


class PayloadMissingError(NotFoundError):
    """The payload is not there: never published (within the wait) or gone from the store."""


class UnsupportedError(TensorwireError):
    """The backend (or the engine) cannot do what was asked, e.g. device memory without a GPU backend."""


class OutOfBoundsError(TensorwireError, IndexError):
    """An offset and length fall outside the memory they address."""


class AccessDeniedError(TensorwireError, PermissionError):
    """Wrong access key, a permission the region does not grant, or a failed authentication."""


class PeerClosedError(TensorwireError, ConnectionError):
    """The peer went away before the operation completed."""


class ProducerGoneError(PeerClosedError):
    """The producer of a payload died, stopped answering, retired or abandoned it."""


class TimeoutError(TensorwireError, builtins.TimeoutError):
    """A wait ran past its bound."""


class CapacityError(TensorwireError):
    """A bounded resource (queue, pool, frame) is full or too small."""


class InvalidArgumentError(TensorwireError, ValueError):
    """An argument that can never be valid."""


class InvalidTensorError(InvalidArgumentError):
    """A tensor description is malformed or does not fit its memory (e.g. not contiguous)."""


class MismatchError(InvalidTensorError):
    """The payload is not the tensor the destination expects (dtype or shape)."""


class DestinationTooSmallError(InvalidTensorError):
    """The destination cannot hold the payload."""


class ChecksumError(TensorwireError):
    """Bytes that arrived do not match their checksum."""


class ProtocolError(TensorwireError):
    """A malformed or unexpected message from a peer."""


class BackendError(TensorwireError):
    """A transport backend's own failure."""


class InternalError(TensorwireError):
    """An invariant of tensorwire broke (a bug; please report it)."""


class KeyExistsError(TensorwireError, KeyError):
    """A put of a key that is already stored."""

    def __str__(self) -> str:
        return Exception.__str__(self)


class CorruptError(TensorwireError):
    """A spill file failed its checks and was not served."""


class StoreIoError(TensorwireError, OSError):
    """A file of the store's spill tier could not be read or written."""


class LeaseEndedError(TensorwireError):
    """The payload's lease ended before this consumer got it."""


class LeaseConsumedError(LeaseEndedError):
    """Every expected consumer already consumed the payload."""


class LeaseExpiredError(LeaseEndedError):
    """The payload's time-to-live ran out."""


class StoppedError(TensorwireError):
    """The orchestrator is gone (or stopped)."""


class RefusedError(TensorwireError):
    """The orchestrator refused the request."""


class RequestFailedError(TensorwireError):
    """A request ended without completing (too many failed attempts)."""
