"""Mooncake's Python APIs with their contracts kept, so a port is an import change:
:class:`TransferEngine` (``mooncake.engine``; see :mod:`tensorwire.mooncake.engine`) and
:class:`MooncakeDistributedStore` with :class:`ReplicateConfig` (``mooncake.store``; see
:mod:`tensorwire.mooncake.store`). Both return Mooncake's codes and never raise for a failed
transfer or a missing key."""

from .engine import PROTOCOLS, TransferEngine, TransferNotify, TransferOpcode
from .store import ErrorCode, MooncakeDistributedStore, ReplicateConfig, SoftPinAction

#: Mooncake's build flags (``mooncake.engine.SUPPORT_*``): none of these transports here.
SUPPORT_CUDA = SUPPORT_EFA = SUPPORT_HIP = SUPPORT_MNNVL = SUPPORT_MUSA = SUPPORT_INTRA_NVLINK = False

__all__ = ["ErrorCode", "MooncakeDistributedStore", "PROTOCOLS", "ReplicateConfig", "SoftPinAction",
           "TransferEngine", "TransferNotify", "TransferOpcode"]
