"""Shared fixtures: engines and connectors on loopback."""

import pytest

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector


@pytest.fixture
def engines():
    a, b = tw.Engine(), tw.Engine()
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.fixture
def store_node():
    """An engine with a shared embedded store served by a store node: (engine, store, node)."""
    e = tw.Engine()
    s = tw.Store.embedded(e, 64 << 20, shared=True)
    node = tw.StoreNode(s)
    yield e, s, node
    e.shutdown()


@pytest.fixture
def pipeline(store_node):
    """A producer and a consumer connector sharing a store node (mode chosen per publish)."""
    node_engine, _, node = store_node
    cfg = {"node_engine": node_engine.address, "node_rpc": node.address}
    prod = DiffusionConnector(role="denoise", transfer_mode="auto", store_config=cfg, checksum=True)
    cons = DiffusionConnector(role="decode", transfer_mode="auto", store_config=cfg, checksum=True)
    yield prod, cons
    prod.close()
    cons.close()


class Child:
    """A Python child process running ``code`` that talks in lines: what it prints is read with
    ``line()`` (bounded), what ``send`` writes arrives on its stdin. Killed at the end."""

    def __init__(self, code: str, netns: "Netns | None" = None):
        import queue
        import subprocess
        import sys
        import threading

        argv = [sys.executable, "-c", code]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns.name, *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._lines: "queue.Queue[str]" = queue.Queue()
        self._seen: list = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))

    def line(self, timeout: float = 30.0) -> str:
        """The next line that starts with ``>`` (others are the child's logs), without it."""
        import queue
        import time

        end = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(end - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"the child said nothing for {timeout} s; it printed {self._seen[-20:]}")
            self._seen.append(line)
            if line.startswith(">"):
                return line[1:]

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def child():
    """Starts children (``child(code)``, or inside a namespace: ``child(code, netns)``) and kills
    them after the test."""
    made = []

    def start(code: str, netns: "Netns | None" = None) -> Child:
        c = Child(code, netns)
        made.append(c)
        return c

    yield start
    for c in made:
        c.kill()


class Netns:
    """Another host, as far as IP goes: a network namespace joined to this one by a veth pair,
    ``here`` on this side and ``there`` inside. ``wrap(argv)`` runs a command inside."""

    def __init__(self) -> None:
        import os
        import subprocess

        pid = os.getpid()
        n = pid % 250 + 1
        self.name, self._outer, self._inner = f"twpy{pid}", f"twpa{pid}", f"twpb{pid}"
        self.here, self.there = f"10.78.{n}.1", f"10.78.{n}.2"

        def ip(*args: str) -> None:
            subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

        ip("netns", "add", self.name)
        try:
            ip("link", "add", self._outer, "type", "veth", "peer", "name", self._inner)
            ip("link", "set", self._inner, "netns", self.name)
            ip("addr", "add", f"{self.here}/30", "dev", self._outer)
            ip("link", "set", self._outer, "up")
            ip("netns", "exec", self.name, "ip", "addr", "add", f"{self.there}/30", "dev", self._inner)
            ip("netns", "exec", self.name, "ip", "link", "set", self._inner, "up")
            ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        import subprocess

        subprocess.run(["ip", "link", "del", self._outer], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)


@pytest.fixture
def netns():
    """A second host (see ``Netns``); skipped, with the reason, without root or iproute2."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns) to make a second host")
    try:
        ns = Netns()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"cannot make a network namespace here: {getattr(e, 'stderr', e)}")
    yield ns
    ns.close()
