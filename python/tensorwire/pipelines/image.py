"""An SD3-style image model (MMDiT), split into its three stages.

``encode`` runs the text encoders (two CLIPs and a T5, as Stable Diffusion 3 does) and returns every
tensor the transformer takes; ``denoise`` runs the scheduler loop from those tensors and returns the
final latent (and can stop at a step and resume from there); ``decode`` runs the VAE. ``encode``
is the pipeline's ``encode_prompt``, ``denoise`` is the pipeline's denoising loop step for step,
``decode`` is the pipeline's own latent-to-image step. So the split output equals ``generate``
(the pipeline called whole, the oracle) bit for bit, given the same components and seed.
"""

from typing import Any, Callable, Dict, Optional

from .checkpoint import StepState, state
from .checkpoint import steps as denoise_steps
from .tokenizer import VOCAB_SIZE, byte_tokenizer

__all__ = ["CONDITION", "tiny", "load", "encode", "denoise", "state", "decode", "generate"]

# The tensors encode hands to denoise, by the pipeline's argument names.
CONDITION = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")


def tiny(seed: int = 0, device: str = "cpu") -> Any:
    """A ``StableDiffusion3Pipeline`` of seeded random weights built from configs (about 10 M
    parameters; no download): two CLIP text encoders (hidden 16, projection 16), a T5 encoder
    (d_model 32), an MMDiT (2 joint blocks, 4 heads of 8, patch 2) and a VAE with 8x downsampling
    and 4 latent channels."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip = CLIPTextConfig(vocab_size=VOCAB_SIZE, hidden_size=16, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=2, projection_dim=16, max_position_embeddings=77,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2, hidden_act="gelu")
    text_encoder = CLIPTextModelWithProjection(clip)
    text_encoder_2 = CLIPTextModelWithProjection(clip)
    t5 = T5Config(vocab_size=VOCAB_SIZE, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  pad_token_id=0, eos_token_id=2, decoder_start_token_id=0)
    text_encoder_3 = T5EncoderModel(t5)
    transformer = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=2,
                                        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                                        caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
                                        pos_embed_max_size=64)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 16, 16, 16),
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=256,
                        use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                        scaling_factor=1.5035)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=text_encoder, tokenizer=byte_tokenizer(77, bos=True),
        text_encoder_2=text_encoder_2, tokenizer_2=byte_tokenizer(77, bos=True),
        text_encoder_3=text_encoder_3, tokenizer_3=byte_tokenizer(256, bos=False))
    return _ready(pipe, device)


def load(path: str, device: str = "cpu", dtype: Optional[Any] = None) -> Any:
    """A ``StableDiffusion3Pipeline`` from a local weights directory (``from_pretrained``)."""
    from diffusers import StableDiffusion3Pipeline

    return _ready(StableDiffusion3Pipeline.from_pretrained(path, torch_dtype=dtype), device)


def _ready(pipe: Any, device: str) -> Any:
    """Inference mode (a model built from a config starts in training mode: dropout on) on
    ``device``, no progress bars."""
    for part in pipe.components.values():
        if hasattr(part, "eval") and hasattr(part, "parameters"):
            part.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def encode(pipe: Any, prompt: str, negative_prompt: str = "", guidance_scale: float = 4.0,
           max_sequence_length: int = 32) -> Dict[str, Any]:
    """Condition Encode: the prompt's embeddings, pooled embeddings and, with classifier-free
    guidance (``guidance_scale > 1``), the negative prompt's."""
    import torch

    with torch.no_grad():
        pe, npe, ppe, nppe = pipe.encode_prompt(prompt=prompt, prompt_2=None, prompt_3=None,
                                                negative_prompt=negative_prompt,
                                                do_classifier_free_guidance=guidance_scale > 1,
                                                device=pipe.device, max_sequence_length=max_sequence_length)
    out = {"prompt_embeds": pe, "pooled_prompt_embeds": ppe}
    if guidance_scale > 1:
        out.update(negative_prompt_embeds=npe, negative_pooled_prompt_embeds=nppe)
    return out


def denoise(pipe: Any, condition: Dict[str, Any], seed: int, steps: int = 8, height: int = 256, width: int = 256,
            guidance_scale: float = 4.0, *, resume: Optional[StepState] = None,
            after_step: Optional[Callable[[int, Any], bool]] = None) -> Optional[Any]:
    """DiT Denoise: the final latent (as the VAE takes it, before scaling).

    The loop of ``StableDiffusion3Pipeline.__call__`` (the same operations in the same order, so
    the same bits; its skip-layer guidance, IP-adapter and callbacks are not here), with two
    additions: ``after_step(k, latents)`` runs after step ``k`` (1-based) and stops the job,
    returning None, when it returns False (preemption: it saves ``state(pipe, k, latents)``
    first); ``resume`` continues a job from such a state, on any worker with the same
    components."""
    import torch
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

    cfg = guidance_scale > 1
    embeds, pooled = condition["prompt_embeds"], condition["pooled_prompt_embeds"]
    if cfg:
        embeds = torch.cat([condition["negative_prompt_embeds"], embeds], dim=0)
        pooled = torch.cat([condition["negative_pooled_prompt_embeds"], pooled], dim=0)
    device = pipe._execution_device

    def fresh() -> Any:
        generator = torch.Generator(device="cpu").manual_seed(seed)
        batch = condition["prompt_embeds"].shape[0]
        latents = pipe.prepare_latents(batch, pipe.transformer.config.in_channels, height, width, embeds.dtype,
                                       device, generator, None)
        kwargs = {}
        if pipe.scheduler.config.get("use_dynamic_shifting", None):
            c, p = pipe.scheduler.config, pipe.transformer.config.patch_size
            kwargs["mu"] = calculate_shift((latents.shape[2] // p) * (latents.shape[3] // p),
                                           c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                                           c.get("base_shift", 0.5), c.get("max_shift", 1.16))
        retrieve_timesteps(pipe.scheduler, steps, device, **kwargs)
        return latents

    def predict(i: int, t: Any, latents: Any) -> Any:
        x = torch.cat([latents] * 2) if cfg else latents
        noise = pipe.transformer(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=embeds,
                                 pooled_projections=pooled, joint_attention_kwargs=None, return_dict=False)[0]
        if not cfg:
            return noise
        uncond, text = noise.chunk(2)
        return uncond + guidance_scale * (text - uncond)

    return denoise_steps(pipe, device, resume, fresh, predict, after_step)


def decode(pipe: Any, latent: Any) -> Any:
    """VAE Decode: the image, ``[batch, 3, height, width]`` in ``[0, 1]`` (float)."""
    import torch

    with torch.no_grad():
        z = latent / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(z.to(pipe.vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt")


def generate(pipe: Any, prompt: str, seed: int, steps: int = 8, height: int = 256, width: int = 256,
             negative_prompt: str = "", guidance_scale: float = 4.0, max_sequence_length: int = 32) -> Any:
    """The monolithic run: the pipeline called whole, as its users call it."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        return pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width,
                    num_inference_steps=steps, guidance_scale=guidance_scale, generator=generator,
                    max_sequence_length=max_sequence_length, output_type="pt").images
