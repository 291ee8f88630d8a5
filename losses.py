"""losses.py: log-probs, advantages, KL estimators and policy/value losses for GRPO-family training.

Pure functions over tensors; imports only torch (the chunked lm-head lives in fused_logprobs.py, torch only, and is
re-exported here). Shapes: B sequences, T completion tokens, V vocabulary, H hidden size. `mask` is 1 where a token counts. Log-probs come back in float32 (float64 for float64 inputs).

Worked layout: with num_generations G = 4 and two prompts, `rewards` is [8] laid out as
[p0g0, p0g1, p0g2, p0g3, p1g0, p1g1, p1g2, p1g3]; group statistics are taken over each row of `rewards.view(2, 4)`.
"""
import math
from dataclasses import dataclass

import torch
from fused_logprobs import _acc_dtype, fused_linear_logprobs, sampling_mask, sampling_threshold  # noqa: F401 (losses' API)


# ----------------------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------------------

def selective_log_softmax(logits, index):
    """log_softmax(logits)[index] without keeping a second [..., V] tensor around."""
    logits = logits.to(_acc_dtype(logits))
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # [...]


def entropy_from_logits(logits):
    """Shannon entropy of softmax(logits): lse(x) - sum p x."""
    logits = logits.to(_acc_dtype(logits))
    p = logits.softmax(-1)
    return logits.logsumexp(-1) - (p * logits).sum(-1)  # [...]


# ----------------------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------------------

def _nan_group_normalize(x, group_size, scale, eps):
    """(x - group nanmean) / (std + eps) with NaN entries ignored and returned as NaN. x [N]."""
    g = x.view(-1, group_size)  # [N/G, G]
    valid = ~g.isnan()
    count = valid.sum(-1, keepdim=True)
    mean = torch.where(valid, g, 0).sum(-1, keepdim=True) / count.clamp(min=1)
    centered = g - mean  # NaN stays NaN
    if scale == "none":
        return centered.view(-1)
    if scale == "group":
        var = torch.where(valid, centered, 0).square().sum(-1, keepdim=True) / (count - 1).clamp(min=1)
    elif scale == "batch":
        flat = x[~x.isnan()]
        var = flat.var() if flat.numel() > 1 else flat.new_zeros(())
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}: use group, batch or none")
    return (centered / (var.sqrt() + eps)).view(-1)


def group_advantages(rewards, group_size, *, scale="group", eps=1e-4):
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps): rewards [N] -> [N]."""
    # DeepSeekMath GRPO, arXiv 2402.03300 (eq. 3); scale="none" is Dr. GRPO, arXiv 2503.20783
    if group_size == 1:
        return torch.zeros_like(rewards)
    return _nan_group_normalize(rewards, group_size, scale, eps)


def multi_reward_advantages(rewards_per_func, weights, group_size, *, aggregation="sum_then_normalize",
                            scale="group", eps=1e-4):
    """Advantages from K reward functions [N, K] (NaN = does not apply) and weights [K] -> [N]."""
    # GDPO (normalize_then_sum), arXiv 2601.05242; sum_then_normalize is the usual GRPO weighted sum
    w = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    unscorable = rewards_per_func.isnan().all(-1)  # [N]
    if aggregation == "sum_then_normalize":
        total = (rewards_per_func * w).nansum(-1).masked_fill(unscorable, float("nan"))  # [N]
        adv = torch.zeros_like(total) if group_size == 1 else _nan_group_normalize(total, group_size, scale, eps)
    elif aggregation == "normalize_then_sum":
        if group_size == 1:
            return torch.zeros_like(unscorable, dtype=rewards_per_func.dtype)
        per_func = torch.stack([_nan_group_normalize(r, group_size, scale, eps) for r in rewards_per_func.T], -1)
        total = (per_func * w).nansum(-1).masked_fill(unscorable, float("nan"))  # [N]
        scored = total[~unscorable]
        std = scored.std() if scored.numel() > 1 else scored.new_zeros(())
        adv = (total - scored.mean()) / (std + eps)
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}: use sum_then_normalize or normalize_then_sum")
    return adv.nan_to_num(0.0)


def rloo_advantages(rewards, group_size):
    """A_i = r_i - mean_{j != i} r_j (leave-one-out baseline): [N] -> [N]. NaN rewards (unscorable samples) get
    advantage 0 and are left out of the others' baselines; a sample with no scorable peer gets 0."""
    # RLOO, "Back to Basics", arXiv 2402.14740
    if group_size == 1:
        return torch.zeros_like(rewards)
    g = rewards.view(-1, group_size)  # [N/G, G]
    valid = ~g.isnan()
    others = (g.nansum(-1, keepdim=True) - g.nan_to_num(0.0)) / (valid.sum(-1, keepdim=True) - 1).clamp(min=1)
    has_peer = valid.sum(-1, keepdim=True) > 1
    return torch.where(valid & has_peer, g - others, 0.0).view(-1)


def masked_whiten(x, mask, *, eps=1e-8):
    """(x - masked mean) / sqrt(masked unbiased var + eps); 0 where mask is 0."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = ((x - mean).square() * m).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def _discounted_cumsum(x, mask, gamma):
    """y_t = x_t + gamma * y_{t+1} over the masked tokens of each row: [B, T] -> [B, T]."""
    out, running = torch.zeros_like(x), torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        running = (x[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


def reinforce_pp_advantages(token_rewards, mask, *, gamma=1.0):
    """Discounted return-to-go per token, whitened over the batch's valid tokens: [B, T] -> [B, T]."""
    # REINFORCE++, arXiv 2501.03262
    m = mask.to(token_rewards.dtype)
    return masked_whiten(_discounted_cumsum(token_rewards, m, gamma), m)


def gae_advantages(token_rewards, values, mask, *, gamma=1.0, lam=1.0):
    """GAE: delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}. -> (adv, returns) [B, T]."""
    # Generalized Advantage Estimation, arXiv 1506.02438
    m = mask.to(values.dtype)
    next_values = torch.cat([values[:, 1:] * m[:, 1:], torch.zeros_like(values[:, :1])], 1)  # [B, T]
    deltas = (token_rewards + gamma * next_values - values) * m
    adv = _discounted_cumsum(deltas, m, gamma * lam)
    return adv, (adv + values) * m


# ----------------------------------------------------------------------------------------------------------
# KL
# ----------------------------------------------------------------------------------------------------------

def kl_estimate(logps, ref_logps, kind="k3"):
    """Per-token estimators of KL(pi || pi_ref) from samples of pi."""
    # Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html
    log_r = ref_logps - logps
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return log_r.exp() - log_r - 1
    raise ValueError(f"unknown kl_estimator {kind!r}: use k1, k2 or k3")


def reward_kl(logps, ref_logps, kind="k1"):
    """KL_t for the token reward -beta KL_t (verl's kl_penalty, OpenRLHF's compute_approx_kl): k1, the log-ratio, as is;
    k2/k3 from the log-ratio clamped to +-20, then to +-10, so one far-off token cannot swamp the sequence reward."""
    if kind == "k1":  # as a reward (held constant), its score-function gradient is grad KL; k3's is not
        return logps - ref_logps
    return kl_estimate(logps, logps + (ref_logps - logps).clamp(-20, 20), kind).clamp(-10, 10)


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef):
        self.value = kl_coef

    def update(self, current_kl, n_steps):
        pass


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards target_kl."""
    # Ziegler et al., "Fine-Tuning Language Models from Human Preferences", arXiv 1909.08593 (sec. 2.2)

    def __init__(self, init_kl_coef, target_kl, horizon):
        self.value, self.target, self.horizon = init_kl_coef, target_kl, horizon

    def update(self, current_kl, n_steps):
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# ----------------------------------------------------------------------------------------------------------
# Policy and value losses
# ----------------------------------------------------------------------------------------------------------

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class LossConfig:
    loss_type: str = "dapo"
    """grpo | bnpo | dr_grpo | dapo | luspo | cispo | sapo | vespo (aggregation and surrogate; see README)."""
    importance_sampling_level: str = "token"
    """token | sequence. sequence with loss_type grpo is GSPO (arXiv 2507.18071)."""
    epsilon: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clip (None -> epsilon). DAPO clip-higher uses 0.28. For cispo it is the cap on the ratio (None -> 1 + epsilon)."""
    delta: float | None = None
    """Upper cap on the unclipped ratio (two-sided clipping, INTELLECT-2 arXiv 2505.07291). None = off."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (arXiv 1912.09729). None = off."""
    beta: float = 0.0
    """KL coefficient. 0 means no reference policy is ever built or run."""
    kl_in_reward: bool = False
    """Put -beta * KL_t into the per-token reward instead of a loss term (the OpenRLHF/LightRFT PPO convention) with
    --advantage-estimator gae; reinforce_pp always does."""
    kl_estimator: str = "k3"
    """k1 | k2 | k3 per-token KL estimator for the beta term in the loss."""
    reward_kl_estimator: str = "k1"
    """k1 | k2 | k3 per-token KL in the reward (reinforce_pp, gae --loss.kl-in-reward): k1, the log-ratio, as verl
    (kl_penalty="kl"), OpenRLHF and the REINFORCE++ paper; k2/k3 are clamped to +-10 there."""
    use_bias_correction_kl: bool = False
    """Multiply the per-token KL by the importance ratio (unbiased off-policy KL, DeepSeek-V3.2 arXiv 2512.02556)."""
    sapo_temperature_pos: float = 1.0
    """SAPO gate temperature for positive advantages (arXiv 2511.20347)."""
    sapo_temperature_neg: float = 1.05
    """SAPO gate temperature for negative advantages."""
    vespo_k_pos: float = 2.0
    """VESPO kernel shape k for non-negative advantages (arXiv 2602.10693)."""
    vespo_lambda_pos: float = 3.0
    """VESPO kernel rate lambda for non-negative advantages."""
    vespo_k_neg: float = 3.0
    """VESPO kernel shape k for negative advantages."""
    vespo_lambda_neg: float = 2.0
    """VESPO kernel rate lambda for negative advantages."""
    max_completion_length: int = 256
    """Dr. GRPO's constant denominator (set by grpo.py from the rollout's max_completion_length)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2 off-policy sequence mask: drop negative-advantage sequences whose mean KL(sampler||policy) exceeds it."""
    top_entropy_quantile: float = 1.0
    """Train only on the top-q highest-entropy tokens (arXiv 2506.01939). 1.0 = all tokens."""
    sampler_correction: str = "sequence_mask"
    """none | token_truncate | token_mask | sequence_truncate | sequence_mask: correct trainer/engine mismatch."""
    sampler_correction_cap: float = 3.0
    """Cap C on the sampler ratio exp(old - sampler): truncated at C or masked above C."""


def validate_loss_config(cfg):
    """Raise one clear error for an unknown option (called by grpo.py before any collective)."""
    checks = [("loss.loss_type", cfg.loss_type, LOSS_TYPES),
              ("loss.importance_sampling_level", cfg.importance_sampling_level, ("token", "sequence")),
              ("loss.kl_estimator", cfg.kl_estimator, ("k1", "k2", "k3")),
              ("loss.reward_kl_estimator", cfg.reward_kl_estimator, ("k1", "k2", "k3")),
              ("loss.sampler_correction", cfg.sampler_correction, SAMPLER_CORRECTIONS)]
    for flag, value, allowed in checks:
        if value not in allowed:
            raise ValueError(f"--{flag.replace('_', '-')} {value!r} is not known: use one of {', '.join(allowed)}")


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def sampler_ratio(old_logps, sampler_logps, mask, mode, cap):
    """exp(old - sampler) per token or per sequence, truncated at or masked above cap: -> [B, T] or [B, 1]."""
    # Truncated importance sampling for trainer/engine mismatch, Yao et al. 2025 ("Your efficient RL framework
    # secretly brings you off-policy RL training"); sequence-level masking as in arXiv 2512.02556
    log_r = (old_logps - sampler_logps) * mask
    if mode.startswith("sequence"):
        log_r = log_r.sum(-1, keepdim=True)  # [B, 1]
    ratio = log_r.clamp(max=50).exp()
    if mode.endswith("truncate"):
        return ratio.clamp(max=cap)
    return ratio * (ratio <= cap)


def policy_loss(logps, old_logps, advantages, mask, cfg, *, ref_logps=None, sampler_logps=None, entropies=None,
                num_items=None, entropy_threshold=None, num_rows=None):
    """Clipped-surrogate family: -> (scalar loss, metrics). logps/old/ref/sampler/mask [B, T]; advantages [B] or [B, T].
    num_items: the token count bnpo/dapo/cispo/vespo divide by (default mask.sum(); a trainer that cuts a minibatch
    into micro-batches and ranks passes the minibatch's global count); num_rows: the row count grpo/sapo/dr_grpo/luspo
    divide by (default B; rows outside the batch, e.g. dynamic sampling's top-up, leave it); entropy_threshold: the
    top-entropy cut taken over the whole minibatch (default: the quantile of these entropies)."""
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    old = logps.detach() if old_logps is None else old_logps
    metrics = {}

    # Importance ratio: per token, or the length-normalised sequence ratio (GSPO, arXiv 2507.18071)
    log_ratio = logps - old  # [B, T]
    if cfg.importance_sampling_level == "sequence":
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).unsqueeze(-1)  # [B, 1]
    else:
        log_w = log_ratio
    ratio = log_w.exp()  # [B, T] or [B, 1]

    # Sampler-mismatch correction: the engine sampled from pi_sampler, not pi_old
    s_ratio = None
    if sampler_logps is not None and cfg.sampler_correction != "none":
        s_ratio = sampler_ratio(old, sampler_logps, mask, cfg.sampler_correction, cfg.sampler_correction_cap)
        sm = mask if s_ratio.shape[-1] > 1 else (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
        metrics["sampler_ratio/mean"] = _masked_mean(s_ratio, sm)
        metrics["sampler_ratio/min"] = s_ratio.masked_fill(sm == 0, float("inf")).min()
        metrics["sampler_ratio/max"] = s_ratio.masked_fill(sm == 0, float("-inf")).max()
        metrics["sampler_ratio/masked_frac"] = _masked_mean((s_ratio == 0).to(mask.dtype), sm)

    per_token, clipped_low, clipped_high = surrogate(cfg, logps, ratio, log_ratio, adv, mask, s_ratio)
    per_token = per_token.expand_as(logps) if per_token.shape != logps.shape else per_token
    if cfg.dual_clip is not None:  # Dual-clip PPO, arXiv 1912.09729: loss of A < 0 tokens is at most -c A
        per_token = torch.where(adv < 0, torch.min(per_token, -cfg.dual_clip * adv), per_token)

    # Token and sequence masks
    if cfg.top_entropy_quantile < 1.0:  # "Beyond the 80/20 rule", arXiv 2506.01939
        if entropies is None:
            raise ValueError("top_entropy_quantile < 1 needs entropies")
        threshold = entropy_threshold
        if threshold is None and (mask > 0).any():
            threshold = torch.quantile(entropies.detach()[mask > 0].float(), 1 - cfg.top_entropy_quantile)
        if threshold is not None:
            per_token = per_token * (entropies.detach() >= threshold)
    if cfg.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 off-policy sequence masking, arXiv 2512.02556
        behaviour = old if sampler_logps is None else sampler_logps
        seq_kl = ((behaviour - logps.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        keep = ((adv.mean(-1, keepdim=True) >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)).to(logps.dtype)
        metrics["off_policy_mask/frac_masked"] = (1 - keep).sum() / (mask.sum(-1) > 0).sum().clamp(min=1)
        per_token = per_token * keep
    if s_ratio is not None and cfg.loss_type != "vespo":
        per_token = per_token * s_ratio

    # KL penalty against the reference policy
    if cfg.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        kl = kl_estimate(logps, ref_logps, cfg.kl_estimator)
        if cfg.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)

    loss = aggregate(per_token, mask, cfg, num_items, num_rows)
    metrics.update(_clip_metrics(ratio, clipped_low, clipped_high, mask))
    return loss, {k: v.detach() for k, v in metrics.items()}


def surrogate(cfg, logps, ratio, log_ratio, adv, mask, s_ratio):
    """The per-token objective of each loss_type -> (per_token [B, T] or [B, 1], clipped_low, clipped_high)."""
    eps_low, eps_high = cfg.epsilon, (cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high)
    if cfg.loss_type == "cispo":
        # CISPO, MiniMax-M1 arXiv 2506.13585: stop-gradient clipped IS weight times the REINFORCE term
        cap = cfg.epsilon_high if cfg.epsilon_high is not None else 1 + cfg.epsilon  # epsilon_high is the cap here
        clipped_high = (ratio > cap) & (adv > 0)
        return -ratio.clamp(max=cap).detach() * adv * logps, torch.zeros_like(clipped_high), clipped_high
    if cfg.loss_type == "sapo":
        # SAPO, arXiv 2511.20347: smooth sigmoid gate instead of a hard clip
        tau = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        return (-torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv, (ratio < 1 - eps_low) & (adv < 0),
                (ratio > 1 + eps_high) & (adv > 0))
    if cfg.loss_type == "vespo":
        # VESPO, arXiv 2602.10693: detached kernel phi(w) = w^k exp(lambda (1 - w)) on the sequence ratio
        with torch.no_grad():
            log_w_seq = (log_ratio.clamp(-20, 20) * mask).sum(-1, keepdim=True)  # [B, 1]
            if s_ratio is not None:
                log_s = s_ratio.clamp(min=1e-8).log()
                log_w_seq = log_w_seq + ((log_s * mask).sum(-1, keepdim=True) if log_s.shape[-1] > 1 else log_s)
            w = log_w_seq.clamp(math.log(1e-8), 20).exp()
            k = torch.where(adv >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
            lam = torch.where(adv >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
            phi = (k * w.log() + lam * (1 - w)).exp()
        per_token = -phi * adv * logps
        none = torch.zeros_like(per_token, dtype=torch.bool)
        return per_token, none, none
    if cfg.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        # PPO clipped surrogate, arXiv 1707.06347; optional delta cap on the unclipped branch
        unclipped = ratio if cfg.delta is None else ratio.clamp(max=cfg.delta)
        return (-torch.min(unclipped * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv),
                (ratio < 1 - eps_low) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0))
    raise ValueError(f"unknown loss_type {cfg.loss_type!r}: use one of {', '.join(LOSS_TYPES)}")


def aggregate(per_token, mask, cfg, num_items=None, num_rows=None):
    """Per-token losses [B, T] -> one scalar: how they are averaged is what distinguishes most GRPO variants."""
    lt, rows = cfg.loss_type, per_token.shape[0] if num_rows is None else (num_rows or 1)  # per rank: may be < 1
    if lt in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / rows
    if lt == "dr_grpo":  # Dr. GRPO, arXiv 2503.20783: constant denominator removes the length bias
        return (per_token * mask).sum() / (rows * cfg.max_completion_length)
    if lt == "luspo":  # "Length-Unbiased Sequence Policy Optimization" (2026): each sequence weighted by its length
        return (per_token * mask).sum() / rows
    # bnpo (BNPO, 2025), dapo, cispo, vespo: token mean over the whole (global) batch, DAPO arXiv 2503.14476
    n = mask.sum() if num_items is None else num_items
    return (per_token * mask).sum() / (n.clamp(min=1) if torch.is_tensor(n) else max(n, 1))


@torch.no_grad()
def _clip_metrics(ratio, clipped_low, clipped_high, mask):
    cm = mask if clipped_low.shape[-1] > 1 else (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
    cl, ch = clipped_low.expand_as(cm).to(mask.dtype), clipped_high.expand_as(cm).to(mask.dtype)
    return {"clip_ratio/low_mean": _masked_mean(cl, cm), "clip_ratio/high_mean": _masked_mean(ch, cm),
            "clip_ratio/region": _masked_mean(((cl + ch) > 0).to(mask.dtype), cm),
            "ratio/mean": _masked_mean(ratio.detach().expand_as(cm), cm)}


def value_loss(values, old_values, returns, mask, *, clip=0.2):
    """0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), masked mean."""
    # PPO value clipping, arXiv 1707.06347 / "Implementation Matters" arXiv 2005.12729
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * _masked_mean(torch.max((values - returns).square(), (clipped - returns).square()), mask.to(values.dtype))
