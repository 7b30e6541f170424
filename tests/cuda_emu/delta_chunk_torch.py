"""The chunked delta-rule backward in PyTorch, per chunk of 64 as delta_chunk_bwd_kernel.cuh
decomposes it, computed in a given dtype: the tests' second same-dtype peer for the CUDA chunk
kernels (as FlashAttention's tests also hold their kernels against a reference computed in the
kernel's dtype and order). Given float64 tensors it equals autograd of the float64 recurrence to
float32 rounding (its decays, T and score sums are float32;
test_delta_chunk_bwd_emulated.py checks it), so it is a peer of the same math; in bf16 every
matmul and elementwise product rounds to bf16 (fp32 accumulation inside the matmuls), T is
inverted in float32 then rounded, the decays are float32.

    grads(q, k, v, beta, gate, h0, dout, dfinal, qk_l2norm, cu_seqlens, dtype, plain=False)
        -> dq, dk, dv, dbeta, dgate (or None), dh0 (or None)

plain=True is GLA's write (u = v; per-key gates): A = 0, b = 1 in U, W = 0.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

RESET = -104.0  # a gate at or below this is a reset (exp is 0 in float32), as the kernels
C = 64


def _scalars(g: Tensor):
    """G' (within-chunk sums since the last reset), F (that reset's row, -1: none), gamma, Gam."""
    n = g.shape[0]
    G = torch.zeros(n, dtype=torch.float64)
    F = torch.full((n,), -1, dtype=torch.long)
    s, last = 0.0, -1
    for t in range(n):
        x = float(g[t])
        if x <= RESET:
            s, last = 0.0, t
        else:
            s += x
        G[t], F[t] = s, last
    G = G.float()
    gam = torch.where(F >= 0, torch.zeros_like(G), torch.exp(G))
    i = torch.arange(n)
    live = (i[:, None] >= i[None, :]) & (F[:, None] <= i[None, :])
    Gam = torch.where(live, torch.exp(G[:, None] - G[None, :]), torch.zeros(n, n))
    return gam, Gam


def _chunk_fwd(Q, K, V, b, gam, Gam, h0, dt):
    n = Q.shape[0]
    A = torch.tril(b[:, None] * (K @ K.T).float() * Gam, -1)
    T = torch.linalg.inv(torch.eye(n) + A).to(dt)
    W = T @ ((b * gam)[:, None].to(dt) * K)
    u = T @ (b[:, None].to(dt) * V) - W @ h0
    Kt = Gam[n - 1][:, None].to(dt) * K
    h1 = (gam[n - 1] * h0.float() + (Kt.T @ u).float()).to(dt)
    return h1, dict(T=T, W=W, u=u, Kt=Kt)


def _chunk_bwd(Q, K, V, b, g, gam, Gam, h0, dO, dh1, c, dt):
    n = Q.shape[0]
    T, W, u, Kt = c["T"], c["W"], c["u"], c["Kt"]
    L = n - 1
    Pm = (torch.tril((Q @ K.T).float() * Gam)).to(dt)
    du = Pm.T @ dO + Kt @ dh1
    dh0 = (gam[:, None].to(dt) * Q).T @ dO + gam[L].to(dt) * dh1 - W.T @ du
    db = T.T @ du
    dA = -torch.tril((db @ u.T).float(), -1)
    bt = b.to(dt)
    dV = bt[:, None] * db
    Z, X, Y = dO @ h0.T, u @ dh1.T, db @ h0.T
    S1 = (dO @ u.T).float()
    M1 = torch.tril(S1 * Gam)
    D = (dA * Gam * b[:, None]).to(dt)
    dQ = gam[:, None].to(dt) * Z + M1.to(dt) @ K
    dK = M1.T.to(dt) @ Q + Gam[L][:, None].to(dt) * X - (b * gam)[:, None].to(dt) * Y + D @ K + D.T @ K
    KK, QK = (K @ K.T).float(), (Q @ K.T).float()
    dbeta = (db * V).float().sum(1) - gam * (K * Y).float().sum(1) + (dA * Gam * KK).sum(1)
    dGam = torch.tril(QK * S1) + dA * b[:, None] * KK
    dGam[L] += (K * X).float().sum(1)
    dgam = (Q * Z).float().sum(1) - b * (K * Y).float().sum(1)
    dgam[L] += (h0 * dh1).float().sum()
    E = dGam * Gam
    dG = E.sum(1) - E.sum(0) + dgam * gam
    dg = torch.zeros(n)
    run = 0.0
    for t in reversed(range(n)):
        run += float(dG[t])
        if float(g[t]) <= RESET:
            dg[t], run = 0.0, 0.0
        else:
            dg[t] = run
    return dQ, dK, dV, dbeta, dg, dh0


def _key_scalars(g: Tensor):
    """Per-key gates g (n, K): gam (n, K) = w(i, -1) and Gam (n, n, K) = w(i, j) (0 above the
    diagonal) as products of the factors a = e^g (0 at a reset), in float32, as the kernels."""
    a = torch.exp(g.float())
    n = g.shape[0]
    gam = torch.cumprod(a, 0)
    Gam = torch.zeros(n, n, g.shape[1])
    for j in range(n):
        w = torch.ones(g.shape[1])
        for i in range(j, n):
            if i > j:
                w = w * a[i]
            Gam[i, j] = w
    return gam, Gam


def _chunk_fwd_key(Q, K, V, b, gam, Gam, h0, dt, plain=False):
    n = Q.shape[0]
    A = torch.tril(b[:, None] * torch.einsum("id,jd,ijd->ij", K.float(), K.float(), Gam), -1)
    if plain:
        A, b = torch.zeros_like(A), torch.ones_like(b)
    T = torch.linalg.inv(torch.eye(n) + A).to(dt)
    W = T @ (b[:, None] * gam * K.float()).to(dt) * (0.0 if plain else 1.0)
    u = T @ (b[:, None].to(dt) * V) - W @ h0
    Kt = (Gam[n - 1] * K.float()).to(dt)
    h1 = (gam[n - 1][:, None] * h0.float() + (Kt.T @ u).float()).to(dt)
    return h1, dict(T=T, W=W, u=u, Kt=Kt, A=A / torch.where(b == 0, torch.ones_like(b), b)[:, None])


def _chunk_bwd_key(Q, K, V, b, g, gam, Gam, h0, dO, dh1, c, dt, plain=False):
    """The per-key backward as the kernels decompose it: the value-sized products on the tensor
    cores (du, db = T^T du, S1 = dO u^T, S2 = db u^T, Z = dO h0^T, Y = db h0^T, X = u dh1^T),
    then per key channel the decayed sums over the chunk's pairs (the rows' and the columns'),
    the log-gates' gradient per channel by a reverse sum that stops at a zero factor."""
    n = Q.shape[0]
    T, W, u, Kt, Ab = c["T"], c["W"], c["u"], c["Kt"], c["A"]
    L = n - 1
    Qf, Kf = Q.float(), K.float()
    Pm = torch.einsum("id,jd,ijd->ij", Qf, Kf, Gam).tril().to(dt)
    du = Pm.T @ dO + Kt @ dh1
    dh0 = (gam * Qf).to(dt).T @ dO + (gam[L][:, None] * dh1.float()).to(dt) - W.T @ du
    db = T.T @ du
    if plain:  # U = V: b = 1 there, and no A or W (bw: the W term's factor)
        b, bw = torch.ones_like(b), torch.zeros_like(b)
    else:
        bw = b
    bt = b.to(dt)
    dV = bt[:, None] * db
    S1, S2 = (dO @ u.T).float(), (db @ u.T).float()
    M1 = torch.tril(S1)
    Dm = -bw[:, None] * torch.tril(S2, -1)  # b_i dA_ij
    Z, Y, X = (dO @ h0.T).float(), (db @ h0.T).float(), (u @ dh1.T).float()
    Kbar = gam * Kf
    dbeta = (db * V).float().sum(1) - (Kbar * Y).sum(1) - (torch.tril(S2, -1) * Ab).sum(1)
    if plain:
        dbeta = torch.zeros_like(dbeta)
    rowq = torch.einsum("ij,jd,ijd->id", M1, Kf, Gam)   # sum_j M1_ij k_j w(i, j)
    rowk = torch.einsum("ij,jd,ijd->id", Dm, Kf, Gam)
    colp = torch.einsum("ij,id,ijd->jd", M1, Qf, Gam)   # sum_i M1_ij q_i w(i, j)
    cola = torch.einsum("ij,id,ijd->jd", Dm, Kf, Gam)
    wL = Gam[L]
    dQ = gam * Z + rowq
    same = rowk - bw[:, None] * gam * Y
    opp = colp + cola + wL * X
    dK = same + opp
    dG = Qf * dQ + Kf * (same - opp)
    dG[L] += (Kf * wL * X).sum(0) + gam[L] * (h0.float() * dh1.float()).sum(1)
    a = torch.exp(g.float())
    dg = torch.zeros(n, K.shape[1])
    run = torch.zeros(K.shape[1])
    for t in reversed(range(n)):
        run = run + dG[t]
        dg[t] = torch.where(a[t] == 0, torch.zeros_like(run), run)
        run = torch.where(a[t] == 0, torch.zeros_like(run), run)
    return dQ.to(dt), dK.to(dt), dV, dbeta, dg, dh0


def _sequence(q, k, v, beta, g, h0, dout, dh, scale, l2, dt, plain=False):
    """One sequence of one value head: q, k (S, K), v, dout (S, V), beta, g (S) or (S, K) (per-key
    gates), h0, dh (K, V)."""
    S = q.shape[0]
    qf, kf = q.float(), k.float()
    if l2:
        nq, nk = (qf * qf).sum(1).add(1e-6).rsqrt(), (kf * kf).sum(1).add(1e-6).rsqrt()
    else:
        nq, nk = torch.ones(S), torch.ones(S)
    Qh, Kh = (qf * (nq * scale)[:, None]).to(dt), (kf * nk[:, None]).to(dt)
    V, dO = v.to(dt), dout.to(dt)
    h, hs, cs, sc = h0.to(dt), [], [], []
    key = g.dim() == 2
    if key:
        def fwd(*args):
            return _chunk_fwd_key(*args, plain=plain)

        def bwd(*args):
            return _chunk_bwd_key(*args, plain=plain)
        scal = _key_scalars
    else:
        fwd, bwd, scal = _chunk_fwd, _chunk_bwd, _scalars
    for c0 in range(0, S, C):
        sl = slice(c0, min(S, c0 + C))
        gam, Gam = scal(g[sl])
        hs.append(h)
        sc.append((gam, Gam))
        h, cache = fwd(Qh[sl], Kh[sl], V[sl], beta[sl].float(), gam, Gam, h, dt)
        cs.append(cache)
    dQh, dKh = torch.zeros(S, q.shape[1]), torch.zeros(S, k.shape[1])
    dv, dbeta, dg = torch.zeros(S, v.shape[1]), torch.zeros(S), torch.zeros(g.shape)
    dhc = dh.to(dt)
    for ci in reversed(range(len(cs))):
        sl = slice(ci * C, min(S, ci * C + C))
        gam, Gam = sc[ci]
        r = bwd(Qh[sl], Kh[sl], V[sl], beta[sl].float(), g[sl], gam, Gam, hs[ci], dO[sl], dhc, cs[ci], dt)
        dQh[sl], dKh[sl], dv[sl], dbeta[sl], dg[sl] = (x.float() for x in r[:5])
        dhc = r[5]
    dq = scale * (nq[:, None] * dQh - (nq ** 3 * (qf * dQh).sum(1))[:, None] * qf) if l2 else scale * dQh
    dk = nk[:, None] * dKh - (nk ** 3 * (kf * dKh).sum(1))[:, None] * kf if l2 else dKh
    return dq, dk, dv, dbeta, dg, dhc.float()


def grads(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, gate: Optional[Tensor], h0: Optional[Tensor], dout: Tensor,
          dfinal: Optional[Tensor], qk_l2norm: bool, cu_seqlens: Optional[Tensor], dtype: torch.dtype,
          plain: bool = False):
    """Gradients of <out, dout> + <final state, dfinal> (module docstring); q, k (B, H_k, S, K), v
    (B, H_v, S, V), beta (B, H_v, S), gate (B, H_v, S) or per key (B, H_v, S, K), h0 / dfinal
    (N, H_v, K, V) or None."""
    B, Hk, S, Kd = q.shape
    Hv, Vd = v.shape[1], v.shape[3]
    rep, scale = Hv // Hk, Kd ** -0.5
    cu = [int(x) for x in cu_seqlens] if cu_seqlens is not None else None
    seqs = [(0, n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)] if cu else [(b, b, 0, S) for b in range(B)]
    nst = len(seqs)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    dbeta = torch.zeros(beta.shape)
    dgate = torch.zeros(gate.shape if gate is not None else beta.shape)
    dh0 = torch.zeros(nst, Hv, Kd, Vd)
    for bb, n, a, e in seqs:
        for hv in range(Hv):
            hk = hv // rep
            g = gate[bb, hv, a:e].float() if gate is not None else torch.zeros(e - a)
            h = h0[n, hv] if h0 is not None else torch.zeros(Kd, Vd)
            d = dfinal[n, hv] if dfinal is not None else torch.zeros(Kd, Vd)
            if e == a:
                dh0[n, hv] = d.float()
                continue
            r = _sequence(q[bb, hk, a:e], k[bb, hk, a:e], v[bb, hv, a:e], beta[bb, hv, a:e], g, h, dout[bb, hv, a:e], d,
                          scale, qk_l2norm, dtype, plain)
            dq[bb, hk, a:e] += r[0]
            dk[bb, hk, a:e] += r[1]
            dv[bb, hv, a:e], dbeta[bb, hv, a:e], dgate[bb, hv, a:e] = r[2], r[3], r[4]
            dh0[n, hv] = r[5]
    return dq, dk, dv, dbeta, dgate if gate is not None else None, dh0 if h0 is not None else None
