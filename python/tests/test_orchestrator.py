"""The orchestrator from Python: a service, a worker per stage (threads here), a submitter; a
failing attempt is re-queued; requests that keep failing end with RequestFailedError."""

import threading
import time

import pytest

import tensorwire as tw
from tensorwire.orchestrator import Service, Submitter, serve_stage


def test_requests_flow_through_three_stages():
    service = Service()
    stop = threading.Event()
    seen = {"encode": [], "denoise": [], "decode": []}
    failed_once = set()

    def handler(stage):
        def run(a):
            seen[stage].append((a.request, a.attempt, a.inputs))
            if stage == "denoise" and a.request == 2 and a.request not in failed_once:
                failed_once.add(a.request)
                raise RuntimeError("transient")
            return f"{stage}:{a.request}".encode()
        return run

    threads = [threading.Thread(target=serve_stage, args=(service.address, s, handler(s)),
                                kwargs={"stop": stop, "poll": 0.1}, daemon=True) for s in seen]
    for t in threads:
        t.start()
    sub = Submitter(service.address)
    outcomes = [sub.submit(r, "interactive" if r % 2 else "batch") for r in range(1, 5)]
    for o in outcomes:
        o.wait(timeout=30)
    stop.set()
    assert sorted(r for r, _, _ in seen["decode"]) == [1, 2, 3, 4]
    assert (2, 2, b"encode:2") in seen["denoise"]  # the re-queued attempt, with its inputs
    assert all(inputs == f"denoise:{r}".encode() for r, _, inputs in seen["decode"])


def test_a_request_that_keeps_failing_is_reported():
    service = Service(max_attempts=2)
    stop = threading.Event()

    def fail(a):
        raise RuntimeError("always")

    t = threading.Thread(target=serve_stage, args=(service.address, "encode", fail),
                         kwargs={"stop": stop, "poll": 0.1}, daemon=True)
    t.start()
    out = Submitter(service.address).submit(9)
    with pytest.raises(tw.RequestFailedError, match="always"):
        out.wait(timeout=30)
    stop.set()


def test_bad_arguments():
    service = Service()
    with pytest.raises(tw.InvalidArgumentError):
        tw.Worker(service.address, "upscale")
    with pytest.raises(tw.InvalidArgumentError):
        Submitter(service.address).submit(1, "urgent")


def test_a_lost_input_reruns_the_stage_before_and_every_output_is_released():
    service = Service()
    stop = threading.Event()
    seen = {"encode": [], "denoise": [], "decode": []}
    released = []

    def handler(stage):
        def run(a):
            seen[stage].append((a.request, a.inputs))
            if stage == "decode" and len(seen["decode"]) == 1:
                raise tw.ProducerGoneError("the denoise worker died")  # its latent went with it
            return f"{stage}:{a.request}:{len(seen[stage])}".encode()
        return run

    threads = [threading.Thread(target=serve_stage, args=(service.address, s, handler(s)),
                                kwargs={"stop": stop, "poll": 0.1, "release": released.append},
                                daemon=True) for s in seen]
    for t in threads:
        t.start()
    Submitter(service.address).submit(5).wait(timeout=30)
    assert [r for r, _ in seen["encode"]] == [5], "encode ran once"
    assert [i for _, i in seen["denoise"]] == [b"encode:5:1", b"encode:5:1"], "denoise ran again"
    assert seen["decode"][-1][1] == b"denoise:5:2"
    deadline = time.monotonic() + 10
    while len(released) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(timeout=5)
    # Every output of the request: the one a re-run replaced, and decode's own, too.
    assert sorted(released) == [b"decode:5:2", b"denoise:5:1", b"denoise:5:2", b"encode:5:1"]


def test_announced_outputs_are_released_when_the_request_ends():
    # An encode worker announces its store key before the put, then fails: the announced
    # output still comes back for release once the request has failed.
    service = Service(max_attempts=1)
    w = tw.Worker(service.address, "encode")
    out = Submitter(service.address).submit(3)
    a = w.next(timeout=10)
    w.announce(a, b"put:3")
    w.report(a, error="died after its put")
    with pytest.raises(tw.RequestFailedError):
        out.wait(timeout=10)
    r = w.next(timeout=10)
    assert r.release_only and r.held == [b"put:3"]
    w.released(r)


def test_a_service_restarted_on_its_journal_resumes_the_requests_it_had(tmp_path):
    journal = str(tmp_path / "orchestrator.journal")
    service = Service(journal=journal)
    address = service.address
    out = Submitter(address).submit(5)  # no worker yet: it waits at encode, in the journal
    time.sleep(0.3)
    del service  # stopped; what it had is in the journal
    deadline = time.monotonic() + 10
    while True:  # the old listener closes as its tasks stop
        try:
            service = Service(address, journal=journal)
            break
        except tw.TensorwireError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    stop = threading.Event()
    threads = [threading.Thread(target=serve_stage, args=(address, s, lambda a: b"x"),
                                kwargs={"stop": stop, "poll": 0.1}, daemon=True)
               for s in ("encode", "denoise", "decode")]
    for t in threads:
        t.start()
    out.wait(timeout=30)  # the submitter reconnected and asked again: it completes
    stop.set()


def test_a_request_can_start_past_the_encoder_with_given_inputs():
    service = Service()
    stop = threading.Event()
    seen = {"encode": [], "denoise": [], "decode": []}

    def handler(stage):
        def run(a):
            seen[stage].append((a.request, a.inputs))
            return f"{stage}:{a.request}".encode()
        return run

    threads = [threading.Thread(target=serve_stage, args=(service.address, s, handler(s)),
                                kwargs={"stop": stop, "poll": 0.1}, daemon=True) for s in seen]
    for t in threads:
        t.start()
    out = Submitter(service.address).submit(4, start="denoise", inputs=b"cached embedding ref")
    out.wait(timeout=30)
    stop.set()
    assert seen["encode"] == []  # skipped: its output was given
    assert seen["denoise"] == [(4, b"cached embedding ref")]
    assert seen["decode"] == [(4, b"denoise:4")]


def _encode_and_decode(service):
    """Encode and decode workers that answer every item with b"x"; set the event to stop them."""
    stop = threading.Event()
    for s in ("encode", "decode"):
        threading.Thread(target=serve_stage, args=(service.address, s, lambda a: b"x"),
                         kwargs={"stop": stop, "poll": 0.1}, daemon=True).start()
    return stop


def _until_asked(worker, a):
    """Waits (as a denoise loop would at its step boundaries) until `a` is asked back."""
    deadline = time.time() + 10
    while not worker.yield_requested(a):
        assert time.time() < deadline, "never asked to yield"
        time.sleep(0.02)


def test_a_job_resumes_from_its_checkpoint_after_its_worker_dies():
    from tensorwire._native import Worker

    service = Service(max_attempts=3)
    stop = _encode_and_decode(service)
    out = Submitter(service.address).submit(11)
    first = Worker(service.address, "denoise", heartbeat=0.1)
    a = first.next(timeout=10)
    assert a.stage == "denoise" and a.resume is None
    first.checkpoint(a, 6, b"latents at step 6")
    time.sleep(0.5)  # the checkpoint goes out in the background: let it reach the service
    del first  # dies mid-job: its connection closes and the item is re-queued
    second = Worker(service.address, "denoise", heartbeat=0.1)
    while True:
        b = second.next(timeout=10)
        if not b.release_only:
            break
    assert (b.request, b.attempt, b.resume) == (11, 2, (6, b"latents at step 6"))
    second.report(b, b"latent")
    out.wait(timeout=30)
    stop.set()


def _next_job(w):
    while True:
        a = w.next(timeout=10)
        assert a is not None, "no assignment"
        if not a.release_only:
            return a
        w.released(a)


def test_an_interactive_request_preempts_a_batch_job_which_resumes_elsewhere():
    from tensorwire._native import Worker

    service = Service()
    stop = _encode_and_decode(service)
    sub = Submitter(service.address)
    batch = sub.submit(1, "batch")
    a_worker = Worker(service.address, "denoise", heartbeat=0.1)
    a = _next_job(a_worker)
    assert a.request == 1 and a.priority == "batch" and not a_worker.yield_requested(a)
    urgent = sub.submit(2, "interactive")
    _until_asked(a_worker, a)
    a_worker.yield_job(a, 7, b"latents at step 7")
    b = _next_job(a_worker)
    assert (b.request, b.priority, b.resume) == (2, "interactive", None)  # it took the slot
    other = Worker(service.address, "denoise", heartbeat=0.1)
    c = _next_job(other)
    assert (c.request, c.attempt, c.resume) == (1, 1, (7, b"latents at step 7"))
    a_worker.report(b, b"latent 2")
    other.report(c, b"latent 1")
    urgent.wait(timeout=30)
    batch.wait(timeout=30)
    stop.set()


def test_a_drained_worker_gives_its_job_back_and_an_edit_resumes_a_checkpoint():
    from tensorwire._native import Worker

    service = Service()
    stop = _encode_and_decode(service)
    sub = Submitter(service.address)
    out = sub.submit(5, "batch")
    leaving = Worker(service.address, "denoise", heartbeat=0.1)
    a = _next_job(leaving)
    drained = threading.Thread(target=leaving.drain, kwargs={"timeout": 20})
    drained.start()
    _until_asked(leaving, a)
    leaving.yield_job(a, 3, b"latents at step 3")
    drained.join(timeout=20)
    assert not drained.is_alive()
    staying = Worker(service.address, "denoise", heartbeat=0.1)
    b = _next_job(staying)
    assert (b.request, b.resume) == (5, (3, b"latents at step 3"))
    staying.report(b, b"latent")
    out.wait(timeout=30)
    # Edit and resume: a new request starts denoise from that checkpoint.
    edit = sub.submit(6, start="denoise", inputs=b"embedding", resume=(3, b"latents at step 3"))
    c = _next_job(staying)
    assert (c.request, c.inputs, c.resume) == (6, b"embedding", (3, b"latents at step 3"))
    staying.report(c, b"edited latent")
    edit.wait(timeout=30)
    stop.set()


def _get(addr, path):
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _completed(text):
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tensorwire_requests_total{") and 'outcome="completed"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_endpoints_and_the_timeline_of_a_request():
    service = Service(metrics_listen="127.0.0.1:0")
    addr = service.metrics_address
    assert addr and _get(addr, "/healthz") == (200, "ok\n")
    before = _completed(_get(addr, "/metrics")[1])
    stop = threading.Event()
    threads = [threading.Thread(target=serve_stage, args=(service.address, s, lambda a: b"x"),
                                kwargs={"stop": stop, "poll": 0.1, "metrics_listen": "127.0.0.1:0"},
                                daemon=True) for s in ("encode", "denoise", "decode")]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while _get(addr, "/sd")[1].count('"targets"') < 3:  # every worker said where its endpoint is
        assert time.time() < deadline, _get(addr, "/sd")
        time.sleep(0.1)
    sub = Submitter(service.address)
    for o in [sub.submit(r, "batch") for r in range(1, 4)]:
        o.wait(timeout=30)
    assert _completed(_get(addr, "/metrics")[1]) == before + 3  # counted before the outcome went
    status, text = _get(addr, "/metrics")
    assert status == 200 and "# TYPE tensorwire_ttff_seconds histogram" in text
    assert _get(addr, "/readyz")[0] == 200
    t = sub.timeline(2)
    assert t["request"] == 2 and t["priority"] == "batch"
    marks = [(e["stage"], e["mark"]) for e in t["events"]]
    assert marks[0] == (None, "submitted") and marks[-1] == (None, "completed")
    for stage in ("encode", "denoise", "decode"):
        assert (stage, "dispatched") in marks and (stage, "done") in marks
    assert all(a["at"] <= b["at"] for a, b in zip(t["events"], t["events"][1:]))
    assert sub.timeline(12345) is None
    stop.set()


def test_a_worker_reports_how_its_inputs_arrived():
    from tensorwire.orchestrator import Worker
    service = Service()
    w = Worker(service.address, "encode")
    sub = Submitter(service.address)
    sub.submit(5, "interactive")
    a = w.next(timeout=30)
    w.handoff(a, 1000, 0.0025)
    deadline = time.time() + 30
    while True:  # the handoff and the question go on two connections: wait for it to land
        events = sub.timeline(5)["events"]
        handoffs = [e for e in events if e["mark"] == "handoff"]
        if handoffs or time.time() > deadline:
            break
        time.sleep(0.05)
    assert handoffs == [{"at": handoffs[0]["at"], "stage": "encode", "mark": "handoff",
                         "worker": None, "bytes": 1000, "seconds": 0.0025}]
    w.report(a, b"")


def test_an_elastic_service_moves_a_worker_that_can_serve_another_stage():
    """Decode (one slot, 0.3 s an item) holds three denoise workers (0.2 s a job) back; the
    service tells "a", the denoiser that can also decode, to switch; it drains, joins the
    decode pool saying how long the switch took, and every request completes once."""
    from tensorwire._native import Worker

    service = Service(elastic={"interval": 0.1, "dwell": 0, "horizon": 30})
    stop = threading.Event()

    def slow(seconds, out):
        def run(a):
            time.sleep(seconds)
            return out
        return run

    for stage, handler in (("encode", slow(0, b"e")), ("decode", slow(0.3, b"v"))):
        threading.Thread(target=serve_stage, args=(service.address, stage, handler),
                         kwargs={"stop": stop, "poll": 0.05}, daemon=True).start()
    for _ in range(2):
        threading.Thread(target=serve_stage, args=(service.address, "denoise", slow(0.2, b"d")),
                         kwargs={"stop": stop, "poll": 0.05}, daemon=True).start()
    a = Worker(service.address, "denoise", heartbeat=0.1, can={"decode": 0.05})
    assert a.switch_requested is None
    sub = Submitter(service.address)
    outcomes = [sub.submit(r, "batch") for r in range(1, 13)]
    deadline = time.time() + 30

    def jobs(w, until):
        """The worker's jobs until `until()`, releasing what ended requests held."""
        while not until():
            job = w.next(timeout=0.05)
            if job is not None and job.release_only:
                w.released(job)
            elif job is not None:
                yield job

    def switched():
        assert time.time() < deadline, "no switch order"
        return a.switch_requested is not None

    for job in jobs(a, switched):
        for step in range(8):
            if step > 0 and a.yield_requested(job):
                a.yield_job(job, step, b"latents at step %d" % step)
                break
            time.sleep(0.025)
        else:
            a.report(job, b"d")
    assert a.switch_requested == "decode" == a.wait_switch(timeout=1)
    a.drain(timeout=20)
    del a
    time.sleep(0.05)
    decoded = []

    def decode_as_a():
        w = Worker(service.address, "decode", heartbeat=0.1, switched=0.05, can={"denoise": 0.05})
        for job in jobs(w, stop.is_set):
            time.sleep(0.3)
            decoded.append(job.request)
            w.report(job, b"v")

    threading.Thread(target=decode_as_a, daemon=True).start()
    for o in outcomes:
        o.wait(timeout=60)
    stop.set()
    assert decoded, "the switched worker decoded"
    with pytest.raises(tw.InvalidArgumentError, match="unknown setting"):
        Service(elastic={"period": 1})
    with pytest.raises(tw.InvalidArgumentError, match="expected encode, denoise or decode"):
        Worker(service.address, "denoise", can={"vae": 1.0})
