"""The RFC's connector sketch, runnable: only the import differs (mooncake.diffusion -> tensorwire.diffusion)."""

import numpy as np

from tensorwire.diffusion import DiffusionConnector, StagePayload

latents = np.random.default_rng(0).standard_normal((16, 4, 8, 32, 32)).astype(np.float32)  # B C T H W
queue = []  # stands in for the serving framework's queue between stages


def decode_chunk(chunk):  # stands in for vae.decode_chunk
    return float(chunk.mean())


# Denoise worker: publish the latent, chunked along T, released chunk by chunk.
conn = DiffusionConnector(role="denoise", transfer_mode="p2p")
handle = conn.publish(StagePayload(request_id=7, kind="latent", tensor=latents,
                                   chunk_dim=2, num_chunks=8, lease="delete_on_consume"))
queue.append(handle.to_bytes())  # the handle is small bytes
for t in range(8):
    handle.mark_ready(t)  # as each chunk is produced

# Decode worker: consume chunk by chunk into its own buffer; each chunk is a view of dst.
decoder = DiffusionConnector(role="decode", transfer_mode="p2p")
dst = np.empty_like(latents)
frames = [decode_chunk(chunk) for chunk in decoder.consume(queue.pop(), dst=dst)]
assert len(frames) == 8 and np.array_equal(dst, latents)
print(f"decoded {len(frames)} chunks of a {latents.nbytes >> 20} MiB latent")
