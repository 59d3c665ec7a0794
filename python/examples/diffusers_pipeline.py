"""A real diffusers pipeline split into encode, denoise and decode processes through tensorwire.

    python examples/diffusers_pipeline.py --model image --check
    python examples/diffusers_pipeline.py --model video --mode store --check

The parent runs the orchestrator (and, in store mode, a store node) and starts one worker process
per stage. Each worker builds the same pipeline (``--weights DIR`` for real weights, else the
tiny seeded one of ``tensorwire.pipelines``) and runs its stage on the orchestrator's assignments:
encode publishes every tensor the transformer takes; denoise consumes them into tensors it
allocated, runs the scheduler loop and publishes the final latent (the video latent in temporal
chunks, one per latent frame); decode consumes it (the video VAE decodes each temporal chunk as it
lands) and saves the result. Prints per-stage compute time, handoff time per payload and the time
to the first frame; ``--check`` also runs the monolithic pipeline here and prints one JSON line,
``{"identical": true|false, ...}`` (exit status 1 when not identical).

``--device cuda`` runs the models on the GPU and the stage tensors stay there: each stage
publishes its CUDA tensors and the next consumes them into CUDA tensors it allocated (the cuda
backend between the processes, CUDA IPC, where a tensor is a whole allocation: run with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` for that; else tcp through pinned staging). ``--check``'s JSON
says how often a stage tensor went through host memory (``host_staged``, the workers' engines'
counter: 0 when none did) and which backends moved the bytes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen, steam rising", "city lights in rain"]


def prompt(request: int) -> str:
    return PROMPTS[request % len(PROMPTS)]


def build(args: argparse.Namespace):
    import torch

    torch.set_num_threads(args.threads)
    from tensorwire.pipelines import image, video

    m = image if args.model == "image" else video
    pipe = m.load(args.weights, device=args.device) if args.weights else m.tiny(seed=0, device=args.device)
    return m, pipe


def sizes(args: argparse.Namespace) -> dict:
    if args.model == "image":
        return {"steps": args.steps or 8, "height": args.size or 256, "width": args.size or 256}
    return {"steps": args.steps or 4, "frames": args.frames, "height": args.size or 64, "width": args.size or 64}


def worker(args: argparse.Namespace) -> None:
    import torch

    from tensorwire.diffusion import DiffusionConnector
    from tensorwire.orchestrator import serve_stage
    from tensorwire.pipelines import handoff

    m, pipe = build(args)
    store = {"address": args.node_rpc, "node_engine": args.node_engine} if args.mode == "store" else None
    conn = DiffusionConnector(role=args.stage, transfer_mode=args.mode, store_config=store)
    kept = []  # p2p: a stage's tensors serve its consumer from here until consumed
    log = open(os.path.join(args.out, f"timing-{args.stage}.jsonl"), "a", buffering=1)
    knobs = sizes(args)

    def send(request: int, kind: str, tensors: dict, chunked=None) -> bytes:
        p = handoff.publish(conn, request, kind, {k: v.contiguous() for k, v in tensors.items()},
                            chunked=chunked, consumer_credit=1 if args.mode == "p2p" else None)
        for name, (_, count) in (chunked or {}).items():
            for i in range(count):
                p.mark_ready(name, i)
        p.wait_stored()
        handoff.keep_last(kept, p)
        return p.message

    def receive(a) -> tuple:
        t0 = time.perf_counter()
        got = handoff.consume(conn, a.inputs, hold=True, device=args.device)
        return got, time.perf_counter() - t0

    def record(request: int, **fields) -> None:
        stats = conn.engine.stats()
        fields.update(host_staged=stats["host_staged"], by_backend=stats["by_backend"])
        log.write(json.dumps({"request": request, **fields}) + "\n")

    def encode(a) -> bytes:
        t0 = time.perf_counter()
        cond = m.encode(pipe, prompt(a.request))
        record(a.request, compute=time.perf_counter() - t0)
        return send(a.request, "condition_embedding", cond)

    def denoise(a) -> bytes:
        cond, took = receive(a)
        t0 = time.perf_counter()
        latent = m.denoise(pipe, cond, seed=a.request, **knobs)
        record(a.request, compute=time.perf_counter() - t0, handoff=took,
               handoff_bytes=sum(v.numel() * v.element_size() for v in cond.values()))
        chunked = {"latent": (2, latent.shape[2])} if args.model == "video" else None
        return send(a.request, "latent", {"latent": latent}, chunked)

    def decode(a) -> bytes:
        t0 = time.perf_counter()
        (h,) = handoff.handles(a.inputs).values()
        dst = handoff.destination(h, device=args.device)
        first = None
        if args.model == "video":
            d = m.ChunkedDecode(pipe)
            for start, chunk in handoff.stream(conn, h, dst, hold=True):  # in any order
                if d.feed(chunk, start) and first is None:
                    first = time.time()  # frame 0 decoded
            out = d.finish()
        else:
            for _ in handoff.stream(conn, h, dst, hold=True):
                pass
            out = m.decode(pipe, dst)
            first = time.time()
        total = time.perf_counter() - t0
        torch.save(out.cpu(), os.path.join(args.out, f"out-{a.request}.pt"))
        record(a.request, compute=total, first_frame_at=first, handoff_bytes=h.nbytes)
        return b""

    handler = {"encode": encode, "denoise": denoise, "decode": decode}[args.stage]
    open(os.path.join(args.out, f"ready-{args.stage}"), "w").close()
    serve_stage(args.orch, args.stage, handler, release=lambda msg: handoff.release(conn, msg))


def wait_ready(out: str, procs: list, timeout: float) -> None:
    """Returns once every worker has built its pipeline (so the timings leave start-up out)."""
    deadline = time.time() + timeout
    while not all(os.path.exists(os.path.join(out, f"ready-{s}")) for s in ("encode", "denoise", "decode")):
        if any(proc.poll() is not None for proc in procs):
            raise RuntimeError("a stage worker exited before it was ready")
        if time.time() > deadline:
            raise TimeoutError(f"stage workers not ready after {timeout} s")
        time.sleep(0.05)


def read_timings(out: str, stage: str) -> dict:
    rows = {}
    path = os.path.join(out, f"timing-{stage}.jsonl")
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            rows[r["request"]] = r
    return rows


def ms(xs) -> str:
    return f"{statistics.median(xs) * 1e3:.1f}" if xs else "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["image", "video"], default="image")
    p.add_argument("--mode", choices=["p2p", "store"], default="p2p", help="how stage tensors travel")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--weights", help="a local diffusers weights directory (default: the tiny seeded model)")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--steps", type=int, help="denoising steps (image 8, video 4)")
    p.add_argument("--size", type=int, help="height and width in pixels (image 256, video 64)")
    p.add_argument("--frames", type=int, default=9, help="video frames (4k + 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (same in every process)")
    p.add_argument("--check", action="store_true", help="compare with the monolithic pipeline run here")
    p.add_argument("--timeout", type=float, default=150.0)
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--orch", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--node-engine", help=argparse.SUPPRESS)
    p.add_argument("--node-rpc", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.stage:
        worker(args)
        return 0

    import tensorwire as tw
    from tensorwire.orchestrator import Service, Submitter

    service = Service()
    node = store = None
    extra = []
    if args.mode == "store":
        node_engine = tw.Engine()
        store = tw.Store.embedded(node_engine, 512 << 20, shared=True)
        node = tw.StoreNode(store)
        extra = ["--node-engine", node_engine.address, "--node-rpc", node.address]
    out = tempfile.mkdtemp(prefix="tw-diffusers-")
    passed = [a for a in sys.argv[1:] if a != "--check"]
    procs = [subprocess.Popen([sys.executable, __file__, *passed, "--stage", s, "--orch", service.address,
                               "--out", out, *extra]) for s in ("encode", "denoise", "decode")]
    try:
        wait_ready(out, procs, args.timeout)
        submitter = Submitter(service.address)
        start = time.time()
        submitted = {}
        for r in range(1, args.requests + 1):  # one at a time: each request's own latency
            submitted[r] = time.time()
            submitter.submit(r, "interactive").wait(timeout=args.timeout)
        took = time.time() - start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

    enc, den, dec = (read_timings(out, s) for s in ("encode", "denoise", "decode"))
    ttff = [dec[r]["first_frame_at"] - submitted[r] for r in submitted if r in dec]
    what = "image" if args.model == "image" else f"{args.frames}-frame video"
    print(f"{args.requests} requests ({what}, {args.mode}, {args.device}) through encode -> denoise -> decode "
          f"in {took:.2f} s")
    print("| stage | compute ms (median) | handoff in, ms (median) | bytes in |")
    print("|---|---|---|---|")
    print(f"| encode | {ms([v['compute'] for v in enc.values()])} | - | - |")
    print(f"| denoise | {ms([v['compute'] for v in den.values()])} | {ms([v['handoff'] for v in den.values()])} | "
          f"{next(iter(den.values()))['handoff_bytes'] if den else '-'} |")
    print(f"| decode (with its handoff) | {ms([v['compute'] for v in dec.values()])} | streamed | "
          f"{next(iter(dec.values()))['handoff_bytes'] if dec else '-'} |")
    print(f"time to first frame (submit -> first decoded frame), median: {ms(ttff)} ms")
    if not args.check:
        return 0

    import torch

    m, pipe = build(args)
    knobs = sizes(args)
    same, worst = True, 0.0
    for r in submitted:
        got = torch.load(os.path.join(out, f"out-{r}.pt"))
        ref = m.generate(pipe, prompt(r), seed=r, **knobs).cpu()
        same = same and torch.equal(got, ref)
        worst = max(worst, float((got - ref).abs().max()))
    # Each stage's engine's counters after its last request (cumulative).
    last = [t[max(t)] for t in (enc, den, dec) if t]
    staged = sum(t.get("host_staged", 0) for t in last)
    moved = {}
    for t in last:
        for b, n in t.get("by_backend", {}).items():
            moved[b] = moved.get(b, 0) + n
    print(json.dumps({"identical": same, "model": args.model, "mode": args.mode, "device": args.device,
                      "requests": len(submitted), "max_abs_diff": worst, "host_staged": staged,
                      "moved_by_backend": moved}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
