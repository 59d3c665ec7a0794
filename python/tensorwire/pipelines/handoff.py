"""A stage's tensors through the connector: publish a named set of torch tensors, hand their
handles on as one queue message, consume them into tensors the next stage allocates.

The message (a stage's orchestrator output) is JSON: ``{name: handle hex}``. Nothing is copied on
either side: the producer's tensors are read where they are (a tensor that is not contiguous is
refused, not copied behind the caller's back), and each consumed chunk lands in the destination
the consumer allocated (``consume`` checks that every chunk it yields is a view of it).
"""

import json
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..diffusion import DiffusionConnector, PayloadHandle, StagePayload


class Published:
    """What ``publish`` returns: the message for the next stage and the publications, which the
    producer keeps (with the tensors) until the payloads are consumed or stored."""

    def __init__(self, message: bytes, handles: Dict[str, PayloadHandle], tensors: Dict[str, Any]):
        self.message = message
        self.handles = handles
        self.tensors = tensors

    def mark_ready(self, name: str, index: int) -> None:
        """Chunk ``index`` of the chunked tensor ``name`` is produced."""
        self.handles[name].mark_ready(index)

    def wait_stored(self, timeout: float = 30.0) -> None:
        """Store mode: returns once every payload is in the store."""
        for h in self.handles.values():
            if h.source == "store":
                h.wait_stored(timeout=timeout)


def publish(conn: DiffusionConnector, request: int, kind: str, tensors: Dict[str, Any], *,
            chunked: Optional[Dict[str, Tuple[int, int]]] = None, consumer_credit: Optional[int] = None,
            timeout: float = 30.0) -> Published:
    """Publishes each tensor of ``tensors`` (host memory, contiguous) as a payload of ``kind``;
    ``chunked`` maps a name to ``(chunk_dim, num_chunks)`` for a tensor handed over in pieces
    (``mark_ready`` per piece). Unchunked ones are ready at once."""
    chunked = chunked or {}
    handles: Dict[str, PayloadHandle] = {}
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name}: not contiguous (strides {tuple(t.stride())}); publish a contiguous tensor")
        dim, count = chunked.get(name, (None, None))
        handles[name] = conn.publish(StagePayload(request, kind, t.detach(), chunk_dim=dim, num_chunks=count),
                                     consumer_credit=consumer_credit, timeout=timeout)
    message = json.dumps({name: h.to_str() for name, h in handles.items()}).encode()
    return Published(message, handles, dict(tensors))


def handles(message: bytes) -> Dict[str, PayloadHandle]:
    """The handles in a stage's message (``ValueError`` when it is not one)."""
    try:
        named = json.loads(message)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not a stage message: {e}") from None
    if not isinstance(named, dict) or not all(isinstance(v, str) for v in named.values()):
        raise ValueError("not a stage message: expected {name: handle hex}")
    return {name: PayloadHandle.from_str(text) for name, text in named.items()}


def destination(handle: PayloadHandle, device: str = "cpu") -> Any:
    """A fresh torch tensor of the payload's dtype and shape, for it to land in."""
    import torch

    return torch.empty(handle.shape, dtype=getattr(torch, handle.dtype), device=device)


def _is_view_of(chunk: Any, dst: Any) -> bool:
    return chunk.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()


def stream(conn: DiffusionConnector, handle: PayloadHandle, dst: Any, *, hold: bool = False,
           timeout: float = 30.0) -> Iterator[Tuple[int, Any]]:
    """Consumes ``handle`` into ``dst``, yielding ``(start, chunk)`` as each chunk lands, in any
    order: ``chunk`` is a view of ``dst`` (``AssertionError`` should one not be) starting at
    index ``start`` along the chunk dimension."""
    for start, _, chunk in conn.consume_ranges(handle, dst, hold=hold, timeout=timeout):
        assert _is_view_of(chunk, dst), "a consumed chunk is not a view of its destination"
        yield start, chunk


def consume(conn: DiffusionConnector, message: bytes, *, hold: bool = False, timeout: float = 30.0,
            device: str = "cpu") -> Dict[str, Any]:
    """Every tensor of a stage's message, each in a tensor allocated here on ``device``."""
    out = {}
    for name, h in handles(message).items():
        dst = destination(h, device=device)
        for _ in stream(conn, h, dst, hold=hold, timeout=timeout):
            pass
        out[name] = dst
    return out


def release(conn: DiffusionConnector, message: bytes, timeout: float = 30.0) -> None:
    """Reports every payload of a stage's message consumed (the end of a ``hold`` consume)."""
    for h in handles(message).values():
        conn.release(h, timeout=timeout)


def keep_last(kept: List[Published], p: Published, n: int = 8) -> None:
    """Keeps ``p`` (its tensors serve p2p consumers) and drops all but the last ``n``."""
    kept.append(p)
    del kept[:-n]
