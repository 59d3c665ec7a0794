"""Shared fixtures: engines and connectors on loopback."""

import pytest

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector


@pytest.fixture
def engines():
    a, b = tw.Engine(), tw.Engine()
    yield a, b
    a.shutdown()
    b.shutdown()


@pytest.fixture
def store_node():
    """An engine with a shared embedded store served by a store node: (engine, store, node)."""
    e = tw.Engine()
    s = tw.Store.embedded(e, 64 << 20, shared=True)
    node = tw.StoreNode(s)
    yield e, s, node
    e.shutdown()


@pytest.fixture
def pipeline(store_node):
    """A producer and a consumer connector sharing a store node (mode chosen per publish)."""
    node_engine, _, node = store_node
    cfg = {"node_engine": node_engine.address, "node_rpc": node.address}
    prod = DiffusionConnector(role="denoise", transfer_mode="auto", store_config=cfg, checksum=True)
    cons = DiffusionConnector(role="decode", transfer_mode="auto", store_config=cfg, checksum=True)
    yield prod, cons
    prod.close()
    cons.close()
