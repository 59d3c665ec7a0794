"""A Wan-style video model, split into its three stages, with a decode that starts on the first
temporal chunk of the latent.

``encode`` is ``WanPipeline.encode_prompt`` (a UMT5 encoder), ``denoise`` is the pipeline's
denoising loop step for step (it stops after a step and resumes from a checkpoint, as the image
model's does), ``decode`` is the pipeline's own latent-to-video step
and ``ChunkedDecode`` is the same decode fed one temporal chunk at a time as the chunks land.

Why chunked decode is exact: ``AutoencoderKLWan`` decodes a latent one frame at a time, its causal
3D convolutions carrying the frames before in a feature cache; the steps before the frame loop
(un-normalising the latent, the 1x1x1 ``post_quant_conv``) act on each latent frame on its own, and
the clamp after it on each output element. ``ChunkedDecode`` runs the same loop over the frames of
each chunk as it arrives, carrying the cache across chunks, so its output is the whole decode's
(``tests/test_pipelines.py`` checks ``torch.equal``; where a kernel's blocking depended on the
number of frames it would not be, and the example's ``--check`` reports the largest difference).
"""

from typing import Any, Callable, Dict, List, Optional

from .checkpoint import StepState, state
from .checkpoint import steps as denoise_steps
from .image import _ready
from .tokenizer import VOCAB_SIZE, byte_tokenizer

__all__ = ["CONDITION", "tiny", "load", "encode", "denoise", "state", "decode", "generate", "ChunkedDecode"]

CONDITION = ("prompt_embeds", "negative_prompt_embeds")


def tiny(seed: int = 0, device: str = "cpu") -> Any:
    """A ``WanPipeline`` of seeded random weights built from configs (no download): a UMT5 encoder
    (d_model 32), a Wan transformer (2 layers, 2 heads of 12, patch 1x2x2) and an
    ``AutoencoderKLWan`` (8x spatial, 4x temporal compression, 16 latent channels)."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=VOCAB_SIZE, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, pad_token_id=0, eos_token_id=2,
                                               decoder_start_token_id=0))
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                        num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                        rope_max_seq_len=32)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    pipe = WanPipeline(tokenizer=byte_tokenizer(512, bos=False), text_encoder=text_encoder, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=transformer)
    return _ready(pipe, device)


def load(path: str, device: str = "cpu", dtype: Optional[Any] = None) -> Any:
    """A ``WanPipeline`` from a local weights directory (``from_pretrained``)."""
    from diffusers import WanPipeline

    return _ready(WanPipeline.from_pretrained(path, torch_dtype=dtype), device)


def encode(pipe: Any, prompt: str, negative_prompt: str = "", guidance_scale: float = 5.0,
           max_sequence_length: int = 32) -> Dict[str, Any]:
    """Condition Encode: the prompt's embeddings and, with classifier-free guidance, the negative
    prompt's."""
    import torch

    with torch.no_grad():
        pe, npe = pipe.encode_prompt(prompt=prompt, negative_prompt=negative_prompt,
                                     do_classifier_free_guidance=guidance_scale > 1,
                                     max_sequence_length=max_sequence_length, device=pipe.device)
    out = {"prompt_embeds": pe}
    if guidance_scale > 1:
        out["negative_prompt_embeds"] = npe
    return out


def denoise(pipe: Any, condition: Dict[str, Any], seed: int, steps: int = 4, frames: int = 9, height: int = 64,
            width: int = 64, guidance_scale: float = 5.0, guidance_scale_2: Optional[float] = None, *,
            resume: Optional[StepState] = None,
            after_step: Optional[Callable[[int, Any], bool]] = None) -> Optional[Any]:
    """DiT Denoise: the final latent, ``[batch, 16, 1 + (frames - 1) / 4, height / 8, width / 8]``.

    The loop of ``WanPipeline.__call__`` (the same operations in the same order: Wan 2.1's one
    transformer, Wan 2.2's two with their boundary, expanded timesteps), with ``after_step`` and
    ``resume`` as in ``image.denoise``."""
    import torch

    if (frames - 1) % pipe.vae_scale_factor_temporal:
        raise ValueError(f"frames must be {pipe.vae_scale_factor_temporal}k + 1, not {frames}")
    model = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
    dtype = model.dtype
    cfg = guidance_scale > 1
    embeds = condition["prompt_embeds"].to(dtype)
    negative = condition["negative_prompt_embeds"].to(dtype) if cfg else None
    boundary = None
    if pipe.config.boundary_ratio is not None:
        boundary = pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps
        guidance_scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
    device = pipe._execution_device

    def fresh() -> Any:
        pipe.scheduler.set_timesteps(steps, device=device)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        latents = pipe.prepare_latents(embeds.shape[0], model.config.in_channels, height, width, frames,
                                       torch.float32, device, generator, None)
        pipe.scheduler.set_begin_index(0)
        return latents

    def predict(i: int, t: Any, latents: Any) -> Any:
        current, scale = pipe.transformer, guidance_scale
        if boundary is not None and t < boundary:
            current, scale = pipe.transformer_2, guidance_scale_2
        x = latents.to(dtype)
        if pipe.config.expand_timesteps:
            mask = torch.ones(latents.shape, dtype=torch.float32, device=device)
            timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(latents.shape[0], -1)
        else:
            timestep = t.expand(latents.shape[0])
        n = len(pipe.scheduler.timesteps)
        ctx = {"step_index": i, "sigma": float(pipe.scheduler.sigmas[i]), "num_inference_steps": n}
        with current.cache_context("cond", **ctx):
            noise = current(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                            attention_kwargs=None, return_dict=False)[0]
        if not cfg:
            return noise
        with current.cache_context("uncond", **ctx):
            uncond = current(hidden_states=x, timestep=timestep, encoder_hidden_states=negative,
                             attention_kwargs=None, return_dict=False)[0]
        return uncond + scale * (noise - uncond)

    return denoise_steps(pipe, device, resume, fresh, predict, after_step)


def _unnormalised(vae: Any, latent: Any) -> Any:
    import torch

    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latent.device, latent.dtype)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latent.device, latent.dtype)
    return latent / std + mean


def decode(pipe: Any, latent: Any) -> Any:
    """VAE Decode of the whole latent: the video, ``[batch, frames, 3, height, width]`` in
    ``[0, 1]`` (float), as the pipeline returns it with ``output_type="pt"``."""
    import torch

    with torch.no_grad():
        z = _unnormalised(pipe.vae, latent.to(pipe.vae.dtype))
        video = pipe.vae.decode(z, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type="pt")


class ChunkedDecode:
    """VAE Decode fed temporal chunks of the latent in order (``feed``), each decoded as it comes;
    ``finish`` returns the video, equal to ``decode`` of the whole latent. Uses the frame loop of
    diffusers' ``AutoencoderKLWan._decode`` (0.3x-0.42): its feature cache, ``decoder`` and
    ``post_quant_conv``; a VAE with tiling on is refused (tiles are not causal in time)."""

    def __init__(self, pipe: Any):
        vae = pipe.vae
        if getattr(vae, "use_tiling", False):
            raise ValueError("chunked decode needs the VAE's tiling off")
        self._pipe = pipe
        self._vae = vae
        self._frames: List[Any] = []
        self._waiting: Dict[int, Any] = {}  # latent frames that came before the ones before them
        self._next = 0
        vae.clear_cache()

    @property
    def frames(self) -> int:
        """Latent frames decoded so far."""
        return self._next

    def feed(self, chunk: Any, start: Optional[int] = None) -> int:
        """Takes latent frames ``[start, start + t)`` (``chunk``: ``[batch, channels, t, h, w]``;
        ``start`` defaults to the frame after the last one fed) and decodes every frame it can in
        order: chunks may come in any order, a frame waits for the ones before it. Returns the
        number of frames decoded so far."""
        start = self._next + len(self._waiting) if start is None else start
        for i in range(chunk.shape[2]):
            if start + i < self._next or start + i in self._waiting:
                raise ValueError(f"latent frame {start + i} fed twice")
            self._waiting[start + i] = chunk[:, :, i:i + 1]
        while self._next in self._waiting:
            self._decode_frame(self._waiting.pop(self._next))
        return self._next

    def _decode_frame(self, frame: Any) -> None:
        import torch

        vae = self._vae
        with torch.no_grad():
            x = vae.post_quant_conv(_unnormalised(vae, frame.to(vae.dtype)))
            vae._conv_idx = [0]
            self._frames.append(vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                            first_chunk=self._next == 0))
            self._next += 1

    def finish(self) -> Any:
        """The decoded video (``[batch, frames, 3, height, width]`` in ``[0, 1]``)."""
        import torch

        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        vae = self._vae
        if self._waiting:
            raise ValueError(f"latent frames {sorted(self._waiting)} came without frame {self._next}")
        out = torch.cat(self._frames, 2)
        self._frames = []
        if vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=vae.config.patch_size)
        out = torch.clamp(out, min=-1.0, max=1.0)
        vae.clear_cache()
        return self._pipe.video_processor.postprocess_video(out, output_type="pt")


def generate(pipe: Any, prompt: str, seed: int, steps: int = 4, frames: int = 9, height: int = 64, width: int = 64,
             negative_prompt: str = "", guidance_scale: float = 5.0, max_sequence_length: int = 32) -> Any:
    """The monolithic run: the pipeline called whole."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        return pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=frames,
                    num_inference_steps=steps, guidance_scale=guidance_scale, generator=generator,
                    max_sequence_length=max_sequence_length, output_type="pt").frames
