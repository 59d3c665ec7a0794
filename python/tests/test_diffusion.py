"""The RFC's DiffusionConnector API: publish / consume in p2p, store and auto modes, chunks that
are views of the destination, and each kind of bad input with its own exception."""

import asyncio
import time

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.diffusion import DiffusionConnector, PayloadHandle, StagePayload


def latent(shape=(16, 4, 12, 10), seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32)


def test_the_rfc_sketch_runs():
    # The RFC sketch of the Python chapter (docs/book/src/python.md), names adapted only in the import.
    producer = DiffusionConnector(role="denoise", transfer_mode="p2p")
    consumer = DiffusionConnector(role="decode", transfer_mode="p2p")
    latents = latent()
    handle = producer.publish(StagePayload(request_id=7, kind="latent", tensor=latents,
                                           chunk_dim=2, num_chunks=4, lease="delete_on_consume"))
    wire = handle.to_bytes()  # what travels in the queue message
    dst = np.empty_like(latents)
    decoded = []
    for i in range(4):
        handle.mark_ready(i)
    for chunk in consumer.consume(wire, dst=dst):
        decoded.append(chunk.sum())  # "vae.decode_chunk(chunk)"
    assert len(decoded) == 4
    assert np.array_equal(dst, latents)
    producer.close()
    consumer.close()


def released(prod, request, x, dim):
    """A p2p payload of `x` in 4 chunks along `dim`, every chunk ready."""
    h = prod.publish(StagePayload(request, "latent", x, chunk_dim=dim, num_chunks=4), consumer_credit=1)
    h.mark_all_ready()
    return h


def test_chunks_are_views_of_dst(pipeline):
    prod, cons = pipeline
    x = latent()
    h = released(prod, 1, x, dim=1)
    dst = np.zeros_like(x)
    seen = []
    for chunk in cons.consume(h, dst):
        assert np.shares_memory(chunk, dst)
        assert chunk.shape[1] == 1
        seen.append(chunk)
    assert len(seen) == 4 and np.array_equal(dst, x)
    assert h.source == "p2p"


def test_store_mode_frees_the_producer(pipeline):
    prod, cons = pipeline
    emb = latent((1, 226, 64))
    h = prod.publish(StagePayload(2, "condition_embedding", emb, lease="delete_on_consume", consumers=2))
    assert h.source == "store"  # no consumer credit: auto goes through the store
    h.wait_stored()
    original = emb.copy()
    emb[:] = 0  # the producer may reuse its buffer once stored
    for _ in range(2):
        dst = np.zeros_like(original)
        list(cons.consume(h.to_str(), dst))
        assert np.array_equal(dst, original)


def test_store_mode_over_several_store_nodes_survives_one(store_node):
    # Three store nodes behind a cluster store: each payload on two; one node's engine stops
    # between publish and consume, and the consumer reads the other copy.
    nodes = [store_node]
    for _ in range(2):
        e = tw.Engine()
        s = tw.Store.embedded(e, 64 << 20, shared=True)
        nodes.append((e, s, tw.StoreNode(s)))
    cfg = {"address": ",".join(n.address for _, _, n in nodes)}
    prod = DiffusionConnector(role="encode", transfer_mode="store", store_config=cfg)
    cons = DiffusionConnector(role="denoise", transfer_mode="store", store_config=cfg)
    assert prod.store.is_cluster
    emb = latent((1, 226, 64))
    h = prod.publish(StagePayload(3, "condition_embedding", emb, lease="delete_on_consume", consumers=1))
    h.wait_stored()
    held = [i for i, (_, s, _) in enumerate(nodes) if s.stats()["objects"] == 1]
    assert len(held) == 2, "two copies"
    nodes[held[0]][0].shutdown()
    dst = np.zeros_like(emb)
    list(cons.consume(h.to_str(), dst))
    assert np.array_equal(dst, emb)
    for e, _, _ in nodes[1:]:
        e.shutdown()  # (again, for the one stopped above: shutting down twice is harmless)


def test_a_handle_travels_as_bytes_or_text(pipeline):
    prod, _ = pipeline
    h = prod.publish(StagePayload(3, "step_latent", latent(), step=12), consumer_credit=1)
    # The producer's own handle reads its fields when asked (decoded on first use).
    assert (h.request_id, h.kind, h.dtype, h.shape) == (3, "step_latent", "float32", (16, 4, 12, 10))
    for form in (h.to_bytes(), h.to_str()):
        back = PayloadHandle.from_bytes(form) if isinstance(form, bytes) else PayloadHandle.from_str(form)
        assert (back.request_id, back.kind, back.dtype, back.shape) == (3, "step_latent", "float32", (16, 4, 12, 10))
    with pytest.raises(tw.InvalidArgumentError):
        back.mark_ready(0)  # only the producer's handle controls the payload


def test_a_wrong_dtype_or_shape_is_a_mismatch(pipeline):
    prod, cons = pipeline
    h = prod.publish(StagePayload(4, "latent", latent()), consumer_credit=1)
    with pytest.raises(tw.MismatchError):
        cons.consume(h, np.zeros((16, 4, 12, 10), dtype=np.float16))
    with pytest.raises(tw.MismatchError):
        cons.consume(h, np.zeros((16, 4, 12, 11), dtype=np.float32))


def test_a_non_contiguous_destination_is_refused(pipeline):
    prod, cons = pipeline
    h = prod.publish(StagePayload(5, "latent", latent()), consumer_credit=1)
    strided = np.zeros((16, 4, 12, 20), dtype=np.float32)[..., ::2]
    with pytest.raises(tw.InvalidTensorError, match="contiguous"):
        cons.consume(h, strided)


def test_a_non_contiguous_tensor_is_not_published(pipeline):
    prod, _ = pipeline
    x = latent((8, 8))[:, ::2]
    with pytest.raises(tw.InvalidTensorError, match=r"contiguous: shape \[8, 4\] has strides \[8, 2\]") as e:
        prod.publish(StagePayload(6, "latent", x), consumer_credit=1)
    assert not isinstance(e.value, tw.MismatchError) and "chunking" not in str(e.value)


def test_retire_says_whether_the_payload_was_still_served(pipeline):
    prod, cons = pipeline
    x = latent((4, 4))
    h = prod.publish(StagePayload(8, "latent", x), consumer_credit=1)
    assert h.retire() is True and h.retire() is False
    h = prod.publish(StagePayload(9, "latent", x), consumer_credit=1)
    list(cons.consume(h, np.empty_like(x)))
    deadline = time.monotonic() + 5
    while prod.held and time.monotonic() < deadline:  # the consumer's report reaches the producer
        time.sleep(0.01)
    assert h.retire() is False


def test_an_unknown_handle_is_invalid(pipeline):
    _, cons = pipeline
    with pytest.raises(tw.InvalidArgumentError):
        cons.consume(b"\x01not a handle", np.zeros(4, dtype=np.float32))
    with pytest.raises(tw.InvalidArgumentError):
        PayloadHandle.from_bytes(b"\x01not a handle")  # checked when it arrives, not when read


def test_a_consumed_payload_says_so(pipeline):
    prod, cons = pipeline
    x = latent((4, 4))
    h = prod.publish(StagePayload(7, "latent", x, consumers=1), consumer_credit=1)
    list(cons.consume(h, np.empty_like(x)))
    with pytest.raises(tw.LeaseConsumedError):
        list(cons.consume(h, np.empty_like(x), timeout=5))


def test_an_expired_lease_says_so(pipeline):
    prod, cons = pipeline
    x = latent((4, 4))
    h = prod.publish(StagePayload(8, "latent", x, lease="ttl", ttl=0.2), consumer_credit=1)
    time.sleep(0.5)
    with pytest.raises((tw.LeaseExpiredError, tw.PayloadMissingError)):
        list(cons.consume(h, np.empty_like(x), timeout=5))


def test_a_dead_producer_is_producer_gone():
    prod = DiffusionConnector(transfer_mode="p2p", wait_timeout=2)
    cons = DiffusionConnector(transfer_mode="p2p", wait_timeout=2)
    x = latent((4, 4))
    h = prod.publish(StagePayload(9, "latent", x, chunk_dim=0, num_chunks=2))
    wire = h.to_bytes()
    prod.close()
    with pytest.raises((tw.ProducerGoneError, tw.PeerClosedError, tw.TimeoutError)):
        list(cons.consume(wire, np.empty_like(x), timeout=5))
    cons.close()


def test_a_wait_that_times_out_leaves_the_consume_going(pipeline):
    # A `next` that gives up leaves the consume going: a later one gets the chunk, then the end.
    # The wait for a small chunk spins (about 100 us) before it parks: a wait far longer costs
    # next to no CPU.
    prod, cons = pipeline
    x = latent((8, 6), seed=4)
    h = prod.publish(StagePayload(12, "latent", x, chunk_dim=0, num_chunks=1), consumer_credit=1)
    dst = np.zeros_like(x)
    c = cons._conn.consume(h.to_bytes(), dst, timeout=5)
    start, cpu = time.monotonic(), time.process_time()  # every thread of this process
    with pytest.raises(tw.TimeoutError):
        c.next(timeout=0.5)  # not marked ready yet
    assert time.monotonic() - start >= 0.5
    # A caller that spun through the whole wait would use half a second of a core.
    assert time.process_time() - cpu < 0.25
    h.mark_ready(0)
    assert c.next(timeout=5) == (0, 0, 8)
    assert c.next(timeout=5) is None and c.next(timeout=5) is None
    assert np.array_equal(dst, x)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_consume_dropped_early_leaves_the_payload(pipeline, chunks):
    # A consume nobody waits for stops, and does not count its consumer: another reads it all.
    prod, cons = pipeline
    x = latent((8, 6), seed=5)
    h = prod.publish(StagePayload(13 + chunks, "latent", x, chunk_dim=0, num_chunks=chunks), consumer_credit=1)
    c = cons._conn.consume(h.to_bytes(), np.zeros_like(x), timeout=5)
    with pytest.raises(tw.TimeoutError):
        c.next(timeout=0.05)
    del c
    h.mark_all_ready()
    dst = np.zeros_like(x)
    assert len(list(cons.consume(h, dst, timeout=5))) == chunks
    assert np.array_equal(dst, x)


def test_consume_async(pipeline):
    prod, cons = pipeline
    x = latent()
    h = released(prod, 10, x, dim=0)
    dst = np.empty_like(x)

    async def run():
        return [c async for c in cons.consume_async(h, dst)]

    chunks = asyncio.run(run())
    assert len(chunks) == 4 and np.array_equal(dst, x)


@pytest.mark.parametrize("mode", ["p2p", "store"])
def test_a_held_payload_stays_until_released(pipeline, store_node, mode):
    # A stage worker that dies mid-stage must leave its input for the retry: it consumes with
    # hold=True and releases only once its result is committed.
    prod, cons = pipeline
    store_config = {"node_engine": store_node[0].address, "node_rpc": store_node[2].address}
    x = latent(seed=3)
    h = prod.publish(StagePayload(11, "latent", x), consumer_credit=1 if mode == "p2p" else None)
    if mode == "store":
        h.wait_stored()
    assert h.source == mode
    for attempt in range(2):  # the first "worker" died before committing; the retry reads again
        dst = np.zeros_like(x)
        for _ in cons.consume(h, dst, hold=True):
            pass
        assert np.array_equal(dst, x), f"attempt {attempt}"
    cons.release(h)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and prod.held:
        time.sleep(0.02)
    late = DiffusionConnector(transfer_mode="auto", store_config=store_config, wait_timeout=0.2)
    with pytest.raises((tw.LeaseEndedError, tw.PayloadMissingError)):
        for _ in late.consume(h, np.zeros_like(x), timeout=5):
            pass
    late.close()
