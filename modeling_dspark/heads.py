"""Sequential correction heads (eqs. 5–6, and DeepSpec's gated Markov head) and the confidence head (eq. 7).

All heads read the previous token x_{k−1} through their own embedding W_1 ∈ R^{V×r} (not the target's table) and
produce an additive logit correction B_k ∈ R^N (N = V, or the draft vocabulary size) on top of the parallel
backbone's base logits U_k (eq. 4):

    p_k(v | x_0, x_<k) = softmax_v(U_k(v) + B_k(x_0, x_<k, v)).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    """Low-rank first-order Markov correction B(x_{k−1}, ·) = W_1[x_{k−1}] W_2 (eq. 5).

    Cost: 2·r·V FLOPs per drafted token (eq. 15). W_2 starts at zero, so an untrained head leaves U_k unchanged.
    """

    def __init__(self, vocab_size: int, rank: int, out_size: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)  # W_1 ∈ R^{V×r}
        # W_2 ∈ R^{r×V} (stored transposed, [V, r]); V = the draft vocabulary size N when one is set
        self.out = nn.Linear(rank, out_size or vocab_size, bias=False)

    def token_features(self, prev_tokens: torch.LongTensor) -> torch.Tensor:
        """W_1[x_{k−1}]: ``[...] -> [..., r]``."""
        return self.embed(prev_tokens)

    def forward(self, prev_tokens: torch.LongTensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced correction for a whole block: ``prev_tokens [..., γ] -> B [..., γ, V]``."""
        return self.out(self.embed(prev_tokens))

    def step(self, prev_token: torch.LongTensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One left-to-right step: ``prev_token [B]`` → ``(B_k [B, V], state)``; the Markov head has no state."""
        return self.out(self.embed(prev_token)), state


class GatedMarkovHead(nn.Module):
    """Gated low-rank Markov correction (DeepSpec's ``markov_head_type="gated"``).

    g = σ(W_g [h_k; W_1[x_{k−1}]] + b_g) ∈ R^r;  B_k = W_2ᵀ (g ⊙ W_1[x_{k−1}]).  Without state, like eq. 5, but the
    backbone state h_k decides how much of the previous token's correction passes.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)  # W_1
        self.gate_proj = nn.Linear(hidden_size + rank, rank)  # W_g, b_g
        self.out = nn.Linear(rank, out_size or vocab_size, bias=False)  # W_2 (over the draft vocabulary)

    def token_features(self, prev_tokens: torch.LongTensor) -> torch.Tensor:
        return self.embed(prev_tokens)

    def forward(self, prev_tokens: torch.LongTensor, hidden: torch.Tensor) -> torch.Tensor:
        """``prev_tokens [...]``, ``hidden [..., H]`` → ``B [..., N]`` (teacher-forced block or one step alike)."""
        emb = self.embed(prev_tokens)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(emb.dtype), emb], dim=-1)))
        return self.out(gate * emb)

    def step(self, prev_token: torch.LongTensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """One left-to-right step: ``prev_token [B]``, ``hidden [B, H]`` → ``(B_k [B, N], state)``; no state."""
        return self.forward(prev_token, hidden), state


class RNNHead(nn.Module):
    """Gated recurrent correction (eq. 6).

    z_k = [s_{k−1}; W_1[x_{k−1}]; h_k];  g = σ(W_g z_k);  s_k = g ⊙ s_{k−1} + (1−g) ⊙ tanh(W_c z_k);
    B_k = W_2ᵀ tanh(W_o z_k);  s_0 = 0.  W_g, W_c, W_o are packed in one projection ``gates``.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, out_size: int | None = None):
        super().__init__()
        self.rank = rank
        self.embed = nn.Embedding(vocab_size, rank)  # W_1
        self.gates = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [W_g; W_c; W_o]
        self.out = nn.Linear(rank, out_size or vocab_size, bias=False)  # W_2 (over the draft vocabulary)

    def token_features(self, prev_tokens: torch.LongTensor) -> torch.Tensor:
        return self.embed(prev_tokens)

    def step(self, prev_token: torch.LongTensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """``prev_token [B]``, ``hidden`` h_k ``[B, H]``, ``state`` s_{k−1} ``[B, r]`` or None (= s_0 = 0)."""
        emb = self.embed(prev_token)
        if state is None:
            state = emb.new_zeros(emb.shape[:-1] + (self.rank,))
        z = torch.cat([state, emb, hidden.to(emb.dtype)], dim=-1)
        g, c, o = self.gates(z).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        state = g * state + (1 - g) * torch.tanh(c)
        return self.out(torch.tanh(o)), state

    def forward(self, prev_tokens: torch.LongTensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: ``prev_tokens [..., γ]``, ``hidden [..., γ, H]`` → ``B [..., γ, V]`` (loop over k)."""
        state, out = None, []
        for k in range(prev_tokens.shape[-1]):
            bias, state = self.step(prev_tokens[..., k], hidden[..., k, :], state)
            out.append(bias)
        return torch.stack(out, dim=-2)


class ConfidenceHead(nn.Module):
    """c_k = σ(wᵀ [h_k; W_1[x_{k−1}]] + b) (eq. 7): probability that x_k survives verification given x_<k survived.

    With ``token_feature_size`` 0 it reads h_k alone (DeepSpec's ``confidence_head_with_markov=false``). Returns the
    *logit*; the caller divides by the STS temperature T_k (docs/method.md §3) and adds the offset b_k
    (``sts_biases``, 0 unless calibrated with ``--bias``) before the sigmoid.
    """

    def __init__(self, hidden_size: int, token_feature_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + token_feature_size, 1)

    def forward(self, hidden: torch.Tensor, token_features: torch.Tensor | None) -> torch.Tensor:
        """``hidden [..., H]``, ``token_features [..., e]`` (None when e = 0) → logits ``[...]`` (float32)."""
        x = hidden if token_features is None else torch.cat([hidden, token_features.to(hidden.dtype)], dim=-1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()
