"""flow_grpo.py's image side: the SDE sampler step and its log-likelihood, the diffusers flow-matching pipelines (the
Velocity module FSDP2 shards, the offline tiny SD3 / FLUX / Qwen-Image pipelines), image grids, and the image tasks
(prompts, and rewards fn(prompts, images, **columns) -> list[float | None]). grpo.py never imports it."""
import io
import math
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import tasks
import user_code

# ---- Flow-matching image pipelines (flow_grpo.py): diffusers loaders and the offline built-in ----

def pipeline_family(pipe):
    """'sd3' (SD3 / SD3.5), 'flux' (FLUX.1) or 'qwen' (Qwen-Image): how its prompts are encoded, its transformer called
    and its latents laid out; None for a pipeline flow_grpo.py does not wire."""
    from diffusers import FluxPipeline, QwenImagePipeline, StableDiffusion3Pipeline
    kinds = {StableDiffusion3Pipeline: "sd3", FluxPipeline: "flux", QwenImagePipeline: "qwen"}
    return next((name for cls, name in kinds.items() if isinstance(pipe, cls)), None)


class Velocity(nn.Module):
    """flow_grpo.py's FSDP2 root (as TokenLogprobs is grpo.py's): the transformer's velocity v(x, sigma | prompt), with
    classifier-free guidance applied inside, so sampling and log-prob recomputation combine it identically.
    x: latents [B, C, h, w] (SD3) or packed [B, L, 4C] (FLUX, Qwen-Image); sigma [B]; cond: encode_prompts' dict
    (embeds [B, T, D] with pooled [B, P] or mask [B, T]) plus the negative prompt's, neg_* [1, ...]."""

    def __init__(self, transformer, num_train_timesteps, family="sd3"):
        super().__init__()
        self.transformer = transformer
        self.num_train_timesteps = num_train_timesteps
        self.family = family

    def forward(self, x, sigma, cond, guidance_scale, detach_uncond=False):
        """With CFG (SD3's; Qwen-Image's true CFG with the negative prompt, QwenImagePipeline's true_cfg_scale) one
        transformer call over [uncond; cond]; detach_uncond: no gradient through the unconditional prediction
        (Flow-GRPO's train_sd3.py compute_log_prob)."""
        if self.family == "flux":
            return self.flux_velocity(x, sigma, cond, guidance_scale)
        call = self.qwen_velocity if self.family == "qwen" else self.sd3_velocity
        if guidance_scale <= 1:
            return call(x, sigma, cond)
        v = call(torch.cat([x, x]), torch.cat([sigma, sigma]), with_negative(cond, x.shape[0]))  # [2B, ...]
        v_uncond, v_cond = v.chunk(2)
        v_uncond = v_uncond.detach() if detach_uncond else v_uncond
        v = v_uncond + guidance_scale * (v_cond - v_uncond)
        if self.family == "qwen":  # QwenImagePipeline rescales the guided velocity per token to the conditional one's norm
            v = v * (v_cond.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))  # [B, L, 4C]
        return v

    def sd3_velocity(self, x, sigma, cond):
        """SD3: the timestep in [0, 1000]."""
        return self.transformer(hidden_states=x, timestep=sigma * self.num_train_timesteps,
                                encoder_hidden_states=cond["embeds"], pooled_projections=cond["pooled"],
                                return_dict=False)[0]

    def flux_velocity(self, x, sigma, cond, guidance_scale):
        """FLUX.1: packed latents x [B, L, D] (a square image), guidance as an embedding (dev; no unconditional pass),
        the timestep in [0, 1], position ids: zeros for the text tokens, (row, column) for the image tokens."""
        side = math.isqrt(x.shape[1])
        img_ids = torch.zeros(side, side, 3, device=x.device)
        img_ids[..., 1], img_ids[..., 2] = torch.arange(side, device=x.device)[:, None], torch.arange(side, device=x.device)
        guidance = sigma.new_full(sigma.shape, guidance_scale) if self.transformer.config.guidance_embeds else None
        return self.transformer(hidden_states=x, timestep=sigma, guidance=guidance, pooled_projections=cond["pooled"],
                                encoder_hidden_states=cond["embeds"], txt_ids=x.new_zeros(cond["embeds"].shape[1], 3),
                                img_ids=img_ids.view(-1, 3), return_dict=False)[0]

    def qwen_velocity(self, x, sigma, cond):
        """Qwen-Image: packed latents x [B, L, 4C] (a square image), the timestep in [0, 1], text tokens with a padding
        mask."""
        side = math.isqrt(x.shape[1])
        return self.transformer(hidden_states=x, timestep=sigma, encoder_hidden_states=cond["embeds"],
                                encoder_hidden_states_mask=cond["mask"], img_shapes=[[(1, side, side)]] * x.shape[0],
                                return_dict=False)[0]


def with_negative(cond, B):
    """Velocity's CFG batch: each prompt tensor (embeds [B, T, D], pooled [B, P], mask [B, T]) after the negative
    prompt's (neg_*, [1, ...] expanded to B) -> [2B, ...], the two texts zero-padded to one length (Qwen-Image's mask
    hides the padding; SD3's two texts have one length)."""
    out = {}
    for k in ("embeds", "pooled", "mask"):
        if k in cond:
            pair = [cond["neg_" + k].expand(B, *cond["neg_" + k].shape[1:]), cond[k]]
            T = max(t.shape[1] for t in pair)
            out[k] = torch.cat([F.pad(t, (0, 0) * (t.dim() - 2) + (0, T - t.shape[1])) for t in pair])
    return out


FLOW_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# train_sd3.py names them under "attn." (PEFT matches by suffix): SD3.5's second attention, attn2, stays frozen.
# Flow-GRPO's reference code for Qwen-Image also adapts the image and text MLPs of every block
LORA_TARGETS = {"sd3": tuple("attn." + n for n in FLOW_LORA_TARGETS), "flux": FLOW_LORA_TARGETS,
                "qwen": FLOW_LORA_TARGETS + ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                                             "txt_mlp.net.2")}


@torch.no_grad()
def encode_prompts(pipe, prompts, device, max_sequence_length):
    """Frozen text encoders -> the prompts' part of Velocity's cond: SD3 / FLUX {embeds [n, T, D], pooled [n, P]};
    Qwen-Image {embeds [n, T, D], mask [n, T]}: its chat template's system tokens dropped, padded to the longest."""
    family = pipeline_family(pipe)
    if family == "qwen":
        embeds, mask = pipe.encode_prompt(prompt=prompts, device=device, max_sequence_length=max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return {"embeds": embeds, "mask": mask}
    if family == "flux":
        msl = min(max_sequence_length, pipe.tokenizer_2.model_max_length)
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=device, max_sequence_length=msl)
        return {"embeds": embeds, "pooled": pooled}
    msl = 1 if pipe.text_encoder_3 is None else max_sequence_length  # without T5 its tokens are zeros anyway
    embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                              do_classifier_free_guidance=False, max_sequence_length=msl)
    return {"embeds": embeds, "pooled": pooled}


def latent_shape(pipe, px):
    """One image's initial noise for a px x px image: SD3 [C, h, w]; FLUX and Qwen-Image pack 2x2 latent patches into
    tokens, [L = (h/2)^2, 4C]."""
    h = px // pipe.vae_scale_factor
    if pipeline_family(pipe) in ("flux", "qwen"):
        return ((h // 2) ** 2, pipe.transformer.config.in_channels)
    return (pipe.transformer.config.in_channels, h, h)


@torch.no_grad()
def decode_latents(pipe, latents, px, micro_batch_size):
    """Final latents -> images [N, 3, px, px] in [-1, 1] through the frozen VAE, micro_batch_size at a time. FLUX:
    unpacked to [N, C, h, w], then scaling/shift; Qwen-Image: unpacked to its video VAE's [N, C, 1, h, w] and
    un-normalised per channel (z * latents_std + latents_mean), as QwenImagePipeline decodes."""
    vae, family = pipe.vae, pipeline_family(pipe)
    if family == "qwen":
        z = pipe._unpack_latents(latents, px, px, pipe.vae_scale_factor).to(vae.dtype)  # [N, C, 1, h, w]
        stat = lambda name: torch.tensor(vae.config[name]).view(1, -1, 1, 1, 1).to(z)  # noqa: E731  [1, C, 1, 1, 1]
        z = z * stat("latents_std") + stat("latents_mean")
    else:
        if family == "flux":  # [N, L, 4C] -> [N, C, h, w]
            latents = pipe._unpack_latents(latents, px, px, pipe.vae_scale_factor)
        z = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    out = torch.cat([vae.decode(z[i:i + micro_batch_size], return_dict=False)[0]
                     for i in range(0, len(z), micro_batch_size)])
    return out[:, :, 0] if family == "qwen" else out  # [N, 3, px, px]


WORDS = ("a an the on in of photo picture red green blue yellow white black purple orange grey dark square circle "
         "cat house flower car background").split()  # colors_task's words


def _tiny_clip(max_length):
    """The tiny pipelines' CLIP text side, built in memory -> (a word-level tokenizer with CLIP's layout: <bos> words
    <eos>, padded to max_length; the words of colors_task, others map to <unk>; a 2-layer CLIPTextConfig for it)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers import models as tk_models
    from transformers import CLIPTextConfig, PreTrainedTokenizerFast
    specials = ["<|startoftext|>", "<|endoftext|>", "<pad>", "<unk>"]
    tk = Tokenizer(tk_models.WordLevel(vocab={t: i for i, t in enumerate(specials + WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="<|startoftext|> $A <|endoftext|>",
                                                      special_tokens=[("<|startoftext|>", 0), ("<|endoftext|>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|startoftext|>", eos_token="<|endoftext|>",
                                  pad_token="<pad>", unk_token="<unk>", model_max_length=max_length)
    return tok, CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, projection_dim=32, max_position_embeddings=max_length,
                               bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _word_qwen_tokenizer():
    """Qwen2Tokenizer's layout for QwenImagePipeline's prompt template, built in memory: word-level (the words of
    colors_task and of the template), <|im_start|> / <|im_end|> special, newlines kept as tokens, no bos/eos added,
    right padding with <|endoftext|>. The template's system part is then 34 tokens, as with Qwen's BPE, so the
    pipeline's drop of its first 34 tokens leaves exactly the prompt's turn, as it does for the real model."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast
    template = ("Describe image by detailing color , shape size texture quantity text spatial relationships objects "
                "and : system user assistant").split()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + ["\n"] + list(dict.fromkeys(WORDS + template)))}
    tk = Tokenizer(tk_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # words, punctuation runs and newlines are tokens; other whitespace separates them (tokenizers' Whitespace + \n)
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w\s]+|\n"), behavior="removed", invert=True)
    tk.add_special_tokens(specials[:3])
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", model_max_length=2048)


def _identity_vae():
    """A VAE whose decode is the identity (latent = image in [-1, 1]); built lazily so models.py needs no diffusers."""
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class IdentityVAE(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, latent_channels=3, block_out_channels=(1,), scaling_factor=1.0, shift_factor=0.0):
            super().__init__()
            self.register_buffer("anchor", torch.zeros(1))  # gives the module a dtype and a device

        def decode(self, z, return_dict=False):
            return (z,)

    return IdentityVAE()


def build_tiny_flow_pipeline(seed=0, *, latent_size=8, layers=2, max_length=16):
    """builtin:tiny-flow: a tiny random StableDiffusion3Pipeline built in memory, offline and identical on every rank
    (same seed): a 2-block SD3 transformer on 8x8x3 latents (block 0 with SD3.5's second attention, attn2), two tiny
    CLIP text encoders with a word-level tokenizer, no T5, and an identity VAE (the latent is the 8x8 RGB image), so a
    reward on pixels is a reward on latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection
    torch.manual_seed(seed)
    tok, clip = _tiny_clip(max_length)
    transformer = SD3Transformer2DModel(sample_size=latent_size, patch_size=2, in_channels=3, out_channels=3,
                                        num_layers=layers, attention_head_dim=16, num_attention_heads=2,
                                        joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64,
                                        pos_embed_max_size=latent_size, dual_attention_layers=(0,))
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_identity_vae(),
        text_encoder=CLIPTextModelWithProjection(clip), tokenizer=tok,
        text_encoder_2=CLIPTextModelWithProjection(clip), tokenizer_2=tok, text_encoder_3=None, tokenizer_3=None)


def build_tiny_flux_pipeline(seed=0, *, latent_size=8, max_length=16):
    """builtin:tiny-flux: a tiny random FluxPipeline built in memory (FLUX.1-dev layout: guidance embedding, packed
    2x2 latents, CLIP pooled + T5 tokens), with the identity VAE and word-level tokenizer of builtin:tiny-flow."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel
    torch.manual_seed(seed)
    tok, clip_config = _tiny_clip(max_length)
    clip = CLIPTextModel(clip_config)  # (no projection: projection_dim unread)
    t5 = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                 pad_token_id=2, dropout_rate=0.0))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=12, num_layers=1, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True),
                        vae=_identity_vae(), text_encoder=clip, tokenizer=tok, text_encoder_2=t5, tokenizer_2=tok,
                        transformer=transformer)
    for m in (clip, t5, transformer):
        m.eval()
    pipe.default_sample_size = latent_size  # 8x8 images by default (FLUX's own default is 128 latents)
    return pipe


def build_tiny_qwen_image_pipeline(seed=0, *, latent_size=8):
    """builtin:tiny-qwen-image: a tiny random QwenImagePipeline built in memory, offline and identical on every rank: a
    2-block QwenImageTransformer2DModel on packed 2x2 latents (4 channels -> 16 per token), a 2-layer Qwen2.5-VL text
    encoder (hidden 32) with the word-level tokenizer above, a real (random) AutoencoderKLQwenImage with one 2x
    downsampling and non-trivial latents_mean / latents_std (16x16 images), and Qwen-Image's scheduler config
    (dynamic exponential shift, shift_terminal 0.02)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    tok = _word_qwen_tokenizer()
    unused = len(tok) + 100  # vision token ids outside the vocabulary: a text-only prompt never contains them
    text = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        image_token_id=unused, video_token_id=unused + 1, vision_start_token_id=unused + 2,
        vision_end_token_id=unused + 3, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    z = 4
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
                                 latents_mean=[-0.5, 0.2, 0.0, 0.7], latents_std=[1.5, 0.8, 1.2, 2.0])
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * z, out_channels=z, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler_config.json
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0, shift_terminal=0.02,
        time_shift_type="exponential", use_dynamic_shifting=True)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text, tokenizer=tok, transformer=transformer)
    for m in (text, vae, transformer):
        m.eval()
    pipe.default_sample_size = latent_size  # 16x16 images by default (Qwen-Image's own default is 128 latents)
    return pipe


BUILTIN_PIPELINES = {"builtin:tiny-flow": build_tiny_flow_pipeline, "builtin:tiny-flux": build_tiny_flux_pipeline,
                     "builtin:tiny-qwen-image": build_tiny_qwen_image_pipeline}


# ---- Image tasks (flow_grpo.py): prompts, and rewards fn(prompts, images: list[PIL.Image], **columns) -> list[float | None]

COLORS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
          "white": (255, 255, 255), "black": (0, 0, 0), "purple": (128, 0, 128), "orange": (255, 165, 0)}


def colors_task(n, seed):
    """'a red square on a black background'-style prompts with their target colour in the `color` column."""
    rng = random.Random(seed)
    shapes, backs = ["square", "circle", "cat", "house", "flower", "car"], ["black", "white", "grey", "dark"]
    return [{"prompt": f"a {c} {rng.choice(shapes)} on a {rng.choice(backs)} background", "color": c}
            for c in (rng.choice(list(COLORS)) for _ in range(n))]


def _pixels(image):
    return np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0  # [H, W, 3] in [0, 1]


def brightness_reward(prompts, images, **_):
    """Mean pixel value in [0, 1]."""
    return [float(_pixels(im).mean()) for im in images]


def target_color_reward(prompts, images, color=None, **_):
    """1 - mean absolute distance of the pixels to the row's `color` (a name in COLORS), in [0, 1]; None without one."""
    return [None if c not in COLORS else float(1 - np.abs(_pixels(im) - np.array(COLORS[c]) / 255).mean())
            for im, c in zip(images, color or [None] * len(images))]


def _jpeg_kb(image, quality=95):
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.tell() / 1000


def jpeg_compressibility_reward(prompts, images, **_):
    """DDPO (arXiv 2305.13301): minus the JPEG size in kB (quality 95): simpler images score higher."""
    return [-_jpeg_kb(im) for im in images]


def jpeg_incompressibility_reward(prompts, images, **_):
    """DDPO (arXiv 2305.13301): the JPEG size in kB: more detailed images score higher."""
    return [_jpeg_kb(im) for im in images]


IMAGE_TASKS = {"colors": colors_task}
IMAGE_REWARDS = {"brightness": brightness_reward, "target_color": target_color_reward,
                 "jpeg_compressibility": jpeg_compressibility_reward,
                 "jpeg_incompressibility": jpeg_incompressibility_reward}


def resolve_image_reward(name):
    """A built-in image reward (IMAGE_REWARDS) or 'package.module:function'."""
    if name in IMAGE_REWARDS:
        return IMAGE_REWARDS[name]
    if ":" in name:
        return user_code.resolve(name, "--rewards")
    raise ValueError(f"--rewards: unknown image reward {name!r}. Use one of {', '.join(IMAGE_REWARDS)} or "
                     "'package.module:function' (fn(prompts, images, **columns) -> list[float | None]).")


def load_prompt_rows(name, *, split="train", prompt_column="prompt", size=2000, seed=0):
    """Prompts for flow_grpo.py: a built-in image task (IMAGE_TASKS), a .txt file (one prompt a line), or anything
    load_dataset_rows reads (.jsonl / .parquet / hub)."""
    if name in IMAGE_TASKS:
        return IMAGE_TASKS[name](size, seed if split == "train" else seed + 10_000)
    if name.endswith(".txt"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"--dataset {name!r}: no such file. Pass a .txt (one prompt a line), .jsonl or "
                                    f".parquet file, a hub dataset or a built-in task ({', '.join(IMAGE_TASKS)}).")
        with open(name) as f:
            return [{"prompt": line.strip()} for line in f if line.strip()]
    return tasks.load_dataset_rows(name, split=split, prompt_column=prompt_column, size=size, seed=seed,
                                   flags=("--dataset", "--prompt-column"))


# ---- The SDE step and its Gaussian log-likelihood (pure functions). x, v, mean: [B, C, h, w]; sigma: [B, 1, 1, 1] ----

def sde_std(sigma, sigma_max, noise_level):
    """sigma_t = a sqrt(t / (1 - t)) (Flow-GRPO eq. 9); at t = 1 the denominator uses 1 - sigma_max, the largest
    sigma below 1, as the reference code does."""
    return noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))


def sde_mean(x, v, sigma, sigma_next, std):
    """Flow-GRPO eq. 9: mu = x + [v + std^2 / (2t) (x + (1 - t) v)] dt with dt = sigma_next - sigma < 0."""
    return x + (v + std ** 2 / (2 * sigma) * (x + (1 - sigma) * v)) * (sigma_next - sigma)


def gaussian_logprob(x_next, mean, scale):
    """log N(x_next; mean, scale^2 I) per dimension, averaged over the latent (Flow-GRPO's convention): -> [B]."""
    lp = -(x_next - mean) ** 2 / (2 * scale ** 2) - torch.log(scale) - 0.5 * math.log(2 * math.pi)
    return lp.flatten(1).mean(-1)


def gaussian_kl(mean, ref_mean, scale):
    """KL(N(mean, s^2 I) || N(ref_mean, s^2 I)) = |mean - ref_mean|^2 / (2 s^2), averaged over the latent: -> [B]."""
    return ((mean - ref_mean) ** 2 / (2 * scale ** 2)).flatten(1).mean(-1)


def sde_step(x, v, sigma, sigma_next, sigma_max, noise_level, *, noise=None, x_next=None):
    """One denoising step: sample x_next = mean + scale * noise (or take the given x_next) -> (x_next, log-prob [B],
    mean, scale). scale = sigma_t sqrt(|dt|); with noise_level 0 it is the scheduler's Euler step and log-prob 0."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, v.dtype), torch.float32)  # bf16 overflows; float64 stays
    x, v, sigma, sigma_next, sigma_max = (torch.as_tensor(t, device=x.device).to(dtype)
                                          for t in (x, v, sigma, sigma_next, sigma_max))
    std = sde_std(sigma, sigma_max, noise_level)
    mean = sde_mean(x, v, sigma, sigma_next, std)
    scale = std * torch.sqrt(sigma - sigma_next)
    if x_next is None:
        x_next = mean + scale * noise if noise_level > 0 else mean
    logp = gaussian_logprob(x_next, mean, scale) if noise_level > 0 else x.new_zeros(x.shape[0])
    return x_next, logp, mean, scale


def step_sigmas(scheduler, num_steps, image_seq_len=None):
    """The scheduler's sigma schedule for num_steps (its shift applied; FLUX's and Qwen-Image's shift grows with the
    image's token count, as FluxPipeline and QwenImagePipeline compute it): [num_steps + 1], from 1 down to 0."""
    if scheduler.config.use_dynamic_shifting:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift
        c = scheduler.config
        mu = calculate_shift(image_seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
    else:
        scheduler.set_timesteps(num_steps, device="cpu")
    return scheduler.sigmas.float().clone()


def bcast(s, x):
    """Per-image sigmas [B] -> [B, 1, ...] against latents x ([B, C, h, w], or the packed [B, L, D] of FLUX / Qwen)."""
    return s.view(-1, *[1] * (x.dim() - 1))


# ---- Image grids ----

def image_grid(images, n_cols, captions, cell=96):
    """A grid PNG: one row per prompt (its caption on the left), one column per generation; pixels upscaled."""
    from PIL import Image, ImageDraw
    n_rows, text_w = math.ceil(len(images) / n_cols), 6 * max(len(c) for c in captions) + 8
    grid = Image.new("RGB", (text_w + n_cols * cell, n_rows * cell), "white")
    draw = ImageDraw.Draw(grid)
    for k, im in enumerate(images):
        r, c = divmod(k, n_cols)
        grid.paste(im.convert("RGB").resize((cell, cell), Image.NEAREST), (text_w + c * cell, r * cell))
    for r, text in enumerate(captions):
        draw.text((4, r * cell + cell // 2 - 5), text, fill="black")
    return grid
