"""Training losses of the DSpark drafter (docs/method.md eqs. 8, 11–14).

Notation (docs/method.md): a block has γ positions k = 1..γ; ``p_d^k`` is the drafter's
distribution at position k (after the sequential head, eq. 4), ``p_t^k`` the
frozen target's distribution at the same position, ``x_k*`` the true
(target-generated) token and ``c_k`` the confidence head's output (eq. 7).

* eq. 8   c_k* = 1 − ½‖p_d^k − p_t^k‖₁            (exact acceptance probability)
* eq. 11  L_ce   = −Σ_k w_k log p_d^k(x_k*)
* eq. 12  L_tv   =  Σ_k w_k ‖p_d^k − p_t^k‖₁        (full L1 norm, i.e. 2 × TV distance)
* eq. 13  L_conf = −Σ_k w_k [c_k* log c_k + (1 − c_k*) log(1 − c_k)]
* eq. 14  L = 0.1 L_ce + 0.9 L_tv + 1.0 L_conf
* §5      w_k = exp(−(k − 1)/decay), decay = γ by default.

Normalisation: every term is returned as a weighted *mean* over the valid
(unmasked) positions of the batch, Σ_{n,k} w_k·m_{n,k}·term_{n,k} /
Σ_{n,k} w_k·m_{n,k}, so its magnitude does not depend on the batch size or on
how many blocks were cut short by a sequence end. (The paper's Σ_k w_k·term
per block differs from this only by the constant factor Σ_k w_k when no
position is masked.)

Memory: V is 49k–150k and N·γ up to a few thousand, so a float32 [N·γ, V]
buffer is up to ~2 GB. The CE and L1 terms of the draft logits are computed
by one fused autograd function that works on row chunks in float32, keeps only
the caller's logits for backward (no float32 softmax is stored) and
recomputes the softmax chunk by chunk in backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["position_weights", "confidence_labels", "dspark_loss"]

# Row-chunk size is chosen so one float32 [rows, V] buffer holds about this many elements.
_CHUNK_ELEMENTS = 1 << 24  # 16M floats = 64 MiB


def _row_chunk(vocab_size: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def position_weights(
    block_size: int,
    decay: float | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Position weights w_k = exp(−(k − 1)/decay), k = 1..γ (docs/method.md §5).

    Args:
        block_size: γ, the number of drafted positions per block.
        decay: decay constant; defaults to γ as in the paper (the official
            code uses a separate constant, hence configurable). Must be > 0.
        device: device of the returned tensor.

    Returns:
        float32 tensor of shape [γ]; w_1 = 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    decay = float(block_size) if decay is None else float(decay)
    if not decay > 0:
        raise ValueError(f"decay must be > 0, got {decay}")
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    return torch.exp(-k / decay)


def _l1_distance_no_grad(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """‖softmax(draft) − softmax(target)‖₁ over the last dim, float32, no grad; [M, V] → [M]."""
    out = torch.empty(draft_logits.shape[0], dtype=torch.float32, device=draft_logits.device)
    step = _row_chunk(draft_logits.shape[-1])
    with torch.no_grad():
        for s in range(0, draft_logits.shape[0], step):
            p = torch.softmax(draft_logits[s : s + step].float(), dim=-1)
            q = torch.softmax(target_logits[s : s + step].float(), dim=-1)
            out[s : s + step] = p.sub_(q).abs_().sum(dim=-1)
    return out


def _target_probs(target_logits: torch.Tensor, target_lse: torch.Tensor | None) -> torch.Tensor:
    """q = softmax(t), or exp(t − lse) when t is a column subset of logits whose full logsumexp is ``lse``."""
    if target_lse is None:
        return torch.softmax(target_logits.float(), dim=-1)
    return (target_logits.float() - target_lse[:, None].float()).exp_()


class _DraftCeL1(torch.autograd.Function):
    """Fused per-row CE and L1 distance of the draft distribution.

    forward(u [M, N], t [M, N], y [M], lse [M] | None) → (ce [M], l1 [M]) float32, where
    ce = logsumexp(u) − u[y] = −log softmax(u)[y] and l1 = ‖p − q‖₁ with p = softmax(u).
    Without ``lse``, q = softmax(t) over the same N columns. With ``lse`` (a reduced draft vocabulary), t holds the
    target's logits on the N draft columns only and ``lse`` the logsumexp of its *full* V logits, so
    q = exp(t − lse) is the target's true probability there; p is 0 on the V − N other tokens, which add their
    target mass 1 − Σq to the L1 exactly. Gradient flows to u only; t is a label.
    Backward (s = sign(p − q)):
        ∂ce/∂u = p − onehot(y),  ∂l1/∂u = p ⊙ (s − ⟨p, s⟩)  (the outside mass does not depend on u).
    """

    @staticmethod
    def forward(ctx, draft_logits, target_logits, tokens, target_lse=None):  # type: ignore[override]
        m, _ = draft_logits.shape
        ce = torch.empty(m, dtype=torch.float32, device=draft_logits.device)
        l1 = torch.empty_like(ce)
        step = _row_chunk(draft_logits.shape[-1])
        for s in range(0, m, step):
            u = draft_logits[s : s + step].to(torch.float32, copy=True)  # private copy, edited in place
            lse = torch.logsumexp(u, dim=-1)
            ce[s : s + step] = lse - u.gather(-1, tokens[s : s + step, None]).squeeze(-1)
            p = u.sub_(lse[:, None]).exp_()
            q = _target_probs(target_logits[s : s + step], None if target_lse is None else target_lse[s : s + step])
            outside = None if target_lse is None else (1.0 - q.sum(dim=-1)).clamp_(min=0.0)
            l1[s : s + step] = p.sub_(q).abs_().sum(dim=-1)
            if outside is not None:
                l1[s : s + step] += outside
        ctx.target_lse = target_lse
        ctx.save_for_backward(draft_logits, target_logits, tokens)
        return ce, l1

    @staticmethod
    def backward(ctx, grad_ce, grad_l1):  # type: ignore[override]
        draft_logits, target_logits, tokens = ctx.saved_tensors
        target_lse = ctx.target_lse
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        grad = torch.empty_like(draft_logits)
        m = draft_logits.shape[0]
        step = _row_chunk(draft_logits.shape[-1])
        g_ce = grad_ce if grad_ce is not None else torch.zeros(m, device=draft_logits.device)
        g_l1 = grad_l1 if grad_l1 is not None else torch.zeros(m, device=draft_logits.device)
        for s in range(0, m, step):
            p = torch.softmax(draft_logits[s : s + step].float(), dim=-1)
            q = _target_probs(target_logits[s : s + step], None if target_lse is None else target_lse[s : s + step])
            sign = (p - q).sign_()
            del q
            inner = (p * sign).sum(dim=-1, keepdim=True)
            g = p * (sign.sub_(inner)).mul_(g_l1[s : s + step, None].float())
            g.addcmul_(p, g_ce[s : s + step, None].float())
            g.scatter_add_(
                -1, tokens[s : s + step, None], -g_ce[s : s + step, None].float()
            )
            # rows with no incoming gradient (masked positions) get exactly 0, even if their
            # logits hold inf/NaN garbage
            live = (g_ce[s : s + step] != 0) | (g_l1[s : s + step] != 0)
            grad[s : s + step] = torch.where(live[:, None], g, 0.0).to(grad.dtype)
        return grad, None, None, None


def confidence_labels(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Analytic confidence labels c* = 1 − ½‖softmax(draft) − softmax(target)‖₁ (docs/method.md eq. 8).

    c* is the exact probability that rejection sampling accepts the drafted
    token (check: p_t = (0.7, 0.3), p_d = (0.5, 0.5) → 0.8).

    Args:
        draft_logits: [..., γ, V] draft logits (any float dtype).
        target_logits: [..., γ, V] target logits, same shape.

    Returns:
        float32 tensor [..., γ] in [0, 1], detached (a label: no gradient).
    """
    if draft_logits.shape != target_logits.shape:
        raise ValueError(
            f"draft_logits {tuple(draft_logits.shape)} and target_logits "
            f"{tuple(target_logits.shape)} must have the same shape"
        )
    v = draft_logits.shape[-1]
    l1 = _l1_distance_no_grad(draft_logits.detach().reshape(-1, v), target_logits.detach().reshape(-1, v))
    return (1.0 - 0.5 * l1).clamp_(0.0, 1.0).reshape(draft_logits.shape[:-1])


def dspark_loss(
    draft_logits: torch.Tensor, target_logits: torch.Tensor, target_tokens: torch.Tensor,
    confidence_logits: torch.Tensor | None, weights: torch.Tensor, loss_mask: torch.Tensor | None = None,
    ce_weight: float = 0.1, tv_weight: float = 0.9, conf_weight: float = 1.0, ce_mask: torch.Tensor | None = None,
    target_lse: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """DSpark training loss, docs/method.md eqs. 11–14.

    Args:
        draft_logits: [N, γ, V] drafter logits after the sequential head (eq. 4), any float dtype; gradients flow
            into it.
        target_logits: [N, γ, V] frozen target logits; treated as labels (no gradient).
        target_tokens: [N, γ] long, the true next tokens x_k*. Values at masked positions are ignored (may be
            e.g. −100).
        confidence_logits: [N, γ] pre-sigmoid confidence-head outputs (eq. 7), or None when the confidence head is
            disabled (then ``conf`` is 0).
        weights: [γ] position weights w_k (see :func:`position_weights`).
        loss_mask: optional [N, γ] bool; False marks positions past the end of a sequence, which contribute nothing
            (also no gradient).
        ce_weight, tv_weight, conf_weight: α_ce, α_tv, α_conf of eq. 14.
        ce_mask: optional [N, γ] bool restricting the CE term only (e.g. to labels inside a reduced draft
            vocabulary, whose draft probability is 0 outside it); TV and confidence still use ``loss_mask``.
        target_lse: optional [N, γ] logsumexp of the target's *full* logits, for a reduced draft vocabulary:
            then ``draft_logits`` and ``target_logits`` hold only the N ≪ V draft columns, the target
            probabilities there are exp(t − lse), and the target mass outside the draft vocabulary (where p_d = 0)
            is added to the L1 term — the same ``tv`` and c* as the expanded [.., V] computation, at N/V of the
            cost. ``target_tokens`` are then indices into the draft columns.

    Returns:
        dict of float32 scalars:
        ``ce``   weighted mean of −log p_d^k(x_k*)                                                    (eq. 11)
        ``tv``   weighted mean of ‖p_d^k − p_t^k‖₁ — the full L1 norm as written in eq. 12, i.e. twice the
                 total-variation distance; range [0, 2]                                               (eq. 12)
        ``conf`` weighted mean of BCE-with-logits(conf_logit, c_k*), with c_k* from eq. 8 (detached). Note its
                 minimum is the entropy of c*, not 0                                                  (eq. 13)
        ``loss`` ce_weight·ce + tv_weight·tv + conf_weight·conf                                       (eq. 14)
        The weighted mean is Σ_{n,k} w_k m_{n,k} term_{n,k} / Σ_{n,k} w_k m_{n,k} over valid positions m; if no
        position is valid every term is 0.

    Raises:
        ValueError: an input whose shape does not fit ``draft_logits`` (:func:`_check_loss_shapes`).
    """
    _check_loss_shapes(draft_logits, target_logits, target_tokens, confidence_logits, weights, loss_mask, target_lse)
    n, gamma, _ = draft_logits.shape
    device = draft_logits.device
    valid = (torch.ones(n, gamma, dtype=torch.bool, device=device) if loss_mask is None
             else loss_mask.to(device=device, dtype=torch.bool))
    # [N, γ] effective weights w_k·m_{n,k}; 0 at masked positions.
    w = weights.to(device=device, dtype=torch.float32)[None, :] * valid
    ce_rows, l1_rows = _ce_l1_per_position(draft_logits, target_logits, target_tokens, target_lse, valid)
    if ce_mask is None:
        ce = _weighted_mean(ce_rows, w, valid)
    else:
        ce_valid = valid & ce_mask.to(device=device, dtype=torch.bool)
        ce = _weighted_mean(ce_rows, w * ce_valid, ce_valid)
    tv = _weighted_mean(l1_rows, w, valid)
    conf = _confidence_loss(confidence_logits, l1_rows, w, valid)
    loss = ce_weight * ce + tv_weight * tv + conf_weight * conf
    return {"loss": loss, "ce": ce, "tv": tv, "conf": conf}


def _check_loss_shapes(draft_logits, target_logits, target_tokens, confidence_logits, weights, loss_mask,
                       target_lse) -> None:
    """Check the shapes of :func:`dspark_loss`'s inputs against ``draft_logits [N, γ, V]``, before any compute.

    Raises:
        ValueError: ``draft_logits`` is not 3-d, ``target_logits`` is not [N, γ, V], ``weights`` not [γ], or
            ``target_tokens`` / ``confidence_logits`` / ``loss_mask`` / ``target_lse`` (when given) not [N, γ].
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits must be [N, γ, V], got {tuple(draft_logits.shape)}")
    if target_logits.shape != draft_logits.shape:
        raise ValueError(
            f"target_logits {tuple(target_logits.shape)} must match draft_logits "
            f"{tuple(draft_logits.shape)}"
        )
    n, gamma, _ = draft_logits.shape
    if target_tokens.shape != (n, gamma):
        raise ValueError(f"target_tokens must be [{n}, {gamma}], got {tuple(target_tokens.shape)}")
    if confidence_logits is not None and confidence_logits.shape != (n, gamma):
        raise ValueError(
            f"confidence_logits must be [{n}, {gamma}], got {tuple(confidence_logits.shape)}"
        )
    if weights.shape != (gamma,):
        raise ValueError(f"weights must be [{gamma}], got {tuple(weights.shape)}")
    if loss_mask is not None and loss_mask.shape != (n, gamma):
        raise ValueError(f"loss_mask must be [{n}, {gamma}], got {tuple(loss_mask.shape)}")
    if target_lse is not None and target_lse.shape != (n, gamma):
        raise ValueError(f"target_lse must be [{n}, {gamma}], got {tuple(target_lse.shape)}")


def _ce_l1_per_position(draft_logits: torch.Tensor, target_logits: torch.Tensor, target_tokens: torch.Tensor,
                        target_lse: torch.Tensor | None, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position −log p_d^k(x_k*) (eq. 11) and ‖p_d^k − p_t^k‖₁ (eq. 12), float32 [N, γ] each, by the fused
    :class:`_DraftCeL1` (gradient into ``draft_logits`` only). Tokens at invalid positions are replaced by 0, so a
    placeholder label such as −100 is never indexed."""
    n, gamma, v = draft_logits.shape
    device = draft_logits.device
    tokens = torch.where(valid, target_tokens.to(device), torch.zeros((), dtype=torch.long, device=device))
    ce_rows, l1_rows = _DraftCeL1.apply(
        draft_logits.reshape(n * gamma, v),
        target_logits.detach().reshape(n * gamma, v),
        tokens.reshape(n * gamma).long(),
        None if target_lse is None else target_lse.detach().reshape(n * gamma).float(),
    )
    return ce_rows.view(n, gamma), l1_rows.view(n, gamma)


def _weighted_mean(term: torch.Tensor, w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Σ w·term / Σ w over the ``valid`` positions ([N, γ] each; ``w`` already 0 where not valid), a float32 scalar;
    0 when no position is valid."""
    # torch.where (not w * term) so a NaN/inf in a masked slot cannot leak in.
    weighted = torch.where(valid, w * term, torch.zeros((), device=w.device)).sum()
    return weighted / w.sum().clamp_min(torch.finfo(torch.float32).tiny)


def _confidence_loss(confidence_logits: torch.Tensor | None, l1_rows: torch.Tensor, w: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
    """L_conf (eq. 13): the weighted mean BCE of the confidence logits c_k against the labels
    c_k* = 1 − ½‖p_d^k − p_t^k‖₁ (eq. 8, from ``l1_rows [N, γ]``, detached); a float32 0 without a confidence head."""
    if confidence_logits is None:
        return torch.zeros((), dtype=torch.float32, device=w.device)
    c_star = (1.0 - 0.5 * l1_rows.detach()).clamp(0.0, 1.0)  # eq. 8, a label
    bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), c_star, reduction="none")
    return _weighted_mean(bce, w, valid)
