"""token_logprobs.py: the trainer's per-token log-probs of completions: the batch layout (one row per sample, or
completions sharing their prompt's row), the lm-head's transform, and the FSDP2 roots that run the policy through
losses.fused_linear_logprobs (TokenLogprobs) or a critic (TokenValues).

Shapes: N samples, T completion tokens, R rows, L row length, H hidden size.
"""
import torch
from torch import nn

import context_parallel
from losses import fused_linear_logprobs
from models import is_image_text, lm_head, text_config


# ---- The lm-head ----

def head_transform(config):
    """Logit transform after the lm-head matmul, read from the config: -> dict(logit_scale, softcap)."""
    c = text_config(config)
    scale = float(getattr(c, "logit_scale", None) or 1.0)  # Cohere: logits * logit_scale
    if getattr(c, "logits_scaling", None):  # Granite: logits / logits_scaling
        scale /= float(c.logits_scaling)
    softcap = getattr(c, "final_logit_softcapping", None)  # Gemma 2/3: c * tanh(x / c)
    return {"logit_scale": scale, "softcap": float(softcap) if softcap else None}


PLACEHOLDER_BIAS = -100.0  # the OpenAI-style logit-bias floor vLLM accepts; exp(-100) is ~1e-44


def placeholder_token_ids(config):
    """Image/video placeholder tokens, which the trainer's forward would replace by vision features: the engine and the
    trainer both add PLACEHOLDER_BIAS to their logits (the policy never emits them)."""
    return sorted({i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
                   if isinstance(i, int)})


def collapse_placeholders(ids, placeholders):
    """Each run of an image placeholder token (the processor's expansion) cut to one -> ids: what vLLM takes (it
    expands it again from multi_modal_data) and what a text critic reads."""
    return [t for j, t in enumerate(ids) if not (j and t in placeholders and ids[j - 1] == t)]


def final_hidden_states(model, input_ids, attention_mask, **extra):
    """Last-layer hidden states (after the final norm) -> [B, L, H], computing logits for one position only."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1,
                use_cache=False, **extra)
    return out.hidden_states[-1]


@torch.no_grad()
def check_head_transform(model, *, rtol=1e-3):
    """Fail loudly when the model's own logits differ from head_transform(hidden @ W^T + b) (an unhandled head)."""
    head, t = lm_head(model), head_transform(model.config)
    ids = torch.arange(4, device=head.weight.device).clamp(max=head.weight.shape[0] - 1)[None]
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False)
    bias = head.bias.float() if getattr(head, "bias", None) is not None else 0
    z = (out.hidden_states[-1][:, -1].float() @ head.weight.float().T + bias) * t["logit_scale"]
    if t["softcap"]:
        z = t["softcap"] * torch.tanh(z / t["softcap"])
    ref = out.logits[:, -1].float()
    err = (z - ref).abs().max().item()
    if err > rtol * max(ref.abs().max().item(), 1.0):
        raise ValueError(f"{type(model).__name__}: logits from the final hidden states and lm-head differ from the "
                         f"model's own logits by {err:.3g}; its head transform is not handled in token_logprobs.head_transform")


# ---- The trainer's log-prob module and batch layout ----

def split_over(model, cp_group):
    """--policy.context-parallel: the model attends through context_parallel's all-gather K/V -> cp_group (None off)."""
    if cp_group is not None:
        context_parallel.register()
        model.set_attn_implementation(context_parallel.NAME)
    return cp_group


def rank_tokens(model, inputs, cp):
    """collate's inputs -> (the model's keyword inputs, (rows, cols) [n] each of the completion tokens this rank
    scores, their flat index `where` [n] into [N, T], and hidx [n] into the model's flattened [R * L or l] outputs):
    every token, or under context parallelism (cp) this rank's chunks of every row and the tokens it holds states of."""
    kw = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], **inputs["mm"],
          **({"position_ids": inputs["position_ids"]} if "position_ids" in inputs else {})}
    am = kw["attention_mask"]
    if am.dim() == 4 and model.config._attn_implementation not in ("sdpa", context_parallel.NAME):
        kw["attention_mask"] = torch.zeros(am.shape, device=am.device).masked_fill(~am, torch.finfo(torch.float32).min)
    cm = inputs["logprob_mask"]  # [N, T]
    rows, cols = inputs["logprob_index"] if "logprob_index" in inputs else cm.nonzero().unbind(1)  # [n] each
    where = rows * cm.shape[1] + cols  # [n]: the same tokens, flat
    hidx = inputs["hidden_index"].flatten()[where]  # [n]: the hidden states that predict them
    if cp is not None:
        kw["input_ids"], kw["position_ids"], kw["attention_mask"], hidx = context_parallel.shard(inputs, hidx, cp)
        kw["cp_group"], mine = cp, hidx >= 0
        rows, cols, where, hidx = rows[mine], cols[mine], where[mine], hidx[mine]
    return kw, (rows, cols), where, hidx


def whole_rows(xs, index, shape, cp):
    """Per-token results [n] each at `index` -> [N, T] each, 0 past the end (not a view: FSDP2 warns, in-place ops on
    one would skip its backward hook); under context parallelism every token on every rank, one all-reduce."""
    full = [x.new_zeros(shape).index_put(index, x) for x in xs]  # [N, T] each
    return full if cp is None else [x.clone() for x in context_parallel.SumTokens.apply(torch.stack(full), cp)]


class TokenLogprobs(nn.Module):
    """The FSDP2 root: per-token log-probs (and entropies) of the completion tokens through the fused lm-head, inside
    the root's forward where FSDP2 has the head unsharded; of the distribution the engine sampled from (temperature,
    then top-k, then top-p). Rows are prompt + completion, right-padded (positions match the engine's)."""

    def __init__(self, policy, cp_group=None):
        super().__init__()
        self.policy = policy
        self.transform = head_transform(policy.config)
        self.banned = placeholder_token_ids(policy.config)
        self.cp_group = split_over(policy, cp_group)  # --policy.context-parallel: each row split over these ranks

    def forward(self, inputs, temperature, with_entropy=False, top_k=0, top_p=1.0):
        kw, index, where, hidx = rank_tokens(self.policy, inputs, self.cp_group)
        hidden = final_hidden_states(self.policy, **kw).flatten(0, 1)[hidx]  # [R, L or l, H] -> [n, H]
        head = lm_head(self.policy)
        bias = getattr(head, "bias", None)
        if self.banned:  # the engine applies the same logit bias (placeholder_token_ids)
            bias = (bias if bias is not None else head.weight.new_zeros(head.weight.shape[0])).clone()
            bias[self.banned] += PLACEHOLDER_BIAS
        lp, ent = fused_linear_logprobs(hidden, head.weight, inputs["targets"].flatten()[where], bias=bias,
                                        temperature=temperature, top_k=top_k, top_p=top_p, with_entropy=with_entropy,
                                        keep_probs=None, **self.transform)  # [n]; p kept for the backward if it fits
        out = whole_rows([x for x in (lp, ent) if x is not None], index, inputs["logprob_mask"].shape, self.cp_group)
        return out[0], (out[1] if ent is not None else None)  # [N, T] each


class TokenValues(nn.Module):
    """The critic's FSDP2 root: V(s_t) of each completion token t, at the position that predicts it (as TokenLogprobs:
    the state before the token is chosen; under context parallelism each rank's tokens, then every token). -> [N, T],
    0 past the end."""

    def __init__(self, policy, cp_group=None):
        super().__init__()
        self.policy = policy  # a token classifier with one label (named policy so shard() treats both roots alike)
        self.cp_group = split_over(policy, cp_group)

    def forward(self, inputs):
        kw, index, _, hidx = rank_tokens(self.policy, inputs, self.cp_group)  # an image-text critic sees the images
        v = self.policy(**kw, use_cache=False).logits[..., 0]  # [R, L or l]
        v = v.to(torch.promote_types(v.dtype, torch.float32)).flatten()[hidx]  # [n]: float32, float64 in tests
        return whole_rows([v], index, inputs["logprob_mask"].shape, self.cp_group)[0]  # [N, T]


def pair_cost(config):
    """One token's linear-layer MACs in a decoder layer, in units of one attention query-key pair's MACs (QK and AV):
    the exchange rate collate's packing plan uses (SmolLM2-135M: 3072, i.e. a token costs 3072 pairs)."""
    c = text_config(config)
    width = c.num_attention_heads * (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    kv_width = kv * width // c.num_attention_heads
    linear = 2 * c.hidden_size * width + 2 * c.hidden_size * kv_width + 3 * c.hidden_size * c.intermediate_size
    return linear / (2 * width)


def attention_only(config):
    """A text model whose layers are all full or sliding attention: its per-row state is a KV cache, which may be
    shared across rows (conv / linear-attention / chunked layers carry other state)."""
    types = set(getattr(text_config(config), "layer_types", None) or ())
    return not is_image_text(config) and types <= {"full_attention", "sliding_attention"}


def share_limit(config):
    """The longest row in which completions may share their prompt: 0 = never (image-text models; kernels other than
    sdpa / eager take no 4-D mask; other layers than full or sliding attention would mix a row's completions), the
    sliding window if any (the 4-D mask stands in for transformers' sliding-window masks: causal within the window),
    else None (no limit)."""
    c = text_config(config)
    types, window = set(getattr(c, "layer_types", None) or ()), getattr(c, "sliding_window", None)
    if not attention_only(config) or config._attn_implementation not in ("sdpa", "eager"):
        return 0
    sliding = "sliding_attention" in types or (not types and getattr(c, "use_sliding_window", True) is not False)
    return window if window and sliding else None


@torch.no_grad()
def check_shared_prompts(model, limit):
    """-> limit when shared-prompt rows give this model's own log-probs on a random probe (two completions after one
    prompt vs one row each), else 0, saying why: what share_limit cannot see (ignored position ids, remote code)."""
    if limit == 0:
        return 0
    g = torch.Generator().manual_seed(0)
    V = lm_head(model).weight.shape[0]
    prompt = torch.randint(0, V, (5,), generator=g).tolist()
    samples = [{"prompt_ids": prompt, "completion_ids": torch.randint(0, V, (n,), generator=g).tolist()} for n in (3, 4)]
    module, device = TokenLogprobs(model), next(model.parameters()).device
    try:
        packed = module(collate(samples, 0, device, 4, pair_cost=1e9), 1.0)[0]
        plain = module(collate(samples, 0, device, 4), 1.0)[0]
        err = (packed - plain).abs().max().item()
    except Exception as e:  # noqa: BLE001 (a model that cannot take a 4-D mask or position ids at all)
        err, why = float("inf"), f"{type(e).__name__}: {e}"
    else:
        why = f"log-probs differ by {err:.3g} nats"
    tol = 1e-3 if next(model.parameters()).dtype in (torch.float32, torch.float64) else 5e-2
    if not err <= tol:
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(f"--policy.share-prompts: off for {type(model).__name__} (packed rows change its output: {why}); "
                  "one row per sample", flush=True)
        return 0
    return limit


def row_length(samples, members):
    """Tokens in a row holding the prompt of members[0] once and each member's completion."""
    return len(samples[members[0]]["prompt_ids"]) + sum(len(samples[i]["completion_ids"]) for i in members)


def prompt_groups(samples):
    """Sample indices grouped by equal prompt ids, in first-seen order -> [[i, ...], ...]."""
    groups = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s["prompt_ids"]), []).append(i)
    return list(groups.values())


def pack_plan(samples, pair_cost, max_len=None):
    """Rows of the batch as lists of sample indices: samples with the same prompt share one copy of it in a row
    (prompt, completion 1, completion 2, ...; each completion attends to the prompt and to itself only), k
    completions per row, k chosen to minimise rows x (pair_cost x L + L^2) for the padded row length L (linear
    layers + the dense attention mask), among plans whose rows fit max_len. pair_cost 0 -> one sample per row."""
    groups = prompt_groups(samples)
    largest = max(len(g) for g in groups)
    best = None
    for k in sorted({1} | ({2 ** j for j in range(1, 12)} | {len(g) for g in groups} if pair_cost else set())):
        rows = [g[j:j + k] for g in groups for j in range(0, len(g), k)]
        L = max(row_length(samples, r) for r in rows)
        cost = len(rows) * (pair_cost * L + L * L)
        if best is None or (cost < best[0] and (max_len is None or L <= max_len)):
            best = (cost, rows)
        if k >= largest:
            break
    return best[1]


def layout(samples, pair_cost=0.0, max_len=None):
    """collate's rows (pack_plan; a row per sample when any has images) and padded length -> (rows, L)."""
    rows = pack_plan(samples, 0.0 if any("mm" in s for s in samples) else pair_cost, max_len)
    return rows, max(row_length(samples, r) for r in rows)


def length_order(samples, share):
    """Sample indices, longest row first (the micro-batch token budget's order); with shared prompts (share) each
    prompt's samples together, in their order (pack_plan's rows of k), by the length of their shared row."""
    groups = prompt_groups(samples) if share else [[i] for i in range(len(samples))]
    return [i for g in sorted(groups, key=lambda g: row_length(samples, g), reverse=True) for i in g]


def collate(samples, pad_id, device, T, image_token_id=None, pair_cost=0.0, max_len=None):
    """samples: dicts with prompt_ids, completion_ids (and mm tensors) -> the model's inputs, right-padded: input_ids,
    attention_mask, hidden_index, targets, logprob_mask [N, T] (1 at every completion position, inserted tool/env
    tokens too: where log-probs are computed; Batch.mask picks the loss's), logprob_index (its (row, col) pairs), mm.

    One sample per row (pair_cost 0), e.g. (pad = _): prompt [5 6 7], completion [8 9] -> input_ids [5 6 7 8 9 _],
    hidden_index [2 3] (the hidden state at position 2 predicts token 8). With pair_cost > 0, samples sharing a prompt
    may share a row (pack_plan): prompt [5 6 7] with completions [8 9] and [4] -> input_ids [5 6 7 8 9 4], positions
    [0 1 2 3 4 3], a 4-D mask hiding 8 9 from 4, hidden_index [2 3] and [2 _]. hidden_index is into the flattened
    [rows * L] hidden states, one row of it per sample: the logits of each sample match its own row's. max_len caps
    a shared row's length (share_limit)."""
    rows, L = layout(samples, pair_cost, max_len)
    ids, pos, part = [], [], []  # per row, as lists: one tensor each at the end (no per-sample tensor ops)
    hidx, targets = [[0] * T for _ in samples], [[0] * T for _ in samples]
    for r, members in enumerate(rows):
        p = list(samples[members[0]]["prompt_ids"])
        if not p:
            raise ValueError("a sample has an empty prompt: the trainer needs at least one prompt token to predict "
                             "the first completion token from (give the tokenizer a BOS token or a chat template)")
        row, row_pos, row_part = list(p), list(range(len(p))), [0] * len(p)  # part: which completion (0 = prompt)
        for j, i in enumerate(members):
            c, o = list(samples[i]["completion_ids"]), len(row)
            targets[i][:len(c)] = c
            hidx[i] = [r * L + min(k, L - 1) for k in [len(p) - 1, *range(o, o + T - 1)]]
            row, row_pos, row_part = row + c, row_pos + [*range(len(p), len(p) + len(c))], row_part + [j + 1] * len(c)
        for out, x, pad in ((ids, row, pad_id), (pos, row_pos, 0), (part, row_part, -1)):
            out.append(x + [pad] * (L - len(row)))
    ids, pos, part = (torch.tensor(x, dtype=torch.long) for x in (ids, pos, part))  # [R, L]
    am = (part >= 0).long()
    hidx, targets = torch.tensor(hidx, dtype=torch.long), torch.tensor(targets, dtype=torch.long)  # [N, T]
    cmask = torch.arange(T)[None] < torch.tensor([len(s["completion_ids"]) for s in samples])[:, None]  # [N, T]
    inputs = {"input_ids": ids.to(device), "attention_mask": am.to(device), "hidden_index": hidx.to(device),
             "targets": targets.to(device), "logprob_mask": cmask.to(device), "mm": {},
             "logprob_index": tuple(torch.tensor(x, dtype=torch.long).to(device) for x in  # (row, col) of each completion
                             ([i for i, s in enumerate(samples) for _ in s["completion_ids"]],  # token, found on the
                              [t for s in samples for t in range(len(s["completion_ids"]))]))}  # host: no device sync
    if max(len(r) for r in rows) > 1:  # a key is visible if causal and in the prompt or the query's own completion
        q, k = part[:, :, None], part[:, None, :]  # [R, L, 1], [R, 1, L]
        causal = torch.arange(L)[:, None] >= torch.arange(L)[None, :]
        seen = causal & (k >= 0) & ((k == 0) | (k == q)) | torch.eye(L, dtype=torch.bool)  # padding sees itself
        inputs["attention_mask"] = seen[:, None].to(device)  # [R, 1, L, L] (TokenLogprobs adapts it to the kernel)
        inputs["position_ids"] = pos.to(device)
    if any("mm" in s for s in samples):
        for key in next(s["mm"] for s in samples if "mm" in s):  # in row order: pack_plan groups equal prompts
            inputs["mm"][key] = torch.cat([samples[m]["mm"][key] for members in rows for m in members  # (equal ids,
                                          if "mm" in samples[m]]).to(device)  # maybe other images); text rows have none
        inputs["mm"]["mm_token_type_ids"] = (ids == image_token_id).long().to(device)  # Qwen2.5-VL needs it in training
    return inputs
