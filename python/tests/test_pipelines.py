"""Real diffusers models through tensorwire (``tensorwire.pipelines``): the stages split across
connectors and processes give the monolithic pipeline's output bit for bit. Tiny models of seeded
random weights, built from configs (no download). Skipped where torch, diffusers or transformers
is not installed (``.ci/run`` installs them)."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed in this venv")
pytest.importorskip("diffusers", reason="diffusers is not installed in this venv")
pytest.importorskip("transformers", reason="transformers is not installed in this venv")

from tensorwire.diffusion import DiffusionConnector  # noqa: E402
from tensorwire.pipelines import checkpoint, handoff, image, video  # noqa: E402
from tensorwire.pipelines.cache import EmbeddingCache  # noqa: E402

torch.set_num_threads(1)
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "diffusers_pipeline.py")
IMAGE = {"steps": 4, "height": 128, "width": 128}
VIDEO = {"steps": 3, "frames": 9, "height": 64, "width": 64}


@pytest.fixture(scope="module")
def sd3():
    return image.tiny(seed=0)


@pytest.fixture(scope="module")
def wan():
    return video.tiny(seed=0)


@pytest.fixture
def pair():
    producer, consumer = DiffusionConnector(transfer_mode="p2p"), DiffusionConnector(transfer_mode="p2p")
    yield producer, consumer
    producer.close()
    consumer.close()


def _through(pair, request, kind, tensors, chunked=None):
    """``tensors`` published by one connector and consumed by the other."""
    producer, consumer = pair
    p = handoff.publish(producer, request, kind, tensors, chunked=chunked, consumer_credit=1)
    for name, (_, count) in (chunked or {}).items():
        for i in range(count):
            p.mark_ready(name, i)
    return handoff.consume(consumer, p.message)


def test_a_tiny_model_is_the_same_model_in_every_process(sd3):
    again = image.tiny(seed=0)
    for name in ("transformer", "vae", "text_encoder", "text_encoder_3"):
        a, b = getattr(sd3, name).state_dict(), getattr(again, name).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert not getattr(sd3, name).training, f"{name} left in training mode (dropout on)"


def test_the_image_model_split_through_connectors_is_the_monolithic_run(sd3, pair):
    ref = image.generate(sd3, "a red fox", seed=3, **IMAGE)
    cond = _through(pair, 3, "condition_embedding", image.encode(sd3, "a red fox"))
    assert sorted(cond) == sorted(image.CONDITION), "every tensor the transformer takes"
    latent = _through(pair, 3, "latent", {"latent": image.denoise(sd3, cond, seed=3, **IMAGE)})["latent"]
    out = image.decode(sd3, latent)
    assert out.shape == (1, 3, 128, 128) and out.std() > 0
    assert torch.equal(out, ref)


def test_another_seed_or_prompt_gives_another_image(sd3):
    a = image.generate(sd3, "a red fox", seed=3, **IMAGE)
    assert not torch.equal(a, image.generate(sd3, "a red fox", seed=4, **IMAGE))
    assert not torch.equal(a, image.generate(sd3, "a blue fox", seed=3, **IMAGE))


def test_the_video_model_split_with_a_chunked_latent_is_the_monolithic_run(wan, pair):
    ref = video.generate(wan, "a red fox", seed=5, **VIDEO)
    cond = _through(pair, 5, "condition_embedding", video.encode(wan, "a red fox"))
    latent = video.denoise(wan, cond, seed=5, **VIDEO)
    frames = latent.shape[2]
    assert frames == 3
    producer, consumer = pair
    p = handoff.publish(producer, 5, "latent", {"latent": latent}, chunked={"latent": (2, frames)},
                        consumer_credit=1)
    (h,) = handoff.handles(p.message).values()
    dst = handoff.destination(h)
    d = video.ChunkedDecode(wan)
    for i in range(frames):
        p.mark_ready("latent", i)
    for start, chunk in handoff.stream(consumer, h, dst):
        d.feed(chunk, start)  # decoded as it lands (a frame waits for the ones before it)
    assert d.frames == frames
    out = d.finish()
    assert out.shape == (1, 9, 3, 64, 64)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("pieces", [1, 2, 3])
def test_chunked_video_decode_is_the_whole_decode(wan, pieces):
    cond = video.encode(wan, "waves")
    latent = video.denoise(wan, cond, seed=9, **VIDEO)
    whole = video.decode(wan, latent)
    d = video.ChunkedDecode(wan)
    for part in torch.tensor_split(latent, pieces, dim=2):
        d.feed(part)
    assert torch.equal(d.finish(), whole)


def test_chunks_fed_out_of_order_decode_in_order(wan):
    latent = video.denoise(wan, video.encode(wan, "waves"), seed=9, **VIDEO)
    whole = video.decode(wan, latent)
    d = video.ChunkedDecode(wan)
    assert d.feed(latent[:, :, 2:3], 2) == 0, "frame 2 waits for 0 and 1"
    assert d.feed(latent[:, :, 0:1], 0) == 1
    with pytest.raises(ValueError, match="fed twice"):
        d.feed(latent[:, :, 2:3], 2)
    assert d.feed(latent[:, :, 1:2], 1) == 3
    assert torch.equal(d.finish(), whole)


def test_a_missing_frame_is_an_error_not_a_shorter_video(wan):
    latent = video.denoise(wan, video.encode(wan, "waves"), seed=9, **VIDEO)
    d = video.ChunkedDecode(wan)
    d.feed(latent[:, :, 0:1], 0)
    d.feed(latent[:, :, 2:3], 2)
    with pytest.raises(ValueError, match="without frame 1"):
        d.finish()


def test_consumed_tensors_land_in_the_destinations_the_stage_allocated(pair):
    producer, consumer = pair
    src = {"a": torch.randn(4, 8), "b": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)}
    p = handoff.publish(producer, 1, "feature", src, consumer_credit=1)
    hs = handoff.handles(p.message)
    for name, h in hs.items():
        dst = handoff.destination(h)
        seen = []
        for start, chunk in handoff.stream(consumer, h, dst):
            assert start == 0
            seen.append(chunk)
        assert len(seen) == 1 and seen[0].data_ptr() == dst.data_ptr()
        assert torch.equal(dst, src[name]) and dst.dtype == src[name].dtype


def test_publish_reads_the_producers_tensor_in_place(pair):
    """p2p: the consumer reads the producer's memory, not a copy made at publish."""
    producer, consumer = pair
    t = torch.zeros(1024)
    p = handoff.publish(producer, 1, "feature", {"t": t}, consumer_credit=1)
    t.fill_(7.0)  # after publish, before the read
    assert torch.equal(handoff.consume(consumer, p.message)["t"], torch.full((1024,), 7.0))


def test_a_non_contiguous_tensor_is_refused_not_copied(pair):
    with pytest.raises(ValueError, match="not contiguous"):
        handoff.publish(pair[0], 1, "feature", {"t": torch.zeros(4, 6).t()})


@pytest.mark.parametrize("message", [b"", b"\xff", b"[]", b'{"a": 1}', b'{"a": "zz"}'])
def test_a_message_that_is_not_a_stage_message_is_an_error(message):
    with pytest.raises(Exception) as e:
        handoff.handles(message)
    assert isinstance(e.value, ValueError) or "handle" in str(e.value).lower()


def _example(*args):
    r = subprocess.run([sys.executable, EXAMPLE, *args, "--requests", "2", "--check"], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    verdict = json.loads(r.stdout.strip().splitlines()[-1])
    return verdict, r.stdout


@pytest.mark.parametrize("model,mode", [("image", "p2p"), ("image", "store"), ("video", "p2p"), ("video", "store")])
def test_three_processes_and_the_orchestrator_give_the_monolithic_output(model, mode):
    verdict, out = _example("--model", model, "--mode", mode, "--steps", "3", "--size", "64" if model == "video" else "128")
    assert verdict["identical"] is True and verdict["requests"] == 2, out
    assert "| denoise |" in out and "time to first frame" in out


def _unipc(pipe):
    from diffusers import UniPCMultistepScheduler

    pipe.scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return pipe


@pytest.fixture(scope="module")
def sd3_unipc():
    """Two workers' components with a multistep scheduler (its state has a history of outputs)."""
    return _unipc(image.tiny(seed=0)), _unipc(image.tiny(seed=0))


def _preempted(pipe, cond, seed, k):
    """The job stopped after step ``k``: its step state's portable bytes."""
    saved = {}

    def after(step, latents):
        if step < k:
            return True
        saved["state"] = checkpoint.encode(image.state(pipe, step, latents))
        return False

    assert image.denoise(pipe, cond, seed=seed, after_step=after, **IMAGE) is None
    return saved["state"]


@pytest.mark.parametrize("scheduler", ["flow-match-euler", "unipc-multistep"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_job_preempted_at_step_k_resumes_elsewhere_to_the_same_image(sd3, sd3_unipc, scheduler, k):
    first, second = (sd3, image.tiny(seed=0)) if scheduler == "flow-match-euler" else sd3_unipc
    ref = image.generate(first, "a red fox", seed=7, **IMAGE)
    cond = image.encode(first, "a red fox")
    state = checkpoint.decode(_preempted(first, cond, 7, k))
    assert state.step == k
    latent = image.denoise(second, cond, seed=7, resume=state, **IMAGE)
    assert torch.equal(image.decode(second, latent), ref)


def test_a_video_job_preempted_at_a_step_resumes_elsewhere_to_the_same_video(wan):
    ref = video.generate(wan, "waves", seed=4, **VIDEO)
    cond = video.encode(wan, "waves")
    saved = {}

    def after(step, latents):
        saved["state"] = checkpoint.encode(video.state(wan, step, latents))
        return step < 2

    assert video.denoise(wan, cond, seed=4, after_step=after, **VIDEO) is None
    elsewhere = video.tiny(seed=0)
    latent = video.denoise(elsewhere, cond, seed=4, resume=checkpoint.decode(saved["state"]), **VIDEO)
    assert torch.equal(video.decode(elsewhere, latent), ref)


def test_a_resume_without_the_solvers_history_is_not_the_same_image(sd3_unipc):
    """The oracle above is sensitive: a checkpoint of only the latents and the step index (the
    multistep solver's history dropped) resumes to another image."""
    first, second = sd3_unipc
    ref = image.generate(first, "a red fox", seed=7, **IMAGE)
    cond = image.encode(first, "a red fox")
    state = checkpoint.decode(_preempted(first, cond, 7, 2))
    second.scheduler.set_timesteps(IMAGE["steps"])  # a fresh solver, at step 2
    naive = checkpoint.capture(second.scheduler)
    naive["fields"]["_step_index"] = 2
    state.scheduler = naive
    latent = image.denoise(second, cond, seed=7, resume=state, **IMAGE)
    assert not torch.equal(image.decode(second, latent), ref)


def test_a_state_resumes_only_its_own_scheduler(sd3, sd3_unipc):
    cond = image.encode(sd3, "a red fox")
    state = checkpoint.decode(_preempted(sd3, cond, 7, 1))
    with pytest.raises(ValueError, match="cannot resume"):
        image.denoise(sd3_unipc[1], cond, seed=7, resume=state, **IMAGE)
    other = image.tiny(seed=0)
    other.scheduler = type(sd3.scheduler).from_config(sd3.scheduler.config, shift=2.0)
    with pytest.raises(ValueError, match="another scheduler config"):
        image.denoise(other, cond, seed=7, resume=state, **IMAGE)


def test_a_step_state_decoder_is_total(sd3):
    good = _preempted(sd3, image.encode(sd3, "x"), 1, 1)
    assert checkpoint.decode(good).step == 1
    bad = [b"", b"TWSS", good[:-1], good + b"\0", b"XXXX" + good[4:], good[:4] + b"\x02" + good[5:],
           good[:5] + b"\xff\xff\xff\x7f" + good[9:]]
    for n in (10, 40, 200):
        bad.append(good[:n] + bytes([good[n] ^ 0x5A]) + good[n + 1:])  # a byte of the header changed
    for b in bad:
        try:
            checkpoint.decode(b)
        except ValueError:
            continue
        # A header byte flip that still parses must still describe whole tensors.
        assert b[:9] == good[:9]


def test_a_job_checkpointed_through_the_orchestrator_resumes_on_another_worker(sd3):
    import time

    import tensorwire as tw
    from tensorwire._native import Worker
    from tensorwire.orchestrator import Service, Submitter

    engine = tw.Engine()
    store = tw.Store.embedded(engine, 64 << 20, shared=True)
    node = tw.StoreNode(store)
    conn = DiffusionConnector(transfer_mode="store", store_config={"address": node.address})
    ckpts = checkpoint.Checkpoints(store)
    service = Service(max_attempts=3)
    prompt = "a lighthouse at dusk"
    cond = handoff.publish(conn, 21, "condition_embedding", image.encode(sd3, prompt))
    cond.wait_stored()
    decode = Worker(service.address, "decode", heartbeat=0.1)  # a decode pool: denoise work is admitted
    outcome = Submitter(service.address).submit(21, start="denoise", inputs=cond.message)

    first = Worker(service.address, "denoise", heartbeat=0.1)
    a = first.next(timeout=10)
    assert a.resume is None

    def after(step, latents, worker=first):
        if step < 2:
            return True
        worker.checkpoint(a, step, ckpts.save(a.request, image.state(sd3, step, latents)))
        return False

    assert image.denoise(sd3, handoff.consume(conn, a.inputs, hold=True), seed=21, after_step=after, **IMAGE) is None
    time.sleep(0.5)  # the checkpoint goes out in the background
    del after, first  # dies mid-job: the item is re-queued with its checkpoint

    second = Worker(service.address, "denoise", heartbeat=0.1)
    b = second.next(timeout=10)
    while b.release_only:
        second.released(b)
        b = second.next(timeout=10)
    step, ref = b.resume
    assert (b.request, step) == (21, 2)
    elsewhere = image.tiny(seed=0)  # the second worker's own components
    latent = image.denoise(elsewhere, handoff.consume(conn, b.inputs, hold=True), seed=21,
                           resume=ckpts.load(ref), **IMAGE)
    out = handoff.publish(conn, 21, "latent", {"latent": latent})
    out.wait_stored()
    second.report(b, out.message)

    d = decode.next(timeout=10)
    img = image.decode(elsewhere, handoff.consume(conn, d.inputs)["latent"])
    decode.report(d, b"")
    outcome.wait(timeout=30)
    assert torch.equal(img, image.generate(sd3, prompt, seed=21, **IMAGE))
    assert ckpts.remove(ref), "the checkpoint was kept until removed"


def test_an_embedding_cache_hit_gives_the_same_image(sd3):
    import tensorwire as tw

    engine = tw.Engine()
    cache = EmbeddingCache(tw.Store.embedded(engine, 16 << 20), "tiny-sd3-seed0")
    key = cache.key("a red fox", "", {"max_sequence_length": 32})
    assert cache.get(key) is None and cache.misses == 1
    assert cache.put(key, image.encode(sd3, "a red fox"))
    hit = cache.get(key)
    assert cache.hits == 1 and sorted(hit) == sorted(image.CONDITION)
    latent = image.denoise(sd3, hit, seed=3, **IMAGE)
    assert torch.equal(image.decode(sd3, latent), image.generate(sd3, "a red fox", seed=3, **IMAGE))
    assert cache.key("a red fox", "blurry", {"max_sequence_length": 32}) != key
    assert cache.key("a red fox", "", {"max_sequence_length": 64}) != key
    assert EmbeddingCache(cache.store, "another-encoder").key("a red fox", "", {"max_sequence_length": 32}) != key
    assert cache.put(key, image.encode(sd3, "a red fox")), "a second put of the same entry is fine"
    cache.store.remove(f"{key}/pooled_prompt_embeds")
    assert cache.get(key) is None, "an entry with a part evicted is a miss"


@pytest.mark.parametrize("model", [image, video], ids=["image", "video"])
def test_weights_saved_to_a_directory_load_to_the_same_output(model, tmp_path):
    """``load(DIR)`` is the path real weights take (``from_pretrained`` of a local directory).

    Every weight and buffer loads bit for bit. The outputs agree to float32 rounding, not bit
    for bit: a loaded weight lies where the safetensors file put it (e.g. 24 bytes past a
    64-byte boundary), and the CPU matmul kernel's result depends on that alignment (the same
    values copied to an aligned buffer give the built model's result exactly)."""
    pytest.importorskip("accelerate", reason="from_pretrained of these models needs accelerate")
    built = model.tiny(seed=0)
    built.save_pretrained(str(tmp_path))
    loaded = model.load(str(tmp_path))
    assert not loaded.transformer.training
    for name, part in built.components.items():
        if not isinstance(part, torch.nn.Module):
            continue
        mine, theirs = part.state_dict(), getattr(loaded, name).state_dict()
        assert mine.keys() == theirs.keys(), name
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), f"{name}: a weight changed on the way"
    knobs = {"steps": 2, "height": 64, "width": 64}
    a, b = model.generate(built, "fox", seed=1, **knobs), model.generate(loaded, "fox", seed=1, **knobs)
    assert a.shape == b.shape
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max().item()
