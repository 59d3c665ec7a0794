"""The records of :class:`~tensorwire.omni.TensorwireConnector` in a store node, for connectors
on several hosts: the same interface as :class:`~tensorwire.omni.host_records.HostRecords`, one
small store object per published payload.

A record is stored pinned (never evicted) with the store's lease: ``consumers`` consumers
(each a ``consumed`` report) or its TTL remove it. Two limits of a store against a directory:
a consumer counts itself without checking the record's generation (a re-put between a
consumer's read and its report is counted once too early), and the Python ``Store`` does not
list keys (the store RPC can since its version 3; the binding does not offer it yet), so
:meth:`StoreRecords.records_of` knows only the keys this process wrote or read.
"""

import hashlib
import json
import threading
import time
from typing import Any, Dict, List, Optional, Set

from ..errors import KeyNotFoundError

__all__ = ["StoreRecords"]


def _h(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class StoreRecords:
    """Records kept in ``store`` (a ``tensorwire.Store``), each call bounded by ``timeout``."""

    def __init__(self, store: Any, timeout: float):
        self.store = store
        self.timeout = timeout
        self._known: Dict[str, Set[str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _skey(put_key: str, key: str) -> str:
        return f"twomni/{_h(put_key)}.{_h(key)}"

    def _know(self, put_key: str, key: str) -> None:
        with self._lock:
            self._known.setdefault(put_key, set()).add(key)

    def stamp(self, record: Dict[str, Any]) -> Dict[str, Any]:
        return record

    def write(self, record: Dict[str, Any]) -> None:
        k = self._skey(record["put_key"], record["key"])
        self.store.remove(k, timeout=self.timeout)
        self.store.put(k, json.dumps(record).encode(), retention="pinned", timeout=self.timeout)
        ttl = None if record.get("expires") is None else max(record["expires"] - time.time(), 0.001)
        self.store.set_lease(k, consumers=int(record.get("consumers", 0)) if ttl is None else 0, ttl=ttl,
                             timeout=self.timeout)
        self._know(record["put_key"], record["key"])

    def read(self, put_key: str, key: str) -> Optional[Dict[str, Any]]:
        try:
            raw = self.store.get(self._skey(put_key, key), timeout=self.timeout)
        except KeyNotFoundError:
            return None
        try:
            record = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(record, dict) or record.get("key") != key:
            return None
        self._know(put_key, key)
        return record

    def consume(self, record: Dict[str, Any]) -> bool:
        try:
            return bool(self.store.consumed(self._skey(record["put_key"], record["key"]), timeout=self.timeout))
        except KeyNotFoundError:
            return False

    def remove(self, put_key: str, key: str, generation: Optional[str] = None) -> bool:
        if generation is not None:
            current = self.read(put_key, key)
            if current is None or current.get("generation") != generation:
                return False
        return bool(self.store.remove(self._skey(put_key, key), timeout=self.timeout))

    def records_of(self, put_key: str) -> List[Dict[str, Any]]:
        with self._lock:
            keys = list(self._known.get(put_key, ()))
        found = [self.read(put_key, k) for k in keys]
        return [r for r in found if r is not None]

    def forget(self, put_key: str) -> None:
        with self._lock:
            self._known.pop(put_key, None)

    def sweep(self) -> int:
        return 0  # the store's leases and TTLs remove records
