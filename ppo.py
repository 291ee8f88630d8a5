"""ppo.py: token-level advantages for grpo.py: PPO with a learned critic (GAE) and REINFORCE++.

What GRPO gets from a group of samples, these get per token: a token reward (the sequence reward on the last
completion token, minus beta * KL_t when the KL penalty lives in the reward), then discounted returns (REINFORCE++) or
GAE against a critic's values, whitened over the global batch. The critic is a one-label token classifier, FSDP2-sharded
like the policy, with its own optimizer, schedule, clipping and checkpoint folder (an image-text policy's: by default
its backbone, fed the same images). One function per stage: build_critic (setup), values (before the advantages),
token_advantages (advantages), update_critic (after the policy update), save_critic / load_critic_state.
"""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import batching
import checkpoints
import distributed
import losses
import models
import optim
import token_logprobs

TOKEN_ESTIMATORS = ("reinforce_pp", "gae")


@dataclass
class CriticConfig:
    model: str = ""
    """Critic checkpoint for --advantage-estimator gae: a one-label token classifier, or any causal-LM or image-text
    checkpoint (its backbone gets a fresh, zero-initialised value head). Empty = the policy's checkpoint. A text critic
    of an image-text policy reads the prompt's text, each image as one placeholder token."""
    lr: float | None = None
    """Critic peak learning rate (AdamW; betas from --optim.betas). Default: 1e-5 with --advantage-estimator gae."""
    weight_decay: float = 0.0
    """Critic AdamW weight decay."""
    warmup_steps: int = 0
    """Critic linear warmup, in optimizer updates."""
    schedule: str = "constant"
    """Critic schedule after warmup: constant | cosine."""
    max_grad_norm: float = 1.0
    """Critic gradient clipping (global norm)."""
    value_clip: float = 0.2
    """PPO value clipping: the new value may move at most this far from the old value in the clipped branch."""
    freeze_actor_steps: int = 0
    """Train only the critic for the first N steps (LightRFT's freezing_actor_steps): the policy is not updated."""


def build_critic(cfg, model_path, device, mp_policy, dtype, policy_config, cp_group=None):
    """(--advantage-estimator gae) The critic, FSDP2-sharded (each row split over cp_group's ranks as the policy's),
    with AdamW and its schedule -> dict, else None."""
    if cfg.advantage_estimator != "gae":
        return None
    c = cfg.critic
    model = models.load_critic(c.model or model_path, dtype=dtype, attn_implementation=cfg.policy.attn_implementation,
                               trust_remote_code=cfg.policy.trust_remote_code,
                               gradient_checkpointing=cfg.policy.gradient_checkpointing,
                               freeze_vision=cfg.policy.freeze_vision)
    module = models.shard(token_logprobs.TokenValues(model, cp_group).to(device), mp_policy)
    params = [p for p in module.parameters() if p.requires_grad]  # a frozen vision tower stays out
    optimizer, scheduler = optim.adamw(params, c, cfg.optim.betas,
                                       cfg.max_steps * cfg.steps_per_generation * cfg.num_iterations, fused=True)
    image_text = models.is_image_text(model.config)  # sees the images (LightRFT's CriticVL), else reads the text only
    return {"model": model, "module": module, "optimizer": optimizer, "scheduler": scheduler,
            "image_token_id": getattr(model.config, "image_token_id", None) if image_text else None,
            "placeholders": [] if image_text else token_logprobs.placeholder_token_ids(policy_config)}


def _collate(critic, batch, rows, pad_id, device):
    """The critic's batch: an image-text critic gets the images as the policy does; a text critic one placeholder
    token per image (where an image was, not the image nor its size)."""
    samples, ph = [batch.samples[i] for i in rows], critic.get("placeholders")
    if ph:
        samples = [{"prompt_ids": token_logprobs.collapse_placeholders(s["prompt_ids"], ph), "completion_ids": s["completion_ids"]}
                   for s in samples]
    return token_logprobs.collate(samples, pad_id, device, batch.T, critic.get("image_token_id"))


@torch.no_grad()
def values(critic, batch, micro_batch_size, pad_id, device, micro_batch_tokens=0):
    """V(s_t) of every completion token, in micro-batches (batching.micro_batch_plan) -> [N, T]."""
    plan = batching.micro_batch_plan(torch.arange(len(batch.samples)), None, micro_batch_size, device,
                                     micro_batch_tokens, batch.samples)  # the policy's rows: >= a text critic's
    critic["module"].eval()  # the old values: no dropout, whatever the checkpoint sets (update_critic sets train())
    return batching.in_order([(mb, critic["module"](_collate(critic, batch, mb.tolist(), pad_id, device)))
                              for mb, _ in plan])


def token_rewards(rewards, completion_mask, kl=None, beta=0.0):
    """r_t = -beta KL_t on every model token, plus the sequence reward on the last model token (an episode may end
    with inserted tokens, which the returns skip) -> [N, T]."""
    # KL penalty in the reward: Ouyang et al., "Training language models to follow instructions", arXiv 2203.02155
    r = -beta * kl * completion_mask if kl is not None and beta else torch.zeros_like(completion_mask)
    ends = torch.arange(1, r.shape[1] + 1, device=r.device) * (completion_mask > 0)  # [N, T]: t + 1 on model tokens
    last = ends.max(-1).values  # [N]: 1 + the last model token's position; 0 in a row without any
    r[torch.arange(len(r), device=r.device), (last - 1).clamp(min=0)] += rewards.to(r) * (last > 0).to(r)
    return r


def kl_in_reward(cfg):
    """Does -beta KL_t go into the token rewards (and out of the loss)?"""
    return cfg.loss.beta != 0 and (cfg.loss.kl_in_reward or cfg.advantage_estimator == "reinforce_pp")


def token_level_advantages(cfg, rewards, weights, batch, kl_coef, device):
    """(collective) The advantages stage for reinforce_pp/gae: token rewards (token_rewards), then returns or GAE over
    the global batch -> ({"advantages": [N, T], "returns", "mask": without unscorable samples (all NaN)}, metrics)."""
    total = (rewards * torch.tensor(weights)).nansum(-1).to(device)  # [N]
    mask = batch.mask.masked_fill(rewards.isnan().all(-1).to(device)[:, None], 0)  # [N, T]
    kl, metrics = None, {}
    if kl_in_reward(cfg):
        kl = losses.reward_kl(batch.old_logps, batch.ref_logps, cfg.loss.reward_kl_estimator)
        kl = kl * batch.completion_mask  # [N, T]
        s = distributed.global_sums({"kl": (kl * mask).sum().item(), "tokens": mask.sum().item()}, device)
        metrics["kl"] = s["kl"] / max(s["tokens"], 1)
    token_r = token_rewards(total, batch.completion_mask, kl, kl_coef)  # [N, T]
    adv, returns, more = token_advantages(cfg.advantage_estimator, token_r, mask, batch.old_values, gamma=cfg.gamma,
                                          lam=cfg.lam, device=device)
    return {"advantages": adv, "returns": returns, "mask": mask}, {**metrics, **more}


def _global_rows(x, T_all):
    """(collective) Pad [N, T] to [N, T_all] and concatenate every rank's rows -> [world * N, T_all]."""
    return distributed.all_gather_cat(F.pad(x, (0, T_all - x.shape[1])))


def token_advantages(estimator, token_r, mask, old_values, *, gamma, lam, device):
    """(collective) Advantages (and GAE returns) on the whole global batch, whitened over its valid tokens -> this
    rank's rows: (adv [N, T], returns [N, T] or None, metrics)."""
    N, T = mask.shape
    T_all = int(distributed.global_sums({"T": T}, device, dist.ReduceOp.MAX)["T"])
    r_all, m_all = _global_rows(token_r, T_all), _global_rows(mask.to(token_r.dtype), T_all)
    mine = slice(distributed.data_rank() * N, (distributed.data_rank() + 1) * N)
    if estimator == "reinforce_pp":  # REINFORCE++, arXiv 2501.03262: discounted returns, batch-whitened
        adv = losses.reinforce_pp_advantages(r_all, m_all, gamma=gamma)
        ret, _ = losses.gae_advantages(r_all, torch.zeros_like(r_all), m_all, gamma=gamma, lam=1.0)  # V = 0: returns
        return adv[mine, :T], None, {"advantages/mean": _mean(ret, m_all), "returns/mean": _mean(ret, m_all)}
    v_all = _global_rows(old_values, T_all)
    adv, returns = losses.gae_advantages(r_all, v_all, m_all, gamma=gamma, lam=lam)  # GAE, arXiv 1506.02438
    metrics = {"advantages/mean": _mean(adv, m_all), "returns/mean": _mean(returns, m_all),
               "critic/value_mean": _mean(v_all, m_all)}
    if _var(returns, m_all) > 1e-8:  # undefined when every return is the same
        metrics["critic/explained_variance"] = 1 - _var(returns - v_all, m_all) / _var(returns, m_all)
    return losses.masked_whiten(adv, m_all)[mine, :T], returns[mine, :T], metrics


def _mean(x, m):
    return ((x * m).sum() / m.sum().clamp(min=1)).item()


def _var(x, m):
    return (((x - _mean(x, m)) ** 2 * m).sum() / m.sum().clamp(min=1)).item()


def update_critic(critic, batch, minibatch_rows, cfg, pad_id, device, world):
    """(collective) One critic update per minibatch (the policy's minibatches): clipped value loss, token-weighted
    over the minibatch's global tokens so the gradient does not depend on micro-batches or ranks -> metrics."""
    c, mask = cfg.critic, batch.mask
    params = critic["optimizer"].param_groups[0]["params"]  # the sharded ones (one rank: after values()' no-grad
    critic["module"].train()  # forward module.parameters() would be the unsharded views, which get no .grad)
    sums = []
    for rows in minibatch_rows:
        n_tokens = distributed.global_sums({"tokens": mask[rows].sum().item()}, device)["tokens"]
        loss, clipped = 0.0, 0.0
        for mb, _ in batching.micro_batch_plan(rows, None, cfg.micro_batch_size, device, cfg.micro_batch_tokens,
                                               batch.samples):
            v = critic["module"](_collate(critic, batch, mb.tolist(), pad_id, device))  # [b, T]
            old, ret, m = batch.old_values[mb], batch.returns[mb], mask[mb]
            vl = losses.value_loss(v, old, ret, m, clip=c.value_clip) * m.sum() / max(n_tokens / world, 1)
            vl.backward()  # FSDP2 averages over ranks: a rank's loss is its share of the global token mean, x world
            loss += vl.item() / world
            v_clip = old + (v.detach() - old).clamp(-c.value_clip, c.value_clip)
            clipped += (((v_clip - ret) ** 2 > (v.detach() - ret) ** 2) * m).sum().item()
        n = distributed.global_sums({"loss": loss, "clipped": clipped}, device)
        grad_norm, _ = optim.optimizer_step(params, critic["optimizer"], critic["scheduler"], c.max_grad_norm, n["loss"])
        sums.append({"critic/loss": n["loss"], "critic/clip_frac": n["clipped"] / max(n_tokens, 1),
                     "critic/grad_norm": grad_norm})
    return {**{k: sum(s[k] for s in sums) / max(len(sums), 1) for k in ("critic/loss", "critic/clip_frac",
                                                                         "critic/grad_norm")},
            "critic/lr": critic["scheduler"].get_last_lr()[0]}


def save_critic(critic, processor, path, rank):
    """(collective) checkpoint-N/critic/: HF format (loadable as the next run's --critic.model) + sharded state."""
    out = os.path.join(path, "critic")
    checkpoints.save_hf(critic["model"], processor, out, rank, save_merged=False)
    checkpoints.save_sharded(os.path.join(out, "dcp"), critic["module"], critic["optimizer"])


def load_critic_state(critic, path, scheduler_state):
    """(collective) Resume the critic exactly: weights, optimizer, schedule."""
    checkpoints.load_sharded(os.path.join(path, "critic", "dcp"), critic["module"], critic["optimizer"])
    critic["scheduler"].load_state_dict(scheduler_state)
