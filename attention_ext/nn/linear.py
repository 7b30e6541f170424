"""Linear attention layers: `LinearAttention`, the module of attention_type="linear" (Katharopoulos
et al.; Performer with feature_map="favor"; RFA-Gate / RetNet-style decay with decay_gate=True;
GLA-style gates per feature with decay_gate="feature").

Same projections, RoPE and call signature as `Attention`, so the blocks and models use either;
generation keeps a `LinearCache` (the recurrent state, O(M Dv) per head) instead of a KV cache.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import key_padding_mask_renamed, real_tokens
from ..linear import LinearAttentionState, feature_maps, linear_attention, linear_attention_step
from .layers import ATTENTION_MODULES, AttentionConfig, init_projections

# a continuation of at most this many tokens runs the recurrent step; longer ones the parallel form
_STEP_TOKENS = 8


class LinearCache:
    """The generation state of one linear attention layer: the LinearAttentionState after `pos`
    positions (None before the prefill). `static`: cross-attention, the state of the whole memory,
    filled once and then only read."""

    def __init__(self, static: bool = False):
        self.state: Optional[LinearAttentionState] = None
        self.pos = 0
        self.static = static

    def reset(self) -> None:
        self.state, self.pos = None, 0


class LinearAttention(nn.Module):
    """Multi-head linear attention from an AttentionConfig (attention_type="linear"):
    out = phi(q)^T S / phi(q)^T z per head, causal (the recurrent form) or not.

    config.feature_map names the map ("elu", "relu", "identity", "favor", "rfa" or a registered
    one); random maps are built per layer (their own projection, redrawn by their
    redraw_interval in training). config.decay_gate adds a projection x -> (H) log-decays,
    logsigmoid(W x + b) (a recency gate per position and head), or with decay_gate="feature" x ->
    (H, M), a gate per feature as GLA's (S_t = Diag(exp(g_t)) S_{t-1} + ...; the fused feature
    maps), causal self-attention only. config.decay_gate_rank = r > 0 factors W through rank r
    and config.decay_gate_temperature = tau divides the log-gates: GLA's gate is
    decay_gate="feature", decay_gate_rank=16, decay_gate_temperature=16.
    Softmax-only options (window, ALiBi, sinks, softcap, attn_mask) are rejected; dropout on
    probabilities has no equivalent and is not applied. key_mask (B, S_k) True = a real key /
    seqlens_k mark padded keys, which then contribute nothing.

    Set `keep_weights = True` to store in `last_weights` the (B, H, S_q, S_k) weights each call's
    output is the average of (see `_weights`; the demo's heatmaps use this). A generation step
    that reads a cached state has no keys to weigh and stores nothing.
    """

    def __init__(self, config: AttentionConfig, cross: bool = False):
        super().__init__()
        c = config
        unsupported = [n for n, bad in (("window", tuple(c.window) != (-1, -1)), ("ALiBi", c.positional == "alibi"),
                                         ("sinks", c.sinks), ("softcap", c.softcap > 0)) if bad]
        if unsupported:
            raise ValueError(f"attention_type='linear' has no {', '.join(unsupported)}")
        self.config = config
        self.cross = cross
        self.causal = c.causal and not cross
        init_projections(self, c, cross)
        self.feature_map = feature_maps.get_feature_map(c.feature_map, c.head_dim)
        self.gate = None
        self.per_feature = c.decay_gate == "feature" and self.causal  # a gate orders positions: causal only
        if self.per_feature and getattr(self.feature_map, "fused_code", None) is None:
            raise ValueError(f"decay_gate='feature' takes the fused feature maps ('elu', 'relu', 'identity'), got "
                             f"feature_map={c.feature_map!r}")
        self.gate_temperature = c.decay_gate_temperature
        if c.decay_gate and self.causal:
            # per feature: the fused maps keep the head's width, M = head_dim
            width = c.n_heads * (c.head_dim if self.per_feature else 1)
            if c.decay_gate_rank:  # GLA's low-rank gate: x -> r -> gates (the first factor without bias)
                self.gate = nn.Sequential(nn.Linear(c.d_model, c.decay_gate_rank, bias=False),
                                          nn.Linear(c.decay_gate_rank, width))
                last = self.gate[-1]
            else:
                self.gate = last = nn.Linear(c.d_model, width)
            nn.init.zeros_(last.weight)  # with the low rank, the first factor keeps its random init
            nn.init.constant_(last.bias, 4.0)  # sigmoid(4) = 0.98: start close to no decay
        self.keep_weights = False
        self.last_weights: Optional[Tensor] = None

    @classmethod
    def allocate_cache(cls, config: AttentionConfig, batch: int, max_len: int, *, device=None, dtype=None,
                       static: bool = False) -> LinearCache:
        return LinearCache(static=static)

    def _read(self, q: Tensor, state: LinearAttentionState) -> Tensor:
        """Queries (B, T, H, D) against a fixed non-causal state, nothing added: (B, T, H, D)."""
        fq = feature_maps.apply(self.feature_map, q.transpose(1, 2), is_query=True, normalized=True)
        fq = fq.to(state.S.dtype)  # (B, H, T, M)
        out = (fq @ state.S) / ((fq * state.z.unsqueeze(2)).sum(-1, keepdim=True) + 1e-6)
        return out.to(q.dtype).transpose(1, 2)

    def _weights(self, q: Tensor, k: Tensor, key_mask: Optional[Tensor], decay: Optional[Tensor]) -> Tensor:
        """The weights linear attention averages v with, (B, H, S_q, S_k) float32, from q
        (B, S_q, H, D) and k (B, S_k, H_k, D): a_ij = phi(q_i) . phi(k_j) (times exp(G_i - G_j),
        G the running sum of decay, and j <= i when causal; with gates per feature, the sum over
        features m of phi(q_i)_m phi(k_j)_m exp(G_im - G_jm); 0 for a padded key), normalized by
        sum_j a_ij + eps as the layer's output is. Quadratic: for inspection only."""
        fq = feature_maps.apply(self.feature_map, q.transpose(1, 2).float(), is_query=True, normalized=True)
        fk = feature_maps.apply(self.feature_map, k.transpose(1, 2).float(), is_query=False, normalized=True)
        fk = fk.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H, S_k, M)
        if decay is not None and decay.dim() == 4:  # (B, H, S, M): (B, H, rows, S_k, M) products by query blocks
            g = decay.float().cumsum(2)
            sq = fq.shape[2]
            allowed = torch.ones(sq, sq, dtype=torch.bool, device=fq.device).tril()
            rows = max(1, (1 << 24) // max(1, fq.shape[0] * fq.shape[1] * sq * fq.shape[-1]))
            blocks = []
            for i0 in range(0, sq, rows):
                i1 = min(sq, i0 + rows)
                d = g[:, :, i0:i1].unsqueeze(3) - g.unsqueeze(2)  # G_i - G_j, (B, H, rows, S_k, M)
                w = torch.where(allowed[None, None, i0:i1, :, None], d, float("-inf")).exp()
                blocks.append((fq[:, :, i0:i1].unsqueeze(3) * fk.unsqueeze(2) * w).sum(-1))
            a = torch.cat(blocks, 2)  # (B, H, S_q, S_k)
            if key_mask is not None:
                a = a * key_mask[:, None, None, :].to(a.dtype)
            return a / (a.sum(-1, keepdim=True) + 1e-6)
        a = fq.float() @ fk.float().transpose(-1, -2)  # (B, H, S_q, S_k)
        if key_mask is not None:
            a = a * key_mask[:, None, None, :].to(a.dtype)
        if self.causal:
            sq, sk = a.shape[-2:]
            g = decay.float().cumsum(-1) if decay is not None else a.new_zeros(a.shape[0], a.shape[1], sq)  # (B, H, S)
            allowed = torch.ones(sq, sk, dtype=torch.bool, device=a.device).tril()
            a = a * torch.where(allowed, g.unsqueeze(-1) - g.unsqueeze(-2), float("-inf")).exp()
        return a / (a.sum(-1, keepdim=True) + 1e-6)

    def _memory_state(self, k: Tensor, v: Tensor, key_mask: Optional[Tensor]) -> LinearAttentionState:
        """The non-causal state sum_j phi(k_j) [v_j, 1]^T over a memory (B, S_k, H_k, D): the op's
        final state (its queries, here zeros, are not read), for cross-attention where S_q != S_k."""
        b, sk = k.shape[:2]
        q0 = k.new_zeros(b, sk, self.n_heads, self.head_dim)
        _, state = linear_attention(q0, k, v, feature_map=self.feature_map, key_mask=key_mask,
                                    layout="bshd", return_state=True)
        return state

    def forward(self, x: Tensor, context: Optional[Tensor] = None, *, key_mask: Optional[Tensor] = None,
                seqlens_k: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                cache: Optional[LinearCache] = None, key_padding_mask: None = None) -> Tensor:
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("LinearAttention.forward()")
        if attn_mask is not None:
            raise ValueError("attention_type='linear' takes no attn_mask (key_mask / seqlens_k only)")
        if cache is not None and not isinstance(cache, LinearCache):
            raise TypeError(f"a linear attention layer keeps a LinearCache, got {type(cache).__name__} "
                            f"(allocate it with nn.layers.allocate_cache)")
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)  # (B, S, H, D)
        if cache is not None and cache.static and cache.state is not None:
            return self.out_proj(self._read(q, cache.state).reshape(b, s, -1))
        src = context if self.cross else x
        sk = src.shape[1]
        k = self.k_proj(src).view(b, sk, self.n_kv_heads, self.head_dim)  # (B, S_k, H_k, D)
        v = self.v_proj(src).view(b, sk, self.n_kv_heads, self.head_dim)
        offset = cache.pos if (cache is not None and not self.cross) else 0
        if self.rope is not None:
            q, k = self.rope(q, offset), self.rope(k, offset)
        key_mask = real_tokens(key_mask, seqlens_k, b, sk, x.device, "LinearAttention.forward()")  # (B, S_k)
        decay = None
        if self.gate is not None:  # (B, H, S), or (B, H, S, M) per feature
            g = F.logsigmoid(self.gate(x))
            if self.gate_temperature != 1.0:
                g = g / self.gate_temperature
            decay = (g.view(b, s, self.n_heads, -1).permute(0, 2, 1, 3) if self.per_feature else g.transpose(1, 2))
            decay = decay.contiguous()
        if decay is not None and key_mask is not None:  # (real_tokens checked it: (B, S) bool)
            # a padded token writes nothing (key_mask) and decays nothing (its gate 0: linear_attention
            # applies every gate it is given), as GatedDeltaNet's
            real = key_mask[:, None, :, None] if decay.dim() == 4 else key_mask[:, None, :]
            decay = decay.masked_fill(~real, 0.0)
        if self.keep_weights and (cache is None or cache.state is None or self.cross):
            self.last_weights = self._weights(q, k, key_mask, decay).detach()
        kw = dict(feature_map=self.feature_map, causal=self.causal, layout="bshd")
        if self.cross:
            state = self._memory_state(k, v, key_mask)
            if cache is not None:
                cache.state = state
            return self.out_proj(self._read(q, state).reshape(b, s, -1))
        if cache is None:
            out = linear_attention(q, k, v, decay=decay, key_mask=key_mask, **kw)
        elif cache.state is not None and self.causal and s <= _STEP_TOKENS and key_mask is None:
            out, cache.state = linear_attention_step(q, k, v, cache.state, feature_map=self.feature_map,
                                                     decay_t=decay, layout="bshd", inplace=True)
        else:
            out, cache.state = linear_attention(q, k, v, decay=decay, key_mask=key_mask,
                                                initial_state=cache.state, return_state=True, **kw)
            if not self.causal:  # a non-causal self-attention layer reads the keys of this call only
                cache.state = None
        if cache is not None:
            cache.pos += s
        return self.out_proj(out.reshape(b, s, self.n_heads * self.head_dim))  # (B, S, d_model)


ATTENTION_MODULES["linear"] = LinearAttention
