"""Where a Python handoff's time goes: publish, consume, the first chunk and the end, timed apart.

    python bench/handoff_parts.py [--size 1M] [--handoffs 1500]

Two DiffusionConnectors in this process (p2p over tcp on loopback, as `connector.py`), one
numpy tensor published and consumed into a numpy destination, over and over. Prints the p50 of
each part (the first 10% of the handoffs are left out as warm-up): `publish` (the Python call,
with the native call inside it shown apart), `consume` (the call that starts the consume), the
first `next` (the chunk landing), the last `next` (the consume's end and report), and the whole.
Wall time of the calling thread; it parks only where the runtime's work is not done yet.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see connector.py

import numpy as np  # noqa: E402

from connector import size_of  # noqa: E402  (this directory's connector.py)
from tensorwire.diffusion import DiffusionConnector, StagePayload  # noqa: E402


class Timed:
    """Wraps one method of a native object, recording each call's wall time."""

    def __init__(self, obj, name: str):
        self._obj, self.times = obj, []
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            self.times.append(time.perf_counter() - t)
            return out

        setattr(self, name, timed)

    def __getattr__(self, name):
        return getattr(self._obj, name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="1M")
    p.add_argument("--handoffs", type=int, default=1500)
    args = p.parse_args()
    n = size_of(args.size)
    prod = DiffusionConnector(transfer_mode="p2p", te_config={"streams": 2})
    cons = DiffusionConnector(transfer_mode="p2p", te_config={"streams": 2})
    native = prod._conn = Timed(prod._conn, "publish")
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    parts = {"publish": [], "consume": [], "first next": [], "last next": [], "handoff": []}
    for i in range(args.handoffs):
        t0 = time.perf_counter()
        h = prod.publish(StagePayload(i, "latent", src), consumer_credit=1)
        t1 = time.perf_counter()
        chunks = cons.consume(h, dst)
        t2 = time.perf_counter()
        next(chunks)
        t3 = time.perf_counter()
        for _ in chunks:
            pass
        t4 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
            parts[k].append(v)
    skip = args.handoffs // 10
    us = {k: statistics.median(v[skip:]) * 1e6 for k, v in parts.items()}
    us["native publish"] = statistics.median(native.times[skip:]) * 1e6
    for k in ("publish", "native publish", "consume", "first next", "last next", "handoff"):
        print(f"{k:15s} p50 {us[k]:8.1f} us")


if __name__ == "__main__":
    main()
