"""Real diffusers pipelines split into tensorwire stages: Condition Encode, DiT Denoise, VAE
Decode, each runnable in its own process with the stage tensors moving through the connector.

- ``image``: an SD3-style model (MMDiT, two CLIPs and a T5, AutoencoderKL); ``denoise`` stops at
  a step and resumes from a checkpoint (``checkpoint``: the real scheduler's state, portable).
- ``video``: a Wan model (UMT5, WanTransformer3DModel, AutoencoderKLWan); ``ChunkedDecode``
  decodes the latent temporal chunk by temporal chunk as the chunks land.
- ``handoff``: a stage's named tensors published and consumed into tensors the next stage
  allocated, one queue message for all of them.
- ``cache``: the embedding cache in the store.

Each model module has ``tiny(seed)`` (seeded random weights from configs, no download),
``load(path)`` (``from_pretrained`` of a local weights directory), ``encode``, ``denoise``,
``decode``, and ``generate``: the pipeline called whole, the oracle the split run must equal bit
for bit. Needs torch, diffusers and transformers (not dependencies of tensorwire; imported when
a function needs them). ``python/examples/diffusers_pipeline.py`` runs them as processes under
the orchestrator.
"""
