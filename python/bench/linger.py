"""Publish+consume from Python with the runtime's linger off and on, taking turns in one process.

    python bench/linger.py [--sizes 1M,4M,64M] [--pairs 8] [--linger-us 1000]

Two DiffusionConnectors in this process (p2p over tcp on loopback, as `connector.py`), one numpy
tensor published and consumed into a numpy destination, over and over for `--budget` seconds
per sample. Samples alternate between `set_linger(0)` and `set_linger(--linger-us)` (which goes
first alternates too), so both see the same machine; prints each side's median GB/s, their
ratio, and the samples. On a shared machine the figures drift from minute to minute; the ratio
within one run is what this measures.
"""

import argparse
import json
import os
import statistics

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see connector.py

import numpy as np  # noqa: E402

import tensorwire as tw  # noqa: E402
from connector import python_sample, size_of  # noqa: E402  (this directory's connector.py)
from tensorwire.diffusion import DiffusionConnector  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1M,4M,64M")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--budget", type=float, default=0.4, help="seconds per sample")
    p.add_argument("--linger-us", type=float, default=1000)
    args = p.parse_args()
    prod = DiffusionConnector(transfer_mode="p2p", te_config={"streams": 2})
    cons = DiffusionConnector(transfer_mode="p2p", te_config={"streams": 2})
    before = tw.set_linger(0)
    try:
        for s in args.sizes.split(","):
            n = size_of(s)
            src = (np.arange(n, dtype=np.uint64) % 251).astype(np.uint8)
            dst = np.empty_like(src)
            off, on = [], []
            for i in range(args.pairs):
                for linger in ((0, args.linger_us) if i % 2 else (args.linger_us, 0)):
                    tw.set_linger(linger * 1e-6)
                    (on if linger else off).append(python_sample(prod, cons, src, dst, args.budget))
            assert np.array_equal(src, dst)
            mo, mn = statistics.median(off), statistics.median(on)
            print(json.dumps({"size": n, "linger_us": args.linger_us, "off_gbps": round(mo, 3),
                              "on_gbps": round(mn, 3), "ratio": round(mn / mo, 3),
                              "off_samples": [round(x, 2) for x in off], "on_samples": [round(x, 2) for x in on]}))
    finally:
        tw.set_linger(before)


if __name__ == "__main__":
    main()
