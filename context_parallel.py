"""context_parallel.py: --policy.context-parallel N: each row's sequence split over the N ranks of a context-parallel
group for the trainer's forward and backward, exact against one rank (docs/context-parallel.md).

All-gather K/V context parallelism (The Llama 3 Herd of Models, arXiv 2407.21783, section 3.3.2): each rank embeds and
runs the layers on its own chunks of every row; in each attention layer it keeps its queries, gathers the keys and
values of the whole row from the group (their gradients reduce-scattered back) and attends under the row's mask cut to
its queries. RoPE is applied before the attention at each token's global position. Any head count works (SmolLM2-135M's
9 query / 3 KV heads rule out splitting heads, Ulysses-style, over 2 or 4 ranks). The chunks zigzag: a row is cut
into 2N chunks and rank r holds r and 2N-1-r, so under the causal mask each rank's queries see about as many keys.
Each rank scores the completion tokens whose hidden states it holds; one all-reduce puts every token's log-prob (and
entropy) on every rank of the group, so the loss sees whole rows.

Example, N = 2, a row of 6 tokens padded to 8 (4 chunks of 2): rank 0 holds positions [0 1 6 7], rank 1 [2 3 4 5];
the gathered keys are in the order [0 1 6 7 2 3 4 5], and rank 1's query at position 3 sees keys 0 1 2 3.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F

NAME = "context_parallel"  # the attention implementation registered with transformers


def positions(L, n, r):
    """The positions of a row of length L that rank r of n holds: zigzag chunks r and 2n-1-r of 2n (L padded up to a
    multiple of 2n) -> [L_pad / n]."""
    c = -(-L // (2 * n))
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


class GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 2, [B, heads, l, D]) in group-rank order; backward: the gradients of the
    whole sequence summed over the group, this rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 2)  # [B, heads, n * l, D]

    @staticmethod
    def backward(ctx, grad):
        parts = [p.contiguous() for p in grad.chunk(dist.get_world_size(ctx.group), 2)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=ctx.group)
        return out, None


def attention(module, query, key, value, attention_mask, cp_group=None, **kwargs):
    """transformers' attention interface: this rank's queries [B, H, l, D] against the group's keys and values
    [B, Hkv, L_pad, D], under the mask shard() cut for these queries ([B, 1, l, L_pad] bool, keys in rank order)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    k, v = GatherSequence.apply(key, cp_group), GatherSequence.apply(value, cp_group)  # [B, Hkv, L_pad, D] each
    return sdpa_attention_forward(module, query, k, v, attention_mask, **{**kwargs, "is_causal": False})


def register():
    """Make NAME a transformers attention implementation (idempotent); the mask is always ours (4-D, passed as is)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, attention)


def shard(inputs, hidden_index, group):
    """collate's inputs -> this rank's share: (input_ids [R, l] and position_ids [R, l] at its positions(), the mask
    of its queries over the gathered keys [R, 1, l, L_pad] bool, hidden_index [n] into its [R * l] hidden states,
    -1 where another rank holds the state)."""
    n, r, ids = dist.get_world_size(group), dist.get_rank(group), inputs["input_ids"]
    (R, L), dev = ids.shape, ids.device
    mine = positions(L, n, r).to(dev)  # [l]
    keys = torch.cat([positions(L, n, j) for j in range(n)]).to(dev)  # [L_pad]: the gathered keys' positions
    pad = len(keys) - L
    pos = inputs.get("position_ids", torch.arange(L, device=dev).expand(R, L))  # [R, L]
    pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(pad, device=dev)], 1)  # [R, L_pad]: padding continues
    am = inputs["attention_mask"]
    if am.dim() == 2:  # key padding [R, L]: causal by index over the keys that are tokens
        seen = (keys[None, None] <= mine[None, :, None]) & F.pad(am.bool(), (0, pad))[:, None, keys]  # [R, l, L_pad]
    else:  # collate's shared-prompt mask [R, 1, L, L]
        seen = F.pad(am[:, 0].bool(), (0, pad, 0, pad))[:, mine][:, :, keys]  # [R, l, L_pad]
    seen = seen | (mine[:, None] == keys[None])  # padding sees itself: no query's row is empty
    local = torch.full((len(keys),), -1, device=dev).index_copy(0, mine, torch.arange(len(mine), device=dev))
    col = local[hidden_index % L]  # [n]
    hidx = torch.where(col >= 0, hidden_index // L * len(mine) + col, -1)
    return F.pad(ids, (0, pad))[:, mine], pos[:, mine], seen[:, None], hidx


class SumTokens(torch.autograd.Function):
    """(collective) Per-token results [..., N, T], each rank's tokens filled and 0 elsewhere -> every token, on every
    rank of the group; backward: the gradients summed too (every rank's loss reads every token)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, x = group, x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def share_rollouts(group, prompts, seeds, rollouts, tp=1):
    """(collective over `group` unless None) rollouts(prompts, seeds) -> [per prompt], each engine of a
    context-parallel group (`tp` ranks each: vLLM TP) running its share of the prompts and every rank getting all of
    them, in order (identical rows). A group within one engine: the engine runs them all."""
    n = 0 if group is None else dist.get_world_size(group)
    if n <= tp:
        return rollouts(prompts, seeds)
    r, k = dist.get_rank(group) // tp, -(-len(prompts) // (n // tp))  # this rank's engine in the group, its share
    mine = rollouts(prompts[r * k:(r + 1) * k], seeds[r * k:(r + 1) * k]) if prompts[r * k:(r + 1) * k] else []
    parts = [None] * n
    dist.all_gather_object(parts, mine, group=group)
    return [o for part in parts[::tp] for o in part]  # one engine's ranks hold the same share: its first rank's


def from_first(group, *values):
    """(collective over `group` unless None) The group's first rank's values on every rank of it: its rows' rewards,
    so a reward that is not deterministic (a sampled judge, a server) cannot give one row two advantages."""
    if group is None:
        return values
    box = [values]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def groups(world, n):
    """(collective: every rank creates every group) Context-parallel groups of n consecutive ranks, and data-parallel
    groups of the ranks at the same place in theirs -> (this rank's context-parallel group, its data-parallel group)."""
    rank, cp, dp = dist.get_rank(), None, None
    for g in range(world // n):
        made = dist.new_group(list(range(g * n, (g + 1) * n)))
        cp = made if rank // n == g else cp
    for j in range(n):
        made = dist.new_group(list(range(j, world, n)))
        dp = made if rank % n == j else dp
    return cp, dp


def check(cfg, world, configs=None):
    """--policy.context-parallel on this world, these flags and (when given) the configs of the models whose rows it
    splits ({flag: config or None}: --model, --distill.teacher, --critic.model), or one clear error."""
    n, world = cfg.policy.context_parallel, world - cfg.rollout.inference_ranks  # the ranks that train
    tp = 1 if cfg.rollout.engine == "hf" or cfg.rollout.inference_ranks else cfg.vllm.tp  # ranks per colocated engine
    why = ("must be >= 1 (1 = off)" if n < 1 else None if n == 1 else
           f"and --vllm.tp {tp}: one must divide the other (TP groups within a context-parallel group, or groups "
           "within one engine)" if n % tp and tp % n else
           f"does not divide a world of {world} ranks{' that train' * bool(cfg.rollout.inference_ranks)}: launch a "
           f"multiple of {max(n, tp)}" if world % max(n, tp) else
           "does not take --policy.attn-implementation (it sets its own)" if cfg.policy.attn_implementation else
           next((f"{refusal(c)} (the model of {flag})" for flag, c in (configs or {}).items() if c and refusal(c)),
                None))
    if why:
        raise ValueError(f"--policy.context-parallel {n} {why}. Drop it or what it cannot split.")


def refusal(config):
    """Why this model's rows cannot be split (None: they can): image-text rows, attention other than plain full or
    not through transformers' attention interface (recurrent, alibi, remote code)."""
    from transformers import AutoModelForCausalLM
    from models import is_image_text, text_config
    c, lm = text_config(config), AutoModelForCausalLM._model_mapping
    interface = type(c) in lm and lm[type(c)]._supports_attention_backend  # (False: our attention would not be used)
    types = set(getattr(c, "layer_types", None) or ["full_attention"])
    sliding = getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True) is not False
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    rope = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    return ("does not split image-text rows (the vision tower's tokens)" if is_image_text(config) else
            f"does not split {type(config).__name__}: its attention does not go through transformers' attention "
            "interface" if not interface else
            f"does not split rows under RoPE type {rope!r}: its frequencies follow the longest position a forward "
            "sees, which differs between the ranks" if rope in ("dynamic", "longrope") else
            f"does not split {type(config).__name__}'s attention (layers {sorted(types)}, sliding window "
            f"{getattr(c, 'sliding_window', None) if sliding else None}): plain full attention only"
            if types != {"full_attention"} or sliding else None)
