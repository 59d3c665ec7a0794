"""The orchestrator from Python: ``Service`` (serve the scheduler), ``Worker`` (join a stage pool),
``Submitter`` (submit requests, wait for outcomes), plus ``serve_stage``, the usual worker loop.

.. code-block:: python

    from tensorwire.orchestrator import Service, Submitter, serve_stage

    service = Service("127.0.0.1:0")
    # in each worker process:
    serve_stage(service.address, "decode", lambda a: decode(a.inputs))   # returns outputs bytes
    # in the frontend:
    Submitter(service.address).submit(17, "interactive").wait(timeout=60)
"""

import asyncio
import logging
import threading
from typing import Callable, List, Optional

from ._native import Assignment, Outcome, Service, Submitter, Worker
from .errors import LeaseEndedError, PayloadMissingError, ProducerGoneError, StoppedError

__all__ = ["Assignment", "Outcome", "Service", "Submitter", "Worker", "serve_stage", "wait_async"]

log = logging.getLogger("tensorwire.orchestrator")


def serve_stage(address: str, stage: str, handler: Callable[[Assignment], Optional[bytes]], *, slots: int = 1,
                secret_file: Optional[str] = None, stop: Optional[threading.Event] = None,
                poll: float = 0.5, release: Optional[Callable[[bytes], None]] = None,
                metrics_listen: Optional[str] = None) -> int:
    """Joins the ``stage`` pool and runs ``handler`` for each assignment until ``stop`` is set or
    the orchestrator goes away; returns the number of items handled. ``handler`` returns the
    outputs for the next stage (bytes, e.g. payload handles) or raises to have the item
    re-queued (the exception's text is the reason). A handler that raises ``ProducerGoneError``,
    ``PayloadMissingError`` or ``LeaseEndedError`` (its input is gone for good) has the stage
    before run again instead.

    Inputs outlive failures when handlers consume with ``hold=True`` and the loop is given
    ``release`` (called with each stage output, as reported, that nothing needs any more): once
    a request ends, completed or failed, the orchestrator hands its outputs to a worker to
    release, and to another should that one leave before it said it did.

    With ``metrics_listen`` the worker serves this process's metrics there (see ``Worker``)."""
    w = Worker(address, stage, slots=slots, secret_file=secret_file, metrics_listen=metrics_listen)
    done = 0
    while stop is None or not stop.is_set():
        try:
            a = w.next(timeout=poll)
        except StoppedError:
            break
        if a is None:
            continue
        if a.release_only:
            _release(release, a.held, a.request)
            w.released(a)
            continue
        try:
            outputs = handler(a)
        except (ProducerGoneError, PayloadMissingError, LeaseEndedError) as e:
            log.warning("%s of request %d lost its input: %s", stage, a.request, e)
            w.report(a, error=f"{type(e).__name__}: {e}", input_lost=True)
            continue
        except Exception as e:  # the item goes back to the queue with the reason
            log.warning("%s of request %d failed: %s", stage, a.request, e)
            w.report(a, error=f"{type(e).__name__}: {e}")
            continue
        w.report(a, outputs or b"")
        done += 1
    return done


def _release(release: Optional[Callable[[bytes], None]], outputs: List[bytes], request: int) -> None:
    if release is None:
        return
    for o in outputs:
        if not o:
            continue
        try:
            release(o)
        except Exception as e:  # a release that fails leaves a payload to its lease; log it
            log.warning("releasing a payload of request %d failed: %s", request, e)


async def wait_async(outcome: Outcome, timeout: float = 60.0) -> None:
    """``outcome.wait`` for asyncio (the wait runs in a worker thread)."""
    await asyncio.to_thread(outcome.wait, timeout=timeout)
