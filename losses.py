"""losses.py: advantages, KL estimators and policy/value losses for GRPO-family training.

Pure functions over tensors; imports only torch (the log-softmax helpers and the chunked lm-head: fused_logprobs.py,
re-exported here). Shapes: B sequences, T completion tokens, V vocabulary. `mask` is 1 where a token counts. A policy
loss type is one entry in LOSSES. Worked layout: with num_generations G = 4 and two prompts, `rewards` is [8, K] laid
out as [p0g0, p0g1, p0g2, p0g3, p1g0, p1g1, p1g2, p1g3]; group statistics are over each row of a column's `view(2, 4)`.
"""
import math
from dataclasses import dataclass

import torch

from fused_logprobs import entropy_from_logits, fused_linear_logprobs, sampling_mask, sampling_threshold  # noqa: F401
from fused_logprobs import selective_log_softmax  # noqa: F401 (the re-exports above: losses' public API)

# ---- Advantages ----

def group_advantages(rewards, weights, group_size, *, aggregation="sum_then_normalize", scale="group", eps=1e-4):
    """Advantages from K reward functions' rewards [N, K] (NaN = does not apply) and their weights [K] -> [N]: in each
    group, A_i = (r_i - mean(r_group)) / (std(r_group) + eps) of the weighted sum (sum_then_normalize), or the weighted
    sum of each function's A, normalised over the batch (normalize_then_sum). std: the sample std (n - 1) of the group,
    of the whole batch (scale="batch", still centred per group) or none (scale="none": r_i - mean only; the batch
    normalisation of normalize_then_sum stays); NaN rewards stay out of every statistic; unscorable samples (NaN in
    every column) and groups of one get 0."""
    # DeepSeekMath GRPO, arXiv 2402.03300 (eq. 3); scale="none" is Dr. GRPO, arXiv 2503.20783; GDPO, arXiv 2601.05242
    def normalised(r):  # [N] -> [N], over each row of r.view(-1, group_size); NaN stays NaN
        if group_size == 1:
            return torch.zeros_like(r)
        g = r.view(-1, group_size)  # [N/G, G]
        valid = ~g.isnan()
        count = valid.sum(-1, keepdim=True)
        centered = g - torch.where(valid, g, 0).sum(-1, keepdim=True) / count.clamp(min=1)
        if scale == "none":
            return centered.view(-1)
        if scale == "group":
            var = torch.where(valid, centered, 0).square().sum(-1, keepdim=True) / (count - 1).clamp(min=1)
        elif scale == "batch":
            flat = r[~r.isnan()]
            var = flat.var() if flat.numel() > 1 else flat.new_zeros(())
        else:
            raise ValueError(f"unknown scale_rewards {scale!r}: use group, batch or none")
        return (centered / (var.sqrt() + eps)).view(-1)
    w = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device)
    unscorable = rewards.isnan().all(-1)  # [N]
    if aggregation == "sum_then_normalize":  # the usual GRPO weighted sum
        adv = normalised((rewards * w).nansum(-1).masked_fill(unscorable, float("nan")))  # [N]
    elif aggregation == "normalize_then_sum":  # GDPO
        total = (torch.stack([normalised(r) for r in rewards.T], -1) * w).nansum(-1).masked_fill(unscorable, math.nan)
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
    m, n = mask.to(x.dtype), mask.sum().to(x.dtype)
    mean = (x * m).sum() / n.clamp(min=1)
    var = ((x - mean).square() * m).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def _discounted_cumsum(x, mask, gamma):
    """y_t = x_t + gamma * y_t' on each row's mask-1 tokens, t' the next one; a mask-0 token (tool/environment) is no
    step: it carries y_t' back unchanged (verl's GAE skips observation tokens so). [B, T] -> [B, T]."""
    out, running = torch.zeros_like(x), torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        running = torch.where(mask[:, t] > 0, x[:, t] + gamma * running, running)
        out[:, t] = running
    return out


def reinforce_pp_advantages(token_rewards, mask, *, gamma=1.0):
    """Discounted return-to-go per token, whitened over the batch's valid tokens: [B, T] -> [B, T]."""
    # REINFORCE++, arXiv 2501.03262
    m = mask.to(token_rewards.dtype)
    return masked_whiten(_discounted_cumsum(token_rewards, m, gamma), m)


def gae_advantages(token_rewards, values, mask, *, gamma=1.0, lam=1.0):
    """GAE: delta_t = r_t + gamma V_t' - V_t, A_t = delta_t + gamma lam A_t' (t' = next mask-1 token) -> (adv, ret)."""
    # Generalized Advantage Estimation, arXiv 1506.02438
    m = mask.to(values.dtype)
    ahead = _discounted_cumsum(values, m, 0.0)  # [B, T]: V of the first mask-1 token at or after t
    next_values = torch.cat([ahead[:, 1:], torch.zeros_like(values[:, :1])], 1)  # [B, T]
    adv = _discounted_cumsum((token_rewards + gamma * next_values - values) * m, m, gamma * lam) * m
    return adv, (adv + values) * m


# ---- KL ----

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


def distill_advantages(logps, teacher_logps, mask, coef=1.0):
    # On-policy distillation (GKD, arXiv 2306.13649; Thinking Machines 2025): minus the token's reverse KL, no discount
    return -coef * (logps - teacher_logps) * mask  # [N, T]


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


# ---- Policy and value losses ----

@dataclass
class LossConfig:
    loss_type: str = "dapo"
    """A key of losses.LOSSES: grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo, vespo, gpg, clip_cov, kl_cov, gmpo."""
    importance_sampling_level: str = "token"
    """token | sequence. sequence with loss_type grpo is GSPO (arXiv 2507.18071)."""
    epsilon: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clip (None: epsilon); DAPO's clip-higher uses 0.28. For cispo: the ratio's cap (None: 1 + epsilon)."""
    delta: float | None = None
    """Upper cap on the unclipped ratio (two-sided clipping, INTELLECT-2 arXiv 2505.07291). None = off."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 bounding the loss of negative-advantage tokens (arXiv 1912.09729). None = off."""
    beta: float = 0.0
    """KL coefficient. 0 means no reference policy is ever built or run."""
    kl_in_reward: bool = False
    """-beta KL_t in the token reward instead of the loss (OpenRLHF's PPO) with --advantage-estimator gae."""
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
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: fraction of the minibatch's tokens cut out of the gradient (arXiv 2505.22617)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance band a cut token comes from."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of that band."""
    kl_cov_ratio: float = 2e-4
    """KL-Cov: fraction of the minibatch's tokens (largest covariance) that get the KL penalty."""
    kl_cov_coef: float = 1.0
    """KL-Cov: coefficient of the |log ratio| penalty on those tokens."""
    gmpo_epsilon: float = 0.4
    """GMPO: clip range of each token's log-ratio, (-eps, eps) (arXiv 2507.20673)."""
    max_completion_length: int | None = None
    """Dr. GRPO's constant denominator (None: --rollout.max-completion-length; grpo.update fills it in)."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2 off-policy mask: drop A < 0 sequences whose mean KL(sampler || policy) exceeds it. None = off."""
    top_entropy_quantile: float = 1.0
    """Train only on the top-q highest-entropy tokens (arXiv 2506.01939). 1.0 = all tokens."""
    sampler_correction: str = "sequence_mask"
    """none | token_truncate | token_mask | sequence_truncate | sequence_mask: correct trainer/engine mismatch."""
    sampler_correction_cap: float = 3.0
    """Cap C on the sampler ratio exp(old - sampler): truncated at C or masked above C."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss - entropy_coef x the loss tokens' entropy, aggregated like the loss (verl entropy_coeff)."""


def validate_loss_config(cfg):
    """Raise one clear error for an unknown option or a field the loss type does not read (flags.validate calls it)."""
    for name, allowed in {"loss_type": tuple(LOSSES), **CHOICES}.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--loss.{name.replace('_', '-')} {getattr(cfg, name)!r} is not known: use one of "
                             f"{', '.join(allowed)}")
    own = {f for entry in LOSSES.values() for f in entry.get("reads", ())}
    stray = [f for f in sorted(own - set(LOSSES[cfg.loss_type].get("reads", ())))
             if getattr(cfg, f) != getattr(LossConfig(), f)]
    if stray:
        raise ValueError(f"{', '.join('--loss.' + f.replace('_', '-') for f in stray)} would be ignored: "
                         f"--loss.loss-type {cfg.loss_type} does not read it. Drop it, or pick a loss type that does.")


def _masked_mean(x, mask):
    """Mean of x [B, T] over the loss tokens, or of x [B, 1] (one value per row) over the rows with loss tokens."""
    m = mask if x.shape[-1] == mask.shape[-1] else (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def _row_mean(x, mask):
    return (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, T] -> [B, 1]


def top_entropy_threshold(entropies, mask, quantile, gather, width):
    """The (1 - q) quantile of the entropies of every rank's loss tokens (None if there are none); width bounds any
    rank's token count (gather concatenates equal shapes)."""
    # "Beyond the 80/20 rule: high-entropy minority tokens", arXiv 2506.01939
    valid = entropies[mask > 0].float()  # [n_valid]
    everyone = gather(torch.cat([valid, valid.new_full((width - len(valid),), float("nan"))]))
    everyone = everyone[~everyone.isnan()]
    return torch.quantile(everyone, 1 - quantile) if everyone.numel() else None


@dataclass
class LossInputs:
    """What a surrogate reads: one micro-batch of B sequences x T completion tokens."""
    logps: torch.Tensor                 # [B, T] the policy's log-probs of the sampled tokens (requires grad)
    log_ratio: torch.Tensor             # [B, T] logps - old_logps, per token whatever the ratio level
    ratio: torch.Tensor                 # [B, T] exp(log_ratio), or [B, 1] GSPO's length-normalised sequence ratio
    adv: torch.Tensor                   # [B, 1] one advantage per sequence, or [B, T] per token
    mask: torch.Tensor                  # [B, T] 1.0 where a token counts
    sampler_ratio: torch.Tensor | None  # [B, T] or [B, 1] the sampler-mismatch weight; None: no correction
    statistics: dict                    # {name: [B, ...]} the entry's minibatch `statistics` for these rows ({}: none)


@dataclass
class Surrogate:
    """What a surrogate returns: its loss before masks, KL and aggregation, and where a bound binds (clip metrics)."""
    per_token: torch.Tensor                   # [B, T], or [B, 1]: one loss per sequence, on each of its tokens
    clipped_low: torch.Tensor | None = None   # bool, shaped like the ratio: a lower bound binds (A < 0); None: nowhere
    clipped_high: torch.Tensor | None = None  # bool, shaped like the ratio: an upper bound binds (A > 0); None: nowhere


def policy_loss(logps, old_logps, advantages, mask, cfg, *, ref_logps=None, sampler_logps=None, entropies=None,
                num_items=None, entropy_threshold=None, num_rows=None, statistics=None):
    """-> (scalar loss, metrics). logps/old/ref/sampler/mask/entropies [B, T], advantages [B] or [B, T]. num_items,
    num_rows, entropy_threshold, statistics: the token and row counts to divide by, the top-entropy cut and the loss
    type's statistics, of the minibatch over micro-batches and ranks (default: this batch's, every row counted)."""
    entry, mask = loss_entry(cfg), mask.to(logps.dtype)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    old = logps.detach() if old_logps is None else old_logps
    if entropies is None and (cfg.top_entropy_quantile < 1.0 or cfg.entropy_coef != 0.0):
        raise ValueError("top_entropy_quantile < 1 or entropy_coef != 0 needs entropies")
    if not statistics and entry["statistics"] is not None:
        statistics = entry["statistics"](cfg, logps.detach, old_logps, adv, mask, lambda t: t)

    # 1. Importance ratio: per token, or the length-normalised sequence ratio (GSPO, arXiv 2507.18071)
    log_ratio = logps - old  # [B, T]
    log_w = log_ratio if cfg.importance_sampling_level == "token" else _row_mean(log_ratio, mask)  # [B, T] or [B, 1]
    # the sampler-mismatch weight exp(old - sampler), per token or per sequence, truncated at or masked above the cap:
    # truncated IS (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"),
    # sequence masking as in arXiv 2512.02556
    s_ratio, mode, cap = None, cfg.sampler_correction, cfg.sampler_correction_cap
    if sampler_logps is not None and mode != "none":
        log_s = (old - sampler_logps) * mask  # [B, T]
        s_ratio = (log_s.sum(-1, keepdim=True) if mode.startswith("sequence") else log_s).clamp(max=50).exp()
        s_ratio = s_ratio.clamp(max=cap) if mode.endswith("truncate") else s_ratio * (s_ratio <= cap)  # [B, T]/[B, 1]
    x = LossInputs(logps, log_ratio, log_w.exp(), adv, mask, s_ratio, statistics or {})

    # 2. Surrogate, then the dual clip (Dual-clip PPO, arXiv 1912.09729: the loss of an A < 0 token is at most -c A)
    out = entry["surrogate"](cfg, x)
    per_token = out.per_token.expand_as(logps)  # [B, T]
    if cfg.dual_clip is not None:
        per_token = torch.where(adv < 0, torch.min(per_token, -cfg.dual_clip * adv), per_token)

    # 3. Masks and weights (constants): top-entropy tokens, off-policy sequences, the sampler-mismatch weight
    metrics = loss_metrics(x, out) | ({} if entropies is None else {"entropy": _masked_mean(entropies.detach(), mask)})
    if cfg.top_entropy_quantile < 1.0:  # "Beyond the 80/20 rule", arXiv 2506.01939
        threshold = entropy_threshold if entropy_threshold is not None else top_entropy_threshold(
            entropies.detach(), mask, cfg.top_entropy_quantile, lambda t: t, entropies.numel())
        per_token = per_token if threshold is None else per_token * (entropies.detach() >= threshold)
    if cfg.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 off-policy sequence masking, arXiv 2512.02556
        seq_kl = _row_mean((old if sampler_logps is None else sampler_logps) - logps.detach(), mask)  # [B, 1]
        keep = ((adv.mean(-1, keepdim=True) >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)).to(logps.dtype)
        metrics["off_policy_mask/frac_masked"] = _masked_mean(1 - keep, mask)  # of the rows with loss tokens
        per_token = per_token * keep
    per_token = per_token * s_ratio if s_ratio is not None and not entry["own_sampler_ratio"] else per_token

    # 4. KL penalty against the reference policy
    if cfg.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        kl = kl_estimate(logps, ref_logps, cfg.kl_estimator) * (x.ratio if cfg.use_bias_correction_kl else 1)  # [B, T]
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), mask)

    # 5. Entropy bonus, aggregated like the loss (verl dp_actor.update_policy: policy_loss -= entropy_agg * coeff)
    per_token = per_token - cfg.entropy_coef * entropies if cfg.entropy_coef != 0.0 else per_token

    # 6. Aggregate
    num_rows = per_token.shape[0] if num_rows is None else (num_rows or 1)
    return entry["aggregate"](per_token, mask, cfg, num_items, num_rows), {k: v.detach() for k, v in metrics.items()}


@torch.no_grad()
def loss_metrics(x, out):
    """clip_ratio/{low_mean, high_mean, region}, ratio/mean, sampler_ratio/{mean, min, max, masked_frac}: means over the
    loss tokens, or over the rows with loss tokens for one value per sequence (TRL GRPOTrainer._compute_loss)."""
    no = torch.zeros_like(x.ratio, dtype=torch.bool)
    low, high = [no if c is None else c for c in (out.clipped_low, out.clipped_high)]
    metrics = {"clip_ratio/low_mean": _masked_mean(low, x.mask), "clip_ratio/high_mean": _masked_mean(high, x.mask),
               "clip_ratio/region": _masked_mean(low | high, x.mask), "ratio/mean": _masked_mean(x.ratio, x.mask)}
    if x.sampler_ratio is not None:
        s = x.sampler_ratio  # [B, T] or [B, 1]
        live = (x.mask if s.shape[-1] > 1 else x.mask.sum(-1, keepdim=True)) > 0
        metrics |= {"sampler_ratio/mean": _masked_mean(s, x.mask), "sampler_ratio/min": s.where(live, math.inf).min(),
                    "sampler_ratio/max": s.where(live, -math.inf).max(),
                    "sampler_ratio/masked_frac": _masked_mean(s == 0, x.mask)}
    return metrics


# Surrogates: (cfg, x: LossInputs) -> Surrogate

def ppo_clip(cfg, x):
    """PPO clipped surrogate with an optional delta cap on the unclipped branch."""
    # PPO, arXiv 1707.06347; delta: INTELLECT-2, arXiv 2505.07291
    eps_low, eps_high = cfg.epsilon, (cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high)
    unclipped = x.ratio if cfg.delta is None else x.ratio.clamp(max=cfg.delta)
    return Surrogate(-torch.min(unclipped * x.adv, x.ratio.clamp(1 - eps_low, 1 + eps_high) * x.adv),
                     (x.ratio < 1 - eps_low) & (x.adv < 0), (x.ratio > 1 + eps_high) & (x.adv > 0))


def cispo(cfg, x):
    """Stop-gradient clipped IS weight times the REINFORCE term; epsilon_high is the cap (None -> 1 + epsilon)."""
    # CISPO, MiniMax-M1 arXiv 2506.13585
    cap = cfg.epsilon_high if cfg.epsilon_high is not None else 1 + cfg.epsilon
    return Surrogate(-x.ratio.clamp(max=cap).detach() * x.adv * x.logps, None, (x.ratio > cap) & (x.adv > 0))


def sapo(cfg, x):
    """Smooth sigmoid gate instead of a hard clip; its clip metrics count where PPO's clip would bind."""
    # SAPO, arXiv 2511.20347
    tau = torch.where(x.adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
    clip = ppo_clip(cfg, x)
    return Surrogate(-torch.sigmoid(tau * (x.ratio - 1)) * 4 / tau * x.adv, clip.clipped_low, clip.clipped_high)


def vespo(cfg, x):
    """Detached kernel phi(w) = w^k exp(lambda (1 - w)) of the sequence ratio (sampler ratio folded in) x REINFORCE."""
    # VESPO, arXiv 2602.10693
    with torch.no_grad():
        log_w_seq = (x.log_ratio.clamp(-20, 20) * x.mask).sum(-1, keepdim=True)  # [B, 1]
        if x.sampler_ratio is not None:
            log_s = x.sampler_ratio.clamp(min=1e-8).log()
            log_w_seq = log_w_seq + ((log_s * x.mask).sum(-1, keepdim=True) if log_s.shape[-1] > 1 else log_s)
        w = log_w_seq.clamp(math.log(1e-8), 20).exp()
        k = torch.where(x.adv >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = torch.where(x.adv >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
        phi = (k * w.log() + lam * (1 - w)).exp()
    return Surrogate(-phi * x.adv * x.logps)


def gpg(cfg, x):
    """Plain policy gradient -alpha A log pi: no ratio, no clip; alpha = B / (B - M) from `gpg_alpha`."""
    # GPG, arXiv 2504.02546 (eq. 9 and 11); verl compute_policy_loss_gpg
    return Surrogate(-x.statistics["alpha"] * x.adv * x.logps)


def clip_cov(cfg, x):
    """PPO clip, with the tokens `cov_selection` picked (high covariance of log pi and A) cut out of the gradient."""
    # Clip-Cov, "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617 (eq. 11)
    clip = ppo_clip(cfg, x)
    return Surrogate(clip.per_token * ~x.statistics["selected"], clip.clipped_low, clip.clipped_high)


def kl_cov(cfg, x):
    """-A r, plus kl_cov_coef |log r| on the tokens `cov_selection` picked (not a multiple of A)."""
    # KL-Cov, arXiv 2505.22617 (eq. 12)
    return Surrogate(-x.adv * x.ratio + cfg.kl_cov_coef * x.log_ratio.abs() * x.statistics["selected"])


def gmpo(cfg, x):
    """-A x the geometric mean of the token ratios, each clipped in log space to +-gmpo_epsilon on A's side."""
    # GMPO, arXiv 2507.20673 (eq. 5); verl compute_policy_loss_geo_mean
    a = _row_mean(x.adv, x.mask) if x.adv.shape[-1] > 1 else x.adv  # [B, 1]
    clipped = x.log_ratio.clamp(-cfg.gmpo_epsilon, cfg.gmpo_epsilon)
    sign = x.adv.sign()
    log_r = sign * torch.min(sign * x.log_ratio, sign * clipped)  # [B, T]: the pessimistic side
    was = x.log_ratio != clipped  # verl's pg_clipfrac(_lower): either side of the range, split by A's sign
    return Surrogate(-a * _row_mean(log_r, x.mask).exp(), was & (x.adv < 0), was & (x.adv > 0))


# Minibatch statistics: (cfg, current_logps() -> [B, T], old_logps, adv, mask, gather) -> {name: [B, ...]}, taken over
# the whole minibatch on all ranks (gather concatenates a tensor's dim 0 over ranks), so no cut changes the gradient

def gpg_alpha(cfg, current_logps, old_logps, adv, mask, gather):
    """GPG's alpha = B / (B - M) over the minibatch's rows with loss tokens, M those with a zero advantage -> [B, 1]."""
    # GPG, arXiv 2504.02546 (eq. 11)
    rows, live = (mask.sum(-1) > 0).sum(), ((adv * mask) != 0).any(-1).sum()
    n = gather(torch.stack([rows, live]).to(mask.dtype)[None]).sum(0)
    return {"alpha": (n[0] / n[1].clamp(min=1)).expand(len(mask), 1)}


def cov_selection(current_logps, old_logps, adv, mask, gather, ratio, band=None):
    """The tokens Clip-Cov / KL-Cov treat: cov = (A - mean A)(log pi - mean log pi) over the minibatch's tokens, its
    k = max(1, ratio x tokens) largest (band = (eps_low, eps_high, lb, ub): lb < cov < ub, unclipped) -> [B, T]."""
    # "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617 (sec. 4); verl _clip_cov / _kl_cov
    lp = current_logps()  # [B, T]
    a, valid = adv.expand_as(lp), mask > 0
    sums = gather(torch.stack([(a * mask).sum(), (lp * mask).sum(), mask.sum()])[None]).sum(0)
    cov = (a - sums[0] / sums[2].clamp(min=1)) * (lp - sums[1] / sums[2].clamp(min=1))  # [B, T]
    if band is not None:
        eps_low, eps_high, lb, ub = band
        r = (lp - (lp if old_logps is None else old_logps)).exp()
        valid &= (-a * r.clamp(1 - eps_low, 1 + eps_high) <= -a * r) & (cov > lb) & (cov < ub)
    k = max(int(ratio * sums[2].item()), 1)
    top = torch.where(valid, cov, float("-inf")).flatten().topk(min(k, cov.numel())).values
    top = gather(torch.cat([top, top.new_full((k - len(top),), float("-inf"))]))  # [world x k]: each rank's k largest
    return {"selected": valid & (cov >= top.topk(k).values[-1])}


def clip_cov_tokens(cfg, current_logps, old_logps, adv, mask, gather):
    """Clip-Cov's tokens: the --loss.clip-cov-ratio share with the largest covariance inside its band."""
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    band = (cfg.epsilon, eps_high, cfg.clip_cov_lb, cfg.clip_cov_ub)
    return cov_selection(current_logps, old_logps, adv, mask, gather, cfg.clip_cov_ratio, band)


def kl_cov_tokens(cfg, current_logps, old_logps, adv, mask, gather):
    """KL-Cov's tokens: the --loss.kl-cov-ratio share with the largest covariance."""
    return cov_selection(current_logps, old_logps, adv, mask, gather, cfg.kl_cov_ratio)


# Aggregations: (per_token [B, T], mask, cfg, num_items, num_rows) -> scalar. num_items / num_rows: the minibatch's
# global token / row count per rank, so that micro-batches and ranks sum to the one-big-batch loss

def seq_mean_token_mean(per_token, mask, cfg, num_items, num_rows):
    """Mean over sequences of per-sequence token means (grpo, sapo)."""
    # DeepSeekMath GRPO, arXiv 2402.03300
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_rows


def token_sum_over_max_length(per_token, mask, cfg, num_items, num_rows):
    """Masked sum / (B x max_completion_length): no length bias."""
    # Dr. GRPO, arXiv 2503.20783
    return (per_token * mask).sum() / (num_rows * cfg.max_completion_length)


def seq_mean_token_sum(per_token, mask, cfg, num_items, num_rows):
    """Mean over sequences of per-sequence token sums: each sequence weighted by its length."""
    # "Length-Unbiased Sequence Policy Optimization" (LUSPO, 2026)
    return (per_token * mask).sum() / num_rows


def token_mean(per_token, mask, cfg, num_items, num_rows):
    """Token mean over the whole (global) minibatch."""
    # DAPO, arXiv 2503.14476 (token-level loss)
    n = mask.sum() if num_items is None else num_items
    return (per_token * mask).sum() / (n.clamp(min=1) if torch.is_tensor(n) else max(n, 1))


# One entry per loss type, read by policy_loss, grpo.py's statistics pass, --loss.loss-type and the tests (which walk
# this dict). `reads`: the LossConfig fields it reads that not every type reads (any other such field set is refused;
# entropy_coef, read by all, is in none). Each key: docs/signal-and-losses.md ("One entry ...").
CLIP = ("epsilon", "epsilon_high", "delta", "dual_clip", "importance_sampling_level")  # what ppo_clip types read
LOSSES = {
    "grpo": dict(surrogate=ppo_clip, aggregate=seq_mean_token_mean, reads=CLIP),
    "bnpo": dict(surrogate=ppo_clip, aggregate=token_mean, reads=CLIP),  # BNPO (2025)
    "dr_grpo": dict(surrogate=ppo_clip, aggregate=token_sum_over_max_length, reads=CLIP + ("max_completion_length",)),
    "dapo": dict(surrogate=ppo_clip, aggregate=token_mean, reads=CLIP),
    "luspo": dict(surrogate=ppo_clip, aggregate=seq_mean_token_sum, reads=CLIP),
    "cispo": dict(surrogate=cispo, aggregate=token_mean,
                  reads=("epsilon", "epsilon_high", "importance_sampling_level")),
    "sapo": dict(surrogate=sapo, aggregate=seq_mean_token_mean,
                 reads=("epsilon", "epsilon_high", "sapo_temperature_pos", "sapo_temperature_neg",
                        "importance_sampling_level")),  # no dual clip: the gate bounds it (verl: none)
    "vespo": dict(surrogate=vespo, aggregate=token_mean, own_sampler_ratio=True,
                  reads=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")),
    "gpg": dict(surrogate=gpg, aggregate=token_mean, statistics=gpg_alpha),
    "clip_cov": dict(surrogate=clip_cov, aggregate=token_mean, statistics=clip_cov_tokens,
                     reads=CLIP + ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")),
    "kl_cov": dict(surrogate=kl_cov, aggregate=token_mean, statistics=kl_cov_tokens,
                   reads=("kl_cov_ratio", "kl_cov_coef", "importance_sampling_level")),  # no dual clip (verl: none)
    "gmpo": dict(surrogate=gmpo, aggregate=seq_mean_token_mean, reads=("gmpo_epsilon", "dual_clip")),
}


# The values each string field takes besides loss_type (a key of LOSSES, read live): others are refused
CHOICES = {"importance_sampling_level": ("token", "sequence"), "kl_estimator": ("k1", "k2", "k3"),
           "reward_kl_estimator": ("k1", "k2", "k3"),
           "sampler_correction": ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")}


def loss_entry(cfg):
    """The LOSSES entry of cfg.loss_type, with its defaults filled in; an unknown type raises."""
    if cfg.loss_type not in LOSSES:
        raise ValueError(f"--loss.loss-type {cfg.loss_type!r} is not known: use one of {', '.join(LOSSES)} "
                         "(or add an entry to losses.LOSSES)")
    return {"statistics": None, "own_sampler_ratio": False, "reads": (), **LOSSES[cfg.loss_type]}


def value_loss(values, old_values, returns, mask, *, clip=0.2):
    """0.5 * max((V - R)^2, (clip(V, V_old +- clip) - R)^2), masked mean."""
    # PPO value clipping, arXiv 1707.06347 / "Implementation Matters" arXiv 2005.12729
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = torch.max((values - returns).square(), (clipped - returns).square())  # [B, T]
    return 0.5 * _masked_mean(per_token, mask.to(values.dtype))
