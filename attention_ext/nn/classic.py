"""The classic sequence-to-sequence attentions, as in the original papers.

Both score one decoder state s against every encoder state h_j, softmax over j, and return the
context vector c = sum_j a_j v_j and the alignment weights a. Queries may be one step (B, D_q)
or a sequence of steps (B, T, D_q); keys are (B, S, D_k); values default to the keys.
`mask` (B, S) is True for valid (non-padding) source positions.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn


def _align(scores: Tensor, values: Tensor, mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """scores (B, T, S), values (B, S, D_v) -> context (B, T, D_v), weights (B, T, S)."""
    if mask is not None:
        scores = scores.masked_fill(~mask.bool().unsqueeze(1), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # a sequence with no valid position attends to nothing
    return torch.bmm(weights, values), weights


class AdditiveAttention(nn.Module):
    """Bahdanau et al. (2015): score(s, h_j) = v^T tanh(W_q s + W_k h_j)."""

    def __init__(self, query_dim: int, key_dim: Optional[int] = None, hidden_dim: Optional[int] = None):
        super().__init__()
        key_dim = key_dim or query_dim
        hidden_dim = hidden_dim or query_dim
        self.w_q = nn.Linear(query_dim, hidden_dim, bias=False)
        self.w_k = nn.Linear(key_dim, hidden_dim, bias=True)
        self.v = nn.Linear(hidden_dim, 1, bias=False)

    def forward(self, query: Tensor, keys: Tensor, values: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        one_step = query.dim() == 2
        if one_step:
            query = query.unsqueeze(1)  # (B, 1, D_q)
        # (B, T, 1, A) + (B, 1, S, A) -> (B, T, S, A) -> (B, T, S)
        scores = self.v(torch.tanh(self.w_q(query).unsqueeze(2) + self.w_k(keys).unsqueeze(1))).squeeze(-1)
        context, weights = _align(scores, keys if values is None else values, mask)
        if one_step:
            return context.squeeze(1), weights.squeeze(1)
        return context, weights


class LuongAttention(nn.Module):
    """Luong et al. (2015), with score
        "dot":     s^T h_j                         (needs D_q == D_k)
        "general": s^T W_a h_j
        "concat":  v^T tanh(W_a [s; h_j])
    """

    def __init__(self, query_dim: int, key_dim: Optional[int] = None, score: str = "general",
                 hidden_dim: Optional[int] = None):
        super().__init__()
        key_dim = key_dim or query_dim
        self.score = score
        if score == "dot":
            if key_dim != query_dim:
                raise ValueError(f"score='dot' needs query_dim == key_dim, got {query_dim} and {key_dim}")
        elif score == "general":
            self.w_a = nn.Linear(key_dim, query_dim, bias=False)
        elif score == "concat":
            hidden_dim = hidden_dim or query_dim
            self.w_a = nn.Linear(query_dim + key_dim, hidden_dim, bias=False)
            self.v = nn.Linear(hidden_dim, 1, bias=False)
        else:
            raise ValueError(f"score must be 'dot', 'general' or 'concat', got {score!r}")

    def forward(self, query: Tensor, keys: Tensor, values: Optional[Tensor] = None,
                mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        one_step = query.dim() == 2
        if one_step:
            query = query.unsqueeze(1)  # (B, 1, D_q)
        if self.score == "dot":
            scores = torch.bmm(query, keys.transpose(1, 2))  # (B, T, S)
        elif self.score == "general":
            scores = torch.bmm(query, self.w_a(keys).transpose(1, 2))  # (B, T, S)
        else:
            t, s = query.shape[1], keys.shape[1]
            pair = torch.cat([query.unsqueeze(2).expand(-1, -1, s, -1),
                              keys.unsqueeze(1).expand(-1, t, -1, -1)], dim=-1)  # (B, T, S, D_q + D_k)
            scores = self.v(torch.tanh(self.w_a(pair))).squeeze(-1)  # (B, T, S)
        context, weights = _align(scores, keys if values is None else values, mask)
        if one_step:
            return context.squeeze(1), weights.squeeze(1)
        return context, weights
