"""Python publish+consume of CUDA tensors between two processes, against torch's own
device-to-device copy in the same run, interleaved.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 python bench/device_handoff.py [--sizes 4M,64M,256M,1G] [--runs 5]

This process is the producer: it publishes a CUDA tensor (p2p, `consumer_credit=1`) and sends
the handle to a child process. The child is the consumer, with its own engine. It consumes the
payload into a CUDA tensor it allocated once per size and answers when the chunk has landed. A
sample is `--batch` such handoffs back to back (handles sent in one line, one answer). The
baseline sample is `dst.copy_(src)` and `torch.cuda.synchronize()` here, on the same GPU, the same
number of times. Prints one JSON line per size: GB/s of each (medians), the ratio, which backends
moved the bytes, and the child's `host_staged` count. That count is 0 when no byte went through
host memory, which needs whole CUDA allocations: run with PYTORCH_NO_CUDA_MEMORY_CACHING=1, or the
bytes go through tcp and pinned staging, and the JSON says so. The last chunk's bytes are checked
against the source (a sum on the GPU).

Needs a GPU, torch with CUDA and this package built (scripts/gpu-check runs it).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


def size_of(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s)


def child() -> None:
    """The consumer: reads `<nbytes> <hex handle> ...` lines, consumes each, answers
    `<checksum> <host_staged> <by_backend json>` once all of the line's handles have landed."""
    import torch

    from tensorwire.diffusion import DiffusionConnector

    cons = DiffusionConnector(role="decode", transfer_mode="p2p")
    dst = {}
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            break
        n, handles = int(words[0]), words[1:]
        if n not in dst:
            dst[n] = torch.empty(n // 4, dtype=torch.float32, device="cuda:0")
        for h in handles:
            for _ in cons.consume(bytes.fromhex(h), dst[n], timeout=60):
                pass
        total = float(dst[n].double().sum())
        stats = cons.engine.stats()
        print(f"{total} {stats['host_staged']} {json.dumps(stats['by_backend'])}", flush=True)
    cons.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4M,64M,256M,1G")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="handoffs per sample")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child()

    import torch

    from tensorwire.diffusion import DiffusionConnector, StagePayload

    if not torch.cuda.is_available():
        raise SystemExit("device_handoff: no CUDA device (this bench needs a GPU)")
    proc = subprocess.Popen([sys.executable, __file__, "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready", "the consumer process did not start"
    prod = DiffusionConnector(role="denoise", transfer_mode="p2p")
    try:
        for s in args.sizes.split(","):
            n = size_of(s)
            src = (torch.arange(n // 4, device="cuda:0", dtype=torch.float32) % 251)
            want = float(src.double().sum())
            copy_dst = torch.empty_like(src)
            torch.cuda.synchronize()

            def handoff() -> float:
                start = time.perf_counter()
                hs = [prod.publish(StagePayload(1, "latent", src), consumer_credit=1) for _ in range(args.batch)]
                proc.stdin.write(f"{n} " + " ".join(h.to_bytes().hex() for h in hs) + "\n")
                proc.stdin.flush()
                total, staged, moved = proc.stdout.readline().split(" ", 2)
                took = time.perf_counter() - start
                assert float(total) == want, f"the consumer's bytes differ (sum {total}, want {want})"
                handoff.staged, handoff.moved = int(staged), json.loads(moved)
                return n * args.batch / took / 1e9

            def d2d() -> float:
                start = time.perf_counter()
                for _ in range(args.batch):
                    copy_dst.copy_(src)
                torch.cuda.synchronize()
                return n * args.batch / (time.perf_counter() - start) / 1e9

            handoff(), d2d()  # warm: first openings, first kernels
            hs, ds = [], []
            for _ in range(args.runs):
                hs.append(handoff())
                ds.append(d2d())
            hm, dm = statistics.median(hs), statistics.median(ds)
            print(json.dumps({"size": n, "handoff_gbps": round(hm, 2), "torch_d2d_gbps": round(dm, 2),
                              "ratio": round(hm / dm, 3), "consumer_host_staged_total": handoff.staged,
                              "consumer_moved_by_backend": handoff.moved,
                              "handoff_samples": [round(x, 2) for x in hs], "d2d_samples": [round(x, 2) for x in ds]}),
                  flush=True)
    finally:
        prod.close()
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
