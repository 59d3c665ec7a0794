"""Encode -> denoise -> decode as three Python processes and the orchestrator, moving real tensors.

    python examples/pipeline.py --requests 6

The parent runs the orchestrator service and a store node and starts one worker process per
stage. The encode worker publishes a condition embedding through the store; the denoise worker
consumes it, makes a video latent and publishes it p2p in temporal chunks; the decode worker
consumes the chunks as views of its destination and checks every byte. The queue messages
between stages are the payload handles (small bytes) the orchestrator passes from one stage's
result to the next stage's assignment. Exits non-zero unless every request completed and
every byte matched.
"""

import argparse
import subprocess
import sys
import time

import numpy as np

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector, PayloadHandle, StagePayload
from tensorwire.orchestrator import Service, Submitter, serve_stage

EMBED = (1, 77, 256)  # text tokens x hidden (small, so the example runs anywhere)
LATENT = (16, 8, 24, 24)  # channels x frames x height x width
CHUNKS = 4  # temporal chunks of the latent


def embedding(request: int) -> np.ndarray:
    return np.random.default_rng(request).standard_normal(EMBED).astype(np.float32)


def latent(request: int) -> np.ndarray:
    """What "denoising" request `request` produces (decode recomputes it to check every byte)."""
    e = embedding(request)
    rng = np.random.default_rng(1000 + request)
    return (rng.standard_normal(LATENT) + e.mean()).astype(np.float32)


def worker(stage: str, orch: str, store: dict) -> None:
    conn = DiffusionConnector(role=stage, transfer_mode="auto", store_config=store, checksum=True)
    keep = []  # p2p payloads: the tensors must live until their consumer read them

    def encode(a: tw.Assignment) -> bytes:
        h = conn.publish(StagePayload(a.request, "condition_embedding", embedding(a.request)))
        h.wait_stored()
        return h.to_bytes()

    def denoise(a: tw.Assignment) -> bytes:
        src = PayloadHandle.from_bytes(a.inputs)
        e = np.empty(src.shape, dtype=src.dtype)
        for _ in conn.consume(src, e, hold=True):  # released by decode, once the request is done
            pass
        assert np.array_equal(e, embedding(a.request)), "embedding bytes differ"
        x = latent(a.request)
        keep.append(x)
        del keep[:-8]
        h = conn.publish(StagePayload(a.request, "latent", x, chunk_dim=1, num_chunks=CHUNKS),
                         consumer_credit=1)
        h.mark_all_ready()
        return h.to_bytes()

    def decode(a: tw.Assignment) -> bytes:
        src = PayloadHandle.from_bytes(a.inputs)
        dst = np.empty(src.shape, dtype=src.dtype)
        frames = 0
        for chunk in conn.consume(src, dst, hold=True):  # each chunk a view of dst, decoded as it lands
            frames += chunk.shape[1]
        if frames != LATENT[1] or not np.array_equal(dst, latent(a.request)):
            raise RuntimeError(f"request {a.request}: latent bytes differ")
        return b""  # the last stage has no outputs to hand on

    handler = {"encode": encode, "denoise": denoise, "decode": decode}[stage]
    # Inputs are held until the request completes, so a killed worker's item finds them again.
    serve_stage(orch, stage, handler, release=conn.release)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--timeout", type=float, default=120.0)
    sub = p.add_subparsers(dest="cmd")
    w = sub.add_parser("worker")
    w.add_argument("--stage", required=True)
    w.add_argument("--orch", required=True)
    w.add_argument("--node-engine", required=True)
    w.add_argument("--node-rpc", required=True)
    args = p.parse_args()
    if args.cmd == "worker":
        worker(args.stage, args.orch, {"node_engine": args.node_engine, "node_rpc": args.node_rpc})
        return 0

    service = Service()
    node_engine = tw.Engine()
    store = tw.Store.embedded(node_engine, 256 << 20, shared=True)
    node = tw.StoreNode(store)
    procs = [subprocess.Popen([sys.executable, __file__, "worker", "--stage", s, "--orch", service.address,
                               "--node-engine", node_engine.address, "--node-rpc", node.address])
             for s in ("encode", "denoise", "decode")]
    try:
        start = time.time()
        submitter = Submitter(service.address)
        outcomes = [submitter.submit(r, "interactive") for r in range(1, args.requests + 1)]
        for o in outcomes:
            o.wait(timeout=args.timeout)
        took = time.time() - start
        # The decode worker releases a request's payloads just after reporting it: give the
        # last releases a moment to land.
        deadline = time.time() + 5
        while store.stats()["objects"] and time.time() < deadline:
            time.sleep(0.02)
        left = store.stats()["objects"]
        print(f"{args.requests} requests through encode -> denoise -> decode in {took:.2f} s; "
              f"every byte checked; store objects left: {left}")
        return 0 if left == 0 else 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
