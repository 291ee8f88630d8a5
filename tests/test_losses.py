"""losses.py against naive float64 references written here from the papers' formulas (not from losses.py)."""
import dataclasses
import itertools
import math
import os
from types import SimpleNamespace

import pytest
import torch

import loss_sweep
import losses as L

torch.manual_seed(0)
D = torch.float64


# ---------------------------------------------------------------------------- fused linear log-probs

def naive_logits(hidden, weight, bias=None, temperature=1.0, scale=1.0, softcap=None):
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    return z


def naive_head(hidden, weight, targets, bias=None, temperature=1.0, scale=1.0, softcap=None):
    z = naive_logits(hidden, weight, bias, temperature, scale, softcap)
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(p * logp).sum(-1)


def _grads(fn, inputs, g_lp, g_ent):
    lp, ent = fn()
    total = 0
    if g_lp is not None:
        total = total + (lp * g_lp).sum()
    if g_ent is not None:
        total = total + (ent * g_ent).sum()
    return (lp, ent), torch.autograd.grad(total, inputs, allow_unused=True)


CASES = list(itertools.product([0.6, 1.0, 1.3], [(1.0, None), (0.5, None), (1.0, 3.0), (2.0, 5.0)],
                               ["lp", "ent", "both"]))


@pytest.mark.parametrize("keep", [True, False])  # p kept from the forward (3 matmuls), or the logits recomputed
@pytest.mark.parametrize("temperature,scale_cap,flow", CASES)
def test_fused_matches_naive_float64(temperature, scale_cap, flow, keep):
    scale, cap = scale_cap
    N, H, V = 37, 8, 29  # N not a multiple of the chunk size
    h = torch.randn(2, N, H, dtype=D, requires_grad=True)
    w = torch.randn(V, H, dtype=D, requires_grad=True)
    b = torch.randn(V, dtype=D, requires_grad=True)
    t = torch.randint(0, V, (2, N))
    t[0, 0], t[1, -1] = 0, V - 1  # first and last vocab index
    g_lp = torch.randn(2, N, dtype=D) if flow in ("lp", "both") else None
    g_ent = torch.randn(2, N, dtype=D) if flow in ("ent", "both") else None
    kw = dict(temperature=temperature, scale=scale, softcap=cap)
    (rlp, rent), rg = _grads(lambda: naive_head(h, w, t, b, **kw), (h, w, b), g_lp, g_ent)
    (flp, fent), fg = _grads(lambda: L.fused_linear_logprobs(h, w, t, bias=b, temperature=temperature,
                                                             logit_scale=scale, softcap=cap, chunk_size=8,
                                                             with_entropy=True, keep_probs=keep), (h, w, b), g_lp, g_ent)
    assert flp.dtype == D
    torch.testing.assert_close(flp, rlp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fent, rent, rtol=1e-10, atol=1e-10)
    for a, r in zip(fg, rg):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_fused_chunk_sizes_and_no_bias(chunk):
    h = torch.randn(13, 6, dtype=D, requires_grad=True)
    w = torch.randn(11, 6, dtype=D, requires_grad=True)
    t = torch.randint(0, 11, (13,))
    g = torch.randn(13, dtype=D)
    (rlp, _), rg = _grads(lambda: naive_head(h, w, t), (h, w), g, None)
    (flp, fent), fg = _grads(lambda: L.fused_linear_logprobs(h, w, t, chunk_size=chunk), (h, w), g, None)
    assert fent is None
    torch.testing.assert_close(flp, rlp)
    for a, r in zip(fg, rg):
        torch.testing.assert_close(a, r)


def test_fused_bf16_against_float32_reference():
    h32 = torch.randn(64, 32)
    w32 = torch.randn(50, 32) * 0.3
    t = torch.randint(0, 50, (64,))
    h, w = h32.bfloat16().requires_grad_(), w32.bfloat16().requires_grad_()
    lp, ent = L.fused_linear_logprobs(h, w, t, with_entropy=True, chunk_size=16)
    assert lp.dtype == torch.float32
    hr, wr = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    rlp, rent = naive_head(hr, wr, t)
    # stated tolerance: bf16 inputs with fp32 accumulation, |d logp| <= 0.05, relative grad error <= 2%
    torch.testing.assert_close(lp, rlp, atol=5e-2, rtol=0)
    torch.testing.assert_close(ent, rent, atol=5e-2, rtol=0)
    (lp.sum() + ent.sum()).backward()
    (rlp.sum() + rent.sum()).backward()
    for a, r in ((h.grad, hr.grad), (w.grad, wr.grad)):
        assert a.dtype == torch.bfloat16
        assert (a.float() - r).norm() / r.norm() < 2e-2


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_cuda_dtype_path_on_cpu(monkeypatch, with_entropy, keep):
    """The CUDA path (bf16 matmuls writing fp32, the gradient cast to bf16 once) run on CPU, where torch.mm has no
    out_dtype: _mm/_addmm_ are emulated with the same dtype rule cuBLAS enforces (both operands of one dtype). Without
    this the path only ran on a GPU, where its first run failed (the bf16 gradient buffer was allocated fp32)."""
    import fused_logprobs as F

    def mm(a, b, out):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        return out.copy_(a.double() @ b.double())

    def addmm_(acc, a, b):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        return acc.add_((a.double() @ b.double()).to(acc.dtype))

    monkeypatch.setattr(F, "_low_precision_mm", lambda h: h.dtype == torch.bfloat16)
    monkeypatch.setattr(F, "_mm", mm)
    monkeypatch.setattr(F, "_addmm_", addmm_)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(100, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(300, 32, generator=g) * 0.3).bfloat16().requires_grad_()
    t, up = torch.randint(0, 300, (100,), generator=g), torch.randn(100, generator=g)
    lp, ent = L.fused_linear_logprobs(h, w, t, with_entropy=with_entropy, chunk_size=32, keep_probs=keep)
    ((lp * up).sum() + (ent.sum() if with_entropy else 0)).backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = (h64 @ w64.T).log_softmax(-1)
    ((z.gather(-1, t[:, None])[:, 0] * up.double()).sum() + ((-(z.exp() * z).sum(-1)).sum() if with_entropy else 0)
     ).backward()
    assert (lp.double() - z.gather(-1, t[:, None])[:, 0]).abs().max() < 1e-5  # fp32 logits from bf16 inputs
    for a, r in ((h.grad, h64.grad), (w.grad, w64.grad)):  # one bf16 rounding of dL/dz (and of the result)
        assert a.dtype == torch.bfloat16 and (a.double() - r).norm() / r.norm() < 1e-2


def test_fused_kept_bf16_probs_keep_a_confident_tokens_gradient(monkeypatch):
    """Kept p is stored in bf16 on CUDA: p_y - 1 for a target at p_y = 0.999 must come from expm1(log p_y), not from
    bf16(p_y) - 1 = 0 (which zeroes that token's gradient). CUDA's dtype path emulated on CPU as above."""
    import fused_logprobs as F
    monkeypatch.setattr(F, "_low_precision_mm", lambda h: h.dtype == torch.bfloat16)
    monkeypatch.setattr(F, "_mm", lambda a, b, out: out.copy_(a.double() @ b.double()))
    monkeypatch.setattr(F, "_addmm_", lambda acc, a, b: acc.add_((a.double() @ b.double()).to(acc.dtype)))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(8, 16, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(64, 16, generator=g) * 0.05).bfloat16()
    w[0] = (h[0].detach().float() * 11.0 / h[0].detach().float().square().sum()).bfloat16()  # row 0: p_0 ~ 0.999
    t = torch.zeros(8, dtype=torch.long)
    lp, _ = L.fused_linear_logprobs(h, w, t, keep_probs=True)
    lp.sum().backward()
    h64 = h.detach().double().requires_grad_()
    (h64 @ w.double().T).log_softmax(-1)[:, 0].sum().backward()
    assert lp[0].exp().item() > 0.99
    r = h64.grad[0]
    assert (h.grad[0].double() - r).norm() / r.norm() < 2e-2  # 1.0 when the token's own term is lost


def test_fused_huge_logits_stay_finite():
    h = torch.full((4, 3), 100.0, requires_grad=True)
    w = torch.tensor([[100.0, 0, 0], [-100.0, 0, 0], [0, 0, 0]], requires_grad=True)  # logits ~ +-1e4
    t = torch.tensor([0, 1, 2, 0])
    lp, ent = L.fused_linear_logprobs(h, w, t, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    for x in (lp, ent, h.grad, w.grad):
        assert torch.isfinite(x).all()
    assert lp[0].item() == pytest.approx(0.0) and lp[1].item() < -1e4


def test_fused_mask_skips_tokens_and_full_mask_backprops_zeros():
    h = torch.randn(3, 5, 4, dtype=D, requires_grad=True)
    w = torch.randn(7, 4, dtype=D, requires_grad=True)
    t = torch.randint(0, 7, (3, 5))
    m = torch.rand(3, 5) > 0.4
    lp, _ = L.fused_linear_logprobs(h, w, t, mask=m)
    rlp, _ = naive_head(h, w, t)
    torch.testing.assert_close(lp, torch.where(m, rlp, 0.0))
    g = torch.autograd.grad((lp * m).sum(), (h, w))
    rg = torch.autograd.grad((rlp * m).sum(), (h, w))
    for a, r in zip(g, rg):
        torch.testing.assert_close(a, r)
    lp0, ent0 = L.fused_linear_logprobs(h, w, t, mask=torch.zeros(3, 5, dtype=torch.bool), with_entropy=True)
    (lp0.sum() + ent0.sum()).backward()
    assert (h.grad == 0).all() and (w.grad == 0).all()


def test_fused_tied_weights_reach_shared_parameter():
    emb = torch.nn.Embedding(9, 4).double()
    ids = torch.randint(0, 9, (6,))
    t = torch.randint(0, 9, (6,))
    hidden = torch.tanh(emb(ids))  # the same parameter is the embedding and the lm head
    lp, _ = L.fused_linear_logprobs(hidden, emb.weight, t)
    lp.sum().backward()
    fused = emb.weight.grad.clone()
    emb.weight.grad = None
    rlp, _ = naive_head(torch.tanh(emb(ids)), emb.weight, t)
    rlp.sum().backward()
    torch.testing.assert_close(fused, emb.weight.grad)


# ---------------------------------------------------------------------------- top-k / top-p (the sampled distribution)

def naive_kept(z, top_k, top_p):
    """Per row, written as the samplers describe it: keep the k largest (every tie of the k-th value too), then walk
    the survivors from most to least likely and keep a token while the mass before it is < top_p."""
    keep = torch.zeros_like(z, dtype=torch.bool)
    for i, row in enumerate(z.tolist()):
        order = sorted(range(len(row)), key=lambda j: -row[j])
        if 0 < top_k < len(row):
            kth = row[order[top_k - 1]]
            order = [j for j in order if row[j] >= kth]
        mx = max(row[j] for j in order)
        w = [math.exp(row[j] - mx) for j in order]
        total, before = sum(w), 0.0
        for j, wj in zip(order, w):
            if before / total < top_p or top_p >= 1.0:
                keep[i, j] = True
            before += wj
    return keep


def naive_truncated_head(hidden, weight, targets, top_k, top_p, bias=None, temperature=1.0, scale=1.0, softcap=None):
    """log-prob of the target under the truncated, renormalised tempered distribution (target always in the set);
    entropy of the full tempered distribution. The kept set is a constant (computed without grad)."""
    z = naive_logits(hidden, weight, bias, temperature, scale, softcap)
    flat = z.reshape(-1, z.shape[-1])
    keep = naive_kept(flat.detach(), top_k, top_p)
    keep[torch.arange(len(keep)), targets.reshape(-1)] = True
    zk = flat.masked_fill(~keep, float("-inf"))
    lp = zk.gather(-1, targets.reshape(-1, 1)).squeeze(-1) - zk.logsumexp(-1)
    logp = torch.log_softmax(flat, -1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.view(targets.shape), ent.view(targets.shape)


TRUNC = [(5, 1.0), (1, 1.0), (0, 0.7), (0, 0.05), (4, 0.6), (8, 0.95)]


def test_sampling_mask_matches_naive_walk():
    g = torch.Generator().manual_seed(1)
    for top_k, top_p in TRUNC + [(0, 1.0), (40, 0.5)]:
        z = torch.randn(50, 29, generator=g, dtype=D) * 2
        assert torch.equal(L.sampling_mask(z, top_k, top_p), naive_kept(z, top_k, top_p)), (top_k, top_p)


@pytest.mark.parametrize("keep", [True, False])  # kept p is the truncated one; the entropy's gradient recomputes
@pytest.mark.parametrize("top_k,top_p", TRUNC)
@pytest.mark.parametrize("temperature,scale,cap,chunk", [(1.0, 1.0, None, 8), (0.7, 0.5, 3.0, 1), (1.3, 2.0, None, 1000)])
def test_fused_truncated_matches_naive_float64(top_k, top_p, temperature, scale, cap, chunk, keep):
    N, H, V = 23, 6, 29
    h = torch.randn(N, H, dtype=D, requires_grad=True)
    w = torch.randn(V, H, dtype=D, requires_grad=True)
    b = torch.randn(V, dtype=D, requires_grad=True)
    with torch.no_grad():  # targets drawn from the full distribution: some fall outside the kept set
        t = torch.distributions.Categorical(logits=(h @ w.T + b) * scale / temperature).sample()
    g_lp, g_ent = torch.randn(N, dtype=D), (None if keep else torch.randn(N, dtype=D))
    kw = dict(temperature=temperature)
    (rlp, rent), rg = _grads(lambda: naive_truncated_head(h, w, t, top_k, top_p, b, scale=scale, softcap=cap, **kw),
                             (h, w, b), g_lp, g_ent)
    (flp, fent), fg = _grads(lambda: L.fused_linear_logprobs(h, w, t, bias=b, logit_scale=scale, softcap=cap,
                                                             top_k=top_k, top_p=top_p, chunk_size=chunk,
                                                             with_entropy=True, keep_probs=keep, **kw),
                             (h, w, b), g_lp, g_ent)
    torch.testing.assert_close(flp, rlp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fent, rent, rtol=1e-10, atol=1e-10)
    for a, r in zip(fg, rg):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-10)
    full, _ = naive_head(h, w, t, b, scale=scale, softcap=cap, **kw)
    assert (flp - full).abs().max() > 1e-3  # the truncation is real in every case


def test_fused_truncated_ties_at_the_top_k_boundary_are_all_kept():
    z = torch.tensor([3.0, 2.0, 1.0, 1.0, 0.0, -1.0], dtype=D)  # the 3rd and 4th logits tie exactly
    w = torch.diag(z).requires_grad_()
    h = torch.ones(2, 6, dtype=D)
    t = torch.tensor([3, 0])
    lp, _ = L.fused_linear_logprobs(h, w, t, top_k=3)
    ref = z[t] - z[:4].logsumexp(0)  # top_k=3 keeps both tied tokens: 4 in the set
    torch.testing.assert_close(lp, ref, rtol=1e-12, atol=1e-12)
    assert (lp - (z[t] - z[:3].logsumexp(0))).abs().min() > 0.05  # dropping the tie would be visible
    lp.sum().backward()
    p = torch.softmax(z[:4], 0)  # d/dz_j of sum over both rows = onehot(t) - 2 p_j on the kept set
    expected = -2 * torch.cat([p, torch.zeros(2, dtype=D)])
    expected[3] += 1
    expected[0] += 1
    torch.testing.assert_close(torch.diagonal(w.grad), expected)


def test_fused_truncated_ties_at_the_top_p_boundary_are_all_kept():
    """The tie rule for top-p: the set is {z >= the last kept logit}, so a token tied with the last one the walk keeps
    is kept too, whatever order a sort puts ties in (a walk in sorted order would keep one of them and drop the other).
    p = softmax([2, 1, 1, 0]) = .534, .197, .197, .072: top_p 0.6 keeps 0 and 1, so its tie 2 as well."""
    z = torch.tensor([2.0, 1.0, 1.0, 0.0], dtype=D)
    w = torch.diag(z)
    h = torch.ones(3, 4, dtype=D)
    t = torch.tensor([0, 1, 2])
    lp, _ = L.fused_linear_logprobs(h, w, t, top_p=0.6)
    torch.testing.assert_close(lp, z[t] - z[:3].logsumexp(0), rtol=1e-12, atol=1e-12)
    assert (lp[0] - (z[0] - z[:2].logsumexp(0))).abs() > 0.05  # dropping the tie would be visible


def test_fused_truncated_target_outside_the_kept_set_stays_finite():
    w = torch.eye(4, dtype=D) * 5
    h = torch.tensor([[1.0, 0.5, 0.0, -1.0]], dtype=D, requires_grad=True)
    t = torch.tensor([3])  # the least likely token, outside top_k=1
    lp, _ = L.fused_linear_logprobs(h, w, t, top_k=1)
    z = (h @ w.T)[0]
    torch.testing.assert_close(lp[0], z[3] - torch.stack([z[0], z[3]]).logsumexp(0))  # kept set {top-1, target}
    lp.sum().backward()
    assert torch.isfinite(h.grad).all()


def test_fused_truncated_with_mask_and_entropy_flag_do_not_change_logp_grads():
    h = torch.randn(3, 7, 5, dtype=D, requires_grad=True)
    w = torch.randn(19, 5, dtype=D, requires_grad=True)
    t = torch.randint(0, 19, (3, 7))
    m = torch.rand(3, 7) > 0.3
    g = torch.randn(3, 7, dtype=D)
    rlp, _ = naive_truncated_head(h, w, t, 4, 0.8)
    rg = torch.autograd.grad((rlp * g * m).sum(), (h, w))
    for with_entropy in (False, True):
        lp, ent = L.fused_linear_logprobs(h, w, t, top_k=4, top_p=0.8, mask=m, chunk_size=5, with_entropy=with_entropy)
        torch.testing.assert_close(lp, torch.where(m, rlp, 0.0))
        fg = torch.autograd.grad((lp * g).sum(), (h, w))  # entropy computed but unused: no gradient from it
        for a, r in zip(fg, rg):
            torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_selective_log_softmax_and_entropy():
    x = torch.randn(3, 4, 10, dtype=D)
    i = torch.randint(0, 10, (3, 4))
    p = torch.softmax(x, -1)
    torch.testing.assert_close(L.selective_log_softmax(x, i), torch.log(p.gather(-1, i[..., None])).squeeze(-1))
    torch.testing.assert_close(L.entropy_from_logits(x), -(p * p.log()).sum(-1))
    assert L.selective_log_softmax(x.bfloat16(), i).dtype == torch.float32


# ---------------------------------------------------------------------------- advantages

def ref_group(r, G, scale, eps=1e-4):
    out = []
    rs = [float(v) for v in r]
    allv = [v for v in rs if not math.isnan(v)]
    bmean = sum(allv) / len(allv)
    bstd = math.sqrt(sum((v - bmean) ** 2 for v in allv) / (len(allv) - 1))
    for g in range(0, len(rs), G):
        grp = [v for v in rs[g:g + G] if not math.isnan(v)]
        mean = sum(grp) / len(grp) if grp else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in grp) / (len(grp) - 1)) if len(grp) > 1 else float("nan")
        for v in rs[g:g + G]:
            if math.isnan(v) or G == 1:
                out.append(0.0)
            elif scale == "none":
                out.append(v - mean)
            else:
                s = std if scale == "group" else bstd
                out.append(0.0 if v == mean else (v - mean) / (s + eps))
    return torch.tensor(out, dtype=D)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages(scale):
    r = torch.rand(12, dtype=D)
    torch.testing.assert_close(L.group_advantages(r[:, None], [1.0], 4, scale=scale), ref_group(r, 4, scale))


def test_group_edge_cases():
    assert (L.group_advantages(torch.tensor([[0.3], [0.7]]), [1.0], 1) == 0).all()
    a = L.group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])[:, None], [1.0], 3)
    assert not a.isnan().any() and (a[:3] == 0).all()
    assert (L.rloo_advantages(torch.tensor([0.2, 0.9]), 1) == 0).all()


@pytest.mark.parametrize("scale", ["group", "none"])
def test_multi_reward_sum_then_normalize_nan_aware(scale):
    r = torch.rand(8, 2, dtype=D)
    r[1, 0] = float("nan")           # function 0 does not apply to sample 1
    r[2] = float("nan")              # sample 2 unscorable
    w = [1.0, 0.5]
    total = [float("nan") if math.isnan(r[i, 0]) and math.isnan(r[i, 1]) else
             sum(wk * float(r[i, k]) for k, wk in enumerate(w) if not math.isnan(r[i, k])) for i in range(8)]
    ref = ref_group(torch.tensor(total, dtype=D), 4, scale)
    torch.testing.assert_close(L.group_advantages(r, w, 4, scale=scale), ref)


def test_multi_reward_normalize_then_sum_gdpo():
    r = torch.rand(8, 3, dtype=D)
    r[0, 2] = float("nan")
    r[5] = float("nan")
    w = [1.0, 2.0, 0.5]
    per = [ref_group(r[:, k], 4, "group") for k in range(3)]
    xs = []
    for i in range(8):
        if r[i].isnan().all():
            xs.append(float("nan"))
        else:
            xs.append(sum(w[k] * float(per[k][i]) for k in range(3) if not math.isnan(r[i, k])))
    valid = [x for x in xs if not math.isnan(x)]
    m = sum(valid) / len(valid)
    s = math.sqrt(sum((x - m) ** 2 for x in valid) / (len(valid) - 1))
    ref = torch.tensor([0.0 if math.isnan(x) else (x - m) / (s + 1e-4) for x in xs], dtype=D)
    torch.testing.assert_close(L.group_advantages(r, w, 4, aggregation="normalize_then_sum"), ref)


def test_rloo():
    r = torch.rand(9, dtype=D)
    ref = [float(r[i]) - (sum(float(r[j]) for j in range(g, g + 3)) - float(r[i])) / 2
           for g in range(0, 9, 3) for i in range(g, g + 3)]
    torch.testing.assert_close(L.rloo_advantages(r, 3), torch.tensor(ref, dtype=D))


def test_rloo_leaves_unscorable_samples_out_of_the_baseline():
    """NaN = unscorable: advantage 0, and the others' leave-one-out mean runs over scorable peers only (not a NaN
    filled with the group mean, which shrinks every advantage by G/(G-1))."""
    nan = float("nan")
    r = torch.tensor([1.0, nan, 0.0, 0.5, nan, 2.0, nan, nan, 3.0, 1.0, 4.0, 0.0], dtype=D)  # groups of 4
    ref = []
    for g in range(0, 12, 4):
        xs = [float(x) for x in r[g:g + 4]]
        for i, x in enumerate(xs):
            peers = [y for j, y in enumerate(xs) if j != i and not math.isnan(y)]
            ref.append(0.0 if math.isnan(x) or not peers else x - sum(peers) / len(peers))
    torch.testing.assert_close(L.rloo_advantages(r, 4), torch.tensor(ref, dtype=D))


def _ref_whiten(x, m):
    vals = [float(v) for v, k in zip(x.flatten(), m.flatten()) if k]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / (len(vals) - 1)
    return torch.where(m.bool(), (x - mu) / math.sqrt(var + 1e-8), 0.0)


def test_reinforce_pp_and_whiten():
    r = torch.randn(3, 5, dtype=D)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=D)
    gamma = 0.9
    ret = torch.zeros_like(r)
    for b in range(3):
        n = int(m[b].sum())
        for t in range(n):
            ret[b, t] = sum(gamma ** (k - t) * float(r[b, k]) for k in range(t, n))
    torch.testing.assert_close(L.reinforce_pp_advantages(r, m, gamma=gamma), _ref_whiten(ret, m))


def test_gae():
    r, v = torch.randn(2, 4, dtype=D), torch.randn(2, 4, dtype=D)
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=D)
    gamma, lam = 0.95, 0.8
    adv = torch.zeros_like(r)
    for b in range(2):
        n = int(m[b].sum())
        for t in range(n):
            a = 0.0
            for k in range(t, n):
                nv = float(v[b, k + 1]) if k + 1 < n else 0.0
                a += (gamma * lam) ** (k - t) * (float(r[b, k]) + gamma * nv - float(v[b, k]))
            adv[b, t] = a
    a, ret = L.gae_advantages(r, v, m, gamma=gamma, lam=lam)
    torch.testing.assert_close(a, adv)
    torch.testing.assert_close(ret, (adv + v) * m)


def _verl_gae(r, v, m, gamma, lam):
    """verl (volcengine/verl) verl/trainer/ppo/core_algos.py compute_gae_advantage_return, re-written in float64: its
    loop "skip[s] values and TD-error on observation tokens" (response_mask 0 carries nextvalues and lastgaelam back)."""
    nextvalues, lastgaelam, rev = 0.0, 0.0, []
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * nextvalues - v[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = v[:, t] * m[:, t] + (1 - m[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * m[:, t] + (1 - m[:, t]) * lastgaelam
        rev.append(lastgaelam)
    adv = torch.stack(rev[::-1], dim=1)
    return adv, adv + v  # unwhitened advantages, returns


def test_multi_turn_returns_skip_the_inserted_tokens():
    """Multi-turn rows (model turn, inserted tool/environment span with mask 0, model turn, padding): GAE against verl's
    loop (float64, from its source), and both GAE and REINFORCE++ against the plain recursion over each row's model
    tokens alone (gathered into one contiguous row): the inserted tokens are no steps, the returns do not stop there."""
    g = torch.Generator().manual_seed(5)
    m = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 0, 0, 1, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0],
                      [1, 1, 1, 1, 1, 1, 0, 0]], dtype=D)  # row 3: single-turn, for contrast
    r, v = torch.randn(4, 8, generator=g, dtype=D), torch.randn(4, 8, generator=g, dtype=D)  # r on inserted: dropped
    gamma, lam = 0.9, 0.8
    a, ret = L.gae_advantages(r, v, m, gamma=gamma, lam=lam)
    va, vret = _verl_gae(r, v, m, gamma, lam)
    torch.testing.assert_close(a, va * m, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret * m, vret * m, rtol=1e-12, atol=1e-12)
    assert (a[m == 0] == 0).all() and (ret[m == 0] == 0).all()
    gae_alone, rtg_alone = torch.zeros_like(r), torch.zeros_like(r)  # the recursions over the model tokens alone
    for b in range(4):
        idx = m[b].nonzero().flatten().tolist()
        for i, t in enumerate(idx):
            nxt = lambda k: float(v[b, idx[k + 1]]) if k + 1 < len(idx) else 0.0  # noqa: E731
            gae_alone[b, t] = sum((gamma * lam) ** (k - i) * (float(r[b, idx[k]]) + gamma * nxt(k) - float(v[b, idx[k]]))
                                  for k in range(i, len(idx)))
            rtg_alone[b, t] = sum(gamma ** (k - i) * float(r[b, idx[k]]) for k in range(i, len(idx)))
    torch.testing.assert_close(a, gae_alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(L.reinforce_pp_advantages(r, m, gamma=gamma), _ref_whiten(rtg_alone, m))


# ---------------------------------------------------------------------------- KL

def test_kl_estimators_and_controllers():
    lp, ref = torch.randn(10, dtype=D), torch.randn(10, dtype=D)
    for kind, f in {"k1": lambda a, b: a - b, "k2": lambda a, b: 0.5 * (a - b) ** 2,
                    "k3": lambda a, b: math.exp(b - a) - (b - a) - 1}.items():
        ref_v = torch.tensor([f(float(a), float(b)) for a, b in zip(lp, ref)], dtype=D)
        torch.testing.assert_close(L.kl_estimate(lp, ref, kind), ref_v)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        L.kl_estimate(lp, ref, "k9")
    c = L.AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    c.update(12.0, 100)  # error clipped at +0.2
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    c.update(5.7, 10)
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000) * (1 + (5.7 / 6 - 1) * 10 / 10000))
    f = L.FixedKLController(0.04)
    f.update(100.0, 1)
    assert f.value == 0.04


def verl_kl_penalty(logprob, ref_logprob, kind):
    """verl (volcengine/verl@b178a3c) verl/trainer/ppo/core_algos.py kl_penalty_forward, re-written in float64."""
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # "low_var_kl" / "k3"
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def openrlhf_approx_kl(log_probs, log_probs_base, kind):
    """OpenRLHF (OpenRLHF/OpenRLHF@3c3be62) openrlhf/models/utils.py compute_approx_kl, re-written in float64."""
    log_ratio = log_probs - log_probs_base
    if kind == "k2":
        log_ratio = log_ratio ** 2 / 2.0
    elif kind == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def test_reward_kl_against_verl_and_openrlhf():
    """The KL in the token reward, on ordinary and extreme log-ratios (a token the policy gives 1e-10 of the reference's
    probability, and the reverse): k1 is verl's "kl" (OpenRLHF also clamps k1 at +-10; we follow verl, whose default
    it is), k3 is verl's low_var_kl and OpenRLHF's k3, k2 is OpenRLHF's (verl's "mse" is unclamped)."""
    g = torch.Generator().manual_seed(3)
    lp = torch.cat([-torch.rand(50, generator=g, dtype=D) * 3, torch.tensor([-25.0, -2.0, -0.1, -40.0], dtype=D)])
    ref = torch.cat([lp[:50] + 0.5 * torch.randn(50, generator=g, dtype=D), torch.tensor([-2.0, -25.0, -40.0, -0.1], dtype=D)])
    torch.testing.assert_close(L.reward_kl(lp, ref, "k1"), verl_kl_penalty(lp, ref, "kl"))
    torch.testing.assert_close(L.reward_kl(lp, ref, "k3"), verl_kl_penalty(lp, ref, "low_var_kl"))
    torch.testing.assert_close(L.reward_kl(lp, ref, "k3"), openrlhf_approx_kl(lp, ref, "k3"))
    torch.testing.assert_close(L.reward_kl(lp, ref, "k2"), openrlhf_approx_kl(lp, ref, "k2"))
    assert L.reward_kl(lp, ref, "k3").abs().max() <= 10  # unclamped k3 of the first extreme token: 9.8e9


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spread", [0.05, 1.0], ids=["near_reference", "far_from_reference"])
def test_reward_kl_default_has_the_gradient_of_kl(spread, seed):
    """-beta KL_t in the reward is a reward: held constant, its expected score-function gradient is
    E_{x~pi}[KL_t(x) grad log pi(x)]. For the default estimator that must point along grad KL(pi || ref), computed
    exactly over a 7-way categorical in float64. k1's equals it; k3's is a fraction of it (1-2% near the reference),
    in a direction that can even be opposite (seed 1): the reason the default is k1."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(7, generator=g, dtype=D).requires_grad_()
    ref_lp = torch.log_softmax(theta.detach() + spread * torch.randn(7, generator=g, dtype=D), -1)

    def expected_grad(kind):
        lp = torch.log_softmax(theta, -1)
        k = L.reward_kl(lp.detach(), ref_lp, kind)  # [V]: the estimator at each outcome, a constant
        return torch.autograd.grad((lp.exp().detach() * k * lp).sum(), theta)[0]  # sum_x pi(x) k(x) grad log pi(x)

    lp = torch.log_softmax(theta, -1)
    grad_kl = torch.autograd.grad((lp.exp() * (lp - ref_lp)).sum(), theta)[0]
    got = expected_grad(L.LossConfig().reward_kl_estimator)
    cos = (got @ grad_kl / (got.norm() * grad_kl.norm())).item()
    assert cos > 0.99, cos
    torch.testing.assert_close(got, grad_kl)
    assert expected_grad("k3").norm() < 0.5 * grad_kl.norm()  # what the reward used before


# ---------------------------------------------------------------------------- policy loss

def ref_policy_loss(logps, old, adv, mask, cfg, ref=None, sampler=None, entropies=None, num_items=None):
    """Element-by-element float64 loop over the paper formulas."""
    B, T = logps.shape
    lo, hi = cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    lens = [int(mask[b].sum()) for b in range(B)]
    if cfg.top_entropy_quantile < 1.0:
        vals = sorted(float(entropies[b, t]) for b in range(B) for t in range(T) if mask[b, t])
        thr = torch.quantile(torch.tensor(vals, dtype=D), 1 - cfg.top_entropy_quantile).item()
    toks = [(b, t) for b in range(B) for t in range(T) if mask[b, t]]
    selected = set()
    if cfg.loss_type in ("clip_cov", "kl_cov"):  # arXiv 2505.22617: cov(A, log pi) per token over the batch
        mean_a = sum(float(adv[b]) for b, _ in toks) / len(toks)
        mean_lp = sum(float(logps[b, t]) for b, t in toks) / len(toks)
        cov = {(b, t): (float(adv[b]) - mean_a) * (float(logps[b, t]) - mean_lp) for b, t in toks}
        cands, ratio = toks, cfg.kl_cov_ratio
        if cfg.loss_type == "clip_cov":  # in the band, and not already clipped by PPO; ours: the largest first
            r_tok = {(b, t): math.exp(float(logps[b, t] - old[b, t])) for b, t in toks}
            cands = [bt for bt in toks if cfg.clip_cov_lb < cov[bt] < cfg.clip_cov_ub
                     and not -float(adv[bt[0]]) * min(max(r_tok[bt], 1 - lo), 1 + hi) > -float(adv[bt[0]]) * r_tok[bt]]
            ratio = cfg.clip_cov_ratio
        selected = set(sorted(cands, key=cov.get, reverse=True)[:max(int(ratio * len(toks)), 1)])
    # GPG, arXiv 2504.02546: alpha = B / (B - M), M the rows (with tokens) whose advantage is 0
    alpha = sum(n > 0 for n in lens) / max(sum(n > 0 and float(adv[b]) != 0 for b, n in enumerate(lens)), 1)
    rows = []
    for b in range(B):
        a = float(adv[b])
        seq_lr = sum(float(logps[b, t] - old[b, t]) for t in range(T) if mask[b, t])
        seq_s = sum(float(old[b, t] - sampler[b, t]) for t in range(T) if mask[b, t]) if sampler is not None else 0
        keep_seq = 1.0
        if cfg.off_policy_mask_threshold is not None:
            beh = sampler if sampler is not None else old
            kl = sum(float(beh[b, t] - logps[b, t]) for t in range(T) if mask[b, t]) / max(lens[b], 1)
            keep_seq = 1.0 if (a >= 0 or kl <= cfg.off_policy_mask_threshold) else 0.0
        row = []
        for t in range(T):
            lp = logps[b, t]
            if cfg.importance_sampling_level == "sequence":
                r = torch.exp(sum(logps[b, k] - old[b, k] for k in range(T) if mask[b, k]) / max(lens[b], 1))
            else:
                r = torch.exp(lp - old[b, t])
            if cfg.loss_type == "cispo":
                cap = cfg.epsilon_high if cfg.epsilon_high is not None else 1 + cfg.epsilon
                term = -min(r.item(), cap) * a * lp
            elif cfg.loss_type == "sapo":
                tau = cfg.sapo_temperature_pos if a > 0 else cfg.sapo_temperature_neg
                term = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
            elif cfg.loss_type == "vespo":
                w = math.exp(seq_lr + (math.log(max(sratio_seq(seq_s, cfg), 1e-8)) if sampler is not None and cfg.sampler_correction.startswith("sequence") else 0)
                             + (sum(math.log(max(sratio_tok(float(old[b, k] - sampler[b, k]), cfg), 1e-8)) for k in range(T) if mask[b, k])
                                if sampler is not None and cfg.sampler_correction.startswith("token") else 0))
                k_, lam = (cfg.vespo_k_pos, cfg.vespo_lambda_pos) if a >= 0 else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
                phi = math.exp(lam) * w ** k_ * math.exp(-lam * w)
                term = -phi * a * lp
            elif cfg.loss_type == "gpg":
                term = -alpha * a * lp
            elif cfg.loss_type == "kl_cov":
                term = -a * r + (cfg.kl_cov_coef * abs(lp - old[b, t]) if (b, t) in selected else 0)
            elif cfg.loss_type == "gmpo":  # GMPO, arXiv 2507.20673: clip each log-ratio to +-eps on A's side
                e, sg, total = cfg.gmpo_epsilon, (a > 0) - (a < 0), 0
                for k in range(T):
                    if mask[b, k]:
                        lr = logps[b, k] - old[b, k]
                        c = max(-e, min(e, float(lr)))  # the clipped value: a constant where the clip binds
                        total = total + (lr if sg * float(lr) <= sg * c else torch.tensor(c, dtype=D))
                term = -a * torch.exp(total / max(lens[b], 1))
            elif cfg.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "clip_cov"):
                r1 = torch.clamp(r, max=cfg.delta) if cfg.delta is not None else r
                term = -torch.min(r1 * a, torch.clamp(r, 1 - lo, 1 + hi) * a)
                term = term * 0 if (b, t) in selected else term
            else:
                raise KeyError(f"no float64 reference for loss type {cfg.loss_type!r}: add one to ref_policy_loss")
            if cfg.dual_clip is not None and a < 0:
                term = torch.min(term, torch.tensor(-cfg.dual_clip * a, dtype=D))
            if cfg.top_entropy_quantile < 1.0 and float(entropies[b, t]) < thr:
                term = term * 0
            term = term * keep_seq
            if sampler is not None and cfg.loss_type != "vespo" and cfg.sampler_correction != "none":
                s = sratio_seq(seq_s, cfg) if cfg.sampler_correction.startswith("sequence") else \
                    sratio_tok(float(old[b, t] - sampler[b, t]), cfg)
                term = term * s
            if cfg.beta:
                d = ref[b, t] - lp
                kl = {"k1": -d, "k2": 0.5 * d ** 2, "k3": torch.exp(d) - d - 1}[cfg.kl_estimator]
                if cfg.use_bias_correction_kl:
                    kl = kl * r
                term = term + cfg.beta * kl
            if cfg.entropy_coef:  # verl's entropy bonus: -coeff H on every loss token, aggregated like the loss
                term = term - cfg.entropy_coef * entropies[b, t]
            row.append(term * mask[b, t])
        rows.append(row)
    sums = [sum(row) for row in rows]
    lt = cfg.loss_type
    if lt in ("grpo", "sapo", "gmpo"):
        return sum(s / max(n, 1) for s, n in zip(sums, lens)) / B
    if lt == "bnpo":
        return sum(sums) / max(sum(lens), 1)
    if lt == "dr_grpo":
        return sum(sums) / (B * cfg.max_completion_length)
    if lt == "luspo":
        return sum(sums) / B
    assert lt in ("dapo", "cispo", "vespo", "gpg", "clip_cov", "kl_cov"), \
        f"no float64 aggregation for {lt!r}: add it to one of the branches above (its per-token term goes further up)"
    return sum(sums) / (num_items if num_items is not None else max(sum(lens), 1))


def sratio_tok(d, cfg):
    r = math.exp(d)
    return min(r, cfg.sampler_correction_cap) if cfg.sampler_correction.endswith("truncate") else (r if r <= cfg.sampler_correction_cap else 0.0)


def sratio_seq(d, cfg):
    return sratio_tok(d, cfg)


def _inputs(B=6, T=6, seed=0):
    """A float64 batch on which every bound of every option binds on some tokens (or rows) and not on others (checked:
    test_the_shared_inputs_make_every_bound_bind): wide log-ratios (std 0.5), rows 0 and 3 moved as a whole (+-0.4, so
    GSPO's sequence ratio leaves the clip range both ways), advantages of alternating sign but row 4's, which is 0 (a
    group whose rewards agree: a term gated on A's sign must say where 0 goes), ragged masks; log-probs in [-2, 0] and
    a fifth of them 10 nats lower (a term on unlikely tokens acts somewhere), entropies in [0, 4)."""
    g = torch.Generator().manual_seed(seed)
    low = 10.0 * (torch.rand(B, T, generator=torch.Generator().manual_seed(seed + 1000), dtype=D) < 0.2)  # [B, T]
    logps = (-torch.rand(B, T, generator=g, dtype=D) * 2) - low
    drift = 0.4 * torch.tensor([1.0, 0, 0, -1, 0, 0], dtype=D).repeat(B // 6 + 1)[:B, None]  # [B, 1] of log pi - old
    old = logps - drift + 0.5 * torch.randn(B, T, generator=g, dtype=D)
    ref = logps + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    sampler = old + 0.5 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.0, -1.0], dtype=D).repeat(B)[:B] * (0.5 + torch.rand(B, generator=g,
                                                                                                  dtype=D))
    mask = torch.ones(B, T, dtype=D)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    ent = 4 * torch.rand(B, T, generator=g, dtype=D)
    return logps, old, ref, sampler, adv, mask, ent


def loss_types():
    """Every entry of losses.LOSSES, read when the tests are collected (after all of losses.py ran), so an entry added
    anywhere in it, the README's way included, is tested like the others."""
    return list(L.LOSSES)


CONFIGS = [dict(loss_type=lt) for lt in loss_types()] + [
    dict(loss_type="grpo", importance_sampling_level="sequence"),  # GSPO
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1, epsilon_high=0.3),
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="grpo", delta=1.1),
    dict(loss_type="dapo", dual_clip=1.5),
    dict(loss_type="cispo", epsilon_high=1.2),
    dict(loss_type="bnpo", beta=0.1, kl_estimator="k1"),
    dict(loss_type="grpo", beta=0.04, kl_estimator="k2"),
    dict(loss_type="dr_grpo", beta=0.04, use_bias_correction_kl=True, max_completion_length=10),
    dict(loss_type="dapo", off_policy_mask_threshold=0.05),
    dict(loss_type="dapo", top_entropy_quantile=0.5),
    dict(loss_type="sapo", importance_sampling_level="sequence"),
    dict(loss_type="clip_cov", clip_cov_lb=-1.0, clip_cov_ub=1.0, clip_cov_ratio=0.2),  # several tokens cut
    dict(loss_type="kl_cov", kl_cov_ratio=0.2, kl_cov_coef=0.5),  # several tokens penalised
    dict(loss_type="gmpo", gmpo_epsilon=0.1),  # the clip binds on most tokens
    dict(loss_type="grpo", entropy_coef=0.05, top_entropy_quantile=0.5),  # the bonus is not cut by the entropy mask
    dict(loss_type="dapo", entropy_coef=-0.02, beta=0.04, off_policy_mask_threshold=0.05),
]
SAMPLER = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
SAMPLER_CAP = 1.5  # the sampler correction's cap in the value-and-gradient checks


def test_the_shared_inputs_make_every_bound_bind():
    """On _inputs(), each bound that a CONFIGS option (or the sampler correction) sets binds on some of the tokens (or
    rows) it can act on and not on the others, so a wrong bound shows in the loss, its gradient or the clip metrics;
    and masked-out tokens would count as clipped, so a clip metric that drops the mask shows. From the definitions."""
    logps, old, _, sampler, adv, mask, ent = _inputs()
    tok, rows = mask > 0, mask.sum(-1) > 0  # [B, T], [B]
    a = adv[:, None].expand_as(logps)  # [B, T]
    lr = logps - old
    r, seq_r = lr.exp(), ((lr * mask).sum(-1) / mask.sum(-1).clamp(min=1)).exp()  # [B, T], [B]

    def splits(where, binds, what):
        assert (where & binds).any() and (where & ~binds).any(), f"{what}: binds on all or none of its tokens / rows"

    for kw in CONFIGS:
        cfg = L.LossConfig(**kw)
        lo, hi = cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
        if cfg.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "clip_cov", "sapo"):
            if cfg.importance_sampling_level == "sequence":
                splits(rows & (adv < 0), seq_r < 1 - lo, f"{kw}: the lower clip of the sequence ratio")
                splits(rows & (adv > 0), seq_r > 1 + hi, f"{kw}: the upper clip of the sequence ratio")
            else:
                splits(tok & (a < 0), r < 1 - lo, f"{kw}: the lower clip (A < 0)")
                splits(tok & (a > 0), r > 1 + hi, f"{kw}: the upper clip (A > 0)")
                assert (~tok & (((r < 1 - lo) & (a < 0)) | ((r > 1 + hi) & (a > 0)))).any(), "no masked-out clip"
        if cfg.delta is not None:  # caps the unclipped branch: A < 0 above both, A > 0 above delta
            splits(tok & (a < 0), r > max(cfg.delta, 1 + hi), f"{kw}: delta (A < 0)")
            splits(tok & (a > 0), r > cfg.delta, f"{kw}: delta (A > 0)")
        if cfg.dual_clip is not None:  # the clipped loss -A max(r, clip(r)) of an A < 0 token above -c A
            splits(tok & (a < 0), torch.max(r, r.clamp(1 - lo, 1 + hi)) > cfg.dual_clip, f"{kw}: dual clip")
        if cfg.loss_type == "cispo":  # the cap of the stop-gradient weight, either sign
            cap = 1 + cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
            splits(tok & (a > 0), r > cap, f"{kw}: cispo's cap (A > 0)")
            splits(tok & (a < 0), r > cap, f"{kw}: cispo's cap (A < 0)")
        if cfg.loss_type == "gmpo":  # the log-ratio clip on A's (pessimistic) side
            splits(tok & (a > 0), lr > cfg.gmpo_epsilon, f"{kw}: gmpo's clip (A > 0)")
            splits(tok & (a < 0), lr < -cfg.gmpo_epsilon, f"{kw}: gmpo's clip (A < 0)")
        if cfg.off_policy_mask_threshold is not None:  # mean KL(sampler || policy) of an A < 0 sequence
            kl = ((sampler - logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            splits(rows & (adv < 0), kl > cfg.off_policy_mask_threshold, f"{kw}: the off-policy mask")
        if cfg.top_entropy_quantile < 1:
            cut = torch.quantile(ent[tok], 1 - cfg.top_entropy_quantile)
            splits(tok, ent < cut, f"{kw}: the top-entropy cut")
    splits(tok, (old - sampler).exp() > SAMPLER_CAP, "the token sampler cap")
    splits(rows, ((old - sampler) * mask).sum(-1).exp() > SAMPLER_CAP, "the sequence sampler cap")


@pytest.mark.parametrize("kw", CONFIGS, ids=[str(c) for c in CONFIGS])
@pytest.mark.parametrize("sampler_mode", SAMPLER)
def test_policy_loss_value_and_grad(kw, sampler_mode):
    cfg = L.LossConfig(**{"max_completion_length": 256, **kw}, sampler_correction=sampler_mode,
                       sampler_correction_cap=SAMPLER_CAP)
    metrics = _against_the_reference(cfg)
    assert "clip_ratio/region" in metrics and "ratio/mean" in metrics
    assert ("kl" in metrics) == (cfg.beta != 0)
    assert ("sampler_ratio/mean" in metrics) == (sampler_mode != "none")


SWEPT = loss_sweep.sweep(L.LossConfig(), max_completion_length=10)  # read when the tests are collected


@pytest.mark.parametrize("name", list(SWEPT))
def test_every_loss_field_against_the_float64_reference(name):
    """Every LossConfig field at a non-default value, on each loss type that reads it (tests/loss_sweep.py, read live):
    policy_loss's value and gradient equal ref_policy_loss's. A field added later with a term in policy_loss fails
    here until the reference (written from the paper) has that term too, and a term that skips the mask or the
    aggregation fails against it."""
    _against_the_reference(SWEPT[name])


def _against_the_reference(cfg):
    """policy_loss on _inputs() at cfg: its value and gradient equal ref_policy_loss's -> its metrics."""
    logps, old, ref, sampler, adv, mask, ent = _inputs()
    lp, e = logps.clone().requires_grad_(), ent.clone().requires_grad_()
    loss, metrics = L.policy_loss(lp, old, adv, mask, cfg, ref_logps=ref, sampler_logps=sampler, entropies=e)
    lp2, e2 = logps.clone().requires_grad_(), ent.clone().requires_grad_()
    want = ref_policy_loss(lp2, old, adv, mask, cfg, ref=ref, sampler=sampler, entropies=e2)
    torch.testing.assert_close(loss, want.detach().reshape(()))
    for x, y in zip(torch.autograd.grad(loss, (lp, e), allow_unused=True),  # log-probs and entropies both
                    torch.autograd.grad(want, (lp2, e2), allow_unused=True)):
        torch.testing.assert_close(*(torch.zeros_like(logps) if g is None else g for g in (x, y)))
    torch.testing.assert_close(metrics["entropy"], (ent * mask).sum() / mask.sum())  # the console's entropy column
    return metrics


@pytest.mark.parametrize("lt", loss_types())
def test_rows_outside_the_batch_leave_every_denominator(lt):
    """Rows that are not part of the batch (dynamic sampling's top-up: mask 0, num_rows = the rows that are) give the
    loss and gradient of the batch without them (the float64 loop on the kept rows), for every aggregation."""
    logps, old, ref, sampler, adv, mask, ent = _inputs(B=7)
    mask[4:] = 0
    cfg = L.LossConfig(loss_type=lt, max_completion_length=6)
    lp = logps.clone().requires_grad_()
    loss, _ = L.policy_loss(lp, old, adv, mask, cfg, sampler_logps=sampler, num_rows=4)
    (g,) = torch.autograd.grad(loss, lp)
    lp2 = logps[:4].clone().requires_grad_()
    want = ref_policy_loss(lp2, old[:4], adv[:4], mask[:4], cfg, sampler=sampler[:4])
    (wg,) = torch.autograd.grad(want, lp2)
    torch.testing.assert_close(loss, want.detach().reshape(()))
    torch.testing.assert_close(g[:4], wg)
    assert not g[4:].any()


def test_policy_loss_old_none_is_on_policy_and_num_items():
    logps, _, _, _, adv, mask, _ = _inputs()
    cfg = L.LossConfig(loss_type="dapo")
    lp = logps.clone().requires_grad_()
    loss, m = L.policy_loss(lp, None, adv, mask, cfg, num_items=40)
    # on-policy: ratio 1, loss = -sum(A * mask) / num_items, gradient = -A * mask / num_items
    torch.testing.assert_close(loss, -(adv[:, None] * mask).sum() / 40)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, -adv[:, None] * mask / 40)
    assert m["ratio/mean"].item() == pytest.approx(1.0)


def test_clip_metrics_against_counts():
    logps = torch.zeros(1, 4, dtype=D)
    old = torch.tensor([[0.5, -0.5, 0.0, 0.0]], dtype=D)  # ratios e^-0.5 (low) , e^0.5 (high), 1, 1
    for a, low, high in ((-1.0, 0.25, 0.0), (1.0, 0.0, 0.25)):
        _, m = L.policy_loss(logps, old, torch.tensor([a], dtype=D), torch.ones(1, 4), L.LossConfig(loss_type="grpo"))
        assert m["clip_ratio/low_mean"].item() == pytest.approx(low)
        assert m["clip_ratio/high_mean"].item() == pytest.approx(high)
        assert m["clip_ratio/region"].item() == pytest.approx(low + high)


@pytest.mark.parametrize("lt", loss_types())
def test_empty_completion_rows_give_finite_loss(lt):
    logps = torch.zeros(3, 4, dtype=D, requires_grad=True)
    mask = torch.zeros(3, 4)
    mask[1, :2] = 1
    loss, _ = L.policy_loss(logps, None, torch.tensor([1.0, -1.0, 0.5], dtype=D), mask, L.LossConfig(loss_type=lt, max_completion_length=4))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all()
    loss0, _ = L.policy_loss(logps, None, torch.ones(3, dtype=D), torch.zeros(3, 4), L.LossConfig(loss_type=lt, max_completion_length=4))
    assert torch.isfinite(loss0)


# ---------------------------------------------------------------------------- verl's implementations
# Float64 re-implementations of verl/trainer/ppo/core_algos.py (compute_policy_loss_gpg, compute_policy_loss_clip_cov,
# compute_policy_loss_kl_cov, compute_policy_loss_geo_mean; loss_agg_mode "token-mean", one process, no rollout
# weights), written from that source, on one batch with [B, T] advantages.

def verl_masked_mean(x, mask):
    return (x * mask).sum() / (mask.sum() + 1e-8)  # verl.utils.torch_functional.masked_mean


def verl_gpg(old, lp, adv, mask):
    return verl_masked_mean(-lp * adv, mask)


def verl_clip_cov(old, lp, adv, mask, clip_ratio=0.2, clip_cov_ratio=2e-4, lb=1.0, ub=5.0):
    ratio = torch.exp(lp - old)
    pg1, pg2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - clip_ratio, 1 + clip_ratio)
    clip_by_origin = (pg2 > pg1) & (mask > 0)
    cov = (adv - verl_masked_mean(adv, mask)) * (lp - verl_masked_mean(lp.detach(), mask))
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    idx = torch.nonzero((cov < ub) & (cov > lb) & (mask > 0))
    n_candidates = len(idx)
    idx = idx[torch.randperm(len(idx))[:min(clip_num, len(idx))]]  # random: all of them when there are <= clip_num
    corr = torch.ones_like(adv)
    corr[idx[:, 0], idx[:, 1]] = 0
    return verl_masked_mean(torch.maximum(pg1, pg2) * corr, mask), n_candidates, clip_num


def verl_kl_cov(old, lp, adv, mask, kl_cov_ratio=2e-4, ppo_kl_coef=1.0):
    ratio = torch.exp(lp - old)
    pg, pg_kl = -adv * ratio, -adv * ratio + ppo_kl_coef * (lp - old).abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, l_ = adv[valid].detach().reshape(-1), lp[valid].detach().reshape(-1)
    cov = (a - a.mean()) * (l_ - l_.mean())
    top = valid_idx[torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices]
    T = adv.shape[1]
    pg = pg.clone()
    pg[top // T, top % T] = pg_kl[top // T, top % T]
    return verl_masked_mean(pg, mask)


def verl_geo_mean(old, lp, adv, mask, clip_low=0.4, clip_high=0.4):
    neg_kl = lp - old
    sgn = torch.sign(adv)
    clamped = torch.clamp(neg_kl, -clip_low, clip_high)
    neg_kl_min = sgn * torch.min(sgn * neg_kl, sgn * clamped)
    n = mask.sum(-1)
    ratio = torch.exp((neg_kl_min * mask).sum(-1) / (n + 1e-8))
    advantage = (adv * mask).sum(-1) / (n + 1e-8)
    return torch.mean(-advantage * ratio)


def _verl_batch(seed, adv_scale=1.0, old_noise=0.3, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g, dtype=D) * 3
    old = lp + old_noise * torch.randn(B, T, generator=g, dtype=D)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).to(D)
    adv = (adv_scale * torch.randn(B, 1, generator=g, dtype=D)).expand(B, T) * mask  # outcome advantages, [B, T]
    return lp, old, adv, mask


def _ours_and_grad(lp, old, adv, mask, cfg, **kw):
    x = lp.clone().requires_grad_()
    loss, _ = L.policy_loss(x, old, adv, mask, cfg, **kw)
    return loss, torch.autograd.grad(loss, x)[0]


def _verl_and_grad(fn, lp, *args, **kw):
    x = lp.clone().requires_grad_()
    out = fn(args[0], x, *args[1:], **kw)
    loss = out[0] if isinstance(out, tuple) else out
    return loss, torch.autograd.grad(loss, x)[0], out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_matches_verl_with_the_papers_alpha(seed):
    """GPG (arXiv 2504.02546) at its defaults: -alpha A log pi, token mean, alpha = B / (B - M) with M the rows whose
    advantage is 0 (groups whose rewards agree); verl folds alpha into its advantages (compute_gpg_outcome_advantage,
    which counts nonzero rewards instead): its loss on alpha-scaled advantages equals ours."""
    lp, old, _, mask = _verl_batch(seed)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=D)  # groups of 3: [1, 0, 1] has signal, [1, 0, 0] too
    rewards[3:] = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]][seed], dtype=D)  # none, some, none
    adv = L.group_advantages(rewards[:, None], [1.0], 3, scale="none")[:, None] * mask  # GPG: F_norm = 1
    rows = [b for b in range(6) if mask[b].sum() > 0]
    alpha = len(rows) / sum(1 for b in rows if adv[b].abs().sum() > 0)
    assert (alpha > 1) == (seed != 1) and alpha >= 1
    ours, g = _ours_and_grad(lp, old, adv, mask, L.LossConfig(loss_type="gpg"))
    want, wg, _ = _verl_and_grad(verl_gpg, lp, old, alpha * adv, mask)
    torch.testing.assert_close(ours, want)
    torch.testing.assert_close(g, wg)


@pytest.mark.parametrize("seed", [3, 8])
def test_clip_cov_matches_verl(seed):
    """Clip-Cov (arXiv 2505.22617) at verl's defaults (band 1 < cov < 5, clip 0.2) on a batch with no more candidates
    than the number verl cuts, so verl's random pick takes all of them and the check does not hinge on the draw."""
    lp, old, adv, mask = _verl_batch(seed, adv_scale=3.0)
    want, wg, (_, n_cand, clip_num) = _verl_and_grad(verl_clip_cov, lp, old, adv, mask, clip_cov_ratio=0.3)
    assert 0 < n_cand <= clip_num, (n_cand, clip_num)  # the cut is real and deterministic
    ours, g = _ours_and_grad(lp, old, adv, mask, L.LossConfig(loss_type="clip_cov", clip_cov_ratio=0.3))
    torch.testing.assert_close(ours, want)
    torch.testing.assert_close(g, wg)
    plain, pg = _ours_and_grad(lp, old, adv, mask, L.LossConfig(loss_type="bnpo"))
    assert not torch.allclose(pg, g)  # the cut changed the gradient


@pytest.mark.parametrize("kl_cov_ratio", [2e-4, 0.2])
def test_kl_cov_matches_verl(kl_cov_ratio):
    """KL-Cov (arXiv 2505.22617) at verl's defaults (ppo_kl_coef 1) and with a fifth of the tokens penalised."""
    lp, old, adv, mask = _verl_batch(4, adv_scale=2.0)
    want, wg, _ = _verl_and_grad(verl_kl_cov, lp, old, adv, mask, kl_cov_ratio=kl_cov_ratio)
    ours, g = _ours_and_grad(lp, old, adv, mask, L.LossConfig(loss_type="kl_cov", kl_cov_ratio=kl_cov_ratio))
    torch.testing.assert_close(ours, want)
    torch.testing.assert_close(g, wg)


@pytest.mark.parametrize("seed", [0, 5])
def test_gmpo_matches_verl(seed):
    """GMPO (arXiv 2507.20673) at the paper's clip range (-0.4, 0.4) on the log-ratio, with ratios far enough off that
    it binds; rows with no tokens count in the mean as verl's torch.mean does."""
    lp, old, adv, mask = _verl_batch(seed, old_noise=0.6)
    mask[2], adv[2] = 0, 0  # a row with no loss tokens
    assert ((lp - old).abs() * mask > 0.4).any()
    want, wg, _ = _verl_and_grad(verl_geo_mean, lp, old, adv, mask)
    ours, g = _ours_and_grad(lp, old, adv, mask, L.LossConfig(loss_type="gmpo"))
    torch.testing.assert_close(ours, want)
    torch.testing.assert_close(g, wg)


@pytest.mark.parametrize("lt", loss_types())
def test_every_loss_type_has_a_float64_reference(lt):
    """Each LOSSES entry is checked by test_policy_loss_value_and_grad against ref_policy_loss, which raises for a type it
    has no formula for; this names the missing one directly."""
    logps, old, _, _, adv, mask, _ = _inputs()
    ref_policy_loss(logps, old, adv, mask, L.LossConfig(loss_type=lt, max_completion_length=6))  # KeyError/AssertionError: write one


@pytest.mark.parametrize("lt", loss_types())
def test_every_loss_type_gives_the_same_gradient_however_the_batch_is_cut(lt):
    """Micro-batches (and the rows with zero advantage that grpo.py runs forward only when the loss gives them no
    gradient): with the minibatch's statistics, token and row counts, the pieces' gradients sum to the one-batch
    gradient. grpo.idle_rows, which asks the loss through autograd at other log-probs, names exactly the rows with a
    zero advantage and a zero gradient here."""
    logps, old, _, sampler, adv, mask, ent = _inputs(B=8, seed=3)
    adv = adv.abs() + 1  # far from their mean, rows 1 and 6 hold high-covariance tokens (KL-Cov penalises them)
    adv[[1, 6]], adv[7] = 0, -0.5
    cfg = L.LossConfig(loss_type=lt, clip_cov_lb=-1.0, clip_cov_ratio=0.2, kl_cov_ratio=0.2, gmpo_epsilon=0.1,
                       max_completion_length=6)
    entry = L.loss_entry(cfg)
    whole, g = _ours_and_grad(logps, old, adv, mask, cfg, sampler_logps=sampler)
    stats = entry["statistics"](cfg, logps.clone, old, adv[:, None], mask, lambda x: x) if entry["statistics"] else {}
    total, pieces = 0.0, torch.zeros_like(g)
    dense = bool(g[[1, 6]].any())  # a term that is no multiple of A (KL-Cov's penalty) trains them
    skip = set() if dense else {1, 6}
    for rows in ([0, 1, 2], [3, 4], [5, 6, 7]):
        rows = [r for r in rows if r not in skip]
        loss, gp = _ours_and_grad(logps[rows], old[rows], adv[rows], mask[rows], cfg, sampler_logps=sampler[rows],
                                  num_items=mask.sum(), num_rows=8, statistics={k: v[rows] for k, v in stats.items()})
        total, pieces[rows] = total + loss, gp
    torch.testing.assert_close(pieces, g)
    if not dense:
        torch.testing.assert_close(total, whole)  # the skipped rows add nothing to the loss either
    import grpo
    batch = SimpleNamespace(advantages=adv, mask=mask, old_logps=old, engine_logps=sampler, ref_logps=None)
    idle = grpo.idle_rows(SimpleNamespace(processor=SimpleNamespace()), batch, torch.arange(8), cfg, None,
                          {k: v for k, v in stats.items()})
    assert idle.tolist() == [bool(adv[i] == 0 and not g[i].any()) for i in range(8)], (idle, g.abs().sum(-1))


TERMS = {  # a researcher's extra term, flat over part of its range (reached by idle_rows' probe or not)
    "entropy floor": lambda lp, old, ent: torch.relu(2.0 - ent),  # flat above H = 2
    "entropy cap": lambda lp, old, ent: torch.relu(ent - 5.0),  # flat below H = 5
    "far-ratio penalty": lambda lp, old, ent: torch.relu((lp - old).abs() - 0.5),  # flat for ratios in [0.61, 1.65]
    "entropy band": lambda lp, old, ent: -ent.clamp(0.5, 5.0),  # flat outside the entropies real tokens mostly have
}


@pytest.mark.parametrize("term", list(TERMS))
def test_idle_rows_keeps_a_term_that_acts_on_part_of_its_range(monkeypatch, term):
    """grpo.idle_rows runs a zero-advantage row forward only when the loss gives it no gradient; a term added to
    policy_loss that is flat where idle_rows asks (an entropy floor asked at high entropy, a penalty on ratios far from
    1 asked near 1) would be skipped there and train silently wrong. With each such term the zero-advantage rows
    train; without it they stay idle."""
    import grpo
    logps, old, _, sampler, adv, mask, _ = _inputs(B=8, seed=3)
    adv[[1, 6]] = 0
    real = L.policy_loss

    def with_term(logps, old_logps, advantages, mask, cfg, **kw):
        loss, m = real(logps, old_logps, advantages, mask, cfg, **kw)
        extra = TERMS[term](logps, logps.detach() if old_logps is None else old_logps, kw["entropies"])
        return loss + 0.1 * (extra * mask).sum() / mask.sum(), m
    batch = SimpleNamespace(advantages=adv, mask=mask, old_logps=old, engine_logps=sampler, ref_logps=None)
    idle = lambda: grpo.idle_rows(SimpleNamespace(processor=SimpleNamespace()), batch, torch.arange(8),  # noqa: E731
                                  L.LossConfig(loss_type="dapo"), None, {})
    assert idle().tolist() == (adv == 0).tolist() and idle().sum() == 3  # rows 1, 4 and 6
    monkeypatch.setattr(L, "policy_loss", with_term)
    assert not idle().any()


def test_the_add_a_loss_snippet_trains(tmp_path, monkeypatch):
    """The docs' "add a loss" snippet (one function + one LOSSES entry), pasted into losses: --loss.loss-type accepts it,
    its loss and gradient are REINFORCE's float64 formula (token mean), and grpo.py trains a step with it."""
    import json
    import sys

    from conftest import run
    from loss_snippet_run import paste_into
    monkeypatch.setattr(L, "LOSSES", dict(L.LOSSES))
    paste_into(L)
    cfg = L.LossConfig(loss_type="reinforce")
    L.validate_loss_config(cfg)
    logps, old, _, _, adv, mask, _ = _inputs()
    loss, g = _ours_and_grad(logps, old, adv, mask, cfg)
    B, T = mask.shape
    n = sum(float(mask[b, t]) for b in range(B) for t in range(T))
    want = -sum(float(adv[b]) * float(logps[b, t]) for b in range(B) for t in range(T) if mask[b, t]) / n
    assert loss.item() == pytest.approx(want, rel=1e-12)
    torch.testing.assert_close(g, -adv[:, None] * mask / n)
    out = str(tmp_path / "run")
    run([sys.executable, "tests/loss_snippet_run.py", "--loss.loss-type", "reinforce", "--output-dir", out,
         "--max-steps", "1", "--rollout.engine", "hf", "--log.completions-every", "0", "--eval.every", "0"], timeout=300)
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in rows] == [1] and math.isfinite(rows[0]["loss"]) and rows[0]["grad_norm"] > 0


def test_bad_config_errors():
    with pytest.raises(ValueError, match="--loss.loss-type 'ppo2' is not known"):
        L.validate_loss_config(L.LossConfig(loss_type="ppo2"))
    with pytest.raises(ValueError, match="kl-estimator"):
        L.validate_loss_config(L.LossConfig(kl_estimator="k7"))


def test_value_loss():
    v, ov, ret = torch.randn(2, 5, dtype=D), torch.randn(2, 5, dtype=D), torch.randn(2, 5, dtype=D)
    m = torch.ones(2, 5, dtype=D)
    m[1, 3:] = 0
    terms = [0.5 * max((float(v[b, t]) - float(ret[b, t])) ** 2,
                       (float(ov[b, t]) + max(-0.2, min(0.2, float(v[b, t] - ov[b, t]))) - float(ret[b, t])) ** 2)
             for b in range(2) for t in range(5) if m[b, t]]
    assert L.value_loss(v, ov, ret, m).item() == pytest.approx(sum(terms) / len(terms))


def test_off_policy_mask_frac_masked_counts_rows_in_the_loss():
    """off_policy_mask/frac_masked is the fraction of the rows that reach the loss (any loss token) that the mask drops:
    a row outside the batch (all-zero mask, e.g. a dynamic-sampling top-up) neither counts nor dilutes it."""
    cfg = L.LossConfig(loss_type="dapo", off_policy_mask_threshold=0.01)
    old = torch.zeros(3, 4, dtype=torch.float64)
    logps = torch.tensor([[-2.0] * 4, [-0.001] * 4, [-2.0] * 4], dtype=torch.float64)  # rows 0, 2 far off-policy
    adv = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)  # row 2 outside the batch
    _, m = L.policy_loss(logps, old, adv, mask, cfg)
    live = [i for i in range(3) if mask[i].sum() > 0]
    dropped = [i for i in live if adv[i] < 0 and float(-logps[i][mask[i] > 0].mean()) > 0.01]  # mean KL(old || new)
    assert m["off_policy_mask/frac_masked"].item() == pytest.approx(len(dropped) / len(live))  # 1 of 2, not 1 of 3


def test_a_flag_another_loss_type_reads_is_refused():
    """Each LOSSES entry lists the LossConfig fields it reads that not every type reads (`reads`: its own, and shared
    ones such as epsilon): set with a type that does not read them they would be silently ignored, so validation
    refuses them, naming the flag; with a type that reads them, or at their defaults, they pass."""
    with pytest.raises(ValueError, match=r"--loss.kl-cov-ratio would be ignored: --loss.loss-type dapo"):
        L.validate_loss_config(L.LossConfig(loss_type="dapo", kl_cov_ratio=2e-3))
    with pytest.raises(ValueError, match=r"--loss.gmpo-epsilon would be ignored: --loss.loss-type clip_cov"):
        L.validate_loss_config(L.LossConfig(loss_type="clip_cov", gmpo_epsilon=0.3))
    with pytest.raises(ValueError, match=r"--loss.epsilon would be ignored: --loss.loss-type gpg"):
        L.validate_loss_config(L.LossConfig(loss_type="gpg", epsilon=0.3))  # GPG has no ratio, so no clip
    with pytest.raises(ValueError, match=r"--loss.delta would be ignored: --loss.loss-type cispo"):
        L.validate_loss_config(L.LossConfig(loss_type="cispo", delta=2.0))
    with pytest.raises(ValueError, match=r"--loss.max-completion-length would be ignored: --loss.loss-type dapo"):
        L.validate_loss_config(L.LossConfig(loss_type="dapo", max_completion_length=64))
    for loss_type in L.LOSSES:  # every type at the defaults and with the entropy bonus, and kl_cov with its own flag
        L.validate_loss_config(L.LossConfig(loss_type=loss_type))
        L.validate_loss_config(L.LossConfig(loss_type=loss_type, entropy_coef=0.01))
    L.validate_loss_config(L.LossConfig(loss_type="kl_cov", kl_cov_ratio=2e-3))
    L.validate_loss_config(L.LossConfig(loss_type="dr_grpo", max_completion_length=64, epsilon=0.1))


@pytest.mark.parametrize("lt", loss_types())
def test_a_flag_a_loss_reads_is_not_refused_for_it(lt):
    """The declaration is true in the other direction too: changing each field an entry says it `reads` changes that
    entry's loss (sapo: its clip_ratio metrics, what it reads epsilon for) on a batch where every clip and gate binds
    somewhere."""
    logps, old, _, sampler, adv, mask, _ = _inputs(B=8, seed=5)
    old = logps + 0.8 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1), dtype=D)
    moved = {"epsilon": 0.05, "epsilon_high": 0.05, "delta": 1.01, "max_completion_length": 7,
             "sapo_temperature_pos": 3.0, "sapo_temperature_neg": 3.0, "vespo_k_pos": 5.0, "vespo_lambda_pos": 1.0,
             "vespo_k_neg": 5.0, "vespo_lambda_neg": 1.0, "clip_cov_ratio": 2e-4, "clip_cov_lb": 0.5,
             "clip_cov_ub": 0.0, "kl_cov_ratio": 0.3, "kl_cov_coef": 3.0, "gmpo_epsilon": 0.01, "dual_clip": 1.01,
             "importance_sampling_level": "sequence"}
    wide = {"clip_cov": dict(clip_cov_lb=-5.0, clip_cov_ratio=0.3)}  # a band that holds tokens of either sign
    base = L.LossConfig(loss_type=lt, max_completion_length=6, **wide.get(lt, {}))
    for f in L.loss_entry(base)["reads"]:  # a field of a new type: 3x its default (+0.5), unless listed in `moved`
        value = moved[f] if f in moved else 3 * (getattr(base, f) or 0) + 0.5
        a, ma = L.policy_loss(logps, old, adv, mask, base)
        b, mb = L.policy_loss(logps, old, adv, mask, dataclasses.replace(base, **{f: value}))
        assert not torch.isclose(a, b) or ma["clip_ratio/region"] != mb["clip_ratio/region"], \
            f"{lt} declares it reads {f}, but {f}={value} changes neither its loss nor its clip metrics"


@pytest.mark.parametrize("lt", [lt for lt in loss_types() if "dual_clip" in L.LOSSES[lt].get("reads", ())])
def test_the_dual_clip_never_acts_where_no_ratio_is_above_1(lt):
    """Dual-clip PPO (arXiv 1912.09729) bounds an A < 0 token's loss by -c A where its ratio is far above 1: where
    every ratio is at most 1 (on-policy included) a dual clip of c > 1 leaves the loss and its gradient alone, for every
    type that declares it reads the dual clip (sapo's gated loss is 2/tau |A| at ratio 1, above 1.01 |A|; KL-Cov's
    penalty lifts a small-|A| token's loss over c |A|: both would hold back A < 0 tokens that PPO trains)."""
    logps, _, _, _, adv, mask, _ = _inputs(B=8, seed=5)
    u = torch.rand(logps.shape, generator=torch.Generator().manual_seed(2), dtype=D)
    base = L.LossConfig(loss_type=lt, max_completion_length=6, kl_cov_ratio=0.3, kl_cov_coef=3.0)
    for old, a in ((logps.clone(), adv), (logps + 0.8 * u, 0.1 * adv)):  # ratios 1, then in [0.45, 1] with small |A|
        plain, g = _ours_and_grad(logps, old, a, mask, base)
        clipped, g_clipped = _ours_and_grad(logps, old, a, mask, dataclasses.replace(base, dual_clip=1.01))
        torch.testing.assert_close((clipped, g_clipped), (plain, g), rtol=1e-12, atol=1e-12)


def test_an_entry_added_at_the_end_of_losses_is_collected(tmp_path):
    """The README's "add a loss" snippet appended to a copy of losses.py: pytest collects the parametrised loss tests
    for it like for the built-in types (no snapshot of LOSSES taken before the end of the file exempts it)."""
    import shutil
    import subprocess
    import sys

    from loss_snippet_run import add_a_loss_snippet
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("losses.py", "fused_logprobs.py"):
        shutil.copy(os.path.join(root, name), tmp_path / name)
    with open(tmp_path / "losses.py", "a") as f:
        f.write("\n\n" + add_a_loss_snippet())
    shutil.copytree(os.path.join(root, "tests"), tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_losses.py"], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}).stdout
    named = [line for line in out.splitlines() if "reinforce" in line]
    builtin = [line for line in out.splitlines() if "[gpg" in line or "'gpg'" in line or "-gpg" in line]
    assert named and len(named) >= len(builtin) > 0, out[-3000:]




# ---------------------------------------------------------------------------- clip metrics against TRL and verl

def trl_clip_metrics(coef_1, advantages, mask, epsilon_low, epsilon_high, delta=None, loss_type="grpo"):
    """TRL (huggingface/trl@f2cd577) trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss, its clip metrics with one
    process, re-written in float64. coef_1 = exp(log_importance_weights): [B, T], or [B, 1] at sequence level; TRL caps
    it at delta before the metrics (two-sided clipping); cispo's is the epsilon_high cap (its `cispo_clip_ratio`)."""
    def global_masked_mean(x):
        if x.shape[1] == 1:  # when importance_sampling_level == "sequence": one value per sequence
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    if loss_type == "cispo":
        is_cispo_clipped = (coef_1 > epsilon_high) & (advantages > 0)
        return {"clip_ratio/high_mean": global_masked_mean(is_cispo_clipped.to(D))}
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    is_low_clipped = (coef_1 < 1 - epsilon_low) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + epsilon_high) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    return {"clip_ratio/low_mean": global_masked_mean(is_low_clipped.to(D)),
            "clip_ratio/high_mean": global_masked_mean(is_high_clipped.to(D)),
            "clip_ratio/region": global_masked_mean(is_region_clipped.to(D))}


def verl_pg_clipfrac(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                     clip_ratio_c=3.0):
    """verl (volcengine/verl@b178a3c) verl/trainer/ppo/core_algos.py compute_policy_loss_vanilla's metrics, float64:
    pg_clipfrac (either clip binds: TRL's region) and pg_clipfrac_lower (the dual clip binds, A < 0)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).to(D), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    pg_clipfrac_lower = verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).to(D), response_mask)
    return pg_clipfrac, pg_clipfrac_lower


def verl_gspo_clipfrac(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """verl compute_policy_loss_gspo's pg_clipfrac (same commit), float64: the sequence ratio on each token, so the
    fraction is token-weighted."""
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    return verl_masked_mean(torch.gt(pg_losses2, pg_losses1).to(D), response_mask)


def verl_geo_mean_clipfrac(old_log_prob, log_prob, advantages, response_mask, cliprange_low=0.4, cliprange_high=0.4):
    """verl compute_policy_loss_geo_mean's metrics (same commit), float64: a token is clipped when its log-ratio leaves
    (-low, high), on either side; pg_clipfrac counts those with A > 0, pg_clipfrac_lower those with A < 0."""
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -cliprange_low, cliprange_high)
    clipped = torch.ne(negative_approx_kl, negative_approx_kl_clamp)
    return (verl_masked_mean((clipped * (advantages > 0)).to(D), response_mask),
            verl_masked_mean((clipped * (advantages < 0)).to(D), response_mask))


METRIC_CONFIGS = [dict(loss_type="dapo"), dict(loss_type="dapo", epsilon_high=0.28),
                  dict(loss_type="grpo", epsilon=0.1, epsilon_high=0.3), dict(loss_type="luspo", delta=1.3),
                  dict(loss_type="grpo", importance_sampling_level="sequence"),
                  dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1, epsilon_high=0.3),
                  dict(loss_type="sapo", epsilon=0.1, epsilon_high=0.3), dict(loss_type="cispo", epsilon_high=1.2),
                  dict(loss_type="gmpo"), dict(loss_type="gmpo", gmpo_epsilon=0.1)]


@pytest.mark.parametrize("kw", METRIC_CONFIGS, ids=[str(c) for c in METRIC_CONFIGS])
def test_clip_metrics_match_trl_and_verl(kw):
    """clip_ratio/{low_mean, high_mean, region} and ratio/mean on the shared inputs (every bound binds, and masked-out
    tokens would count as clipped): the PPO types and sapo against TRL's is_low/high/region_clipped (sapo: TRL logs
    none for it; ours are PPO's at its epsilon), cispo against TRL's cispo_clip_ratio, gmpo against verl's geo_mean
    fractions; the token-level region also against verl's pg_clipfrac. ratio/mean: the mean of coef_1 over what
    global_masked_mean averages (neither reference logs it)."""
    logps, old, _, _, adv, mask, _ = _inputs()
    cfg = L.LossConfig(**kw)
    lo, hi = cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    _, got = L.policy_loss(logps, old, adv, mask, cfg)
    log_ratio = logps - old
    seq = cfg.importance_sampling_level == "sequence"
    coef_1 = (((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1) if seq else log_ratio).exp()
    a = adv.unsqueeze(1)
    if cfg.loss_type == "gmpo":
        high, low = verl_geo_mean_clipfrac(old, logps, a.expand_as(logps), mask, cfg.gmpo_epsilon, cfg.gmpo_epsilon)
        clipped = (log_ratio.abs() > cfg.gmpo_epsilon) & (a != 0)  # verl's pg_clipfrac + pg_clipfrac_lower, as one flag
        want = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high,
                "clip_ratio/region": verl_masked_mean(clipped.to(D), mask)}
    elif cfg.loss_type == "cispo":
        want = {"clip_ratio/low_mean": torch.tensor(0.0, dtype=D), **trl_clip_metrics(coef_1, a, mask, lo, hi,
                                                                                       loss_type="cispo")}
        want["clip_ratio/region"] = want["clip_ratio/high_mean"]
    else:
        want = trl_clip_metrics(coef_1, a, mask, lo, hi, cfg.delta)
        if not seq:
            assert verl_pg_clipfrac(old, logps, a.expand_as(logps), mask, lo, hi)[0].item() == pytest.approx(
                got["clip_ratio/region"].item(), rel=1e-8)  # verl's masked_mean adds 1e-8 to the count
    want["ratio/mean"] = coef_1.mean() if seq else (coef_1 * mask).sum() / mask.sum()
    for k, v in want.items():
        assert got[k].item() == pytest.approx(v.item(), rel=1e-8, abs=1e-15), k
    assert 0 < got["clip_ratio/region"] < 1  # the shared inputs make it bind somewhere, not everywhere


def test_sequence_clip_metrics_count_rows_with_tokens_and_verl_weights_them_by_length():
    """The two documented differences of the sequence-level clip metrics: ours average over the rows with loss tokens
    (TRL's over every row: a row outside the batch, e.g. a dynamic-sampling top-up, would dilute them), and verl's
    GSPO pg_clipfrac weights each row by its token count (equal to ours when every row has the same length)."""
    logps, old, _, _, adv, mask, _ = _inputs()
    cfg = L.LossConfig(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.1, epsilon_high=0.3)
    _, got = L.policy_loss(logps, old, adv, mask, cfg)
    pad = lambda x: torch.cat([x, x[:1]])  # noqa: E731  a 7th row with no loss tokens
    _, padded = L.policy_loss(pad(logps), pad(old), pad(adv), torch.cat([mask, torch.zeros_like(mask[:1])]), cfg)
    for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region", "ratio/mean"):
        assert padded[k].item() == pytest.approx(got[k].item(), rel=1e-12), k
    verl = verl_gspo_clipfrac(old, logps, adv[:, None].expand_as(logps), mask, 0.1, 0.3)
    assert abs(verl.item() - got["clip_ratio/region"].item()) > 1e-3  # ragged rows: token- vs row-weighted
    full = torch.ones_like(mask)
    _, even = L.policy_loss(logps, old, adv, full, cfg)
    verl = verl_gspo_clipfrac(old, logps, adv[:, None].expand_as(logps), full, 0.1, 0.3)
    assert even["clip_ratio/region"].item() == pytest.approx(verl.item(), rel=1e-8)


# ---------------------------------------------------------------------------- entropy bonus against verl

def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=None):
    """verl (volcengine/verl@b178a3c) verl/trainer/ppo/core_algos.py agg_loss, float64, one process (dp_size 1, the
    batch's own token and row counts)."""
    if loss_agg_mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    if loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).to(D)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
        seq_mask = (seq_mask > 0).to(D)
        return (seq_losses * seq_mask).sum() / seq_mask.sum()
    assert loss_agg_mode == "seq-mean-token-sum-norm"
    return torch.sum(torch.sum(loss_mat * loss_mask, dim=-1)) / loss_scale_factor


@pytest.mark.parametrize("options", [{}, dict(top_entropy_quantile=0.5, off_policy_mask_threshold=0.05)],
                         ids=["plain", "entropy_and_off_policy_masks"])
@pytest.mark.parametrize("lt", loss_types())
def test_entropy_bonus_matches_verl(lt, options):
    """verl dp_actor.py DataParallelPPOActor.update_policy (verl@b178a3c): entropy_agg = agg_loss(entropy,
    response_mask, loss_agg_mode); policy_loss -= entropy_agg * entropy_coeff. So with entropy_coef c our loss is the
    loss at c = 0 minus c x verl's agg_loss of the entropies, in the mode of the type's aggregation, over the response
    mask alone (no top-entropy or off-policy cut, no sampler weight); its entropy gradient is that term's, the
    log-prob gradient does not move, and a row with a zero advantage trains."""
    logps, old, _, sampler, adv, mask, ent = _inputs()
    adv[1] = 0.0
    B, T = mask.shape
    modes = {L.token_mean: ("token-mean",), L.seq_mean_token_mean: ("seq-mean-token-mean",),
             L.seq_mean_token_sum: ("seq-mean-token-sum",),  # dr_grpo: its B x max_completion_length denominator
             L.token_sum_over_max_length: ("seq-mean-token-sum-norm", B * 6)}
    c = 0.05
    cfg0 = L.LossConfig(loss_type=lt, max_completion_length=6, **options)
    cfg = dataclasses.replace(cfg0, entropy_coef=c)
    assert L.loss_entry(cfg0)["aggregate"] in modes, f"{lt}: map its aggregation to one of verl's agg_loss modes here"
    lp, h = logps.clone().requires_grad_(), ent.clone().requires_grad_()
    loss, _ = L.policy_loss(lp, old, adv, mask, cfg, sampler_logps=sampler, entropies=h)
    g_lp, g_h = torch.autograd.grad(loss, (lp, h))
    base, g_base = _ours_and_grad(logps, old, adv, mask, cfg0, sampler_logps=sampler, entropies=ent)
    h2 = ent.clone().requires_grad_()
    bonus = verl_agg_loss(h2, mask, *modes[L.loss_entry(cfg0)["aggregate"]])
    want = base - bonus * c
    torch.testing.assert_close(loss, want.detach(), rtol=1e-7, atol=0)  # verl's seq-mean-token-mean adds 1e-8
    torch.testing.assert_close(g_h, -c * torch.autograd.grad(bonus, h2)[0], rtol=1e-7, atol=0)
    torch.testing.assert_close(g_lp, g_base)
    assert g_h[1].any() and (g_h[mask == 0] == 0).all()
    with pytest.raises(ValueError, match="entropy_coef != 0 needs entropies"):
        L.policy_loss(logps, old, adv, mask, cfg)


def trl_advantages(rewards_per_func, weights, G, aggregation, scale):
    """Written from TRL (huggingface/trl@f2cd577) trl/trainer/grpo_trainer.py, the advantage block of
    _generate_and_score_completions (both multi_objective_aggregation branches), in float64, for batches without NaN:
    TRL's nansum counts a reward that does not apply as 0, where ours leaves it out (docs/rewards.md)."""
    w = torch.tensor(weights, dtype=D)
    if aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
        mean = rewards.view(-1, G).mean(dim=1).repeat_interleave(G)
        std = rewards.view(-1, G).std(dim=1).repeat_interleave(G) if scale in ("group", "none") else \
            rewards.std().expand_as(rewards)
        adv = rewards - mean
        return adv / (std + 1e-4) if scale != "none" else adv
    grouped = rewards_per_func.view(-1, G, rewards_per_func.shape[1])
    reward_k = ((grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4))
    rewards = (reward_k.view(-1, rewards_per_func.shape[1]) * w.unsqueeze(0)).nansum(dim=1)
    return (rewards - rewards.mean()) / (rewards.std() + 1e-4)


@pytest.mark.parametrize("aggregation, scale", [("sum_then_normalize", "group"), ("sum_then_normalize", "batch"),
                                                ("sum_then_normalize", "none"), ("normalize_then_sum", "group")])
def test_group_advantages_match_trl(aggregation, scale):
    """group_advantages equals TRL's advantages (written from its source above) on the same [N, K] rewards, every
    setting where ours follows TRL (normalize_then_sum reads --scale-rewards only in ours: group, TRL's, here)."""
    g = torch.Generator().manual_seed(0)
    r = torch.rand(12, 3, generator=g, dtype=D).round(decimals=1)  # ties inside groups, as 0/1 rewards give
    r[4:8, 1] = 0.5  # one function constant over a group: its std is 0 there
    torch.testing.assert_close(L.group_advantages(r, [1.0, 0.5, 2.0], 4, aggregation=aggregation, scale=scale),
                               trl_advantages(r, [1.0, 0.5, 2.0], 4, aggregation, scale))
