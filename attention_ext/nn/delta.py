"""Gated DeltaNet: `GatedDeltaNet`, the module of attention_type="gated_delta" (Yang, Kautz and
Hatamizadeh, 2024; the linear layers of Qwen3-Next), on ae.delta_rule_attention.

Per token x (d_model):
    q, k, v = SiLU(conv(W_q x)), SiLU(conv(W_k x)), SiLU(conv(W_v x))   short causal depthwise convs
    q, k    L2-normalized per head (the kernel's qk_l2norm)
    beta    = sigmoid(W_b x)                                  per value head, the write strength
    g       = -exp(A_log) softplus(W_a x + dt_bias)           per value head, a log-decay <= 0
    o       = the delta rule (h' = exp(g) h; u = beta (v - h'^T k); h = h' + k u^T; o = h^T q / sqrt(K))
    out     = W_o (RMSNorm(o) * SiLU(W_z x))                  per-head norm, output gate
Heads: config.n_heads value heads, config.n_kv_heads q / k heads (H_v a multiple of H_k: the
grouped values of Gated DeltaNet), head_dim = d_model / n_heads for both K and V.

Generation keeps a `DeltaCache`: the (B, H_v, K, V) float32 state and the convolutions' last
conv_size - 1 inputs, O(1) in the sequence length. A masked token (key_mask False) is a no-op:
its beta and gate are 0 (no write, no decay) and the convolutions read zeros there, as before the
sequence's first token, so left or right padding leaves the real tokens' outputs and the state as
they are without it, whatever the padded rows hold (NaN included). With the convolutions the real
tokens must be one run per sequence (padding on either side): across a gap inside the sequence
a convolution would read the gap's zeros, so such a mask is refused.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import key_padding_mask_renamed, real_tokens
from ..linear.delta import delta_rule_attention, delta_rule_step
from .layers import ATTENTION_MODULES, AttentionConfig


class DeltaCache:
    """The generation state of one GatedDeltaNet layer: the delta rule's state (B, H_v, K, V)
    float32 and the last conv_size - 1 projected inputs of q, k, v (B, conv_size - 1, width) each,
    after `pos` tokens (None before the prefill)."""

    def __init__(self):
        self.state: Optional[Tensor] = None
        self.conv: Optional[list] = None
        self.pos = 0

    def reset(self) -> None:
        self.state, self.conv, self.pos = None, None, 0


class _ShortConv(nn.Module):
    """A causal depthwise Conv1d over the sequence (kernel `size`), then SiLU: x (B, S, C) with the
    previous size - 1 inputs `past` (B, size - 1, C) or zeros. Returns (y, the last size - 1
    inputs of real tokens: `keep` (B, S) marks x's real rows; the past's all count), which the
    next call continues from: after a right-padded prefill, the last real tokens, not the
    padding."""

    def __init__(self, channels: int, size: int):
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.empty(channels, 1, size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: Tensor, past: Optional[Tensor], keep: Optional[Tensor] = None) -> tuple:
        b, s, c = x.shape
        w = self.size - 1
        if past is None:
            past = x.new_zeros(b, w, c)
        xx = torch.cat([past.to(x.dtype), x], 1)  # (B, size - 1 + S, C)
        y = F.conv1d(xx.transpose(1, 2), self.weight.to(x.dtype), groups=c).transpose(1, 2).contiguous()
        if keep is None:
            return F.silu(y), xx[:, xx.shape[1] - w:]
        real = torch.cat([keep.new_ones(b, w), keep], 1)
        pos = torch.arange(xx.shape[1], device=x.device).expand(b, -1)
        last = torch.where(real, pos, -1).topk(w, dim=1).values.flip(1)  # the w latest real rows, in order
        return F.silu(y), xx.gather(1, last.unsqueeze(-1).expand(-1, -1, c))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet attention from an AttentionConfig (attention_type="gated_delta"), causal
    self-attention only (the delta rule is a recurrence). config.delta_conv is the short
    convolutions' kernel (0: none). Softmax-only options (window, ALiBi, sinks, softcap, attn_mask,
    RoPE) are rejected: the recurrence orders positions itself. key_mask (B, S) True = a real
    token / seqlens_k mark padded tokens, which then change nothing (on either side of the real
    tokens; a gap inside them only with delta_conv=0)."""

    def __init__(self, config: AttentionConfig, cross: bool = False):
        super().__init__()
        c = config
        if cross or not c.causal:
            raise ValueError("attention_type='gated_delta' is causal self-attention only (a recurrence): set "
                             "causal=True, and use another attention_type for cross-attention")
        unsupported = [n for n, bad in (("window", tuple(c.window) != (-1, -1)), ("ALiBi", c.positional == "alibi"),
                                         ("RoPE", c.positional == "rope"), ("sinks", c.sinks),
                                         ("softcap", c.softcap > 0)) if bad]
        if unsupported:
            raise ValueError(f"attention_type='gated_delta' has no {', '.join(unsupported)}")
        if not isinstance(c.delta_conv, int) or c.delta_conv < 0 or c.delta_conv == 1:
            raise ValueError(f"delta_conv is the short convolutions' kernel size: an int >= 2, or 0 for none; "
                             f"got {c.delta_conv!r}")
        self.config = config
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        qk, vw = c.n_kv_heads * c.head_dim, c.n_heads * c.head_dim
        self.q_proj = nn.Linear(c.d_model, qk, bias=False)
        self.k_proj = nn.Linear(c.d_model, qk, bias=False)
        self.v_proj = nn.Linear(c.d_model, vw, bias=False)
        self.b_proj = nn.Linear(c.d_model, c.n_heads, bias=False)
        self.a_proj = nn.Linear(c.d_model, c.n_heads, bias=False)
        self.z_proj = nn.Linear(c.d_model, vw, bias=False)
        self.out_proj = nn.Linear(vw, c.d_model, bias=c.bias)
        self.conv = nn.ModuleList(_ShortConv(w, c.delta_conv) for w in (qk, qk, vw)) if c.delta_conv else None
        # decay rates: A in [1, 16], dt in [1e-3, 1e-1] at init (the published layer's ranges)
        self.A_log = nn.Parameter(torch.log(torch.empty(c.n_heads).uniform_(1, 16)))
        dt = torch.exp(torch.empty(c.n_heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.norm_weight = nn.Parameter(torch.ones(c.head_dim))
        self.norm_eps = 1e-6

    @classmethod
    def allocate_cache(cls, config: AttentionConfig, batch: int, max_len: int, *, device=None, dtype=None,
                       static: bool = False) -> DeltaCache:
        if static:
            raise ValueError("attention_type='gated_delta' has no cross-attention, so no static cache")
        return DeltaCache()

    def forward(self, x: Tensor, context: Optional[Tensor] = None, *, key_mask: Optional[Tensor] = None,
                seqlens_k: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                cache: Optional[DeltaCache] = None, key_padding_mask: None = None) -> Tensor:
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("GatedDeltaNet.forward()")
        if context is not None:
            raise ValueError("attention_type='gated_delta' is self-attention only (context must be None)")
        if attn_mask is not None:
            raise ValueError("attention_type='gated_delta' takes no attn_mask (key_mask / seqlens_k only)")
        if cache is not None and not isinstance(cache, DeltaCache):
            raise TypeError(f"a gated_delta layer keeps a DeltaCache, got {type(cache).__name__} "
                            f"(allocate it with nn.layers.allocate_cache)")
        b, s, _ = x.shape
        mask_given = key_mask is not None  # lengths alone give one run of real tokens: nothing to check
        key_mask = real_tokens(key_mask, seqlens_k, b, s, x.device, "GatedDeltaNet.forward()")  # (B, S) or None
        if mask_given and self.conv is not None and s > 1 and \
                not torch.compiler.is_compiling():  # a graph cannot branch on the mask's values
            runs = key_mask[:, :1].sum(1) + (key_mask[:, 1:] & ~key_mask[:, :-1]).sum(1)  # real runs per sequence
            if bool((runs > 1).any()):
                raise ValueError("GatedDeltaNet.forward(): key_mask has a gap inside a sequence's real tokens; the "
                                 "short convolutions would read the gap's zeros: pad on either side only (one run of "
                                 "real tokens per sequence), or use delta_conv=0")
        keep = key_mask.unsqueeze(-1) if key_mask is not None else None  # (B, S, 1)
        # where, not a product: a padded row's NaN / inf times 0 would still be NaN
        xin = torch.where(keep, x, torch.zeros_like(x)) if keep is not None else x
        q, k, v = self.q_proj(xin), self.k_proj(xin), self.v_proj(xin)
        if self.conv is not None:
            past = cache.conv if cache is not None and cache.conv is not None else [None, None, None]
            (q, pq), (k, pk), (v, pv) = (conv(t, p, key_mask) for conv, t, p in zip(self.conv, (q, k, v), past))
            if cache is not None:
                cache.conv = [pq.detach(), pk.detach(), pv.detach()]
        else:
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        q = q.view(b, s, self.n_kv_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        v = v.view(b, s, self.n_heads, self.head_dim)
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # gates and the norm: at least fp32
        # from xin: a padded row's inf / NaN must not reach even its own (masked) outputs, whose
        # backward would multiply it by 0 into the weights' gradients
        # the gates are computed in the op's contiguous (B, H_v, S) layout, which its gradients
        # come back in: softplus_backward's output follows the gradient's strides in eager and its
        # input's under torch.compile (the fake tensor's), so with the two laid out differently a
        # compiled backward's view of that output fails at run time
        beta = torch.sigmoid(self.b_proj(xin).to(acc).transpose(1, 2).contiguous())    # (B, H_v, S)
        g = -torch.exp(self.A_log.to(acc))[:, None] * F.softplus(
            self.a_proj(xin).to(acc).transpose(1, 2).contiguous() + self.dt_bias.to(acc)[:, None])
        if keep is not None:  # a masked token writes nothing and decays nothing
            real = key_mask[:, None, :]  # (B, 1, S)
            beta, g = torch.where(real, beta, torch.zeros_like(beta)), torch.where(real, g, torch.zeros_like(g))
        beta = beta.to(q.dtype).contiguous()
        g = g.contiguous()
        kw = dict(gate=g, qk_l2norm=True, layout="bshd")
        if cache is None:
            o = delta_rule_attention(q, k, v, beta, **kw)
        elif cache.state is not None and not torch.is_grad_enabled():
            o, cache.state = delta_rule_step(q, k, v, beta, cache.state, inplace=True, **kw)
        else:
            o, state = delta_rule_attention(q, k, v, beta, initial_state=cache.state, return_state=True, **kw)
            cache.state = state.detach() if not torch.is_grad_enabled() else state
        if cache is not None:
            cache.pos += s
        o = o.to(acc)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight.to(acc)
        z = self.z_proj(xin).view(b, s, self.n_heads, self.head_dim)
        o = (o * F.silu(z.to(acc))).to(x.dtype)
        return self.out_proj(o.reshape(b, s, -1))


ATTENTION_MODULES["gated_delta"] = GatedDeltaNet
