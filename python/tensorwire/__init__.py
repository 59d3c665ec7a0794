"""tensorwire: tensor transport and orchestration for disaggregated diffusion serving.

- ``tensorwire.diffusion``: the RFC's ``DiffusionConnector`` / ``StagePayload`` API.
- ``tensorwire.mooncake``: ``TransferEngine`` and ``MooncakeDistributedStore`` keeping Mooncake's
  contracts (return codes, never raising for a failed transfer or a missing key; also importable
  from here).
- ``tensorwire.omni``: ``TensorwireConnector``, keeping vLLM-Omni's ``OmniConnectorBase`` contract.
- ``tensorwire.orchestrator``: the orchestrator service, stage workers, submitters.
- The native classes (``Engine``, ``Region``, ``Session``, ``Store``, ``StoreNode``,
  ``Connector``, ...) and every exception class (``tensorwire.errors``).

Tensors move zero-copy through DLPack (host memory: numpy, torch CPU tensors, ...; CUDA tensors
where the process has the CUDA driver, and ``tensorwire.testing``'s fake CUDA device in tests). Every call
that waits takes ``timeout`` (seconds) and releases the GIL. From the start of such a call and
after it the runtime's workers stay awake for a moment (1 ms, so neither the call's transfer nor
the next call waits for a parked one): ``set_linger(seconds)`` or ``TENSORWIRE_LINGER_US``
changes that, 0 turns it off.
"""

from . import errors
from ._native import (
    Assignment,
    Connector,
    Consumption,
    Engine,
    Outcome,
    PreparedTransfer,
    Publication,
    Region,
    Service,
    Session,
    Store,
    StoreNode,
    Submitter,
    Worker,
    __version__,
    describe_handle,
    set_linger,
)
from .errors import *  # noqa: F401,F403  (the exception classes)
from .mooncake import MooncakeDistributedStore, ReplicateConfig, TransferEngine, TransferNotify

__all__ = [
    "Assignment",
    "Connector",
    "Consumption",
    "Engine",
    "MooncakeDistributedStore",
    "Outcome",
    "Publication",
    "Region",
    "ReplicateConfig",
    "Service",
    "Session",
    "Store",
    "StoreNode",
    "Submitter",
    "TransferEngine",
    "TransferNotify",
    "Worker",
    "describe_handle",
    "errors",
    "set_linger",
    "__version__",
] + errors.__all__
