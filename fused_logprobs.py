"""fused_logprobs.py: per-token log-probs (and entropies) of a linear lm-head + (truncated) softmax, chunked so that
no more than chunk_size x V logits are ever held; exact gradients. Imports only torch; re-exported by losses.py, whose
public API it is (losses.fused_linear_logprobs, losses.sampling_mask, ...).

Shapes: N tokens, H hidden size, V vocabulary.
"""
import torch

def _acc_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32



def _chunk_logits(h, weight, bias, scale, softcap, temperature, acc):
    """Logits of one chunk in the accumulation dtype: softcap(scale * (h W^T + b)) / temperature."""
    z = (h @ weight.T).to(acc)  # [n, V]  (the matmul runs in the input dtype, accumulates in fp32 inside)
    if bias is not None:
        z += bias.to(acc)
    if scale != 1.0:
        z *= scale
    if softcap is not None:
        z = torch.tanh(z.div_(softcap)).mul_(softcap)
    if temperature != 1.0:
        z /= temperature
    return z


def sampling_threshold(z, top_k=0, top_p=1.0):
    """The smallest logit a vLLM-style sampler can still draw from tempered logits z [n, V] -> [n]: top-k first
    (ties at the k-th value kept), then top-p on the renormalised rest (walking down from the most likely token,
    keep each token while the mass before it is < top_p, i.e. vLLM's "drop the ascending prefix with mass <= 1-p").
    The kept set is {z >= threshold}, so every tie at the boundary is kept."""
    # Holtzman et al., "The Curious Case of Neural Text Degeneration", arXiv 1904.09751 (nucleus sampling)
    V = z.shape[-1]
    top_k = top_k if 0 < top_k < V else 0
    vals = z.topk(top_k, -1).values if top_k else z.sort(-1, descending=True).values  # [n, k]
    if top_p >= 1.0:
        return vals[:, -1]
    kept = z.masked_fill(z < vals[:, -1:], float("-inf")) if top_k else z  # the top-k set, ties in (no copy without)
    lse = kept.logsumexp(-1, keepdim=True)
    p = (vals - lse).exp()
    n_keep = ((p.cumsum(-1) - p) < top_p).sum(-1, keepdim=True)  # >= 1: nothing comes before the top token
    return vals.gather(-1, n_keep - 1).squeeze(-1)


def sampling_mask(z, top_k=0, top_p=1.0, targets=None, threshold=None):
    """bool [n, V]: the tokens the sampler can draw (`sampling_threshold`), plus `targets` [n] always, so a sampled
    token that sits at the boundary by a rounding difference keeps a finite log-prob."""
    keep = z >= (sampling_threshold(z, top_k, top_p) if threshold is None else threshold)[:, None]
    if targets is not None:
        keep.scatter_(-1, targets[:, None], True)
    return keep


class _FusedLinearLogprobs(torch.autograd.Function):
    """Chunked lm-head + log-softmax; keeps only per-token log-sum-exps and entropy between forward and backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, scale, softcap, top_k, top_p, chunk_size, with_entropy):
        ctx.set_materialize_grads(False)  # an output nothing depends on gets None: its backward branch is skipped
        acc = _acc_dtype(hidden, weight)
        n = hidden.shape[0]
        truncate = top_k > 0 or top_p < 1.0
        logps, lse = (torch.empty(n, dtype=acc, device=hidden.device) for _ in range(2))
        lse_kept = torch.empty(n, dtype=acc, device=hidden.device) if truncate else lse  # of the truncated distribution
        thr = torch.empty(n, dtype=acc, device=hidden.device) if truncate else None  # kept set: logit >= thr, + target
        ent = torch.empty(n, dtype=acc, device=hidden.device) if with_entropy else None
        for s in range(0, n, chunk_size):
            t = targets[s:s + chunk_size]
            x = _chunk_logits(hidden[s:s + chunk_size], weight, bias, scale, softcap, temperature, acc)  # [c, V]
            l = x.logsumexp(-1)  # [c]
            lse[s:s + chunk_size] = l
            lk = l
            if truncate:
                thr[s:s + chunk_size] = sampling_threshold(x, top_k, top_p)
                lk = x.masked_fill(~sampling_mask(x, targets=t, threshold=thr[s:s + chunk_size]), float("-inf")).logsumexp(-1)
            lse_kept[s:s + chunk_size] = lk
            logps[s:s + chunk_size] = x.gather(-1, t[:, None]).squeeze(-1) - lk
            if with_entropy:  # of the full tempered distribution (a diagnostic; top-entropy selection reads it)
                x.sub_(l[:, None])  # log p
                ent[s:s + chunk_size] = -(x.exp() * x).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, lse_kept, ent, thr)
        ctx.cfg = (temperature, scale, softcap, top_k, top_p, chunk_size)
        return logps, ent

    @staticmethod
    def backward(ctx, grad_logps, grad_ent):
        hidden, weight, bias, targets, lse, lse_kept, ent, thr = ctx.saved_tensors
        temperature, scale, softcap, top_k, top_p, chunk_size = ctx.cfg
        truncate = top_k > 0 or top_p < 1.0
        acc = lse.dtype
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if bias is not None and ctx.needs_input_grad[2] else None
        for s in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[s:s + chunk_size], targets[s:s + chunk_size]
            x = _chunk_logits(h, weight, bias, scale, softcap, temperature, acc)  # [c, V]
            # d/du c tanh(u/c) = 1 - tanh^2(u/c) = 1 - (x T / c)^2, read off the capped logits
            dcap = 1 - (x * (temperature / softcap)).square() if softcap is not None else None
            g = torch.zeros_like(x)
            if grad_ent is not None and ent is not None:
                # dH/dx_j = -p_j (x_j - lse + H), p of the full tempered distribution
                lp = x - lse[s:s + chunk_size, None]  # log p  [c, V]; in place from here: one more [c, V], not five
                pg = lp.exp().mul_(grad_ent[s:s + chunk_size, None].to(acc))
                g.sub_(pg.mul_(lp.add_(ent[s:s + chunk_size, None])))
                del lp, pg
            if grad_logps is not None:
                # d logp_y / dx_j = 1[j = y] - p_j, p of the distribution sampled from (0 outside the kept set, whose
                # membership is a constant: it only changes where the loss is not differentiable)
                p = (x - lse_kept[s:s + chunk_size, None]).exp_()
                if truncate:
                    p.masked_fill_(~sampling_mask(x, targets=t, threshold=thr[s:s + chunk_size]), 0.0)
                gl = grad_logps[s:s + chunk_size, None].to(acc)
                g.sub_(p.mul_(gl))
                g.scatter_add_(-1, t[:, None], gl)
                del p
            del x
            if temperature != 1.0:
                g /= temperature
            if dcap is not None:
                g *= dcap
                del dcap
            if scale != 1.0:
                g *= scale
            if grad_h is not None:
                grad_h[s:s + chunk_size] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += (g.T.to(h.dtype) @ h).to(acc)
            if grad_b is not None:
                grad_b += g.sum(0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None, None


def fused_linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
                          top_k=0, top_p=1.0, chunk_size=1024, with_entropy=False, mask=None):
    """log_softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / temperature) at targets, chunked.

    With top_k > 0 or top_p < 1: the log-prob under the truncated, renormalised distribution the engine sampled from
    (temperature, then top-k, then top-p: `sampling_mask`). The entropy is always that of the full tempered
    distribution. Never holds more than chunk_size x V logits; exact gradients for hidden, weight and bias through
    both outputs. `mask` (optional, same shape as targets): positions where it is 0 are skipped and return 0.
    """
    # Liger-style chunked loss (arXiv 2410.10989), pure PyTorch: recompute each chunk's logits in backward.
    lead = targets.shape
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    t = targets.reshape(-1)  # [N]
    idx = None
    if mask is not None:
        idx = mask.reshape(-1).nonzero().squeeze(-1)  # [n_valid]
        h, t = h.index_select(0, idx), t.index_select(0, idx)
    logps, ent = _FusedLinearLogprobs.apply(h, weight, bias, t, float(temperature), float(logit_scale),
                                            None if softcap is None else float(softcap), int(top_k), float(top_p),
                                            int(chunk_size), bool(with_entropy))
    if idx is not None:  # scatter back: masked positions cost nothing and get 0
        n = targets.numel()
        logps = logps.new_zeros(n).index_put((idx,), logps)
        ent = ent.new_zeros(n).index_put((idx,), ent) if ent is not None else None
    return logps.view(lead), (ent.view(lead) if ent is not None else None)


def selective_log_softmax(logits, index):
    """log_softmax(logits)[index] without keeping a second [..., V] tensor around."""
    logits = logits.to(_acc_dtype(logits))
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # [...]


def entropy_from_logits(logits):
    """Shannon entropy of softmax(logits): lse(x) - sum p x."""
    logits = logits.to(_acc_dtype(logits))
    p = logits.softmax(-1)
    return logits.logsumexp(-1) - (p * logits).sum(-1)  # [...]
