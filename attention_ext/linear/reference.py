"""Pure-PyTorch definitions of the linear attention op: the test oracle, the fallback, and the
chunked form that the CPU benchmark compares against.

Readable and slow on purpose: `linear_attention` builds phi(Q) phi(K)^T explicitly (quadratic
in S), which is the definition the kernels' chunked and recurrent forms must equal (tests run it
in float64).

Notation: B batch, H query heads, H_k key/value heads (H % H_k == 0; query head h reads kv head
h // (H / H_k)), S length, M feature width (the head dim of q and k), Dv value width,
Dv' = Dv + 1 with normalize (the state's last column is the normalizer z), else Dv.
Tensors are (B, H, S, D) unless stated otherwise.
"""
from __future__ import annotations

import functools

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

# The feature maps the kernel applies itself, by the op's `feature_map` code.
FUSED_FEATURE_MAPS = {0: "identity", 1: "elu", 2: "relu"}


def phi(x: Tensor, code: int) -> Tensor:
    """phi(x) elementwise by the op's code: 0 identity, 1 elu(x) + 1, 2 relu(x)."""
    if code == 0:
        return x
    if code == 1:
        # elu(x) + 1 as exp(min(x, 0)) + max(x, 0): the same function and gradient (at 0 minimum
        # and maximum pass half each, 1 in all; clamp or relu would pass 0): torch's CPU elu goes
        # through expm1, several times slower (benchmarks/results/2026-12-02-elu-map-zen5.md); for
        # GLA's per-feature gates the map runs here, before the kernel
        zero = x.new_zeros(())
        return torch.exp(torch.minimum(x, zero)) + torch.maximum(x, zero)
    if code == 2:
        return F.relu(x)
    raise ValueError(f"feature_map code must be 0 (identity), 1 (elu) or 2 (relu), got {code}")


def _per_feature_gates(fq: Tensor, fk: Tensor, vv: Tensor, decay: Tensor,
                       s0: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """S_t = Diag(exp(decay_t)) S_{t-1} + phi(k_t) v'_t^T, O'_t = fq_t^T S_t (fq scaled), token by
    token: GLA's per-feature gates, decay (B, H, S, M). Returns (O' (B, H, S, Dv'), S_last)."""
    b, h, s, m = fq.shape
    st = fq.new_zeros(b, h, m, vv.shape[-1]) if s0 is None else s0.to(fq.dtype)
    outs = []
    for t in range(s):
        st = st * decay[:, :, t].exp().unsqueeze(-1) + fk[:, :, t].unsqueeze(-1) * vv[:, :, t].unsqueeze(-2)
        outs.append(torch.einsum("bhm,bhmv->bhv", fq[:, :, t], st))
    return (torch.stack(outs, 2) if outs else vv.new_zeros(b, h, 0, vv.shape[-1])), st


def _normalized(o: Tensor, normalize: bool, eps: float) -> Tuple[Tensor, Tensor]:
    """(out, den) from O' (B, H, S, Dv'): out = O'[:Dv] / (O'[Dv] + eps) with normalize."""
    if normalize:
        den = o[..., -1] + eps
        return o[..., :-1] / den.unsqueeze(-1), den
    return o, torch.ones_like(o[..., 0])


def _dense(q: Tensor, k: Tensor, v: Tensor, code: int, causal: bool, normalize: bool, eps: float, scale: float,
           decay: Optional[Tensor], initial_state: Optional[Tensor],
           key_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """linear_attention on one padded batch (no cu_seqlens); see there."""
    b, h, s, _ = q.shape
    group = h // k.shape[1]
    fq = phi(q, code) * scale  # (B, H, S, M)
    fk = phi(k, code)  # (B, H_k, S, M)
    if key_mask is not None:
        fk = fk * key_mask.view(b, 1, s, 1).to(fk.dtype)
    fk = fk.repeat_interleave(group, dim=1)  # (B, H, S, M)
    vv = v.repeat_interleave(group, dim=1)  # (B, H, S, Dv)
    if normalize:
        vv = torch.cat([vv, torch.ones_like(vv[..., :1])], dim=-1)  # (B, H, S, Dv')
    if causal and decay is not None and decay.dim() == 4:  # GLA: a gate per feature, by the recurrence
        o, final = _per_feature_gates(fq, fk, vv, decay.to(q.dtype), initial_state)
        return _normalized(o, normalize, eps) + (final,)
    a = fq @ fk.transpose(-1, -2)  # (B, H, S, S): a_ij = scale * phi(q_i) . phi(k_j)
    if causal:
        d = decay.to(q.dtype) if decay is not None else q.new_zeros(b, h, s)
        g = d.cumsum(-1)  # (B, H, S) G_i
        # w_ij = exp(G_i - G_j) = exp(d_{j+1} + ... + d_i) for j <= i, built as sums of the gates
        # (row l of the masked matrix holds d_l in columns j < l; a cumulative sum down the rows),
        # never as a difference of running sums, so that gates of -1e9 or -inf stay exact
        below = torch.ones(s, s, dtype=torch.bool, device=q.device).tril(-1)  # l > j
        seg = torch.where(below, d.unsqueeze(-1), d.new_zeros(())).cumsum(-2)  # (B, H, S, S)
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        w = torch.where(allowed, seg, float("-inf")).exp()  # -inf above the diagonal: exp gives 0
        a = a * w
    o = a @ vv  # (B, H, S, Dv')
    if initial_state is not None:
        s0 = initial_state.to(q.dtype)  # (B, H, M, Dv')
        o = o + (fq @ s0) * (g.exp().unsqueeze(-1) if causal else 1.0)
    # the state after the last position: sum_j exp(G_last - G_j) phi(k_j) v'_j^T (+ exp(G_last) S_0)
    if causal and s > 0:
        fk_w = fk * seg[..., -1, :].exp().unsqueeze(-1)  # exp(G_last - G_j), as a sum of gates
        final = fk_w.transpose(-1, -2) @ vv  # (B, H, M, Dv')
        if initial_state is not None:
            final = final + g[..., -1].exp().view(b, h, 1, 1) * s0
    else:
        final = fk.transpose(-1, -2) @ vv
        if initial_state is not None:
            final = final + s0
    if normalize:
        den = o[..., -1] + eps  # (B, H, S)
        out = o[..., :-1] / den.unsqueeze(-1)
    else:
        den = torch.ones_like(o[..., 0])
        out = o
    return out, den, final


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: int = 1,
    causal: bool = False,
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float = 1.0,
    decay: Optional[Tensor] = None,
    initial_state: Optional[Tensor] = None,
    key_mask: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Linear (kernelized) attention, the definition of torch.ops.attention_ext.linear_fwd.
    Returns (out, den, final_state), all in q's dtype.

    q (B, H, S, M); k (B, H_k, S, M); v (B, H_k, S, Dv). phi = the fused map of code `feature_map`, applied to
    q and k (reference.phi); a padded key (key_mask (B, S) False) has phi(k_j) = 0.

        G_i     = sum_{t <= i} decay_t                    decay (B, H, S) log-gates; None = 0
                                                           (B, H, S, M): a gate per feature (GLA), the
                                                           recurrence below with Diag(exp(decay_t))
        w_ij    = exp(G_i - G_j) if j <= i else 0          (causal; decay needs causal; computed as
                                                            exp(decay_{j+1} + ... + decay_i), exact
                                                            for gates of -1e9 or -inf)
                = 1                                        (non-causal)
        v'_j    = [v_j, 1] if normalize else v_j           (Dv')
        O'_i    = scale * phi(q_i)^T (sum_j w_ij phi(k_j) v'_j^T + exp(G_i) S_0)
                  with exp(G_i) = 1 when non-causal; S_0 = initial_state (B, H, M, Dv') or 0
        den_i   = O'_i[Dv] + eps,  out_i = O'_i[:Dv] / den_i     (normalize)
        den_i   = 1,               out_i = O'_i                  (otherwise)
        final   = sum_j w_Sj phi(k_j) v'_j^T + exp(G_S) S_0      (B, H, M, Dv'), S = last position

    Causal, this is the recurrence S_t = exp(decay_t) S_{t-1} + phi(k_t) v'_t^T, S_{-1} = S_0,
    O'_t = scale * phi(q_t)^T S_t; non-causal, every query reads S_0 + sum_j phi(k_j) v'_j^T.

    Varlen: with cu_seqlens (nb + 1) offsets, q, k, v, decay and key_mask are one (1, ., total, .)
    pack, sequence n holds positions [cu[n], cu[n+1]) and starts from initial_state[n]
    ((nb, H, M, Dv')); final is (nb, H, M, Dv').
    """
    if cu_seqlens is None:
        return _dense(q, k, v, feature_map, causal, normalize, eps, scale, decay, initial_state, key_mask)
    outs, dens, finals = [], [], []
    for n in range(cu_seqlens.numel() - 1):
        a, e = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        o, d, f = _dense(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], feature_map, causal, normalize, eps, scale,
                         decay[:, :, a:e] if decay is not None else None,
                         initial_state[n: n + 1] if initial_state is not None else None,
                         key_mask[:, a:e] if key_mask is not None else None)
        outs.append(o)
        dens.append(d)
        finals.append(f)
    total = q.shape[2]
    end = int(cu_seqlens[-1])
    if end < total:  # rows past the last sequence belong to none: zeros, den 1
        outs.append(q.new_zeros(1, q.shape[1], total - end, v.shape[-1]))
        dens.append(q.new_ones(1, q.shape[1], total - end))
    return torch.cat(outs, 2), torch.cat(dens, 2), torch.cat(finals, 0)


def chunked(q: Tensor, k: Tensor, v: Tensor, *, feature_map: int = 1, causal: bool = True, normalize: bool = True,
            eps: float = 1e-6, scale: float = 1.0, chunk: int = 64) -> Tensor:
    """The natural chunked PyTorch form of linear attention (no decay, no initial state, H == H_k
    or GQA by repeat): the CPU benchmark's peer, differentiated by autograd. Returns out
    (B, H, S, Dv) in q's dtype; equals linear_attention(...)[0].

    Causal, with chunks of C positions (N = ceil(S / C), zero-padded keys contribute nothing):
        KV_n   = phi(K_n)^T V_n                  (B, H, N, M, Dv)   one batched matmul
        Ks_n   = sum_{j in n} phi(k_j)           (B, H, N, M)
        P_n    = sum_{m < n} KV_m,  Z_n = sum_{m < n} Ks_m            exclusive cumsums
        O_n    = phi(Q_n) P_n + tril(phi(Q_n) phi(K_n)^T) V_n
        den_n  = phi(Q_n) Z_n + rowsum(tril(phi(Q_n) phi(K_n)^T)) + eps
    Non-causal (the two-matmul form): O = phi(Q) (phi(K)^T V), den = phi(Q) sum_j phi(k_j) + eps.
    """
    b, h, s, m = q.shape
    group = h // k.shape[1]
    fq = phi(q, feature_map) * scale
    fk = phi(k, feature_map).repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    if not causal:
        out = fq @ (fk.transpose(-1, -2) @ v)  # (B, H, S, Dv)
        if normalize:
            out = out / (fq @ fk.sum(-2, keepdim=True).transpose(-1, -2) + eps)
        return out
    c = chunk
    n = -(-s // c)
    pad = n * c - s
    if pad:
        fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
    fq = fq.view(b, h, n, c, m)  # (B, H, N, C, M)
    fk = fk.view(b, h, n, c, m)
    v = v.view(b, h, n, c, -1)  # (B, H, N, C, Dv)
    kv = fk.transpose(-1, -2) @ v  # (B, H, N, M, Dv)
    past = kv.cumsum(2) - kv  # exclusive: the state entering chunk n
    a = (fq @ fk.transpose(-1, -2)).tril()  # (B, H, N, C, C)
    out = fq @ past + a @ v  # (B, H, N, C, Dv)
    if normalize:
        ks = fk.sum(-2)  # (B, H, N, M)
        zpast = ks.cumsum(2) - ks
        den = (fq @ zpast.unsqueeze(-1)).squeeze(-1) + a.sum(-1) + eps  # (B, H, N, C)
        out = out / den.unsqueeze(-1)
    return out.reshape(b, h, n * c, -1)[:, :, :s]



def linear_step(q: Tensor, k: Tensor, v: Tensor, state: Tensor, normalizer: Optional[Tensor] = None,
                decay: Optional[Tensor] = None, *, feature_map: int = 1, eps: float = 1e-6, scale: float = 1.0,
                inplace: bool = True) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The recurrent form of causal linear attention over T (a few) positions, the definition of
    torch.ops.attention_ext.linear_step. Returns (out (B, H, T, Dv) in q's dtype, state,
    normalizer).

    q (B, H, T, M), k (B, H_k, T, M), v (B, H_k, T, Dv); state S (B, H, M, Dv) and normalizer z
    (B, H, M) (None: no normalization) in the compute dtype (the op's: float32, float64 for
    float64 inputs); decay (B, H, T) log-gates, or (B, H, T, M) with a gate per feature (GLA:
    exp(decay_t) multiplies row m of S and entry m of z by its own factor). Per position t, in
    the state's dtype:

        S <- exp(decay_t) S + phi(k_t) v_t^T,   z <- exp(decay_t) z + phi(k_t)
        out_t = scale phi(q_t)^T S / (scale phi(q_t) . z + eps)     (with z; else scale phi(q_t)^T S)

    inplace=True updates state and normalizer in place (the op's semantics; an elementwise
    outer-product update, one pass over S per position). inplace=False leaves them unchanged and
    returns new tensors, built out of place so that autograd can differentiate every input."""
    b, h, t, m = q.shape
    dv = v.shape[-1]
    sdt = state.dtype
    group = h // k.shape[1]
    fq = phi(q.to(sdt), feature_map) * scale  # (B, H, T, M)
    fk = phi(k.to(sdt), feature_map).repeat_interleave(group, dim=1)  # (B, H, T, M)
    vv = v.to(sdt).repeat_interleave(group, dim=1)  # (B, H, T, Dv)
    s_, z = state, normalizer
    outs = []
    for i in range(t):
        fk_i = fk[:, :, i].reshape(b * h, m, 1)
        v_i = vv[:, :, i].reshape(b * h, 1, dv)
        if decay is not None:
            g = decay[:, :, i].to(sdt).exp()  # (B, H), or (B, H, M) per feature
            gs, gz = (g.unsqueeze(-1), g) if decay.dim() == 4 else (g.view(b, h, 1, 1), g.view(b, h, 1))
            if inplace:
                s_.mul_(gs)
                if z is not None:
                    z.mul_(gz)
            else:
                s_, z = s_ * gs, None if z is None else z * gz
        if inplace:  # addcmul_ is one pass over S (baddbmm_ with K = 1 takes two)
            s_.view(b * h, m, dv).addcmul_(fk_i, v_i)
            if z is not None:
                z.add_(fk[:, :, i])
        else:
            s_ = torch.baddbmm(s_.reshape(b * h, m, dv), fk_i, v_i).view(b, h, m, dv)
            z = None if z is None else z + fk[:, :, i]
        o = torch.bmm(fq[:, :, i].reshape(b * h, 1, m), s_.reshape(b * h, m, dv)).view(b, h, dv)
        if z is not None:
            o = o / ((fq[:, :, i] * z).sum(-1, keepdim=True) + eps)
        outs.append(o)
    out = torch.stack(outs, 2) if outs else q.new_empty(b, h, 0, dv, dtype=sdt)  # (B, H, T, Dv)
    return out.to(q.dtype), s_, z


# ---------------------------------------------------------------------------------- the delta rule
def _l2n(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the delta rule's qk_l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _delta_dense(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Optional[Tensor], scale: float,
                 h0: Optional[Tensor], plain: bool = False) -> Tuple[Tensor, Tensor]:
    """The recurrence on one padded batch, q / k already (B, H_v, S, K) and normalized; plain:
    u_t = v_t (linear attention's write, GLA)."""
    b, hv, s, kd = q.shape
    h = torch.zeros(b, hv, kd, v.shape[-1], dtype=q.dtype, device=q.device) if h0 is None else h0.to(q.dtype)
    outs = []
    for t in range(s):
        if gate is not None:
            g = gate[:, :, t]
            a = torch.exp(g)
            h = h * (a.unsqueeze(-1) if g.dim() == 3 else a[..., None, None])
        kt = k[:, :, t]
        u = v[:, :, t] if plain else beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", h, kt))
        h = h + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", h, q[:, :, t] * scale))
    out = torch.stack(outs, 2) if outs else v.new_zeros(b, hv, 0, v.shape[-1])
    return out, h


def delta_rule(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Optional[Tensor] = None, scale: Optional[float] = None,
               initial_state: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
               qk_l2norm: bool = False, acc: Optional[torch.dtype] = None, plain: bool = False) -> Tuple[Tensor, Tensor]:
    """The delta rule by its recurrence, token by token (the oracle, and the fallback where no
    kernel runs): per value head, with q / k shared by H_v / H_k value heads,

        h' = Diag(exp(g_t)) h_{t-1};  u_t = beta_t (v_t - h'^T k_t);  h_t = h' + k_t u_t^T;
        o_t = h_t^T (scale q_t)

    (DeltaNet without gate; Gated DeltaNet with gate (B, H_v, S); KDA with gate (B, H_v, S, K)).
    q, k (B, H_k, S, K), v (B, H_v, S, V), beta (B, H_v, S); computed in float32 (float64 for
    float64 inputs; `acc` overrides it: the tests' same-dtype comparison). Returns out
    (B, H_v, S, V) in q's dtype and the final state (N, H_v, K, V) in the compute dtype; with cu_seqlens (B = 1) each sequence starts from its own
    initial_state[n] (or zeros) and returns its own state. plain: u_t = v_t instead (beta unread),
    linear attention with GLA's per-key-channel gates."""
    if acc is None:
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    hk, hv = q.shape[1], v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf = q.to(acc), k.to(acc)
    if qk_l2norm:
        qf, kf = _l2n(qf), _l2n(kf)
    if hv != hk:
        qf, kf = (t.repeat_interleave(hv // hk, dim=1) for t in (qf, kf))
    vf, bf = v.to(acc), beta.to(acc)
    gf = gate.to(acc) if gate is not None else None
    if cu_seqlens is None:
        out, state = _delta_dense(qf, kf, vf, bf, gf, scale, initial_state, plain)
        return out.to(q.dtype), state
    cu = [int(x) for x in cu_seqlens]
    out = vf.new_zeros(vf.shape)
    states = []
    for n in range(len(cu) - 1):
        a, e = cu[n], cu[n + 1]
        h0 = initial_state[n:n + 1] if initial_state is not None else None
        o, st = _delta_dense(qf[:, :, a:e], kf[:, :, a:e], vf[:, :, a:e], bf[:, :, a:e],
                             gf[:, :, a:e] if gf is not None else None, scale, h0, plain)
        out[:, :, a:e] = o
        states.append(st)
    return out.to(q.dtype), torch.cat(states, 0)


def _pair_log_decay(g: Tensor) -> Tensor:
    """D[..., i, j] = g_{j+1} + ... + g_i for i >= j (0 on the diagonal; -inf above it), over the
    last dim of g (..., C). Each entry sums only the gates between its two tokens, so a -1e4 or
    -inf gate never meets the small ones it does not lie between: no cancellation (a chunked form
    that subtracts cumulative sums, G_i - G_j, loses them, and gives NaN at -inf)."""
    c = g.shape[-1]
    idx = torch.arange(c, device=g.device)
    after = idx[:, None] > idx[None, :]  # (i, j): token i lies after j
    m = torch.where(after, g.unsqueeze(-1).expand(*g.shape, c), g.new_zeros(()))  # (..., i, j) = g_i [i > j]
    d = m.cumsum(-2)
    return torch.where(idx[:, None] >= idx[None, :], d, g.new_full((), float("-inf")))


def delta_rule_wy(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Optional[Tensor] = None,
                  scale: Optional[float] = None, initial_state: Optional[Tensor] = None,
                  cu_seqlens: Optional[Tensor] = None, qk_l2norm: bool = False, chunk: Optional[int] = None,
                  plain: bool = False) -> Tuple[Tensor, Tensor]:
    """The delta rule in its chunked WY form, exact for every gate: where a kernel does not serve
    the call (CUDA calls that need gradients) it runs S / chunk steps of small matmuls instead of S
    steps of the recurrence, differentiable through autograd. Arguments and results as
    delta_rule's (computed in float32, float64 for float64); chunk defaults to 64 (32 with
    per-key gates).

    Per chunk of C tokens entering state h0, with D the pairwise log-decays (_pair_log_decay),
    Gam = exp(D) (lower triangular, 1 on the diagonal) and e_i = exp(g_1 + ... + g_i):
        (I + tril(diag(beta) (K K^T * Gam), -1)) U = diag(beta) (V - diag(e) K h0)   (a triangular solve)
        O = diag(e) (scale Q) h0 + ((scale Q) K^T * Gam) U
        h = e_C h0 + (K * Gam[C, :])^T U
    Every exponent is a sum of gates between two tokens or from the chunk's start, never a
    difference, so hard resets (-inf) and extreme gates stay exact as in the recurrence.

    Per-key gates (KDA, and GLA's with plain=True: U = V, no solve) make Gam (C, C, K): the
    products above become sums over K of q_i k_j Gam_ij per channel, which each chunk forms and
    drops again (torch.utils.checkpoint recomputes them in the backward), so memory stays
    O(C^2 K) per head rather than per chunk."""
    if chunk is None:
        chunk = 32 if gate is not None and gate.dim() == 4 else 64
    if plain and (gate is None or gate.dim() != 4):
        raise ValueError("delta_rule_wy: plain=True (GLA's write) takes per-key gates (B, H_v, S, K)")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    hk, hv = q.shape[1], v.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def prep(qs: Tensor, ks: Tensor) -> Tuple[Tensor, Tensor]:
        # per sequence under cu_seqlens: rows past the pack (NaN, whatever) reach no gradient
        qs, ks = qs.to(acc), ks.to(acc)
        if qk_l2norm:
            qs, ks = _l2n(qs), _l2n(ks)
        if hv != hk:
            qs, ks = (t.repeat_interleave(hv // hk, dim=1) for t in (qs, ks))
        return qs * scale, ks

    vf, bf = v.to(acc), beta.to(acc)
    gf = gate.to(acc) if gate is not None else None
    dense = _delta_wy_key if gf is not None and gf.dim() == 4 else _delta_wy_dense
    if dense is _delta_wy_key:
        dense = functools.partial(_delta_wy_key, plain=plain)
    if cu_seqlens is None:
        out, state = dense(*prep(q, k), vf, bf, gf, initial_state, chunk)
        return out.to(q.dtype), state
    cu = [int(x) for x in cu_seqlens]
    pieces, states = [], []
    for n in range(len(cu) - 1):
        a, e = cu[n], cu[n + 1]
        h0 = initial_state[n:n + 1] if initial_state is not None else None
        o, st = dense(*prep(q[:, :, a:e], k[:, :, a:e]), vf[:, :, a:e], bf[:, :, a:e],
                      gf[:, :, a:e] if gf is not None else None, h0, chunk)
        pieces.append(o)
        states.append(st)
    tail = vf.new_zeros(*vf.shape[:2], vf.shape[2] - cu[-1], vf.shape[3])
    return torch.cat(pieces + [tail], 2).to(q.dtype), torch.cat(states, 0)


def _delta_wy_dense(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Optional[Tensor], h0: Optional[Tensor],
                    chunk: int) -> Tuple[Tensor, Tensor]:
    """delta_rule_wy on one batch: q (scaled) and k (B, H, S, K) in the compute dtype."""
    b, h, s, kd = q.shape
    dv = v.shape[-1]
    state = q.new_zeros(b, h, kd, dv) if h0 is None else h0.to(q.dtype)
    if s == 0:
        return v.new_zeros(b, h, 0, dv), state
    n = -(-s // chunk)
    pad = n * chunk - s
    if pad:  # padded tokens: beta 0 and gate 0, so they write nothing and decay nothing
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        beta = torch.nn.functional.pad(beta, (0, pad))
        gate = torch.nn.functional.pad(gate, (0, pad)) if gate is not None else None
    qc, kc, vc = (t.reshape(b, h, n, chunk, -1) for t in (q, k, v))
    bc = beta.reshape(b, h, n, chunk)
    tril = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    if gate is not None:
        gc = gate.reshape(b, h, n, chunk)
        gam = torch.exp(_pair_log_decay(gc))        # (B, H, n, C, C)
        e = torch.exp(gc.cumsum(-1)).unsqueeze(-1)  # (B, H, n, C, 1): decay from the chunk's start
        last = gam[..., -1, :].unsqueeze(-1)        # (B, H, n, C, 1): from after token j to the chunk's end
        e_end = e[..., -1:, :]                      # (B, H, n, 1, 1)
    else:
        gam = tril.to(q.dtype)
        e = last = None
    kk = (kc @ kc.transpose(-1, -2)) * gam
    lower = torch.eye(chunk, dtype=q.dtype, device=q.device) + (bc.unsqueeze(-1) * kk).tril(-1)
    # every chunk's T = (I + tril(beta KK^T Gam))^-1 diag(beta) at once; then only h0 is sequential
    t_mat = torch.linalg.solve_triangular(lower, torch.diag_embed(bc), upper=False, unitriangular=True)
    u0 = t_mat @ vc                                      # T V
    w = t_mat @ (kc * e if e is not None else kc)        # T diag(e) K
    p = (qc @ kc.transpose(-1, -2)) * gam                # (Q K^T * Gam), lower triangular
    qe = qc * e if e is not None else qc
    kd_end = kc * last if last is not None else kc
    outs = []
    for c in range(n):
        u = u0[:, :, c] - w[:, :, c] @ state
        outs.append(qe[:, :, c] @ state + p[:, :, c] @ u)
        decayed = state * e_end[:, :, c] if e is not None else state
        state = decayed + kd_end[:, :, c].transpose(-1, -2) @ u
    out = torch.cat(outs, 2)[:, :, :s]
    return out, state


def _wy_key_intra(q: Tensor, k: Tensor, g: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk's per-key decay products: KK (strictly lower, sum_d k_i k_j Gam_ijd), QK (lower,
    sum_d q_i k_j Gam_ijd), E = exp(g_1 + ... + g_i) (C, K) and Gam[C - 1, j] (C, K)."""
    d = _pair_log_decay(g.transpose(-1, -2)).permute(0, 1, 3, 4, 2)  # (B, H, i, j, K)
    gam = torch.exp(d)
    kk = torch.einsum("bhid,bhjd,bhijd->bhij", k, k, gam).tril(-1)
    qk = torch.einsum("bhid,bhjd,bhijd->bhij", q, k, gam)
    return kk, qk, torch.exp(g.cumsum(-2)), gam[:, :, -1]


def _delta_wy_key(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Tensor, h0: Optional[Tensor], chunk: int,
                  plain: bool = False) -> Tuple[Tensor, Tensor]:
    """delta_rule_wy on one batch with per-key gates (B, H, S, K): chunk by chunk, the (C, C, K)
    decays formed and dropped inside each (recomputed in the backward)."""
    from torch.utils.checkpoint import checkpoint
    b, h, s, kd = q.shape
    dv = v.shape[-1]
    state = q.new_zeros(b, h, kd, dv) if h0 is None else h0.to(q.dtype)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    outs = []
    for c0 in range(0, s, chunk):
        c1 = min(s, c0 + chunk)
        n = c1 - c0
        qc, kc, vc, gc = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], gate[:, :, c0:c1]
        if torch.is_grad_enabled() and any(t.requires_grad for t in (qc, kc, gc)):
            kk, qk, e, last = checkpoint(_wy_key_intra, qc, kc, gc, use_reentrant=False)
        else:
            kk, qk, e, last = _wy_key_intra(qc, kc, gc)
        if plain:
            u = vc
        else:
            bc = beta[:, :, c0:c1]
            lower = eye[:n, :n] + bc.unsqueeze(-1) * kk
            rhs = bc.unsqueeze(-1) * (vc - (kc * e) @ state)
            u = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
        outs.append((qc * e) @ state + qk @ u)
        state = e[:, :, -1].unsqueeze(-1) * state + (kc * last).transpose(-1, -2) @ u
    out = torch.cat(outs, 2) if outs else v.new_zeros(b, h, 0, dv)
    return out, state


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Optional[Tensor] = None,
                       scale: Optional[float] = None, chunk: int = 64) -> Tuple[Tensor, Tensor]:
    """DeltaNet / Gated DeltaNet (gate (B, H, S)) / KDA (gate (B, H, S, K)) in the chunked form
    (the WY / UT representation of Yang et al., 2024), the way a user writes it in PyTorch: the
    CPU benchmark's peer, in the inputs' dtype. Per chunk of C tokens with cumulative log-gates G
    (per key channel for KDA) and Gam_ij = exp(G_i - G_j) (i >= j):

        T = (I + tril(diag(beta) (K Gam K^T), -1))^-1 diag(beta)   (a triangular solve)
        U = T V - T (K * exp(G)) h0;  O = (Q * exp(G)) h0 + tril(Q Gam K^T) U
        h = exp(G_C) * h0 + (K * exp(G_C - G))^T U

    where K Gam K^T is (k_i * exp(G_i)) . (k_j * exp(-G_j)) per channel for KDA. q, k
    (B, H, S, K) (no GQA), v (B, H, S, V). Like every chunked form it subtracts cumulative
    log-gates, so a hard reset (-inf) gives NaN (and KDA's exp(-G) overflows for strong decays):
    the recurrent kernels exist for that."""
    b, h, s, kd = q.shape
    scale = kd ** -0.5 if scale is None else scale
    dv = v.shape[-1]
    state = q.new_zeros(b, h, kd, dv)
    per_key = gate is not None and gate.dim() == 4
    outs = []
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    for c0 in range(0, s, chunk):
        c1 = min(c0 + chunk, s)
        n = c1 - c0
        qc, kc, vc, bc = q[:, :, c0:c1] * scale, k[:, :, c0:c1], v[:, :, c0:c1], beta[:, :, c0:c1]
        if per_key:
            g = gate[:, :, c0:c1].cumsum(-2)  # (B, H, C, K)
            kp, km, qp = kc * torch.exp(g), kc * torch.exp(-g), qc * torch.exp(g)
            kk = (kp @ km.transpose(-1, -2)).tril()
            qk = (qp @ km.transpose(-1, -2)).tril()
            kg, qg = kp, qp
        else:
            if gate is not None:
                gs = gate[:, :, c0:c1].cumsum(-1)
                gam = torch.exp(gs[..., :, None] - gs[..., None, :]).tril()
                eg = torch.exp(gs)[..., None]
                kg, qg = kc * eg, qc * eg
            else:
                gam = torch.ones(n, n, dtype=q.dtype, device=q.device).tril()
                kg, qg = kc, qc
            kk = (kc @ kc.transpose(-1, -2)) * gam
            qk = (qc @ kc.transpose(-1, -2)) * gam
        a = (bc[..., :, None] * kk).tril(-1)
        # solve_triangular has no bf16 / fp16 CPU kernel: a user solves in float32
        ad = a.dtype if a.dtype in (torch.float32, torch.float64) else torch.float32
        t_mat = torch.linalg.solve_triangular((eye[:n, :n] + a).to(ad), torch.diag_embed(bc).to(ad), upper=False,
                                              unitriangular=True).to(q.dtype)
        u = t_mat @ vc - (t_mat @ kg) @ state
        outs.append(qg @ state + qk @ u)
        if per_key:
            last = g[:, :, -1:]  # (B, H, 1, K)
            state = torch.exp(last).transpose(-1, -2) * state + (kc * torch.exp(last - g)).transpose(-1, -2) @ u
        elif gate is not None:
            last = gs[..., -1:]
            state = torch.exp(last)[..., None] * state + (kc * torch.exp(last - gs)[..., None]).transpose(-1, -2) @ u
        else:
            state = state + kc.transpose(-1, -2) @ u
    return torch.cat(outs, 2), state
