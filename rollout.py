"""rollout.py: the generation engines and their sampling (what a weight sync sends them: weight_sync.py).

Two engines, one interface (generate / load_weights / unknown_names / sleep / wake_up):
  VLLMEngine: a vLLM `LLM` inside each rank (external_launcher), TP groups of `tp` ranks, sleep mode on CUDA.
  HFEngine:   transformers `generate()` on an unsharded copy, for machines without vLLM (`--rollout.engine hf`).
Both return, per prompt, `n` Completions with the token ids and the sampled tokens' processed log-probs
(after temperature / top-p / top-k), which the trainer compares with its own log-probs."""
import functools
import gc
import hashlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import weight_sync
from losses import sampling_mask
from models import VISION_KEYS, fp32_final_norm, is_image_text, lm_head, load_policy
from token_logprobs import PLACEHOLDER_BIAS, attention_only, collapse_placeholders


@dataclass
class VLLMConfig:
    tp: int = 1
    """Tensor-parallel size of each engine (ranks r // tp share one engine and one prompt batch)."""
    gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take (weights + KV cache), colocated with training. Inference ranks
    (--rollout.inference-ranks) own their GPUs: raise it there (e.g. 0.85)."""
    max_model_len: int = 1024
    """Engine context length; must hold max_prompt_length + max_completion_length."""
    enable_sleep_mode: bool = True
    """CUDA only: release the engine's memory between generation and training (ignored on CPU)."""
    sleep_level: int = 1
    """1 = offload weights to CPU and drop KV cache; 2 = drop weights too (then every sync re-sends all weights)."""
    kv_cache_gb: float = 1.0
    """CPU only: KV-cache size in GiB (fractions allowed; vLLM's own default would reserve ~21 GiB per engine). It
    needs max_model_len tokens at least; VLLM_CPU_KVCACHE_SPACE (whole GiB), when set, overrides it."""
    sync_bucket_mb: int = 1024
    """Weight sync streams the weights in buckets of about this size (whole decoder layers; never split a layer)."""
    block_size: int | None = None
    """KV-cache block size in tokens (None = 32 on CPU, vLLM's default on CUDA). The prefix cache shares only full
    blocks: the G completions of a prompt reuse its prefill for every full block of it. On CPU (whose attention
    needs multiples of 32) vLLM's default of 128 shares nothing of a prompt shorter than 128 tokens; 32 made the
    SmolLM2 setting's generation (16 completions, ~48-token prompts, 64 tokens) ~17% faster here."""


@dataclass
class RolloutConfig:
    engine: str = "auto"
    """vllm | hf | auto (vllm when installed, else transformers generate)."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling; the trainer's log-probs are those of the same truncated, renormalised distribution."""
    top_k: int = 0
    """Top-k sampling (0 = off); the trainer applies the same truncation."""
    max_prompt_length: int = 128
    """Prompts longer than this are truncated from the left."""
    max_completion_length: int | None = None
    """Maximum generated tokens per completion; in multi-turn episodes, model tokens over all turns (also Dr. GRPO's
    constant denominator unless --loss.max-completion-length). Default: 256 (TRL's), 2 for the built-in tiny models
    (the find_digit answer is one character; flags.fill_defaults)."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length without EOS from the loss (DAPO)."""
    max_turns: int = 4
    """Multi-turn (--data.tools / --env): most model turns per episode; a turn without a tool call ends it."""
    max_total_length: int | None = None
    """Multi-turn: cap on prompt + every turn + inserted messages, in tokens (None = --vllm.max-model-len)."""
    max_turn_tokens: int = 0
    """Multi-turn: most tokens one model turn may generate (0 = no cap but what the episode's limits leave); a turn cut
    at it ends its episode, truncated (ended "max_turn_tokens": docs/multi-turn.md, "Unfinished episodes")."""
    tool_timeout_s: float = 10.0
    """Seconds each tool call may take; then the model reads a timeout error instead of the result."""
    env_timeout_s: float = 60.0
    """--env: seconds each make_env() + reset() and each step() may take; an environment that raises or runs past it
    ends its episode with reward None (counted in reward/failed), and the run goes on."""
    max_mismatch: float = 0.1
    """Stop when engine and trainer log-probs of the sampled tokens differ by more than this (mean abs nats) before
    an update: stale weights, mismatched sampling settings or dtype. A correct bf16 run stays far below. With
    --rollout.inference-ranks it also bounds both sides' scores of a fixed probe at each version (a broken transfer
    shows even when every sample is stale: async/probe_mismatch). 0 = off."""
    inference_ranks: int = 0
    """Asynchronous rollouts: the last K ranks of the torchrun world only generate (vLLM, --vllm.tp ranks per engine,
    or the HF engine) and the others only train (0 = the colocated loop). inference_ranks.py."""
    max_staleness: int = 1
    """With --rollout.inference-ranks: samples of step s come from weights of version >= s - S (version = steps
    done). 0 = always the current weights (disaggregated but synchronous); 1 = generation of batch s+1 overlaps
    training on batch s. The staleness gap is corrected by --loss.sampler-correction (engine log-probs = behaviour)."""
    inflight_updates: int = 0
    """With --rollout.inference-ranks: a generator samples N tokens at a time and loads newer pushed weights between
    chunks; completions in progress continue under them (partial rollouts; each token keeps its own behaviour log-prob
    and version). 0 = weights change only between batches. inflight.py."""
    compile_decode: bool = False
    """The HF engine (text models of full-attention layers): decode into a static KV cache kept across steps, the
    decode step compiled by torch.compile (on CUDA with CUDA graphs: a small model's decode step is bound by its
    kernel launches), attention by sdpa. Every row of a batch runs until the last one stops. docs/models-and-engine.md."""
    timeout_s: float = 600.0
    """With --rollout.inference-ranks: longest wait across the trainer / generator split (a batch, a weight push)
    before the run stops with a message naming the rank that did not answer. Must exceed one step's training."""


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    truncated: bool  # hit max_tokens without EOS
    versions: list[int] | None = None  # --rollout.inflight-updates: the weight version that sampled each token


def check_compile_decode(config, model):
    """--rollout.compile-decode's StaticCache must hold a text model's layers as plain full-attention KV (transformers
    picks each layer's kind from the config): raise naming what `model` is otherwise."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    kinds = set() if is_image_text(config) else {  # (no tensors yet)
        type(layer).__name__ for layer in StaticCache(config=config, max_cache_len=1).layers}
    if kinds != {StaticLayer.__name__}:
        unfit = f"a model whose layers cache as {', '.join(sorted(kinds))}" if kinds else "an image-text model"
        raise ValueError(f"--rollout.compile-decode needs a text model of full-attention layers; {model} is {unfit}. "
                         "Drop --rollout.compile-decode.")


def completion_seeds(seed, step, first, n_prompts, n):
    """One random stream per completion, keyed by (seed, step, the prompt's place in the step's batch, sample index):
    no two completions of a run share sampling noise, a resumed run draws the same ones, and how the batch is cut over
    ranks does not change them. `first`: the place of these prompts' first. -> [n_prompts][n] 63-bit ints."""
    key = lambda i, j: hashlib.blake2b(f"{seed}:{step}:0:{first + i}:{j}".encode(), digest_size=8).digest()  # noqa: E731
    return [[int.from_bytes(key(i, j), "little") >> 1 for j in range(n)] for i in range(n_prompts)]


def later_seed(seed, kind, k):
    """Part k of a completion (kind: an episode's "turn", an in-flight "chunk") samples from a stream derived from the
    completion's seed; part 0 from that seed itself, as a one-piece rollout would. None stays None."""
    if seed is None or k == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:{kind}{k}".encode(), digest_size=8).digest(), "little") >> 1


def _repack_cpu_lm_head(worker):
    """vLLM's CPU backend pre-packs the lm-head GEMM at load; a tied head gets no weights of its own in a reload and
    would keep the old embedding: re-pack it (without: ~0.7 nats log-prob drift after one update, tied tiny Qwen2)."""
    for name, head in worker.model_runner.model.named_modules():
        if name.split(".")[-1] == "lm_head" and hasattr(head, "cpu_linear"):
            head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    def __init__(self, model_path, *, seed, cfg: VLLMConfig, dtype="auto", image_text=False, banned_token_ids=(),
                 show_progress=True, lora_rank=0):
        on_cuda = torch.cuda.is_available()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this rank's process
        from vllm import LLM
        # CPU: no chunked prefill (a cut prompt rewinds its seeded generator: "CPU Generator does not use offset")
        kwargs = dict(model=model_path, seed=seed, tensor_parallel_size=cfg.tp, max_model_len=cfg.max_model_len,
                      enable_chunked_prefill=on_cuda, dtype=dtype, logprobs_mode="processed_logprobs",
                      enforce_eager=not on_cuda, use_tqdm_on_load=show_progress)  # the "Loading safetensors checkpoint shards" bar
        if not on_cuda:
            kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * 2**30)
        if cfg.block_size or not on_cuda:
            kwargs["block_size"] = cfg.block_size or 32
        if dist.is_initialized():
            kwargs["distributed_executor_backend"] = "external_launcher"
        if on_cuda:
            kwargs.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=cfg.enable_sleep_mode)
        if image_text:
            kwargs["limit_mm_per_prompt"] = {"image": 1, "video": 0}
        if lora_rank:  # --lora.sync adapter: generate with the policy's adapter, one LoRA id per version
            kwargs.update(weight_sync.vllm_options(lora_rank))  # (its requests carry no tokenizer: drop vLLM's warning)
            logging.getLogger("vllm.v1.engine.input_processor").addFilter(lambda r: "LoRA" not in r.getMessage())
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":  # in this process, vLLM freezes the heap once started
            gc.collect()  # (gc.freeze) after 3 full collections over all of it (0.8 s of 2 on CPU): frozen now, the
            gc.freeze()  # trainer's heap is already static to them
        self.llm = LLM(**kwargs)
        self.adapter, self.lora_id = bool(lora_rank), 0
        self.model_path, self.image_text, self.banned = model_path, image_text, list(banned_token_ids)
        self.image_token_id = getattr(self.llm.llm_engine.model_config.hf_config, "image_token_id", None)
        self.bucket_mb = cfg.sync_bucket_mb
        self.sleep_level = cfg.sleep_level if (on_cuda and cfg.enable_sleep_mode) else 0
        self.needs_full_sync = True  # the first sync sends everything

    def unknown_names(self, names):
        if self.adapter:
            return self.llm.collective_rpc(weight_sync.unknown_adapter_names, args=(names,))[0]
        on_disk = weight_sync.checkpoint_names(self.model_path)  # what the engine loaded: accepted as is
        rest = [n for n in names if n not in on_disk]

        def engine_side(worker):  # others must map (HF -> vLLM names, fused qkv / gate_up) onto an engine parameter
            model = worker.model_runner.model
            mapper = getattr(model, "hf_to_vllm_mapper", None)
            packed = getattr(model, "packed_modules_mapping", {}) or {}
            params = {n for n, _ in model.named_parameters()}

            def known(n):
                n = mapper.map_name(n) if mapper else n
                candidates = [n] + [n.replace(f".{part}.", f".{fused}.") for fused, parts in packed.items()
                                    for part in parts if f".{part}." in (n or "")]
                return any(c in params for c in candidates if c)
            return [n for n in rest if not known(n)]
        return self.llm.collective_rpc(engine_side)[0]

    def lora_request(self):
        """--lora.sync adapter: the request of the adapter loaded last (None before the first, or without LoRA)."""
        from vllm.lora.request import LoRARequest
        return LoRARequest(f"policy-{self.lora_id}", self.lora_id, f"memory:{self.lora_id}") if self.lora_id else None

    def load_weights(self, named_tensors):
        if self.adapter:  # a new id per version: vLLM caches adapters, and their prefix-cache blocks, by id and name
            try:
                self.llm.collective_rpc(weight_sync.load_adapter, args=(dict(named_tensors), self.lora_id + 1))
            except Exception as e:  # (ValueError, RuntimeError, ...)
                raise weight_sync.adapter_refused(e) from None
            self.lora_id += 1
        else:
            for bucket in weight_sync.layer_buckets(named_tensors, self.bucket_mb * 2**20):
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": bucket})
            self.llm.collective_rpc(_repack_cpu_lm_head)
        self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        if self.image_text:
            self.llm.llm_engine.reset_encoder_cache()  # else: "Encoder cache miss" on the next image
        self.needs_full_sync = False

    def sleep(self):
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)
            self.needs_full_sync = self.sleep_level >= 2  # level 2 discards the weights

    def wake_up(self):
        if self.sleep_level:
            self.llm.wake_up()

    def generate(self, prompts, *, n, temperature, top_p=1.0, top_k=0, max_tokens=128, seeds=None):
        """prompts: dicts with prompt_token_ids (and for images: prompt + multi_modal_data) -> [[Completion] * n].
        seeds: per prompt, n seeds (completion_seeds): one request per completion, each with its own stream (one
        request with n samples and one seed would give completion k of every prompt the same noise).
        max_tokens: one limit, or one per prompt (multi-turn episodes continue with different budgets)."""
        from vllm import SamplingParams
        lora = self.lora_request()
        bias = {i: PLACEHOLDER_BIAS for i in self.banned} or None
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        params = lambda k, seed, limit: SamplingParams(  # noqa: E731
            n=k, temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0, max_tokens=limit,
            logprobs=0, detokenize=False, seed=seed, logit_bias=bias)
        # image prompts: text + image, or (an episode's turns) ids, the placeholder run cut to one (vLLM expands it)
        vllm_prompts = [{"prompt_token_ids": p["prompt_token_ids"]} if "multi_modal_data" not in p else
                        {"prompt": p["prompt"], "multi_modal_data": p["multi_modal_data"]} if "prompt" in p else
                        {"prompt_token_ids": collapse_placeholders(p["prompt_token_ids"], {self.image_token_id}),
                         "multi_modal_data": p["multi_modal_data"]} for p in prompts]
        if seeds is None or temperature == 0:  # greedy needs no seeds (and n == 1)
            outs = [o.outputs for o in self.llm.generate(vllm_prompts, [params(n, None, m) for m in limits],
                                                         use_tqdm=False, lora_request=lora)]
        else:  # the prefix cache shares each full KV block of a prompt (--vllm.block-size)
            flat = self.llm.generate([p for p in vllm_prompts for _ in range(n)],
                                     [params(1, s, m) for ss, m in zip(seeds, limits) for s in ss], use_tqdm=False,
                                     lora_request=lora)
            outs = [[flat[i * n + j].outputs[0] for j in range(n)] for i in range(len(prompts))]
        return [[Completion(list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
                            c.finish_reason == "length") for c in o] for o in outs]


def kept_token(z, token):
    """z [rows, V] log-probs, token [rows] -> token, each masked (-inf) pick moved to the nearest kept token below it
    (above where none is). A sequential float64 cumsum never lands on a masked token; a parallel one (CUDA) can, by
    one rounding step, and a masked pick would have log-prob -inf."""
    bad = z.gather(-1, token[:, None])[:, 0] == float("-inf")  # [rows]
    if not z.is_cuda and not bad.any():  # on CUDA the check would cost a host sync per step: every row runs below
        return token
    kept = torch.where(z > float("-inf"), torch.arange(z.shape[-1], device=z.device), -1)  # [rows, V]
    below = kept.cummax(-1).values.gather(-1, token[:, None])[:, 0]  # [rows]
    return torch.where(bad, torch.where(below >= 0, below, (kept >= 0).int().argmax(-1)), token)


class PerCompletionSampler:
    """Applies the banned-token bias, temperature, top-k and top-p the vLLM way and draws each row's token by inverting
    its CDF at one float64 uniform from that row's own generator per step (T = 0: the argmax). Inverse-CDF sampling
    needs one random number per row and step where Gumbel-max needs one per vocabulary entry (49k on SmolLM2: the
    noise took a fifth of a decode step). Called as an HF logits processor, it forces the drawn token."""

    def __init__(self, seeds, temperature, top_k, top_p, bias, steps=1):
        self.u = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                              for s in seeds])  # [rows, steps]: each row's own stream
        self.temperature, self.top_k, self.top_p, self.bias = temperature, top_k, top_p, bias
        self.t = 0  # steps drawn so far (every running row is at the same step)
        self.logps = []  # processor form, per step: [rows]

    def draw(self, scores, rows):
        """scores [len(rows), V] of the given rows (indices into seeds) -> their tokens and log-probs [len(rows)]."""
        if self.u.device != scores.device:  # once: no host-to-device copy (a host sync on CUDA) per step
            self.u, self.bias = self.u.to(scores.device), self.bias.to(scores.device)
        z = scores.float() + self.bias  # [rows, V]
        if self.temperature > 0:
            z = z / self.temperature
            if self.top_k > 0 or self.top_p < 1.0:
                z = z.masked_fill(~sampling_mask(z, self.top_k, self.top_p), float("-inf"))
        z = z.log_softmax(-1)
        if self.temperature > 0:  # the first token whose cumulative probability passes u (masked ones add nothing)
            cdf = z.double().exp_().cumsum_(-1)  # [rows, V]
            u = self.u[rows.to(z.device, non_blocking=True), self.t].clamp(min=2.0 ** -64) * cdf[:, -1]  # [rows]
            token = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_(max=z.shape[-1] - 1)
            token = kept_token(z, token)
        else:
            token = z.argmax(-1)
        self.t += 1
        return token, z.gather(-1, token[:, None]).squeeze(-1)  # a sample from softmax(z), its log-prob

    def __call__(self, input_ids, scores):
        token, logp = self.draw(scores, torch.arange(scores.shape[0]))
        self.logps.append(logp)
        return torch.full_like(scores, float("-inf")).scatter_(-1, token[:, None], 0.0)


STATIONARY_MIN = 2 ** 17  # weights with fewer entries run faster as plain F.linear (see weight_stationary_linear)


def weight_stationary_linear(module, x, max_rows=64):
    """F.linear(x, W, b), for at most max_rows rows computed as (W @ x.T).T: CPU BLAS packs a product's right operand
    on every call, and for a decode step's few rows packing W (x @ W.T) costs more than the product. Measured here on
    SmolLM2, 16 rows: its lm head 45 -> 29 ms, HF-engine generation ~22% faster. Weights under 2^17 entries lose
    (256 x 256 at 64 rows: 102 vs 87 us; the extra ops cost more than the packing): only larger ones are patched."""
    if x.numel() > max_rows * x.shape[-1]:
        return torch.nn.functional.linear(x, module.weight, module.bias)
    y = (module.weight @ x.reshape(-1, x.shape[-1]).T).T.contiguous()  # [rows, out]
    y = y + module.bias if module.bias is not None else y
    return y.reshape(*x.shape[:-1], y.shape[-1])


def fp32_head(model):
    """--policy.fp32-lm-head on a bf16 model: final norm and lm-head in fp32 on fp32 hidden states, as the trainer's
    fp32 FSDP2 root computes them; a tied head gets an fp32 copy (inputs keep the bf16 one) -> "tied" | "untied"."""
    head, tied = lm_head(model), model.get_input_embeddings().weight is lm_head(model).weight
    if tied:
        head.weight = torch.nn.Parameter(head.weight.detach().float().clone(), requires_grad=False)
    head.float().register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
    fp32_final_norm(model).float()
    return "tied" if tied else "untied"


class HFEngine:
    """transformers generate() on its own unsharded copy of the policy (kept in sync like the vLLM engine). The
    checkpoint's generation_config is replaced by a neutral one: only the sampling flags we pass apply, exactly the
    distribution the trainer scores (a repetition_penalty from the checkpoint would silently skew it)."""

    def __init__(self, model_path, *, seed, dtype=torch.float32, device="cpu", banned_token_ids=(), fp32_lm_head=False,
                 lora_rank=0, processor=None, compile_decode=False, **_):
        from transformers import GenerationConfig
        self.model, self.processor = load_policy(model_path, dtype=dtype, processor=processor,  # (the trainer's)
                                                 attn_implementation="sdpa" if compile_decode else None)
        self.model.to(device).eval().requires_grad_(False)
        emb = self.model.get_input_embeddings().weight
        self.embed_name = next(n for n, p in self.model.named_parameters() if p is emb)
        self.fp32_head = fp32_lm_head and fp32_head(self.model)
        if torch.device(device).type == "cpu":  # the engine's own copy, whose time goes to few-row decode steps
            for name, m in self.model.named_modules():
                big = type(m) is torch.nn.Linear and m.weight.numel() >= STATIONARY_MIN
                if big and not any(k in name for k in VISION_KEYS):
                    m.forward = functools.partial(weight_stationary_linear, m)
        self.repeat_cache = attention_only(self.model.config)  # else generate prefills every copy (see prefill)
        self.tok = getattr(self.processor, "tokenizer", self.processor)
        stops = self.model.generation_config.eos_token_id  # the checkpoint's stop ids are kept (vLLM stops on them too)
        self.stop_ids = sorted({self.tok.eos_token_id, *(stops if isinstance(stops, list) else [stops])} - {None})
        self.model.generation_config = GenerationConfig()  # ... its sampling defaults are not
        self.seed, self.calls, self.device, self.banned = seed, 0, device, list(banned_token_ids)
        self.needs_full_sync, self.adapter = True, bool(lora_rank)
        self.step, self.static = None, {}  # --rollout.compile-decode: the compiled step; StaticCaches by shape
        if compile_decode:  # CUDA graphs on CUDA: a decode step this small is bound by its kernel launches
            check_compile_decode(self.model.config, model_path)  # (flags.py refuses it earlier where it can)
            model = self.model  # (a LoRA sync's PEFT layers, added later, recompile it once)
            compiled = torch.compile(lambda **kw: model(**kw).logits[:, -1],
                                     mode="reduce-overhead" if torch.device(device).type == "cuda" else None)
            # a new step: the last one's logits (CUDA-graph memory the next replay overwrites) are no longer read
            self.step = lambda **kw: torch.compiler.cudagraph_mark_step_begin() or compiled(**kw)

    def unknown_names(self, names):
        known = set(self.model.state_dict().keys())  # an adapter's names: those of the layers it adapts
        return [n for n in names if (weight_sync.adapted_weight(n) if self.adapter else n) not in known]

    @torch.no_grad()
    def load_weights(self, named_tensors):
        if self.adapter:  # PEFT layers on the sync's modules (the first time), then their lora_A / lora_B
            weight_sync.hf_load_adapter(self.model, named_tensors, self.needs_full_sync)
        else:
            params = self.model.state_dict()
            for name, t in named_tensors:
                params[name].copy_(t)
                if self.fp32_head == "tied" and name == self.embed_name:  # the fp32 head: an untied copy, from fp32
                    lm_head(self.model).weight.copy_(t)
        self.needs_full_sync = False

    def prefill(self, ids, am, n):
        """The KV cache of each prompt but its last token, computed once and repeated for its n completions (generate
        would prefill every copy: as many FLOPs as the whole decode in the SmolLM2 setting). None: generate's way."""
        from transformers import DynamicCache
        if not self.repeat_cache:  # conv / linear-attention state: not a KV cache to repeat
            return None
        if ids.shape[1] < 2:  # 1-token prompts: nothing before the last token
            return DynamicCache(config=self.model.config)
        pos = (am.cumsum(-1) - 1).clamp(min=0)  # generate's own position ids for left padding
        cache = self.model(input_ids=ids[:, :-1].to(self.device), attention_mask=am[:, :-1].to(self.device),
                           position_ids=pos[:, :-1].to(self.device), use_cache=True, logits_to_keep=1).past_key_values
        self.repeat_cache = all(hasattr(layer, "batch_repeat_interleave") and hasattr(layer, "batch_select_indices")
                                for layer in getattr(cache, "layers", [None]))
        if not self.repeat_cache:  # a cache whose layers cannot be repeated or cut: from now on generate's way
            return None
        cache.batch_repeat_interleave(n)
        return cache

    def static_cache(self, cache, width, new_tokens):
        """--rollout.compile-decode: the prefilled cache moved into a StaticCache of its shape, one kept per shape (the
        last 4; held between steps) so its tensors keep their addresses and CUDA graphs replay; the length rounded up
        to 256 tokens, so a run's prompt widths share few shapes. None when every prompt is one token: dynamic decode."""
        from transformers import StaticCache
        if width < 2:
            return None
        shape = (cache.layers[0].keys.shape[0], -(-(width + new_tokens) // 256) * 256)  # (rows, length)
        if shape not in self.static:
            if len(self.static) == 4:
                self.static.pop(next(iter(self.static)))
            self.static[shape] = StaticCache(config=self.model.config, max_cache_len=shape[1])
        static = self.static[shape]
        static.reset()
        for mine, prefilled in zip(static.layers, cache.layers):
            mine.update(prefilled.keys, prefilled.values)  # positions 0 .. width - 2
        cache.reset()  # the prefill's copy
        return static

    def decode(self, ids, am, cache, n, limits, sampler):
        """After prefill: one token per step for the rows still running. A row leaves the batch and the KV cache once it
        stops or reaches its limit (generate computes every row to the longest one's end; completion lengths vary a
        lot in RL); with --rollout.compile-decode every row runs to the end, at one fixed shape. ids, am: [B, W]
        left-padded prompts; limits: [B] -> tokens, log-probs of the B * n rows."""
        dev = self.device
        am = am.repeat_interleave(n, 0).to(dev)  # [R, W]
        pos = (am.sum(-1, keepdim=True) - 1).clamp(min=0)  # [R, 1]: the last prompt token's position
        x = ids[:, -1:].repeat_interleave(n, 0).to(dev)  # [R, 1]
        limit = [m for m in limits for _ in range(n)]  # [R]
        live, done = torch.arange(len(limit)), [False] * len(limit)  # [r]: the rows in the batch
        toks, logps = [[] for _ in live], [[] for _ in live]
        static = self.static_cache(cache, ids.shape[1], max(limit)) if self.step else None
        if static is not None:  # the mask at the cache's full length: the causal mask hides what is not written yet
            cache, step, pad = static, self.step, static.get_max_length() - am.shape[1]
            am = torch.cat([am, am.new_ones(len(live), pad)], 1)  # [R, L]
        else:
            step = lambda **kw: self.model(**kw).logits[:, -1]  # noqa: E731
        for t in range(max(limit)):
            logits = step(input_ids=x, attention_mask=am, position_ids=pos, past_key_values=cache,
                          use_cache=True)  # [r, V]
            token, logp = sampler.draw(logits, live)
            host = torch.stack([token.double(), logp.double()]).cpu()  # [2, r]: one device-to-host copy per step
            rows = live.tolist()
            for r, a, b in zip(rows, host[0].long().tolist(), host[1].tolist()):
                if not done[r]:
                    toks[r].append(a)
                    logps[r].append(b)
                    done[r] = a in self.stop_ids or limit[r] <= t + 1
            keep = ~torch.tensor([done[r] for r in rows])  # [r]
            if not keep.any():
                break
            if not (keep.all() or static is not None):
                idx = keep.nonzero()[:, 0]
                live, idx = live[idx], idx.to(dev)
                cache.batch_select_indices(idx)
                token, am, pos = token[idx], am[idx], pos[idx]
            x, pos = token[:, None], pos + 1
            am = am if static is not None else torch.cat([am, am.new_ones(len(live), 1)], 1)
        return toks, logps

    def sleep(self):  # the engine's copy stays where it is: nothing to release, nothing to restore
        pass

    wake_up = sleep

    @torch.no_grad()
    def generate(self, prompts, *, n, temperature, top_p=1.0, top_k=0, max_tokens=128, seeds=None):
        """Same contract as VLLMEngine.generate; seeds None draws fresh streams from the engine's own seed."""
        self.calls += 1
        if seeds is None:
            seeds = completion_seeds(self.seed, -self.calls, 0, len(prompts), n)
        pad = self.tok.pad_token_id
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        bias = torch.zeros(self.model.get_output_embeddings().weight.shape[0])  # [V]
        bias[self.banned] = PLACEHOLDER_BIAS
        # image prompts carry their processed tensors; generate them one by one, text prompts as one batch
        batches = [[i] for i in range(len(prompts))] if any("hf_inputs" in p for p in prompts) else [range(len(prompts))]
        results = [[] for _ in prompts]
        for batch in batches:
            ps = [prompts[i] for i in batch]
            width = max(len(p["prompt_token_ids"]) for p in ps)
            ids = torch.tensor([[pad] * (width - len(p["prompt_token_ids"])) + list(p["prompt_token_ids"]) for p in ps])
            am = (torch.arange(width)[None] >= torch.tensor([width - len(p["prompt_token_ids"]) for p in ps])[:, None]).long()
            most = max(limits[i] for i in batch)
            sampler = PerCompletionSampler([s for i in batch for s in seeds[i]], temperature, top_k, top_p, bias, most)
            cache = None if "hf_inputs" in ps[0] else self.prefill(ids, am, n)
            if cache is not None:
                toks, logps = self.decode(ids, am, cache, n, [limits[i] for i in batch], sampler)
            else:
                toks, logps = self.hf_generate(ps[0].get("hf_inputs", {}), ids, am, n, most, sampler)
            for j, pi in enumerate([pi for pi in batch for _ in range(n)]):  # row j: a completion of prompt pi
                row = toks[j][:limits[pi]]  # rows of a shorter limit: the tokens past it are dropped
                end = next((k + 1 for k, t in enumerate(row) if t in self.stop_ids), len(row))
                results[pi].append(Completion(row[:end], logps[j][:end], not row or row[end - 1] not in self.stop_ids))
        return results

    def hf_generate(self, hf_inputs, ids, am, n, max_new, sampler):
        """transformers generate(), with the sampler as its logits processor: image prompts (generate expands their
        tensors per copy and gives image tokens M-RoPE positions) and models whose cache cannot be repeated."""
        extra = {k: v.to(self.device) for k, v in hf_inputs.items()}
        if extra:  # which tokens are the image's: without it generate gives them text positions, not M-RoPE ones
            extra["mm_token_type_ids"] = (ids == self.model.config.image_token_id).long().to(self.device)
            mode = dict(do_sample=True, num_return_sequences=n, top_k=0, top_p=1.0, temperature=1.0)  # (HF's warpers
        else:  # each prompt n times, greedy: our one-hot is the argmax                     # pass the one-hot as is)
            mode = dict(do_sample=False)
            ids, am = ids.repeat_interleave(n, 0), am.repeat_interleave(n, 0)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=am.to(self.device), **extra, **mode,
                                  max_new_tokens=max_new, pad_token_id=self.tok.pad_token_id,
                                  eos_token_id=self.stop_ids, logits_processor=[sampler], return_dict_in_generate=True)
        new = out.sequences[:, ids.shape[1]:].tolist()  # [B*n][t]
        return new, torch.stack(sampler.logps, 1).tolist()  # [B*n][t]
