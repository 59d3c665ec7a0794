"""The vLLM-Omni connector's put+get against the connector it is built on, in the same run.

    python bench/omni.py [--sizes 4K,4M,64M] [--budget 3]

For each size: a round of ``TensorwireConnector.put`` + ``get`` of ``{"x": array}`` between two
connectors of this process (p2p over tcp on loopback, the per-host records in /dev/shm)
alternates with a round of ``DiffusionConnector.publish`` + ``consume`` of the same array into a
fresh destination (what the omni connector does underneath, without its records, its skeleton
and its consumer count). Prints the median of each, and the ratio (connector / omni: 1.0 means
the omni layer costs nothing).
"""

import argparse
import statistics
import tempfile
import time
import uuid

import numpy as np

from tensorwire.diffusion import DiffusionConnector, StagePayload
from tensorwire.omni import TensorwireConnector


def size_of(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,4M,64M")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per size (at least 8 rounds)")
    a = ap.parse_args()
    scope = tempfile.mkdtemp(dir="/dev/shm") if _shm() else tempfile.mkdtemp()
    put, get = TensorwireConnector({"registry_dir": scope}), TensorwireConnector({"registry_dir": scope})
    prod, cons = DiffusionConnector(transfer_mode="p2p"), DiffusionConnector(transfer_mode="p2p")
    for s in a.sizes.split(","):
        size = size_of(s)
        x = np.ones(size, dtype=np.uint8)

        def omni() -> None:
            k = uuid.uuid4().hex
            assert put.put("a", "b", k, {"x": x})[0] and get.get("a", "b", k) is not None

        def connector() -> None:
            h = prod.publish(StagePayload(1, "feature", x))
            for _ in cons.consume(h, np.empty_like(x)):
                pass

        times = {"omni": [], "connector": []}
        start, rounds = time.perf_counter(), 0
        while rounds < 8 or time.perf_counter() - start < a.budget:
            rounds += 1
            for name, f in (("omni", omni), ("connector", connector)):
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        o, c = statistics.median(times["omni"]), statistics.median(times["connector"])
        print(f"{s:>5}: omni put+get {o * 1e6:9.0f} us ({size / o / 1e9:5.2f} GB/s), connector publish+consume "
              f"{c * 1e6:9.0f} us ({size / c / 1e9:5.2f} GB/s), ratio {c / o:.2f} ({rounds} rounds)")
    put.close()
    get.close()


def _shm() -> bool:
    import os

    return os.access("/dev/shm", os.W_OK)


if __name__ == "__main__":
    main()
