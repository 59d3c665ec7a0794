"""``TensorwireConnector``: vLLM-Omni's ``OmniConnectorBase`` contract, kept, over tensorwire.

The contract (vLLM-Omni's ``omni_connectors/connectors/base.py`` and how its shared-memory and
Mooncake connectors and its adapter use it), and how this connector keeps it:

- ``put(from_stage, to_stage, put_key, data) -> (ok, size, metadata)``. Never raises: a failure
  is ``(False, 0, None)`` and a log line. ``size`` is the bytes the payload holds (its tensors'
  bytes and the encoded rest); ``metadata`` is a small dict for the adapter's queue message. A
  second put under the same key replaces the first (its payload is released).
- ``get(from_stage, to_stage, get_key, metadata=None) -> (data, size) | None``. Never raises and
  never waits for data that is not there: ``None`` when nothing was put under the key (yet),
  when it was consumed or cleaned up, or when the transfer failed (logged). ``metadata`` may be
  what ``put`` returned, wrapped as ``{get_key: metadata}`` (the adapter's form), or anything
  else (``None``, ``{}``, another connector's fields, not a dict): then the key alone finds the
  payload, from any connector of the host (or of the cluster, with a store). A payload serves
  ``consumers`` gets (config, default 1) and is gone after the last.
- ``get_with_deadline(..., *, deadline)`` (``time.monotonic()`` seconds): ``None`` at or past
  the deadline, and the transfer's waits end by it.
- ``abandon_get(get_key)``: a ``get`` of that key running in another thread returns ``None``
  within about 0.1 s and consumes nothing (the payload stays for a later get).
- ``cleanup(put_key) -> bool``: releases every payload and record put under exactly that key
  (every stage pair; never a key that only starts with it), by this connector or another of
  the host; True when it reclaimed anything.
- ``reap_consumed(max_keys=64)``: a bounded sweep that releases what this connector published
  and consumers already took (or another connector cleaned up).
- ``close()`` (idempotent, also ``with`` and ``__del__``): releases what this connector still
  holds in its own memory and stops its engine (payloads in a store stay for their consumers);
  later puts and gets fail as above.
- ``health()``, ``supports_raw_data = True``, ``_make_key(key, from, to)`` (``key@from_to``).

Records carry data, never code: the rest of ``data`` (everything but its tensors' bytes) travels
as a JSON skeleton (:mod:`tensorwire.omni.skeleton`: None, bools, numbers, strings, bytes, lists,
tuples, sets, dicts, numpy scalars and dtypes), and a ``get`` builds nothing else whatever a
record holds; a ``put`` of another kind of object (a dataclass, an enum, a function) fails and
says which. Records of the pickled format before (``tensorwire: 1``) are refused, not read.

Tensors: torch in, torch out (same dtype, any torch has; same device where it exists); numpy
in, numpy out; anywhere in dicts, lists and tuples (see :mod:`tensorwire.omni.packing`). Their
bytes move without a copy on either side: the consumer's tensors are views of the buffers the
transfer landed in.

Where payloads are found (config):

- ``{}``: one host. Records go to the per-host directory of :mod:`tensorwire.omni.host_records`;
  the bytes stay in the producer's memory (p2p) until read, so the producer's process must live
  until its consumers got them.
- ``{"store_address": "host:port"}`` (a store node's RPC address, e.g. ``tensorwire serve``'s
  store node; several, comma-separated, for a cluster store over those nodes, each payload on
  two of them) or ``store_config``: several hosts. Records go to the store, and payloads too
  (``transfer_mode`` "store", the default then): a producer may exit once ``put`` returned.
  ``transfer_mode: "p2p"`` keeps payloads with their producer (its ``te_config.listen`` must be
  an address the consumers reach).

Other keys: ``consumers`` (gets per put, default 1), ``ttl`` (seconds: a payload and its record
live that long for any number of gets instead), ``timeout`` (bound on each transfer, default 30
s), ``te_config`` (the engine: ``listen``, ``secret_file``, ``insecure``, ``checksum``),
``registry_dir`` and ``scope`` (the host directory's root and a name that separates
deployments). vLLM-Omni's own keys (``stage_id``, ``extra``, ...) are ignored.
"""

import base64
import logging
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Set, Tuple

from ..diffusion import DiffusionConnector, PayloadHandle, StagePayload
from ..errors import (
    InvalidArgumentError,
    KeyNotFoundError,
    LeaseEndedError,
    PayloadMissingError,
    ProducerGoneError,
    StoppedError,
    TimeoutError,
)
from . import packing
from .host_records import HostRecords
from .store_records import StoreRecords

__all__ = ["TensorwireConnector"]

log = logging.getLogger("tensorwire.omni")

_VERSION = 2  # 1: the skeleton was a pickle (refused now: unpickling ran the writer's code)
_SLICE = 0.1  # seconds between checks for an abandoned get
_LOST = (ProducerGoneError, PayloadMissingError, LeaseEndedError, KeyNotFoundError)


class _Published:
    """What a put of this connector left: the publications and the record's generation."""

    __slots__ = ("put_key", "key", "generation", "handles")

    def __init__(self, put_key: str, key: str, generation: str, handles: List[PayloadHandle]):
        self.put_key = put_key
        self.key = key
        self.generation = generation
        self.handles = handles


class TensorwireConnector:
    """A vLLM-Omni connector (``OmniConnectorBase``'s methods and contract; see the module
    documentation) moving tensors with tensorwire."""

    supports_raw_data = True

    def __init__(self, config: Optional[Dict[str, Any]] = None):
        self._closed = True  # until built: __del__ of a half-made connector does nothing
        self.config = dict(config or {})
        cfg = dict(self.config)
        self._consumers = int(cfg.pop("consumers", 1))
        if self._consumers < 1:
            raise InvalidArgumentError(f"consumers must be at least 1, not {self._consumers}")
        ttl = cfg.pop("ttl", None)
        self._ttl = None if ttl is None else float(ttl)
        self._timeout = float(cfg.pop("timeout", 30.0))
        store_config = cfg.pop("store_config", None)
        address = cfg.pop("store_address", None)
        if address is not None:
            store_config = {**(store_config or {}), "address": address}
        mode = cfg.pop("transfer_mode", "store" if store_config else "p2p")
        if mode not in ("p2p", "store", "auto"):
            raise InvalidArgumentError(f"transfer_mode {mode!r}: expected p2p, store or auto")
        if mode != "p2p" and not store_config:
            raise InvalidArgumentError(
                f"transfer_mode {mode!r} needs a store: give store_address (a store node's RPC address)")
        self._conn = DiffusionConnector(role="omni", transfer_mode=mode, store_config=store_config,
                                        te_config=cfg.pop("te_config", None), checksum=bool(cfg.pop("checksum", False)),
                                        wait_timeout=self._timeout)
        root, scope = cfg.pop("registry_dir", None), str(cfg.pop("scope", "default"))
        store = self._conn.store
        self._records = StoreRecords(store, self._timeout) if store is not None else HostRecords(root, scope)
        self._records.sweep()
        self._lock = threading.RLock()
        self._published: "OrderedDict[str, _Published]" = OrderedDict()
        self._abandoned: Set[str] = set()
        self._metrics = {"puts": 0, "gets": 0, "bytes_transferred": 0, "errors": 0, "cleanups": 0}
        self._swept = time.monotonic()
        self._closed = False

    # -- the contract ------------------------------------------------------------------------
    @staticmethod
    def _make_key(key: Any, from_stage: Any, to_stage: Any, separator: str = "@") -> str:
        """The internal key of ``key`` on the edge ``from_stage -> to_stage``."""
        return f"{key}{separator}{from_stage}_{to_stage}"

    def put(self, from_stage: Any, to_stage: Any, put_key: Any, data: Any) -> Tuple[bool, int, Optional[Dict[str, Any]]]:
        """Publishes ``data`` under ``put_key`` on this edge; ``(True, size, metadata)``, or
        ``(False, 0, None)`` on any failure (logged)."""
        handles: List[PayloadHandle] = []
        try:
            self._open()
            self.reap_consumed(max_keys=4)
            put_key = str(put_key)
            key = self._make_key(put_key, from_stage, to_stage)
            skeleton, buffers = packing.pack(data)
            lease = "ttl" if self._ttl is not None else "delete_on_consume"
            for b in buffers:
                payload = StagePayload(request_id=0, kind="feature", tensor=b, lease=lease,
                                       consumers=self._consumers, ttl=self._ttl)
                handles.append(self._conn.publish(payload, timeout=self._timeout))
            for h in handles:
                if h.source == "store":
                    h.wait_stored(timeout=self._timeout)
            size = sum(h.nbytes for h in handles) + len(skeleton)
            record = {
                "tensorwire": _VERSION,
                "key": key,
                "put_key": put_key,
                "from": str(from_stage),
                "to": str(to_stage),
                "generation": uuid.uuid4().hex,
                "handles": [h.to_str() for h in handles],
                "skeleton": base64.b64encode(skeleton).decode(),
                "size": size,
                "consumers": self._consumers,
                "expires": None if self._ttl is None else time.time() + self._ttl,
            }
            with self._lock:
                self._records.write(self._records.stamp(record))
                replaced = self._published.pop(key, None)
                self._published[key] = _Published(put_key, key, record["generation"], handles)
            if replaced is not None:
                self._release(replaced)
            self._metrics["puts"] += 1
            self._metrics["bytes_transferred"] += size
            return True, size, record
        except Exception as e:
            self._metrics["errors"] += 1
            log.error("tensorwire omni connector: put %s (%s -> %s) failed: %s", put_key, from_stage, to_stage, e)
            for h in handles:
                _quietly(h.retire)
            return False, 0, None

    def get(self, from_stage: Any, to_stage: Any, get_key: Any,
            metadata: Any = None) -> Optional[Tuple[Any, int]]:
        """The data put under ``get_key`` on this edge and its size, or None (see the module
        documentation); never raises."""
        return self._get(from_stage, to_stage, get_key, metadata, None)

    def get_with_deadline(self, from_stage: Any, to_stage: Any, get_key: Any, metadata: Any = None, *,
                          deadline: float) -> Optional[Tuple[Any, int]]:
        """``get``, with every wait ending by ``deadline`` (``time.monotonic()``); None once past it."""
        if time.monotonic() >= deadline:
            return None
        return self._get(from_stage, to_stage, get_key, metadata, deadline)

    def get_nowait(self, from_stage: Any, to_stage: Any, get_key: Any) -> Optional[Tuple[Any, int]]:
        """``get`` without metadata: it never waits for data that is not there either."""
        return self._get(from_stage, to_stage, get_key, None, None)

    def abandon_get(self, get_key: Any) -> None:
        """A ``get`` of ``get_key`` now running in another thread gives up (returns None)
        without consuming the payload."""
        with self._lock:
            self._abandoned.add(str(get_key))

    def cleanup(self, request_id: Any) -> bool:
        """Releases every payload and record put under exactly ``request_id`` (any stage pair,
        by any connector of the host, or known to this one through a store); True if anything
        was reclaimed. Never raises."""
        put_key = str(request_id)
        reclaimed = False
        try:
            with self._lock:
                mine = [p for p in self._published.values() if p.put_key == put_key]
                for p in mine:
                    del self._published[p.key]
                self._abandoned.discard(put_key)
            for p in mine:
                # Its record gone means consumed (the consumer's report may still be on its way)
                # or cleaned up elsewhere: the payload goes now, but was not left behind.
                reclaimed |= self._records.remove(p.put_key, p.key, p.generation)
                self._release(p)
            for r in self._records.records_of(put_key):
                if self._records.remove(put_key, r["key"], r.get("generation")):
                    reclaimed = True
                    self._drop_stored(r)
            self._records.forget(put_key)
            if reclaimed:
                self._metrics["cleanups"] += 1
        except Exception as e:
            self._metrics["errors"] += 1
            log.error("tensorwire omni connector: cleanup %s failed: %s", put_key, e)
        return reclaimed

    def reap_consumed(self, *, max_keys: int = 64) -> None:
        """Releases up to ``max_keys`` of this connector's payloads whose record is gone
        (consumed, cleaned up elsewhere) or replaced; the others rotate to the back."""
        try:
            for _ in range(min(max_keys, len(self._published))):
                with self._lock:
                    if not self._published:
                        return
                    key, p = self._published.popitem(last=False)
                current = self._records.read(p.put_key, p.key)
                if current is not None and current.get("generation") == p.generation:
                    with self._lock:
                        self._published.setdefault(key, p)
                else:
                    self._release(p)
            if time.monotonic() - self._swept > 60.0:
                self._swept = time.monotonic()
                self._records.sweep()
        except Exception as e:
            log.warning("tensorwire omni connector: reap_consumed: %s", e)

    def health(self) -> Dict[str, Any]:
        """Status and counters."""
        status = "closed" if self._closed else "healthy"
        h: Dict[str, Any] = {"status": status, **self._metrics, "held_payloads": len(self._published)}
        if not self._closed:
            h["engine"] = self._conn.address
        return h

    def close(self) -> None:
        """Releases the payloads this connector holds in its memory (p2p) and their records, and
        stops its engine; payloads in a store stay for their consumers (their lease, or
        ``cleanup``, removes them). Idempotent; never raises."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        with self._lock:
            held = [p for p in self._published.values() if any(h.source != "store" for h in p.handles)]
            self._published.clear()
        for p in held:
            _quietly(self._records.remove, p.put_key, p.key, p.generation)
            self._release(p)
        _quietly(self._conn.close, timeout=self._timeout)

    def __enter__(self) -> "TensorwireConnector":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    # -- internals -----------------------------------------------------------------------
    def _open(self) -> None:
        if self._closed:
            raise StoppedError("the connector is closed")

    def _get(self, from_stage: Any, to_stage: Any, get_key: Any, metadata: Any,
             deadline: Optional[float]) -> Optional[Tuple[Any, int]]:
        get_key = str(get_key)
        record = None
        try:
            self._open()
            key = self._make_key(get_key, from_stage, to_stage)
            record = _ours(metadata, get_key, key) or self._records.read(get_key, key)
            if record is None:
                return None
            with self._lock:
                self._abandoned.discard(get_key)
            got = self._fetch(record, get_key, deadline)
            if got is not None:
                self._metrics["gets"] += 1
                self._metrics["bytes_transferred"] += got[1]
            return got
        except _LOST as e:
            # Gone for good (its producer died, its lease ended): its record goes too, so later
            # gets do not try it (only that generation's: a newer put of the key stays).
            log.warning("tensorwire omni connector: get %s: the payload is gone: %s", get_key, e)
            if record is not None:
                _quietly(self._records.remove, get_key, record["key"], record.get("generation"))
            return None
        except Exception as e:
            self._metrics["errors"] += 1
            log.error("tensorwire omni connector: get %s (%s -> %s) failed: %s", get_key, from_stage, to_stage, e)
            return None

    def _fetch(self, record: Dict[str, Any], get_key: str, deadline: Optional[float]) -> Optional[Tuple[Any, int]]:
        """Every buffer of ``record`` landed in fresh tensors, then reported consumed; None if
        abandoned or past the deadline (nothing consumed then)."""
        if record.get("tensorwire") != _VERSION:
            raise InvalidArgumentError(
                f"record of {record.get('key')!r} is of format {record.get('tensorwire')!r}, this connector reads "
                f"{_VERSION} (format 1 held a pickle, which is never read)")
        raw = record.get("skeleton")
        if not isinstance(raw, str):
            raise InvalidArgumentError("record without a skeleton")
        try:
            skeleton = packing.load(base64.b64decode(raw.encode("ascii"), validate=True))
            slots = packing.slots(skeleton)
        except (ValueError, UnicodeEncodeError) as e:
            raise InvalidArgumentError(f"record of {record.get('key')!r}: {e}") from None
        handles = [PayloadHandle.from_str(h) for h in record["handles"]]
        if len(slots) != len(handles):
            raise InvalidArgumentError(f"record of {record['key']}: {len(handles)} payloads for {len(slots)} tensors")
        buffers = []
        for slot, h in zip(slots, handles):
            dst = packing.buffer_for(slot, h.nbytes)
            if not self._land(h, dst, get_key, deadline):
                return None
            buffers.append(dst)
        for h in handles:
            # A p2p payload's report goes in the background: its producer also retires it once
            # it sees the record gone (reap_consumed); a store payload's is the store's count.
            self._conn.release(h, timeout=self._timeout, wait=h.source == "store")
        if record.get("expires") is None:
            self._records.consume(record)
        tensors = [packing.restore(s, b) for s, b in zip(slots, buffers)]
        return packing.unpack(skeleton, tensors), int(record["size"])

    def _land(self, h: PayloadHandle, dst: Any, get_key: str, deadline: Optional[float]) -> bool:
        """Reads ``h`` into ``dst`` without reporting it consumed; False if the get was
        abandoned or ran past its deadline first."""
        end = time.monotonic() + self._remaining(deadline)
        c = self._conn._conn.consume(h.to_bytes(), dst, hold=True, timeout=self._remaining(deadline))
        while True:
            with self._lock:
                if get_key in self._abandoned:
                    log.info("tensorwire omni connector: get %s abandoned", get_key)
                    return False
            left = end - time.monotonic()
            if left <= 0:
                log.warning("tensorwire omni connector: get %s: past its deadline", get_key)
                return False
            try:
                if c.next(timeout=min(_SLICE, left)) is None:
                    return True
            except TimeoutError:
                continue

    def _remaining(self, deadline: Optional[float]) -> float:
        if deadline is None:
            return self._timeout
        return max(min(deadline - time.monotonic(), self._timeout), 0.001)

    def _release(self, p: _Published) -> None:
        """Stops serving ``p``'s payloads (store copies removed)."""
        for h in p.handles:
            if h.source == "store":
                _quietly(self._conn.store.remove, h.store_key, timeout=self._timeout)
            else:
                _quietly(h.retire)

    def _drop_stored(self, record: Dict[str, Any]) -> None:
        """Removes the store copies of ``record``'s payloads (a p2p payload of another process
        goes when its producer sees its record gone)."""
        for raw in record.get("handles", []):
            h = PayloadHandle.from_str(raw)
            if h.source == "store" and self._conn.store is not None:
                _quietly(self._conn.store.remove, h.store_key, timeout=self._timeout)



def _ours(metadata: Any, get_key: str, key: str) -> Optional[Dict[str, Any]]:
    """The record in ``metadata`` (what put returned, or that wrapped as ``{get_key: ...}``), if
    it is one of this connector's for ``key``; None means: look the key up."""
    if isinstance(metadata, dict) and isinstance(metadata.get(get_key), dict):
        metadata = metadata[get_key]
    if not isinstance(metadata, dict) or metadata.get("tensorwire") != _VERSION:
        return None
    if metadata.get("key") != key or not isinstance(metadata.get("handles"), list):
        return None
    if not isinstance(metadata.get("skeleton"), str) or not isinstance(metadata.get("generation"), str):
        return None
    return metadata


def _quietly(f: Any, *args: Any, **kwargs: Any) -> Any:
    """``f(...)``, or None with a debug line when it raises (releases of things already gone)."""
    try:
        return f(*args, **kwargs)
    except Exception as e:
        log.debug("tensorwire omni connector: %s: %s", getattr(f, "__name__", f), e)
        return None
