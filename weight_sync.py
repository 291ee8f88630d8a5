"""weight_sync.py: what the engine gets of the policy at a weight sync, gathered from the FSDP2 shards: the names it
will send (checked against the engine's before the first sync), then the tensors, streamed in buckets of whole layers.
A LoRA policy (--lora.sync) sends either each layer merged by PEFT (`peft_merged`) under the base names, or only its
adapter: lora_A and lora_B of each adapted layer (`adapter_weights`), which vLLM serves as a LoRA request built in
memory (no file per step), and the HF engine as PEFT LoRA layers injected into its own copy. Also here: which
--lora.sync a checkpoint can take (`embedding_targets`, `vllm_lora_class`: flags.validate_lora_sync)."""
import glob
import re

import torch

from console import UserError
from distributed import full_tensor
from models import clean_name, is_image_text, is_peft

ADAPTER = re.compile(r"\.lora_|\.trainable_tokens_")  # an adapter's own tensors: PEFT LoRA, trainable token rows
PREFIX = "base_model.model."  # PEFT's saved-adapter names: base_model.model.<module>.lora_A.weight
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM accepts (vllm/config/lora.py)


def _skip(key, tied):
    return bool(ADAPTER.search(key)) or ".reference." in key or (tied and key.endswith("lm_head.weight"))


def _lora_layers(model, adapter="default"):
    """[(the layer's sent name before .lora_A/.lora_B, layer)] of every layer carrying `adapter`, in module order."""
    return [(PREFIX + clean_name(n), m) for n, m in model.named_modules() if adapter in getattr(m, "lora_A", {})]


def sync_names(model, adapter=False):
    """The names the sync will send (checkpoint names; adapter=True: the adapter's), computed locally (no collective)."""
    if adapter:
        return [key + f".lora_{ab}.weight" for key, _ in _lora_layers(model) for ab in "AB"]
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    return [clean_name(k) for k in model.state_dict().keys() if not _skip(k, tied)]


def adapted_weight(name):
    """An adapter tensor's name (the trainer's or a sent one) -> the checkpoint name of the weight its layer adapts;
    any other name -> its checkpoint name."""
    return clean_name(ADAPTER.split(name)[0] + ".weight" if ADAPTER.search(name) else name)


def check_sync_names(engine, model):
    """Before the first sync: every name the trainer will send must be one the engine loads. Raises on every rank."""
    raise_unknown_names(engine.unknown_names(sync_names(model, engine.adapter)))


def raise_unknown_names(unknown):
    """The engine's unknown names (every rank holds the same list) -> one message: an adapter sync's (PEFT's prefix:
    only --lora.sync adapter sends them) names --lora.sync, a merged sync's names the loader."""
    if not unknown:
        return
    shown = "\n  ".join(unknown[:20]) + (f"\n  ... and {len(unknown) - 20} more" if len(unknown) > 20 else "")
    if unknown[0].startswith(PREFIX):
        raise ValueError(f"--lora.sync adapter: the engine has no LoRA layer for {len(unknown)} adapter tensors:\n  "
                         f"{shown}\nUse --lora.sync merged (merged weights under the base names), or leave these "
                         "modules out of --lora.target-modules.")
    raise ValueError(f"weight sync: {len(unknown)} parameter names are not known to the engine:\n  {shown}\n"
                     "Load image-text checkpoints with models.load_policy (AutoModelForImageTextToText) so the "
                     "names match what the engine serves, and pass --model the same checkpoint the engine loads.")


def checkpoint_names(path):
    """Tensor names stored in a checkpoint's safetensors files (what the engine loaded from disk)."""
    from safetensors import safe_open
    names = set()
    for f in glob.glob(f"{glob.escape(path)}/*.safetensors"):  # (vLLM's loader globs the same)
        with safe_open(f, framework="pt") as fh:
            names.update(fh.keys())
    return names


# ---- The tensors: gathered from the shards, identical on every rank ----

def engine_weights(model, dtype, *, full=True, adapter=False, tally=None):
    """What one sync sends: the adapter (--lora.sync adapter) or the (merged) weights; tally["bytes"] counts them."""
    for name, t in adapter_weights(model, dtype) if adapter else iter_engine_weights(model, dtype, full=full):
        if tally is not None:
            tally["bytes"] = tally.get("bytes", 0) + t.numel() * t.element_size()
        yield name, t


def iter_engine_weights(model, dtype, *, full=True):
    """Yield (checkpoint name, full tensor in `dtype`) in state_dict order, identical on every rank (full_tensor is a
    collective). A LoRA layer is sent as PEFT's own merge of the 'default' adapter (`peft_merged`: plain LoRA, rsLoRA,
    DoRA, embeddings, lora_bias) under the base name. full=False sends only the layers training changes."""
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    # a partial sync sends whole layers (an adapter's tensors count as theirs): vLLM's fused qkv given q alone -> NaN
    dirty = {_layer_key(adapted_weight(k)) for k, p in model.named_parameters() if p.requires_grad}
    merged = {}  # the current LoRA layer's merged base parameters (one layer at a time)
    for key, t in model.state_dict().items():
        if _skip(key, tied) or not (full or _layer_key(clean_name(key)) in dirty):
            continue
        prefix, _, leaf = key.partition(".base_layer.")
        if leaf and is_peft(model) and hasattr(model.get_submodule(prefix), "merge"):
            if prefix not in merged:
                merged = {prefix: peft_merged(model.get_submodule(prefix))}
            w = merged[prefix]["base_layer." + leaf]
        else:
            w = full_tensor(t)
        yield clean_name(key), w.detach().to(dtype)


def peft_merged(layer, adapter="default"):
    """(collective) PEFT's own merge (`layer.merge`) of one adapter, run on gathered float32 copies swapped in for
    the layer's parameters, so the training module is untouched. -> {'base_layer.<name>': merged full tensor}."""
    others = {a for n in layer.adapter_layer_names for a in getattr(layer, n).keys()} - {adapter}
    copies = {n: torch.nn.Parameter(full_tensor(p).detach().float().clone(), requires_grad=False)
              for n, p in layer.named_parameters() if not others & set(n.split("."))}
    originals = _swap_params(layer, copies)
    try:
        layer.merge(adapter_names=[adapter])
        out = {n: layer.get_parameter(n).detach().clone() for n in copies if n.startswith("base_layer.")}
        layer.unmerge()  # resets PEFT's merged flags (on the copies)
    finally:
        _swap_params(layer, originals)
    return out


def _swap_params(module, params):
    """Put params {dotted name: Parameter} in place of the module's own; return what was there."""
    old = {}
    for name, p in params.items():
        owner, _, leaf = name.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        old[name] = sub._parameters[leaf]
        sub._parameters[leaf] = p
    return old


def adapter_weights(model, dtype, adapter="default"):
    """(collective) Yield (PEFT name, full tensor in `dtype`) of every LoRA layer's lora_A and lora_B, in module order.
    lora_B comes times the layer's PEFT scaling (alpha / r, rsLoRA's alpha / sqrt(r), rank and alpha patterns): the
    engine applies it at scaling 1, as vLLM folds its own scaling into lora_B (LoRALayerWeights.optimize)."""
    for key, layer in _lora_layers(model, adapter):
        b = full_tensor(layer.lora_B[adapter].weight).detach().float()
        yield key + ".lora_A.weight", full_tensor(layer.lora_A[adapter].weight).detach().to(dtype)  # [r, in]
        yield key + ".lora_B.weight", (b * layer.scaling[adapter]).to(dtype)  # [out, r]


def _layer_key(name):
    """'model.layers.3.mlp.up_proj.weight' -> 'model.layers.3' (decoder layers and vision blocks); else the name."""
    m = re.match(r"(.*\.(?:layers|blocks)\.\d+)\.", name)
    return m.group(1) if m else name


def layer_buckets(named_tensors, max_bytes):
    """Group a (name, tensor) stream into lists of about max_bytes, never splitting one decoder layer: vLLM fuses
    q/k/v and gate/up, and a reload that splits a fused module across calls corrupts it (measured: NaN log-probs)."""
    bucket, size, layer = [], 0, None
    for name, t in named_tensors:
        key = _layer_key(name)
        if bucket and size >= max_bytes and key != layer:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size, layer = size + t.numel() * t.element_size(), key
    if bucket:
        yield bucket


# ---- The engines' side of an adapter sync ----

def adapter_refused(e):
    """An adapter the engine cannot take (every rank's engine refuses the same one, after the sync's collectives)."""
    return UserError(f"--lora.sync adapter: the engine refused the adapter: {e}. Use --lora.sync merged (merged "
                     "weights under the base names).")


def vllm_options(rank):
    """vLLM's LoRA settings for adapters of rank <= `rank`: one adapter slot (the policy's current version)."""
    return dict(enable_lora=True, max_loras=1, max_lora_rank=next(r for r in VLLM_RANKS if r >= rank))


def _manager(worker):
    mgr = worker.model_runner.lora_manager._adapter_manager
    mapper = getattr(mgr.model, "hf_to_vllm_mapper", None)  # image-text models rename their language model
    return mgr, mapper.get_rename_mapper() if mapper else None


def unknown_adapter_names(worker, names):
    """(vLLM worker) The adapter names whose module vLLM serves no LoRA for (after its renames and q/k/v packing)."""
    from vllm.lora.utils import parse_fine_tuned_lora_name
    mgr, mapper = _manager(worker)
    known = set(mgr.modules) | {m for parts in mgr.packed_modules.values() for m in parts}
    return [n for n in names if parse_fine_tuned_lora_name(n, mapper)[0] not in known]


def load_adapter(worker, tensors, lora_id):
    """(vLLM worker) Make `tensors` the engine's only adapter, as LoRA id `lora_id`: a LoRAModel built in memory (what
    vLLM builds from an adapter folder), registered with the worker's manager; a request with that id then finds it
    loaded and never reads its path. Scaling 1: lora_B comes scaled (adapter_weights)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    mgr, mapper = _manager(worker)
    r = max(t.shape[0] for n, t in tensors.items() if n.endswith("lora_A.weight"))
    if r > mgr.lora_config.max_lora_rank:
        raise ValueError(f"rank {r} is above the engine's max LoRA rank {mgr.lora_config.max_lora_rank}")
    helper = PEFTHelper.from_dict({"r": r, "lora_alpha": r, "target_modules": []})
    lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=mgr.lora_config.lora_dtype,
                                       weights_mapper=mapper)
    worker.model_runner.lora_manager.remove_all_adapters()  # the previous version
    mgr.add_adapter(lora)  # packs q/k/v and gate/up as vLLM fuses them
    if unknown := sorted(set(lora.loras) - set(mgr.modules)):
        raise ValueError(f"no LoRA layer in the engine for {unknown[:5]}")
    mgr.activate_adapter(lora_id)  # into the engine's LoRA slot now: a tensor it cannot take fails this sync


def hf_load_adapter(model, named, first):
    """HF engine: PEFT LoRA layers (default adapter, scaling 1, in their base layer's dtype) on the modules the sync
    names, injected at the first sync, take the sent lora_A / lora_B (as <module>.lora_A.default.weight). Every tensor
    has arrived (the sync's collectives are over) before anything can fail, and every rank fails alike: one message."""
    named = list(named)
    try:
        if first:
            from peft import LoraConfig, inject_adapter_in_model
            ranks = {n[len(PREFIX):-len(".lora_A.weight")]: t.shape[0] for n, t in named if n.endswith("lora_A.weight")}
            inject_adapter_in_model(LoraConfig(target_modules=sorted(ranks), rank_pattern=ranks, alpha_pattern=ranks),
                                    model)
        params = model.state_dict()
        for n, t in named:
            params[n[len(PREFIX):-len("weight")] + "default.weight"].copy_(t)
    except Exception as e:  # (ValueError, KeyError, RuntimeError, ...)
        raise adapter_refused(e) from None


# ---- Which --lora.sync a checkpoint can take (flags.validate_lora_sync) ----

def embedding_targets(path, lora, trust_remote_code=False):
    """The modules LoRA would adapt in checkpoint `path` that are embeddings (an nn.Embedding, or the input embeddings
    however named: GPT-2's wte), found by what they are on a meta-device copy of the model (no weights). `lora`: our
    LoraConfig (explicit --lora.target-modules) or a continued adapter's folder (its saved targets, regexes, filters)."""
    from peft import LoraConfig, PeftConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    peft_cfg = PeftConfig.from_pretrained(lora.adapter) if lora.adapter else LoraConfig(
        target_modules=list(lora.target_modules))
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if is_image_text(config) else AutoModelForCausalLM).from_config(
            config, trust_remote_code=trust_remote_code)
    emb = model.get_input_embeddings()
    return [n for n, m in model.named_modules()
            if (isinstance(m, torch.nn.Embedding) or m is emb) and check_target_module_exists(peft_cfg, n)]


def vllm_lora_class(path, trust_remote_code=False):
    """The class vLLM's engine will build for checkpoint `path`, resolved as vLLM's model loader resolves it
    (get_model_architecture) without starting an engine -> (its name, whether it serves LoRA: vLLM's supports_lora)."""
    from vllm.config import ModelConfig
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.models import supports_lora
    cls, _ = get_model_architecture(ModelConfig(model=path, trust_remote_code=trust_remote_code))
    return cls.__name__, supports_lora(cls)
