"""fused_logprobs.py: per-token log-probs (and entropies) of a linear lm-head + (truncated) softmax, chunked so that
no more than chunk_size x V logits are ever held in the accumulation dtype; exact gradients. Imports only torch (and
os, for the free memory); re-exported by losses.py, whose public API it is (losses.fused_linear_logprobs, ...).

The backward gets dL/dz from one of two things (`keep_probs`; the trainer lets free memory choose). Kept p: the
forward writes p - onehot(y) for every token in the matmul's dtype (bf16 on CUDA; the target's entry is expm1(log
p_y), so a confident token keeps its small gradient), and the backward scales it per token and runs the two gradient
matmuls: 3 head matmuls, like the naive path. Recompute (the default; p does not fit, a softcap, the entropy's own
gradient): only per-token log-sum-exps are kept and the backward recomputes each chunk's logits: 4 matmuls.

Passes over each [chunk, V] block (logp only; bench/logprobs.py measures them): forward = the matmul writing fp32 once
+ an in-place log-softmax (one read, one write) [+ one exp writing kept p]; backward = kept p: one in-place scale (CUDA)
+ the two gradient matmuls; recompute: the matmul again + an in-place softmax + the two gradient matmuls (on CUDA after
one cast to bf16 that also applies the per-token factors).

Shapes: N tokens, H hidden size, V vocabulary.
"""
import os

import torch


def _acc_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _low_precision_mm(hidden):
    """True where 16-bit matmuls can write fp32 (cuBLAS: bf16/fp16 inputs, fp32 accumulation and output): the head runs
    in the input dtype there. Elsewhere (CPU) the head runs in the accumulation dtype on upcast copies."""
    return hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16)


def _mm(a, b, out):
    """a @ b written once into `out` (fp32/fp64), never rounded to 16 bits on the way (CUDA: bf16 x bf16 -> fp32)."""
    return torch.mm(a, b, out=out) if a.dtype == out.dtype else torch.mm(a, b, out_dtype=out.dtype, out=out)


def _addmm_(acc, a, b):
    """acc += a @ b with acc in fp32/fp64 and a, b maybe 16-bit; no [V, H] temporary."""
    return acc.addmm_(a, b) if a.dtype == acc.dtype else torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)


def free_memory(device):
    """Bytes free on `device` now (CUDA: the driver's count; CPU: the kernel's available pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 1 << 34


def keep_probs_fits(n, vocab, device, itemsize):
    """Keep p from the forward (3 head matmuls) when its [N, V] block takes at most a quarter of the free memory; else
    recompute the logits in the backward (4 matmuls, only per-token numbers kept)."""
    return n * vocab * itemsize <= free_memory(device) // 4


def default_chunk_size(n, vocab, device, bytes_per_logit=4, kept_bytes=0):
    """Rows per chunk, in multiples of 64: the [chunk, V] working buffers take at most 1/16 of the free memory, 2 GiB on
    CUDA (large blocks keep its matmuls efficient) and 128 MiB on CPU (measured: 512-1024 rows at V=32768 are fastest;
    smaller chunks lose more to the weight-gradient accumulation than they gain in cache), and a quarter of the tokens
    (under a tenth of the naive path's [N, V] tensors); with p kept (`kept_bytes` per logit), an eighth of the kept
    block's bytes, so kept p plus buffers stay under a quarter of the naive path's extra memory on CUDA."""
    budget = min(free_memory(device) // 16, (2 << 30) if device.type == "cuda" else (128 << 20))
    rows = min(budget // (vocab * bytes_per_logit), -(-n // 4))
    if kept_bytes:
        rows = min(rows, n * kept_bytes // (8 * bytes_per_logit))
    return int(max(64, -(-rows // 64) * 64))


def _chunk_logits(h, weight, bias, scale, softcap, temperature, out):
    """One chunk's logits softcap(scale * (h W^T + b)) / temperature, each step in place in `out` [n, V] (acc dtype)."""
    z = _mm(h, weight.T, out)  # [n, V]
    if bias is not None:
        z += bias
    if softcap is not None:
        z.mul_(scale / softcap).tanh_().mul_(softcap / temperature)
    elif scale != temperature:
        z.mul_(scale / temperature)
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
    """Chunked lm-head + log-softmax, each chunk's logits written once into one reused buffer and transformed in place;
    keeps per-token log-sum-exps and entropy, and p - onehot(y) when `keep_probs` (else the backward recomputes)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, scale, softcap, top_k, top_p, chunk_size, with_entropy,
                keep_probs):
        ctx.set_materialize_grads(False)  # an output nothing depends on gets None: its backward branch is skipped
        acc, n, truncate = _acc_dtype(hidden, weight), hidden.shape[0], top_k > 0 or top_p < 1.0
        w = weight if _low_precision_mm(hidden) else weight.to(acc)  # [V, H]; a copy only for 16-bit off CUDA
        V, dev = weight.shape[0], hidden.device
        if softcap is not None or keep_probs is None:  # a softcap's tanh' is not kept: recompute there
            keep_probs = softcap is None and keep_probs_fits(n, V, dev, w.dtype.itemsize)
        c = chunk_size or default_chunk_size(n, V, dev, acc.itemsize * (1 + with_entropy), keep_probs * w.itemsize)
        new = lambda: torch.empty(n, dtype=acc, device=dev)  # noqa: E731
        logps, lse = new(), new()
        lse_kept, thr = (new(), new()) if truncate else (lse, None)  # kept set: logit >= thr, + target
        ent = new() if with_entropy else None
        buf = torch.empty(min(c, n), V, dtype=acc, device=dev)  # [c, V], reused by every chunk
        spare = torch.empty_like(buf) if with_entropy else None
        q = torch.empty(n, V, dtype=w.dtype, device=dev) if keep_probs else None  # [N, V] p - onehot(y)
        for s in range(0, n, c):
            t, k = targets[s:s + c], min(c, n - s)
            x = _chunk_logits(hidden[s:s + c].to(w.dtype), w, bias, scale, softcap, temperature, buf[:k])  # [k, V]
            zt = x.gather(-1, t[:, None]).squeeze(-1)  # [k] the targets' logits
            if truncate:  # before x is consumed: the truncated distribution's normaliser
                thr[s:s + c] = sampling_threshold(x, top_k, top_p)
                keep = sampling_mask(x, targets=t, threshold=thr[s:s + c])
                lse_kept[s:s + c] = x.masked_fill(~keep, float("-inf")).logsumexp(-1)
            lp = torch.log_softmax(x, -1, out=x)  # [k, V] log p, in place: one read and one write of the block
            lpt = lp.gather(-1, t[:, None]).squeeze(-1)  # [k]
            lse[s:s + c] = zt - lpt  # z_y - log p_y: what the backward needs
            logps[s:s + c] = zt - lse_kept[s:s + c] if truncate else lpt
            if with_entropy:  # of the full tempered distribution (a diagnostic; top-entropy selection reads it)
                ent[s:s + c] = -torch.exp(lp, out=spare[:k]).mul_(lp).sum(-1)
            if q is not None:  # p of the distribution sampled from (truncated: 0 outside the kept set), in one write
                qk = torch.exp(lp.add_((lse[s:s + c] - lse_kept[s:s + c])[:, None]) if truncate else lp, out=q[s:s + k])
                if truncate:
                    qk.masked_fill_(~keep, 0.0)
                qk[torch.arange(k, device=dev), t] = torch.expm1(logps[s:s + c]).to(q.dtype)  # p_y - 1, not 1 - 1
        ctx.save_for_backward(hidden, weight, bias, targets, lse, lse_kept, ent, thr, q)
        ctx.cfg = (temperature, scale, softcap, top_k, top_p, c)
        return logps, ent

    @staticmethod
    def backward(ctx, grad_logps, grad_ent):
        hidden, weight, bias, targets, lse, lse_kept, ent, thr, q = ctx.saved_tensors
        temperature, scale, softcap, top_k, top_p, c = ctx.cfg
        acc, n = lse.dtype, hidden.shape[0]
        grad_ent = grad_ent if ent is not None else None
        q = q if grad_ent is None else None  # the entropy's gradient needs log p: recompute
        low = _low_precision_mm(hidden)
        w = weight if low else weight.to(acc)  # [V, H]: the dtype the gradient matmuls run in
        grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        buf = None if q is not None else torch.empty(min(c, n), weight.shape[0], dtype=acc, device=hidden.device)
        buf_lp = torch.empty(buf.shape, dtype=w.dtype, device=buf.device) if low and buf is not None else None
        for s in range(0, n, c):
            sl, k = slice(s, s + c), min(c, n - s)
            h = hidden[sl].to(w.dtype)  # [k, H]
            if q is not None:  # kept from the forward; consumed in place (a second backward through it is refused)
                d, row = q[sl], -grad_logps[sl].to(acc)  # dL/dz = row[:, None] * d
            else:
                x = _chunk_logits(h, w, bias, scale, softcap, temperature, buf[:k])  # [k, V]
                d, row = _chunk_grad_(x, targets[sl], lse[sl], lse_kept[sl], None if ent is None else ent[sl],
                                      None if thr is None else thr[sl], grad_logps, grad_ent, sl, softcap, temperature,
                                      top_k, top_p)  # dL/dz = row[:, None] * d, in place in buf
            row = row * (scale / temperature)  # [k]: d z / d(h W^T + b) is scale / T (times tanh' with a softcap)
            if grad_b is not None:
                grad_b.addmv_(d.T.to(acc), row)
            if low:  # the row factors ride along the one cast to 16 bits the matmuls need anyway
                d, row = torch.mul(d, row[:, None], out=d if buf_lp is None else buf_lp[:k]), None
            if grad_h is not None:
                _mm(d, w, grad_h[sl])
                if row is not None:
                    grad_h[sl] *= row[:, None]
            if grad_w is not None:
                _addmm_(grad_w, d.T, h if row is None else (h * row[:, None].to(h.dtype)))
        cast = lambda g, like: g.to(like.dtype) if g is not None else None  # noqa: E731
        return (cast(grad_h, hidden), cast(grad_w, weight), cast(grad_b, bias)) + (None,) * 9


def _chunk_grad_(x, t, lse, lse_kept, ent, thr, grad_logps, grad_ent, sl, softcap, temperature, top_k, top_p):
    """Turn the chunk's logits x [k, V] in place into d with dL/dz = row[:, None] * d; returns (d, row [k])."""
    tanh_grad = 1 - (x * (temperature / softcap)).square() if softcap is not None else None  # d c tanh(u/c)/du
    keep = sampling_mask(x, targets=t, threshold=thr) if top_k > 0 or top_p < 1.0 else None  # read before x is spent
    if grad_ent is None:  # the usual case: d = p - onehot(y), row = -dL/dlogp
        if keep is None:  # p, in place: one read and one write of the block
            d = torch.softmax(x, -1, out=x)
        else:  # p of the truncated distribution sampled from: 0 outside the kept set (a constant: it moves only where
            d = x.sub_(lse_kept[:, None]).exp_().masked_fill_(~keep, 0.0)  # nothing is smooth)
        d[torch.arange(len(t), device=t.device), t] -= 1
        row = -grad_logps[sl].to(x.dtype)
    else:  # the entropy's gradient too: dH/dx_j = -p_j (log p_j + H), p of the full tempered distribution
        lp = x - lse[:, None]  # [k, V] log p
        d = lp.exp().mul_(lp.add_(ent[:, None])).mul_(grad_ent[sl, None].to(x.dtype))
        del lp
        if grad_logps is not None:
            gl = grad_logps[sl, None].to(x.dtype)
            p = x.sub_(lse_kept[:, None]).exp_()
            if keep is not None:
                p.masked_fill_(~keep, 0.0)
            d.add_(p.mul_(gl)).scatter_add_(-1, t[:, None], -gl)
        row = -torch.ones(len(t), dtype=x.dtype, device=x.device)
    if tanh_grad is not None:
        d.mul_(tanh_grad)
    return d, row


def fused_linear_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, softcap=None,
                          top_k=0, top_p=1.0, chunk_size=None, with_entropy=False, mask=None, keep_probs=False):
    """log_softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / temperature) at targets, chunked: never more
    than chunk_size x V logits held (None: `default_chunk_size`, from the device's free memory); exact gradients for
    hidden, weight and bias through both outputs.

    top_k > 0 or top_p < 1: the log-prob under the truncated, renormalised distribution the engine sampled from
    (temperature, then top-k, then top-p: `sampling_mask`); the entropy is always the full tempered distribution's.
    `mask` (optional, targets' shape): positions where it is 0 are skipped and return 0. `keep_probs`: False (default)
    holds nothing [N, V] and recomputes the logits in the backward; True keeps p - onehot(y) ([N, V], the matmul's
    dtype) for one matmul fewer; None keeps it when a gradient is wanted and it fits (`keep_probs_fits`; the trainer's
    choice, token_logprobs.TokenLogprobs). Never with a softcap."""
    # Liger-style chunked loss (arXiv 2410.10989), pure PyTorch; keeping p trades N x V x 2 bytes (bf16) for a matmul.
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # [N, H], [N]
    idx = None if mask is None else mask.reshape(-1).nonzero().squeeze(-1)  # [n_valid]
    if idx is not None:
        h, t = h.index_select(0, idx), t.index_select(0, idx)
    logps, ent = _FusedLinearLogprobs.apply(h, weight, bias, t, float(temperature), float(logit_scale),
                                            None if softcap is None else float(softcap), int(top_k), float(top_p),
                                            None if chunk_size is None else int(chunk_size), bool(with_entropy),
                                            keep_probs if torch.is_grad_enabled() else False)
    if idx is not None:  # scatter back: masked positions cost nothing and get 0
        logps, ent = [x if x is None else x.new_zeros(targets.numel()).index_put((idx,), x) for x in (logps, ent)]
    return logps.view(targets.shape), (ent.view(targets.shape) if ent is not None else None)


def selective_log_softmax(logits, index):
    """log_softmax(logits)[index] without keeping a second [..., V] tensor around."""
    logits = logits.to(_acc_dtype(logits))
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)  # [...]


def entropy_from_logits(logits):
    """Shannon entropy of softmax(logits): lse(x) - sum p x."""
    logits = logits.to(_acc_dtype(logits))
    p = logits.softmax(-1)
    return logits.logsumexp(-1) - (p * logits).sum(-1)  # [...]
