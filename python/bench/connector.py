"""Python publish+consume against the Rust connector, in the same run, interleaved.

    python bench/connector.py [--sizes 4M,64M] [--runs 5]

For each size: a Python sample (two DiffusionConnectors in this process, p2p over tcp on
loopback, a numpy tensor published and consumed into a numpy destination, repeated for about
`--budget` seconds) alternates with a Rust sample (the `xfer --connector` harness of the same
checkout, one run). Prints the medians and their ratio, then the per-call cost of a 4 KiB
Session.write from Python next to the Rust engine's 4 KiB tcp write. The Rust harness must be
built: `cargo build --release -p tensorwire-benches --bin xfer` (from the repository root).
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import time

import numpy as np

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector, StagePayload

ROOT = pathlib.Path(__file__).resolve().parents[2]
XFER = ROOT / "target" / "release" / "xfer"


def size_of(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def python_sample(prod, cons, src, dst, budget: float) -> float:
    moved, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        h = prod.publish(StagePayload(1, "latent", src), consumer_credit=1)
        for _ in cons.consume(h, dst):
            pass
        moved += src.nbytes
    return moved / (time.perf_counter() - start) / 1e9


def rust_sample(size: int, budget: float) -> float:
    out = subprocess.run([str(XFER), "--connector", "--sizes", str(size), "--runs", "1",
                          "--min-time-ms", str(int(budget * 1000))], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        m = json.loads(line)
        if m.get("op") == "publish+consume":
            return m["gbps"]
    raise RuntimeError(f"no publish+consume line from xfer: {out.stdout}")


def rust_tcp_4k_us() -> float:
    out = subprocess.run([str(XFER), "--backend", "tcp", "--sizes", "4K", "--runs", "3", "--op", "write"],
                         capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.splitlines()[0])
    return 4096 / (m["gbps"] * 1e9) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4M,64M")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.5, help="seconds per sample")
    args = p.parse_args()
    if not XFER.exists():
        raise SystemExit(f"{XFER} is missing: cargo build --release -p tensorwire-benches --bin xfer")
    prod = DiffusionConnector(transfer_mode="p2p", te_config={"streams": 2})
    cons = DiffusionConnector(transfer_mode="p2p", te_config={"streams": 2})
    for s in args.sizes.split(","):
        n = size_of(s)
        src = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
        dst = np.empty_like(src)
        py, rs = [], []
        for run in range(args.runs):  # alternate which goes first
            order = [lambda: py.append(python_sample(prod, cons, src, dst, args.budget)),
                     lambda: rs.append(rust_sample(n, args.budget))]
            for f in (order if run % 2 == 0 else order[::-1]):
                f()
        assert np.array_equal(src, dst)
        pm, rm = statistics.median(py), statistics.median(rs)
        print(json.dumps({"size": n, "python_gbps": round(pm, 3), "rust_gbps": round(rm, 3),
                          "ratio": round(pm / rm, 3), "python_samples": [round(x, 3) for x in py],
                          "rust_samples": [round(x, 3) for x in rs]}))
    a, b = tw.Engine(), tw.Engine()
    ra, rb = a.register(np.zeros(4096, dtype=np.uint8)), b.register(np.zeros(4096, dtype=np.uint8))
    sess, desc = a.connect(b.address), rb.descriptor()
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        sess.write(ra, 0, desc, 0, 4096)
        times.append(time.perf_counter() - t)
    times.sort()
    print(json.dumps({"op": "Session.write 4KiB", "python_p50_us": round(times[len(times) // 2] * 1e6, 1),
                      "python_p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
                      "rust_tcp_write_4KiB_us": round(rust_tcp_4k_us(), 1)}))


if __name__ == "__main__":
    main()
