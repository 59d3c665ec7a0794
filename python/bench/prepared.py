"""A Session op from Python: `write` (checked and routed at every call) against a
`PreparedTransfer.post` (checked once), over shm and tcp, at 4 and 64 KiB.

    python bench/prepared.py [--calls 5000] [--rounds 2]

Two engines in this process; the peer's region is engine memory (`Engine.alloc`), which a
same-host peer maps (shm). Prints the p50 of each kind of call per round, in microseconds,
taking turns. Over shm an op of up to 1 MiB is copied on the calling thread; over tcp the call
waits for the peer's answer, and its figure is a thread wake-up more than a Rust task's
(`xfer --latency --caller blocking` is the Rust figure to hold it against).
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see connector.py

import numpy as np  # noqa: E402

import tensorwire as tw  # noqa: E402


def p50_us(call, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for backend in ["shm", "tcp"]:
        a, b = tw.Engine(backends=[backend]), tw.Engine(backends=[backend])
        try:
            for size in [4096, 65536]:
                src = np.ones(size, dtype=np.uint8)
                ra, rb = a.register(src), b.alloc(size)
                d = rb.descriptor()
                s = a.connect(b.address)
                p = s.prepare_write([(ra, 0, d, 0, size)])
                for _ in range(500):  # warm-up: connections, and the shm lease
                    s.write(ra, 0, d, 0, size)
                    p.post()
                res = {"write": [], "post": []}
                for _ in range(args.rounds):
                    res["write"].append(round(p50_us(lambda: s.write(ra, 0, d, 0, size), args.calls), 2))
                    res["post"].append(round(p50_us(p.post, args.calls), 2))
                print(json.dumps({"backend": backend, "size": size, "p50_us": res}))
        finally:
            a.shutdown()
            b.shutdown()


if __name__ == "__main__":
    main()
