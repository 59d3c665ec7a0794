"""The per-host rendezvous of :class:`~tensorwire.omni.TensorwireConnector`: one small file per
published payload, in a directory that only this user can open (``/dev/shm/tensorwire-omni-UID``
by default), so that a ``get`` in any process of the host finds by key what a ``put`` in another
published, with nothing to configure and no process to keep alive but the producer.

Why files: a well-known socket or a store node started by the first connector would die with
the process that owns it, and every later connector would have to notice and elect another; a
directory has no owner. A record names the payload (its handles, which say where the producer's
engine listens) and counts the consumers still to come; the payload's bytes stay in the
producer's memory until they are read.

- A ``put`` writes a record whole to a temporary file and renames it over the key's file, so a
  reader sees the old record or the new one, never a mix; a re-put gets a new ``generation``.
- A consumer counts itself under an exclusive ``flock`` and removes the file with the last
  consumer; a consumer whose locked file was replaced meanwhile counts nothing (that record is
  another generation's).
- Records of producers that died (same PID namespace, PID gone) and records past their TTL are
  swept when seen.

The directory is private to its user (mode 0700, no group or other bit on it; a record file
0600), and a record holds data only (its skeleton is JSON, :mod:`tensorwire.omni.skeleton`):
reading one runs nothing of its writer's. When another user made ``tensorwire-omni-UID`` first
under the default root (a squatter: the folder is not ours, or is open to others), the records
go to this user's runtime folder (``$XDG_RUNTIME_DIR``, else ``~/.cache``) instead; a root given
explicitly (``registry_dir``) is never replaced: a squatted one is an error.
"""

import contextlib
import errno
import fcntl
import glob
import hashlib
import itertools
import json
import logging
import os
import stat
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

__all__ = ["HostRecords", "default_root"]


def default_root() -> str:
    """``/dev/shm`` where it is a writable directory, else the temporary directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def _h(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _private_dir(path: str) -> None:
    """Creates ``path`` (mode 0700) or checks that it is a directory of this user with no group
    or other permission bit; raises ``PermissionError`` otherwise."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be a directory of uid {os.getuid()} that only it can open "
            f"(found uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")


def fallback_root() -> str:
    """This user's own runtime folder: ``$XDG_RUNTIME_DIR``, else ``~/.cache``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return runtime
    return os.path.join(os.path.expanduser("~"), ".cache")


def user_base(root: Optional[str]) -> str:
    """The user's records folder under ``root`` (the default root when None), made private; in
    the default root, a folder another user took first sends the records to
    :func:`fallback_root` instead (logged)."""
    name = f"tensorwire-omni-{os.getuid()}"
    base = os.path.join(root or default_root(), name)
    try:
        _private_dir(base)
        return base
    except PermissionError as e:
        if root is not None:
            raise
        other = os.path.join(fallback_root(), name)
        logging.getLogger("tensorwire.omni").warning(
            "tensorwire omni records: %s; using %s instead", e, other)
        _private_dir(other)
        return other


class HostRecords:
    """The records of one scope (a deployment) on this host.

    A record is a dict with at least ``key`` (the connector's internal key), ``put_key``,
    ``generation`` and ``consumers`` (how many consumers are still to come); the rest is the
    connector's. ``expires`` (seconds since the epoch, or None) ends it; ``pid`` and ``pidns``
    name its producer.
    """

    def __init__(self, root: Optional[str] = None, scope: str = "default"):
        base = user_base(root)
        self.dir = os.path.join(base, _h(scope))
        _private_dir(self.dir)
        self._pidns = _pid_namespace()
        self._tmp = itertools.count()

    def _path(self, put_key: str, key: str) -> str:
        return os.path.join(self.dir, f"{_h(put_key)}.{_h(key)}.json")

    def stamp(self, record: Dict[str, Any]) -> Dict[str, Any]:
        """``record`` with this process as its producer."""
        return {**record, "pid": os.getpid(), "pidns": self._pidns}

    def write(self, record: Dict[str, Any]) -> None:
        """Publishes ``record``, replacing any record of its key."""
        tmp = os.path.join(self.dir, f".tmp-{os.getpid()}-{threading.get_ident()}-{next(self._tmp)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                _write_all(fd, json.dumps(record).encode())
            finally:
                os.close(fd)
            os.replace(tmp, self._path(record["put_key"], record["key"]))
        except BaseException:
            _unlink(tmp)
            raise

    def read(self, put_key: str, key: str) -> Optional[Dict[str, Any]]:
        """The live record of ``key``, or None (absent, expired, its producer dead, unreadable)."""
        path = self._path(put_key, key)
        record = _load(path, fcntl.LOCK_SH)
        if record is None or record.get("key") != key:
            return None
        if self._stale(record):
            self.remove(put_key, key, record.get("generation"))
            return None
        return record

    def consume(self, record: Dict[str, Any]) -> bool:
        """Counts one consumer of ``record``'s generation; True when it was the last one and the
        record is gone. A record replaced or removed meanwhile counts nothing (False)."""
        path = self._path(record["put_key"], record["key"])
        with _locked(path, record.get("generation"), os.O_RDWR) as held:
            if held is None:
                return False
            fd, current = held
            left = int(current.get("consumers", 1)) - 1
            if left <= 0:
                return _unlink(path)
            os.ftruncate(fd, 0)
            _write_all(fd, json.dumps({**current, "consumers": left}).encode())
            return False

    def remove(self, put_key: str, key: str, generation: Optional[str] = None) -> bool:
        """Removes ``key``'s record (only that generation's, when one is given); True if it was
        there."""
        path = self._path(put_key, key)
        if generation is None:
            return _unlink(path)
        with _locked(path, generation, os.O_RDONLY) as held:
            return held is not None and _unlink(path)

    def records_of(self, put_key: str) -> List[Dict[str, Any]]:
        """Every record whose put key is ``put_key`` (any stage pair), stale ones included."""
        found = []
        for path in glob.glob(os.path.join(self.dir, f"{_h(put_key)}.*.json")):
            r = _load(path, fcntl.LOCK_SH)
            if r is not None and r.get("put_key") == put_key:
                found.append(r)
        return found

    def forget(self, put_key: str) -> None:
        """Nothing to forget: the directory lists every record."""

    def sweep(self) -> int:
        """Removes the records of dead producers and expired ones; returns how many."""
        n = 0
        for r in self._all():
            if self._stale(r) and self.remove(r["put_key"], r["key"], r.get("generation")):
                n += 1
        return n

    def _all(self) -> Iterator[Dict[str, Any]]:
        for path in glob.glob(os.path.join(self.dir, "*.json")):
            r = _load(path, fcntl.LOCK_SH)
            if r is not None and "key" in r and "put_key" in r:
                yield r

    def _stale(self, r: Dict[str, Any]) -> bool:
        expires = r.get("expires")
        if expires is not None and time.time() >= float(expires):
            return True
        pid = r.get("pid")
        if pid is None or r.get("pidns") != self._pidns or self._pidns is None:
            return False  # another PID namespace: its PIDs mean nothing here
        return not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(path: str, generation: Optional[str], mode: int) -> Iterator[Optional[Tuple[int, Dict[str, Any]]]]:
    """The open file at ``path`` under an exclusive lock, with its record, while it still is the
    file at ``path`` and holds ``generation``'s record; None otherwise."""
    try:
        fd = os.open(path, mode)
    except FileNotFoundError:
        yield None
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        current = _parse(_read(fd))
        same = current is not None and current.get("generation") == generation and _same_file(fd, path)
        yield (fd, current) if same else None
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _write_all(fd: int, data: bytes) -> None:
    """Writes ``data`` at the start of ``fd`` (a short write continues where it stopped)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], done)


def _read(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


def _parse(data: bytes) -> Optional[Dict[str, Any]]:
    try:
        r = json.loads(data)
    except ValueError:
        return None
    return r if isinstance(r, dict) else None


def _load(path: str, lock: int) -> Optional[Dict[str, Any]]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, lock)
        return _parse(_read(fd))
    finally:
        os.close(fd)


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
        return False
