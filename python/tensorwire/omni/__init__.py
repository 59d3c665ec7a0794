"""vLLM-Omni's connector contract over tensorwire: :class:`TensorwireConnector` (see
:mod:`tensorwire.omni.connector` for the contract it keeps), the packing of nested data with
tensors (:mod:`tensorwire.omni.packing`), and where payloads are found
(:mod:`tensorwire.omni.host_records`, :mod:`tensorwire.omni.store_records`)."""

from .connector import TensorwireConnector

__all__ = ["TensorwireConnector"]
