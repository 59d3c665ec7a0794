"""Python publish+consume against the Rust connector, in the same run, interleaved.

    python bench/connector.py [--sizes 4M,64M] [--runs 5]

For each size: a Python sample (two DiffusionConnectors in this process, p2p over tcp on
loopback, a numpy tensor published and consumed into a numpy destination, repeated for about
`--budget` seconds) alternates with two Rust samples (the `xfer --connector` harness of the same
checkout, one run each): one calling from a runtime task (`--caller task`, what an async Rust
server does) and one calling from a thread outside the runtime (`--caller blocking`, what every
Python call is: the calling thread parks and a runtime worker wakes it). Prints the medians and
the ratio to each, then the p50 of a 4 KiB Session.write from Python next to the Rust engine's
4 KiB tcp write (`xfer --latency`) from either kind of caller. The Rust harness must be built:
`cargo build --release -p tensorwire-benches --bin xfer` (from the repository root).

numpy's OpenBLAS thread pool is held to one thread (unless OPENBLAS_NUM_THREADS is set): this
bench makes no BLAS call, but the pool's idle threads spin after numpy starts and took 8-10% of
the Python figures on a 2-core machine, a cost of numpy, not of tensorwire.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402  (after the thread-pool setting)

import tensorwire as tw  # noqa: E402
from tensorwire.diffusion import DiffusionConnector, StagePayload  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The Rust harness: this checkout's release build, or TW_XFER (scripts/gpu-check carries its own).
XFER = pathlib.Path(os.environ.get("TW_XFER", ROOT / "target" / "release" / "xfer"))


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


def rust_sample(size: int, budget: float, caller: str) -> float:
    out = subprocess.run([str(XFER), "--connector", "--sizes", str(size), "--runs", "1", "--caller", caller,
                          "--min-time-ms", str(int(budget * 1000))], capture_output=True, text=True, check=True)
    for line in out.stdout.splitlines():
        m = json.loads(line)
        if m.get("op") == "publish+consume":
            return m["gbps"]
    raise RuntimeError(f"no publish+consume line from xfer: {out.stdout}")


def rust_tcp_4k_p50_us(caller: str) -> float:
    out = subprocess.run([str(XFER), "--backend", "tcp", "--latency", "--latency-sizes", "4K", "--op", "write",
                          "--samples", "2000", "--caller", caller], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[0])["p50_us"]


def python_4k_p50_us(sess, ra, desc) -> float:
    times = []
    for _ in range(2000):
        t = time.perf_counter()
        sess.write(ra, 0, desc, 0, 4096)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def interleaved(runs: int, *samplers):
    """``runs`` samples of each sampler, taking turns; which goes first rotates from run to run.
    Returns one list of samples per sampler."""
    out = [[] for _ in samplers]
    for run in range(runs):
        for i in range(len(samplers)):
            k = (run + i) % len(samplers)
            out[k].append(samplers[k]())
    return out


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
        py, rs, rb = interleaved(args.runs, lambda: python_sample(prod, cons, src, dst, args.budget),
                                 lambda: rust_sample(n, args.budget, "task"),
                                 lambda: rust_sample(n, args.budget, "blocking"))
        assert np.array_equal(src, dst)
        pm, rm, bm = statistics.median(py), statistics.median(rs), statistics.median(rb)
        print(json.dumps({"size": n, "python_gbps": round(pm, 3), "rust_gbps": round(rm, 3),
                          "rust_blocking_gbps": round(bm, 3), "ratio": round(pm / rm, 3),
                          "ratio_to_blocking": round(pm / bm, 3), "python_samples": [round(x, 3) for x in py],
                          "rust_samples": [round(x, 3) for x in rs], "rust_blocking_samples": [round(x, 3) for x in rb]}))
    a, b = tw.Engine(), tw.Engine()
    ra, rb = a.register(np.zeros(4096, dtype=np.uint8)), b.register(np.zeros(4096, dtype=np.uint8))
    sess, desc = a.connect(b.address), rb.descriptor()
    py, rs, rbl = interleaved(args.runs, lambda: python_4k_p50_us(sess, ra, desc),
                              lambda: rust_tcp_4k_p50_us("task"), lambda: rust_tcp_4k_p50_us("blocking"))
    pm, rm, bm = statistics.median(py), statistics.median(rs), statistics.median(rbl)
    print(json.dumps({"op": "Session.write 4KiB p50", "python_us": round(pm, 1), "rust_task_us": round(rm, 1),
                      "rust_blocking_us": round(bm, 1), "ratio": round(pm / rm, 3),
                      "ratio_to_blocking": round(pm / bm, 3), "python_samples": [round(x, 1) for x in py],
                      "rust_task_samples": [round(x, 1) for x in rs],
                      "rust_blocking_samples": [round(x, 1) for x in rbl]}))


if __name__ == "__main__":
    main()
