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
from typing import Callable, Optional

from ._native import Assignment, Outcome, Service, Submitter, Worker
from .errors import StoppedError

__all__ = ["Assignment", "Outcome", "Service", "Submitter", "Worker", "serve_stage", "wait_async"]

log = logging.getLogger("tensorwire.orchestrator")


def serve_stage(address: str, stage: str, handler: Callable[[Assignment], Optional[bytes]], *, slots: int = 1,
                secret_file: Optional[str] = None, stop: Optional[threading.Event] = None,
                poll: float = 0.5) -> int:
    """Joins the ``stage`` pool and runs ``handler`` for each assignment until ``stop`` is set or
    the orchestrator goes away; returns the number of items handled. ``handler`` returns the
    outputs for the next stage (bytes, e.g. payload handles) or raises to have the item
    re-queued (the exception's text is the reason)."""
    w = Worker(address, stage, slots=slots, secret_file=secret_file)
    done = 0
    while stop is None or not stop.is_set():
        try:
            a = w.next(timeout=poll)
        except StoppedError:
            break
        if a is None:
            continue
        try:
            outputs = handler(a)
        except Exception as e:  # the item goes back to the queue with the reason
            log.warning("%s of request %d failed: %s", stage, a.request, e)
            w.report(a, error=f"{type(e).__name__}: {e}")
            continue
        w.report(a, outputs or b"")
        done += 1
    return done


async def wait_async(outcome: Outcome, timeout: float = 60.0) -> None:
    """``outcome.wait`` for asyncio (the wait runs in a worker thread)."""
    await asyncio.to_thread(outcome.wait, timeout=timeout)
