"""Tests for dspark.training.losses (docs/method.md eqs. 8, 11–14)."""

import math

import pytest
import torch
import torch.nn.functional as F

from dspark.training import losses
from dspark.training.losses import confidence_labels, dspark_loss, position_weights


def _probs_to_logits(p):
    return torch.log(torch.tensor(p, dtype=torch.float32))


def _naive(draft, target, tokens, conf, w, mask):
    """Straightforward float32 reference of eqs 8, 11–14 with weighted-mean normalisation."""
    log_pd = torch.log_softmax(draft.float(), -1)
    pd, pt = log_pd.exp(), torch.softmax(target.float(), -1)
    ce = -log_pd.gather(-1, tokens.clamp_min(0)[..., None]).squeeze(-1)
    l1 = (pd - pt).abs().sum(-1)
    c_star = (1 - 0.5 * l1).detach()
    bce = F.binary_cross_entropy_with_logits(conf.float(), c_star, reduction="none")
    ww = w[None, :] * mask
    mean = lambda t: (ww * t).sum() / ww.sum()  # noqa: E731
    out = {"ce": mean(ce), "tv": mean(l1), "conf": mean(bce)}
    out["loss"] = 0.1 * out["ce"] + 0.9 * out["tv"] + 1.0 * out["conf"]
    return out


def test_tv_label_spec_example():
    pd = _probs_to_logits([0.5, 0.5])
    pt = _probs_to_logits([0.7, 0.3])
    c = confidence_labels(pd[None, None], pt[None, None])
    assert c.shape == (1, 1) and c.dtype == torch.float32
    assert c.item() == pytest.approx(0.8, abs=1e-6)
    # the tv term is the full L1 norm (eq. 12): 0.4
    out = dspark_loss(pd[None, None], pt[None, None], torch.tensor([[0]]), None, torch.ones(1))
    assert out["tv"].item() == pytest.approx(0.4, abs=1e-6)


def test_confidence_labels_no_grad_and_bounds():
    d = torch.randn(3, 4, 11, requires_grad=True)
    t = torch.randn(3, 4, 11)
    c = confidence_labels(d, t)
    assert c.shape == (3, 4) and not c.requires_grad
    assert torch.all((c >= 0) & (c <= 1))
    assert torch.allclose(confidence_labels(t, t), torch.ones(3, 4), atol=1e-6)
    with pytest.raises(ValueError):
        confidence_labels(d, t[..., :10])


def test_position_weights():
    w = position_weights(7)
    assert w.shape == (7,) and w.dtype == torch.float32
    expected = torch.tensor([math.exp(-k / 7) for k in range(7)])
    assert torch.allclose(w, expected)
    assert w[0].item() == 1.0
    w2 = position_weights(5, decay=2.0)
    assert torch.allclose(w2, torch.tensor([math.exp(-k / 2.0) for k in range(5)]))
    with pytest.raises(ValueError):
        position_weights(4, decay=0.0)


def test_ce_equals_minus_log_p():
    p = [0.6, 0.3, 0.1]
    draft = _probs_to_logits(p)[None, None]
    target = _probs_to_logits([1 / 3] * 3)[None, None]
    for tok in range(3):
        out = dspark_loss(draft, target, torch.tensor([[tok]]), None, torch.ones(1))
        assert out["ce"].item() == pytest.approx(-math.log(p[tok]), abs=1e-6)
    # one-hot-ish draft: large logit on the true token → CE ≈ 0
    draft = torch.tensor([[[20.0, 0.0, 0.0]]])
    out = dspark_loss(draft, target, torch.tensor([[0]]), None, torch.ones(1))
    assert out["ce"].item() == pytest.approx(-torch.log_softmax(draft, -1)[0, 0, 0].item(), abs=1e-7)
    assert out["ce"].item() < 1e-8


def test_matches_naive_and_weighted_combo():
    torch.manual_seed(0)
    n, g, v = 5, 4, 13
    draft = torch.randn(n, g, v) * 2
    target = torch.randn(n, g, v) * 2
    tokens = torch.randint(0, v, (n, g))
    conf = torch.randn(n, g)
    w = position_weights(g)
    mask = torch.rand(n, g) > 0.3
    out = dspark_loss(draft, target, tokens, conf, w, loss_mask=mask)
    ref = _naive(draft, target, tokens, conf, w, mask.float())
    for key in ("loss", "ce", "tv", "conf"):
        assert out[key].item() == pytest.approx(ref[key].item(), rel=1e-5, abs=1e-6), key
    combo = 0.1 * out["ce"] + 0.9 * out["tv"] + 1.0 * out["conf"]
    assert out["loss"].item() == pytest.approx(combo.item(), rel=1e-6)
    out2 = dspark_loss(draft, target, tokens, conf, w, loss_mask=mask, ce_weight=1.0, tv_weight=0.0, conf_weight=2.0)
    assert out2["loss"].item() == pytest.approx(out["ce"].item() + 2 * out["conf"].item(), rel=1e-6)


def test_conf_none_is_zero():
    draft, target = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    out = dspark_loss(draft, target, torch.zeros(2, 3, dtype=torch.long), None, torch.ones(3))
    assert out["conf"].item() == 0.0
    assert out["loss"].item() == pytest.approx(0.1 * out["ce"].item() + 0.9 * out["tv"].item(), rel=1e-6)


def test_masked_positions_contribute_nothing():
    torch.manual_seed(1)
    n, g, v = 3, 4, 9
    draft = torch.randn(n, g, v, requires_grad=True)
    target = torch.randn(n, g, v)
    tokens = torch.randint(0, v, (n, g))
    conf = torch.randn(n, g, requires_grad=True)
    mask = torch.ones(n, g, dtype=torch.bool)
    mask[0, 2:] = False
    mask[2, 1:] = False
    w = position_weights(g)
    out = dspark_loss(draft, target, tokens, conf, w, loss_mask=mask)
    # garbage (even NaN / out-of-range tokens) in masked slots changes nothing
    d2, t2, tok2, c2 = draft.detach().clone(), target.clone(), tokens.clone(), conf.detach().clone()
    d2[~mask] = 1e4 * torch.randn(int((~mask).sum()), v)
    t2[~mask] = float("nan")
    tok2[~mask] = -100
    c2[~mask] = 50.0
    d2.requires_grad_(True)
    out2 = dspark_loss(d2, t2, tok2, c2, w, loss_mask=mask)
    out2["loss"].backward()
    assert torch.all(d2.grad[~mask] == 0) and torch.isfinite(d2.grad).all()
    for key in ("loss", "ce", "tv", "conf"):
        assert out2[key].item() == pytest.approx(out[key].item(), rel=1e-6), key
    out["loss"].backward()
    assert torch.all(draft.grad[~mask] == 0)
    assert torch.all(conf.grad[~mask] == 0)
    assert draft.grad[mask].abs().sum() > 0
    # all masked → zeros, not NaN
    out3 = dspark_loss(draft, target, tokens, conf, w, loss_mask=torch.zeros(n, g, dtype=torch.bool))
    assert all(out3[k].item() == 0.0 for k in out3)


def test_batch_size_invariance():
    torch.manual_seed(2)
    draft, target = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    tokens, conf = torch.randint(0, 8, (4, 3)), torch.randn(4, 3)
    w = position_weights(3)
    one = dspark_loss(draft, target, tokens, conf, w)
    two = dspark_loss(draft.repeat(2, 1, 1), target.repeat(2, 1, 1), tokens.repeat(2, 1), conf.repeat(2, 1), w)
    for key in one:
        assert two[key].item() == pytest.approx(one[key].item(), rel=1e-6)


def test_gradients_flow_to_draft_and_conf_not_labels():
    torch.manual_seed(3)
    n, g, v = 3, 4, 10
    draft = torch.randn(n, g, v, dtype=torch.float64, requires_grad=True)
    target = torch.randn(n, g, v, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, v, (n, g))
    conf = torch.randn(n, g, requires_grad=True)
    w = position_weights(g)
    out = dspark_loss(draft, target, tokens, conf, w)
    out["loss"].backward()
    assert draft.grad is not None and draft.grad.abs().sum() > 0
    assert conf.grad is not None and conf.grad.abs().sum() > 0
    assert target.grad is None  # target is a label
    # the conf term's gradient w.r.t. draft is zero: c* is detached
    draft.grad = None
    out = dspark_loss(draft, target.detach(), tokens, conf, w, ce_weight=0.0, tv_weight=0.0)
    out["loss"].backward()
    assert torch.all(draft.grad == 0)


def test_fused_gradient_matches_autograd_reference():
    torch.manual_seed(4)
    n, g, v = 4, 3, 17
    draft = torch.randn(n, g, v, dtype=torch.float32) * 3
    target = torch.randn(n, g, v) * 3
    tokens = torch.randint(0, v, (n, g))
    conf = torch.randn(n, g)
    w = position_weights(g)
    mask = torch.rand(n, g) > 0.25
    d1 = draft.clone().requires_grad_(True)
    dspark_loss(d1, target, tokens, conf, w, loss_mask=mask)["loss"].backward()
    d2 = draft.clone().requires_grad_(True)
    _naive(d2, target, tokens, conf, w, mask.float())["loss"].backward()
    assert torch.allclose(d1.grad, d2.grad, atol=1e-6, rtol=1e-4)


def test_chunking_and_half_precision(monkeypatch):
    torch.manual_seed(5)
    n, g, v = 3, 5, 31
    draft = torch.randn(n, g, v) * 2
    target = torch.randn(n, g, v) * 2
    tokens = torch.randint(0, v, (n, g))
    conf = torch.randn(n, g)
    w = position_weights(g)
    d_full = draft.clone().requires_grad_(True)
    full = dspark_loss(d_full, target, tokens, conf, w)
    full["loss"].backward()
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 2 * v)  # 2 rows per chunk, ragged tail
    d_chunk = draft.clone().requires_grad_(True)
    chunked = dspark_loss(d_chunk, target, tokens, conf, w)
    chunked["loss"].backward()
    for key in full:
        assert chunked[key].item() == pytest.approx(full[key].item(), rel=1e-6)
    assert torch.allclose(d_full.grad, d_chunk.grad, atol=1e-7)
    # bf16 inputs: float32 math inside, bf16 grad out, float32 scalars
    d_bf = draft.to(torch.bfloat16).requires_grad_(True)
    out = dspark_loss(d_bf, target.to(torch.bfloat16), tokens, conf.to(torch.bfloat16), w)
    out["loss"].backward()
    assert out["loss"].dtype == torch.float32 and d_bf.grad.dtype == torch.bfloat16
    assert out["loss"].item() == pytest.approx(full["loss"].item(), rel=2e-2)


def test_input_not_modified_in_place():
    draft = torch.randn(2, 3, 6)
    target = torch.randn(2, 3, 6)
    d0, t0 = draft.clone(), target.clone()
    dspark_loss(draft, target, torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(3))
    confidence_labels(draft, target)
    assert torch.equal(draft, d0) and torch.equal(target, t0)


def test_shape_errors():
    d, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    tok, c, w = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(3)
    with pytest.raises(ValueError):
        dspark_loss(d, t[:, :2], tok, c, w)
    with pytest.raises(ValueError):
        dspark_loss(d, t, tok[:, :2], c, w)
    with pytest.raises(ValueError):
        dspark_loss(d, t, tok, c[:1], w)
    with pytest.raises(ValueError):
        dspark_loss(d, t, tok, c, torch.ones(4))
    with pytest.raises(ValueError):
        dspark_loss(d, t, tok, c, w, loss_mask=torch.ones(2, 2, dtype=torch.bool))


def test_ce_mask_restricts_only_the_ce_term():
    import torch

    from dspark.training.losses import dspark_loss, position_weights

    torch.manual_seed(0)
    d, t = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    tokens = torch.randint(0, 5, (3, 2))
    w = position_weights(2)
    full = dspark_loss(d, t, tokens, None, w)
    ce_mask = torch.tensor([[True, False], [True, True], [False, True]])
    part = dspark_loss(d, t, tokens, None, w, ce_mask=ce_mask)
    assert torch.allclose(part["tv"], full["tv"])
    logp = torch.log_softmax(d, -1).gather(-1, tokens[..., None])[..., 0]
    ww = w[None].expand(3, 2) * ce_mask
    assert torch.allclose(part["ce"], -(ww * logp).sum() / ww.sum(), atol=1e-6)


def test_reduced_vocab_loss_with_target_lse_equals_expanded_full_vocab():
    """A draft vocabulary D ⊂ V: the loss on the N draft columns with the target's full logsumexp (target_lse) gives
    the same ce / tv / conf / loss values and the same gradients as expanding the draft logits to V (p_d = 0
    outside D) and comparing with the full target distribution."""
    g = torch.Generator().manual_seed(7)
    n, gamma, v = 5, 3, 40
    ids = torch.sort(torch.randperm(v, generator=g)[:12]).values
    draft_sub = torch.randn(n, gamma, ids.numel(), generator=g, dtype=torch.float64).float()
    target = 2 * torch.randn(n, gamma, v, generator=g)
    index = torch.full((v,), -1, dtype=torch.long)
    index[ids] = torch.arange(ids.numel())
    tokens_full = ids[torch.randint(0, ids.numel(), (n, gamma), generator=g)]
    tokens_full[0, 1] = int(torch.nonzero(index < 0)[0])  # one label outside D (CE-masked)
    conf = torch.randn(n, gamma, generator=g)
    w = position_weights(gamma)
    ce_mask = index[tokens_full] >= 0

    d1 = draft_sub.clone().requires_grad_(True)
    expanded = torch.full((n, gamma, v), -1e4).index_copy(-1, ids, d1)
    ref = dspark_loss(expanded, target, tokens_full, conf, w, ce_mask=ce_mask)
    ref["loss"].backward()

    d2 = draft_sub.clone().requires_grad_(True)
    out = dspark_loss(d2, target[..., ids], index[tokens_full].clamp(min=0), conf, w, ce_mask=ce_mask,
                      target_lse=torch.logsumexp(target, dim=-1))
    out["loss"].backward()
    for k in ("ce", "tv", "conf", "loss"):
        torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-6)
    assert ref["tv"] > 0.5  # the outside mass is a real part of the term here
    torch.testing.assert_close(d2.grad, d1.grad, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError, match="target_lse"):
        dspark_loss(d2, target[..., ids], index[tokens_full].clamp(min=0), conf, w, target_lse=torch.zeros(n))
