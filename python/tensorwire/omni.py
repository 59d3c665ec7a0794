"""A connector with the shape of vLLM-Omni's ``OmniConnectorBase``, backed by tensorwire.

``put(from_stage, to_stage, request_id, data)`` publishes every tensor found in ``data`` (also
inside dicts, lists and tuples) zero-copy through the connector and pickles the rest of the
structure; ``get(...)`` rebuilds the structure with the tensors fetched into freshly allocated
ones. One producer may serve many consumers (``consumers=N`` in the config: the payload lives
until N consumers got it, or ``ttl`` seconds). The metadata ``put`` returns is what ``get`` needs;
when the caller does not carry it, ``get`` finds it in the store under the request's key.
"""

import pickle
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _native
from .diffusion import DiffusionConnector, PayloadHandle, StagePayload
from .errors import InvalidArgumentError, KeyNotFoundError

__all__ = ["TensorwireConnector"]


class _Slot:
    """Where a tensor was in the structure."""

    def __init__(self, index: int):
        self.index = index


def _is_tensor(x: Any) -> bool:
    return hasattr(x, "__dlpack__") and hasattr(x, "shape") and hasattr(x, "dtype")


def _walk(data: Any, leaf: Callable[[Any], bool], f: Callable[[Any], Any]) -> Any:
    """``data`` with every leaf replaced by ``f(leaf)``, through dicts, lists and tuples."""
    if leaf(data):
        return f(data)
    if isinstance(data, dict):
        return {k: _walk(v, leaf, f) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        parts = [_walk(v, leaf, f) for v in data]
        return parts if isinstance(data, list) else tuple(parts)
    return data


def _split(data: Any, tensors: List[Any]) -> Any:
    """``data`` with each tensor replaced by a ``_Slot`` (tensors appended to ``tensors``)."""

    def take(t: Any) -> _Slot:
        tensors.append(t)
        return _Slot(len(tensors) - 1)

    return _walk(data, _is_tensor, take)


def _join(skeleton: Any, tensors: List[Any]) -> Any:
    return _walk(skeleton, lambda x: isinstance(x, _Slot), lambda s: tensors[s.index])


def numpy_factory(dtype: str, shape: Tuple[int, ...]) -> Any:
    """Allocates a destination with numpy (bfloat16 and fp8 need a ``tensor_factory``, e.g. torch)."""
    import numpy

    try:
        return numpy.empty(shape, dtype=numpy.dtype(dtype))
    except TypeError as e:
        raise InvalidArgumentError(
            f"numpy has no dtype {dtype!r}: give TensorwireConnector a tensor_factory (e.g. torch)") from e


class TensorwireConnector:
    """``OmniConnectorBase``-shaped connector.

    ``config`` keys: ``transfer_mode`` ("store", default, or "p2p"/"auto"), ``store_config`` and
    ``te_config`` (as for ``DiffusionConnector``; store mode needs a store), ``consumers`` (how
    many ``get`` calls a ``put`` serves, default 1), ``ttl`` (seconds; then the payload lives that
    long instead), ``tensor_factory`` (``(dtype_name, shape) -> tensor`` for ``get``'s
    destinations; numpy by default), ``timeout`` (seconds, default 30).
    """

    def __init__(self, config: Optional[Dict[str, Any]] = None):
        cfg = dict(config or {})
        self._consumers = int(cfg.pop("consumers", 1))
        self._ttl = cfg.pop("ttl", None)
        self._factory: Callable[[str, Tuple[int, ...]], Any] = cfg.pop("tensor_factory", numpy_factory)
        self._timeout = float(cfg.pop("timeout", 30.0))
        mode = cfg.pop("transfer_mode", "store")
        self._conn = DiffusionConnector(role="omni", transfer_mode=mode, **cfg)
        self._held: Dict[str, List[PayloadHandle]] = {}
        self._keys: set = set()
        self._puts = self._gets = 0

    @staticmethod
    def _key(from_stage: Any, to_stage: Any, request_id: Any) -> str:
        return f"omni/{from_stage}->{to_stage}/{request_id}"

    def put(self, from_stage: Any, to_stage: Any, request_id: Any, data: Any) -> Tuple[bool, int, Dict[str, Any]]:
        """Publishes ``data``; returns (ok, bytes of tensors, metadata for ``get``)."""
        tensors: List[Any] = []
        skeleton = _split(data, tensors)
        lease = "ttl" if self._ttl is not None else "delete_on_consume"
        handles = []
        for t in tensors:
            payload = StagePayload(request_id=hash(request_id) & 0xFFFFFFFF, kind="feature", tensor=t,
                                   lease=lease, consumers=self._consumers, ttl=self._ttl)
            handles.append(self._conn.publish(payload, timeout=self._timeout))
        for h in handles:
            if h.source == "store":
                h.wait_stored(timeout=self._timeout)
        key = self._key(from_stage, to_stage, request_id)
        self._held.setdefault(str(request_id), []).extend(handles)
        metadata = {
            "key": key,
            "handles": [h.to_bytes() for h in handles],
            "skeleton": pickle.dumps(skeleton),
        }
        if self._conn.store is not None:
            self._conn.store.put(key, pickle.dumps(metadata), timeout=self._timeout)
            self._keys.add(key)
        self._puts += 1
        return True, sum(h.nbytes for h in handles), metadata

    def get(self, from_stage: Any, to_stage: Any, request_id: Any,
            metadata: Optional[Dict[str, Any]] = None) -> Optional[Tuple[Any, int]]:
        """The data ``put`` published, and the bytes of its tensors; None if it is not there."""
        if metadata is None:
            if self._conn.store is None:
                raise InvalidArgumentError("get without metadata needs a store (store_config)")
            try:
                metadata = pickle.loads(self._conn.store.get(self._key(from_stage, to_stage, request_id),
                                                             timeout=self._timeout))
            except KeyNotFoundError:
                return None
        tensors, size = [], 0
        for raw in metadata["handles"]:
            h = PayloadHandle.from_bytes(raw)
            dst = self._factory(h.dtype, h.shape)
            for _ in self._conn.consume(h, dst, timeout=self._timeout):
                pass
            tensors.append(dst)
            size += h.nbytes
        self._gets += 1
        return _join(pickle.loads(metadata["skeleton"]), tensors), size

    def cleanup(self, request_id: Any) -> None:
        """Releases what this connector published for ``request_id`` (its metadata objects too)."""
        for h in self._held.pop(str(request_id), []):
            try:
                h.retire()
            except Exception:  # already released
                pass
        store = self._conn.store
        if store is not None:
            suffix = f"/{request_id}"
            for key in [k for k in self._keys if k.endswith(suffix)]:
                store.remove(key, timeout=self._timeout)
                self._keys.discard(key)

    def health(self) -> Dict[str, Any]:
        """Status: engine address, payloads still served, puts and gets, store counters."""
        h: Dict[str, Any] = {
            "status": "healthy",
            "engine": self._conn.address,
            "held_payloads": self._conn.held,
            "puts": self._puts,
            "gets": self._gets,
            "time": time.time(),
        }
        if self._conn.store is not None:
            h["store"] = self._conn.store.stats(timeout=self._timeout)
        return h
