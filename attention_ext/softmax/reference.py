"""Pure-PyTorch definitions of every op: the test oracle and the CPU fallback.

Readable and slow on purpose. Each function states the math and the shapes; the compiled
kernels must compute exactly this (tests run it in float64).

Notation: B batch, H query heads, H_k key/value heads (H % H_k == 0), S_q / S_k lengths,
D head dim. Tensors are (B, H, S, D) unless stated otherwise.
"""
from __future__ import annotations

import math
import struct
from typing import Any, Optional, Tuple

import torch
from torch import Tensor
from torch.types import Device


def mask_structure(
    sq: int,
    sk: int,
    *,
    window: Tuple[int, int] = (-1, -1),
    bottom_right: bool = False,
    len_q: Optional[Tensor] = None,
    len_k: Optional[Tensor] = None,
    batch: int = 1,
    device: Device = None,
) -> Tensor:
    """Which (i, j) may attend, from lengths, causal and the sliding window alone.

    The diagonal: key i + diag is aligned with query i, diag = len_k - len_q when
    bottom_right (flash-attn's causal), else 0 (SDPA's is_causal). Query i sees key j iff
    j < len_k, i < len_q, and  i + diag - window[0] <= j <= i + diag + window[1],
    a negative window side being unbounded. Causal is window = (-1, 0).

    Returns a (B, 1, S_q, S_k) bool tensor, True = attend.
    """
    if len_q is None:
        len_q = torch.full((batch,), sq, dtype=torch.long, device=device)
    if len_k is None:
        len_k = torch.full((batch,), sk, dtype=torch.long, device=device)
    len_q = len_q.to(device=device, dtype=torch.long).clamp(0, sq)
    len_k = len_k.to(device=device, dtype=torch.long).clamp(0, sk)
    i = torch.arange(sq, device=device).view(1, sq, 1)
    j = torch.arange(sk, device=device).view(1, 1, sk)
    diag = (len_k - len_q).view(-1, 1, 1) if bottom_right else torch.zeros_like(len_k).view(-1, 1, 1)
    ok = (j < len_k.view(-1, 1, 1)) & (i < len_q.view(-1, 1, 1))
    wl, wr = window
    if wl >= 0:
        ok = ok & (j >= i + diag - wl)
    if wr >= 0:
        ok = ok & (j <= i + diag + wr)
    return ok.unsqueeze(1)


def alibi_bias(slopes: Tensor, sq: int, sk: int, *, bottom_right: bool, len_q: Optional[Tensor] = None,
               len_k: Optional[Tensor] = None) -> Tensor:
    """ALiBi: -slope * |i + diag - j|.  slopes (H) or (B, H) -> (B or 1, H, S_q, S_k)."""
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)
    b = slopes.shape[0]
    if bottom_right and (len_q is not None or len_k is not None):
        lq = len_q if len_q is not None else torch.full((b,), sq, device=slopes.device)
        lk = len_k if len_k is not None else torch.full((b,), sk, device=slopes.device)
        diag = (lk.long() - lq.long()).to(slopes.device).view(-1, 1, 1, 1)
    else:
        diag = torch.tensor(sk - sq if bottom_right else 0, device=slopes.device).view(1, 1, 1, 1)
    i = torch.arange(sq, device=slopes.device).view(1, 1, sq, 1)
    j = torch.arange(sk, device=slopes.device).view(1, 1, 1, sk)
    dist = (i + diag - j).abs().to(slopes.dtype)
    return -slopes.view(slopes.shape[0], -1, 1, 1) * dist


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    softcap: float = 0.0,
    window: Tuple[int, int] = (-1, -1),
    bottom_right: bool = False,
    bias: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    seqlens_k: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    dropout_mask: Optional[Tensor] = None,
    logits: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """Softmax attention with every variant of the fused op. Returns (out, lse).

    q (B, H, S_q, D); k, v (B, H_k, S_k, D) with H % H_k == 0 (query head h reads kv head
    h // (H / H_k)).

        x     = q @ k^T                                    (B, H, S_q, S_k)
        s     = scale * x;   s = softcap * tanh(s / softcap)     if softcap > 0
        s    += -slope_h * |i + diag - j|                  (ALiBi)
        s    += bias                      if bias is float (broadcast to (B, H, S_q, S_k))
        s     = -inf where not allowed    (lengths, window/causal, bool bias False)
        lse   = log(sum_j exp(s_j) + exp(sink_h))          (B, H, S_q); sink term only with sinks
        P     = exp(s - lse) * keep / (1 - p)              keep: dropout_mask (B, H, S_q, S_k)
        out   = P @ v                                      (B, H, S_q, D)

    A row with nothing allowed gives out = 0 and lse = -inf (or the sink logit). `logits`, when
    given, is x (B, H, S_q, S_k) itself (qk_int8_scores': the int8 Q.K^T's), in place of q @ k^T.
    """
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    group = h // hk
    k = k.repeat_interleave(group, dim=1)  # (B, H, S_k, D)
    v = v.repeat_interleave(group, dim=1)
    x = torch.matmul(q, k.transpose(-1, -2)) if logits is None else logits.to(q.dtype)
    s = x * scale  # (B, H, S_q, S_k)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_bias(alibi_slopes.to(s.dtype), sq, sk, bottom_right=bottom_right, len_k=seqlens_k)
    ok = mask_structure(sq, sk, window=window, bottom_right=bottom_right, len_k=seqlens_k, batch=b,
                        device=q.device)
    if bias is not None:
        if bias.dtype == torch.bool:
            ok = ok & bias
        else:
            fb = bias.to(s.dtype)
            s = s + fb
            # a -inf entry masks its key as a False does: without it a row that only a float mask
            # empties gets NaN gradients from logsumexp's backward, where the kernels give 0
            ok = ok & (fb != float("-inf"))
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(s.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
        lse = torch.logsumexp(torch.cat([s, sink_col], dim=-1), dim=-1)  # (B, H, S_q)
    else:
        lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse) & (lse < 0), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1))  # masked entries give exp(-inf) = 0
    if dropout_p > 0.0:
        if dropout_mask is None:
            raise ValueError("reference.attention: dropout_p > 0 needs the dropout_mask to reproduce")
        p = p * dropout_mask.to(p.dtype) / (1.0 - dropout_p)
    out = torch.matmul(p, v)
    return out, lse


# Blocks of the int8 Q.K^T (qk_quant="int8") on the CPU: a scale per kBlockM query rows and per
# kBlockN keys (csrc/cpu/pack.h), counted from each sequence's first row.
QK_INT8_BLOCK_Q = 48
QK_INT8_BLOCK_K = 128
# and of the fp8 one's only kernel, the sm_90 wgmma forward: a q scale per warp's 16 rows, a k
# scale per 128-key tile (the reference's default for "fp8", so that its fallback computes what
# that kernel computes)
QK_FP8_BLOCK_Q = 16
QK_FP8_BLOCK_K = 128


# The largest code of each format of the quantized Q.K^T: a block's amax maps to it
_QUANT_TOP = {"int8": 127.0, "fp8": 448.0}


def _int8_blocks(x: Tensor, block: int, valid: Tensor, fmt: str = "int8") -> Tuple[Tensor, Tensor]:
    """x (B, H, S, D) float32 rounded to int8 (fmt "fp8": to fp8 e4m3) per block of `block` rows
    (rows where `valid` (B, 1 or H, S, 1) is False are left out of the scale and come back 0):
    (xi (B, H, S, D) float32 holding the codes' values, scale (B, H, S, 1) float32, the row's block
    scale). Float32 op for op as the kernels: scale = amax / top, x * (top / amax) rounded (int8:
    rint clamped to +-127; fp8: to nearest even e4m3, saturated at +-448), top 127 or 448; a block
    holding a NaN or an inf gets a NaN scale (and zeros)."""
    b, h, s, d = x.shape
    nb = -(-s // block)
    pad = nb * block - s
    xv = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    xp = torch.nn.functional.pad(xv, (0, 0, 0, pad)).reshape(b, h, nb, block * d)
    ax = xp.abs()
    finite = torch.isfinite(ax).all(-1, keepdim=True)
    amax = torch.where(finite, ax, torch.zeros((), dtype=ax.dtype, device=ax.device)).amax(-1, keepdim=True)
    # full tensors on both sides: torch turns a division by or of a scalar into a multiplication
    # by a reciprocal (two roundings), where the kernels divide once
    top = torch.full_like(amax, _QUANT_TOP[fmt])
    scale = torch.where(finite, amax / top, torch.full_like(amax, float("nan")))
    inv = top / amax.clamp_min(torch.finfo(torch.float32).tiny)
    inv = torch.where(finite & (amax > 0) & torch.isfinite(inv), inv, torch.zeros_like(amax))
    if fmt == "fp8":
        xi = (xp * inv).clamp(-448, 448).nan_to_num(0.0).to(torch.float8_e4m3fn).float()
    else:
        xi = torch.round(xp * inv).clamp(-127, 127).nan_to_num(0.0)
    xi = xi.reshape(b, h, nb * block, d)[:, :, :s]
    rows = scale.view(b, h, nb, 1).repeat_interleave(block, dim=2)[:, :, :s]
    return xi, rows


def seen_keys(b: int, h: int, hk: int, sq: int, sk: int, *, window: Tuple[int, int] = (-1, -1),
              bottom_right: bool = False, seqlens_k: Optional[Tensor] = None, bias: Optional[Tensor] = None,
              visible: Optional[Tensor] = None, device: Device = None) -> Tensor:
    """(B, H_k, S_k) bool: the keys that some row of some head of each kv group may attend (the
    lengths, the window / causal, a bool bias, and `visible`, a bool mask (a block layout's
    elements) kept apart from a float bias; a float bias hides nothing). The int8 Q.K^T leaves the
    others out of its K mean and block scales."""
    ok = mask_structure(sq, sk, window=window, bottom_right=bottom_right, len_k=seqlens_k, batch=b, device=device)
    if bias is not None and bias.dtype == torch.bool:
        ok = ok & bias.to(device)
    if visible is not None:
        ok = ok & visible.to(device)
    return ok.expand(b, h, sq, sk).any(2).view(b, hk, h // hk, sk).any(2)


def qk_int8_scores(q: Tensor, k: Tensor, *, window: Tuple[int, int] = (-1, -1), bottom_right: bool = False,
                   seqlens_k: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                   visible: Optional[Tensor] = None, block_q: int = QK_INT8_BLOCK_Q,
                   block_k: int = QK_INT8_BLOCK_K) -> Tensor:
    """qk_quant_scores(..., qk_quant="int8"): the int8 Q.K^T's raw scores."""
    return qk_quant_scores(q, k, qk_quant="int8", window=window, bottom_right=bottom_right, seqlens_k=seqlens_k,
                           bias=bias, visible=visible, block_q=block_q, block_k=block_k)


def qk_quant_scores(q: Tensor, k: Tensor, *, qk_quant: str = "int8", window: Tuple[int, int] = (-1, -1),
                    bottom_right: bool = False, seqlens_k: Optional[Tensor] = None, bias: Optional[Tensor] = None,
                    visible: Optional[Tensor] = None, block_q: Optional[int] = None,
                    block_k: Optional[int] = None) -> Tensor:
    """The raw scores x = q.k (B, H, S_q, S_k) of the 8-bit Q.K^T (SageAttention's method; qk_quant
    "int8", or "fp8": e4m3 codes, amax to 448), in float64: attention(..., logits=this) is what
    attention(..., qk_quant=qk_quant) computes. Blocks by default: the CPU kernel's for int8
    (QK_INT8_BLOCK_Q / _K), the sm_90 kernel's for fp8 (QK_FP8_BLOCK_Q / _K).

        mean  = mean of the seen keys (B, H_k, 1, D)   (k - mean: the smoothing; summed in float64)
        qi, sq = 8-bit blocks of q (block_q rows);  ki, sk = 8-bit blocks of k - mean (block_k keys)
        x     = (qi @ ki^T) * (sq * sk) + q @ mean^T

    q.k = q.(k - mean) + q.mean, so only the smoothed part is rounded; softmax, softcap and the
    LSE see q.k. The mask options (attention()'s) decide which keys are seen (seen_keys): those no
    row of a kv group may attend take no part in the mean or the scales and round to 0."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    q32, k32 = q.float(), k.float()
    valid = seen_keys(b, h, hk, sq, sk, window=window, bottom_right=bottom_right, seqlens_k=seqlens_k, bias=bias,
                      visible=visible, device=k.device).view(b, hk, sk, 1)
    n = valid.sum(2, keepdim=True)  # (B, H_k, 1, 1)
    kv = torch.where(valid, k32.double(), torch.zeros((), dtype=torch.float64, device=k.device))
    mean = (kv.sum(2, keepdim=True) / n.clamp_min(1)).float()  # (B, H_k, 1, D)
    if qk_quant not in _QUANT_TOP:
        raise ValueError(f"qk_quant must be 'int8' or 'fp8', got {qk_quant!r}")
    fp8 = qk_quant == "fp8"
    block_q = block_q or (QK_FP8_BLOCK_Q if fp8 else QK_INT8_BLOCK_Q)
    block_k = block_k or (QK_FP8_BLOCK_K if fp8 else QK_INT8_BLOCK_K)
    ki, ks = _int8_blocks(torch.where(valid, k32 - mean, torch.zeros((), device=k.device)), block_k, valid, qk_quant)
    qi, qs = _int8_blocks(q32, block_q, torch.ones(b, 1, sq, 1, dtype=torch.bool, device=q.device), qk_quant)
    g = h // hk
    ki, ks, mean = (t.repeat_interleave(g, dim=1) for t in (ki, ks, mean))
    scale = (qs * ks.transpose(-1, -2)).double()  # (B, H, S_q, S_k): float32 products, as the kernels
    return (qi.double() @ ki.double().transpose(-1, -2)) * scale + q32.double() @ mean.double().transpose(-1, -2)


def attention_qk_int8(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tuple[Tensor, Tensor]:
    """attention_qk_quant(..., qk_quant="int8")."""
    return attention_qk_quant(q, k, v, qk_quant="int8", **kwargs)


def attention_qk_quant(q: Tensor, k: Tensor, v: Tensor, *, qk_quant: str = "int8",
                       **kwargs: Any) -> Tuple[Tensor, Tensor]:
    """attention() with the 8-bit Q.K^T's scores (qk_quant_scores) in float64: the oracle of
    attention(..., qk_quant=qk_quant) and its fallback where no kernel runs it. Takes attention()'s
    options, `visible` (seen_keys') and the blocks (block_q, block_k: qk_quant_scores' defaults);
    returns (out, lse) in float64."""
    extra = {n: kwargs.pop(n) for n in ("visible", "block_q", "block_k") if n in kwargs}
    x = qk_quant_scores(q, k, qk_quant=qk_quant, **extra,
                        **{n: kwargs[n] for n in ("window", "bottom_right", "seqlens_k", "bias") if n in kwargs})
    f64 = torch.float64
    kw = {n: (t.to(f64) if isinstance(t, Tensor) and t.is_floating_point() else t) for n, t in kwargs.items()}
    return attention(q.to(f64), k.to(f64), v.to(f64), logits=x, **kw)


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    **kwargs: Any,
) -> Tuple[Tensor, Tensor]:
    """Variable-length packs: q (total_q, H, D), k, v (total_k, H_k, D); sequence b holds rows
    [cu[b], cu[b+1]). Each sequence is attention() on its own. Returns out (total_q, H, D) and
    lse (H, total_q). A (B, H, S_q, S_k)-shaped `bias` or `dropout_mask` is indexed per sequence.
    `attend` (default attention) computes each sequence (attention_qk_int8: the int8 Q.K^T's)."""
    outs, lses = [], []
    attend = kwargs.pop("attend", attention)
    bias = kwargs.pop("bias", None)
    dmask = kwargs.pop("dropout_mask", None)
    slopes = kwargs.pop("alibi_slopes", None)
    for b in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        qb = q[q0:q1].transpose(0, 1).unsqueeze(0)  # (1, H, s_q, D)
        kb = k[k0:k1].transpose(0, 1).unsqueeze(0)
        vb = v[k0:k1].transpose(0, 1).unsqueeze(0)
        extra = dict(kwargs)
        if bias is not None:
            bb = bias[b if bias.shape[0] > 1 else 0]
            extra["bias"] = bb[..., : q1 - q0, : k1 - k0].unsqueeze(0)
        if dmask is not None:
            extra["dropout_mask"] = dmask[b, :, : q1 - q0, : k1 - k0].unsqueeze(0)
        if slopes is not None:
            extra["alibi_slopes"] = slopes[b] if slopes.dim() == 2 else slopes
        o, l = attend(qb, kb, vb, **extra)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs, 0), torch.cat(lses, -1)


def attention_probs(q: Tensor, k: Tensor, lse: Tensor, **kwargs: Any) -> Tensor:
    """The softmax probabilities P = exp(s - lse) (B, H, S_q, S_k), recomputed from the LSE,
    zero where masked. Takes attention()'s score options (no dropout)."""
    return probs_from_scores(attention_scores(q, k, **kwargs), lse)


def probs_from_scores(s: Tensor, lse: Tensor) -> Tensor:
    """P = exp(s - lse) from attention_scores' s (B, H, S_q, S_k) and the LSE (B, H, S_q); a row
    whose LSE is infinite (no key to attend) is 0."""
    lse = lse.to(s.dtype).unsqueeze(-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
    return p.masked_fill(torch.isinf(lse), 0.0)


def attention_scores(q: Tensor, k: Tensor, **kwargs: Any) -> Tensor:
    """The final logits s (B, H, S_q, S_k) of attention()'s score options: scale * q k^T, softcap,
    ALiBi and a float bias added; -inf where a rule hides the key (window / causal, seqlens_k, a
    bool bias). logsumexp(s, -1) is the LSE without sinks."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    scale = kwargs.get("scale") or 1.0 / math.sqrt(d)
    softcap = kwargs.get("softcap", 0.0)
    bottom_right = kwargs.get("bottom_right", False)
    k = k.repeat_interleave(h // hk, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if kwargs.get("alibi_slopes") is not None:
        s = s + alibi_bias(kwargs["alibi_slopes"].to(s.dtype), sq, sk, bottom_right=bottom_right,
                           len_k=kwargs.get("seqlens_k"))
    ok = mask_structure(sq, sk, window=kwargs.get("window", (-1, -1)), bottom_right=bottom_right,
                        len_k=kwargs.get("seqlens_k"), batch=b, device=q.device)
    bias = kwargs.get("bias")
    if bias is not None:
        if bias.dtype == torch.bool:
            ok = ok & bias
        else:
            s = s + bias.to(s.dtype)
    return s.masked_fill(~ok, float("-inf"))


# ---------------------------------------------------------------------------------- dropout mask
_U32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: Tensor) -> Tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit halves of a * b for a < 2**32 and b an int64 tensor of values < 2**32.
    b is split into 16-bit halves so that no int64 product overflows."""
    x = a * (b & 0xFFFF)  # < 2**48
    y = a * (b >> 16)  # < 2**48; a * b = y * 2**16 + x
    lo = (x + ((y & 0xFFFF) << 16)) & _U32
    hi = (y + (x >> 16)) >> 16
    return hi, lo


def _philox4x32_10(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor):
    """Philox4x32-10 (csrc/common/philox.h) on int64 tensors holding uint32 values."""
    for _ in range(10):
        hi0, lo0 = _mulhilo32(0xD2511F53, c0)
        hi1, lo1 = _mulhilo32(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _U32, (k1 + 0xBB67AE85) & _U32
    return c0, c1, c2, c3


def dropout_mask(b: int, h: int, sq: int, sk: int, p: float, rng_state: Tensor, device: Device = None,
                 coords: Optional[Tensor] = None) -> Tensor:
    """The (B, H, S_q, S_k) bool keep-mask the kernels draw, from rng_state = (seed, offset), an
    int64 (2) tensor (read as tensors: no .item(), so torch.compile traces it).

    Element (b, h, i, j) keeps when u >= p, u = (x >> 8) / 2**24 with x the (j mod 4)-th word of
    Philox4x32-10(counter = (j // 4, i, b * H + h, offset_lo), key = (seed_lo, seed_hi ^ offset_hi)):
    bit for bit the mask of the compiled kernels and of attention_ext.dropout_mask().

    coords: the op's dropout_coords, an int (B * H + S_q + S_k) tensor: the element is drawn at
    the global (bh, i, j) it names (one piece of a larger problem: context parallelism)."""
    rng = rng_state.to(device=device, dtype=torch.int64)
    seed, offset = rng[0], rng[1]
    i64 = dict(dtype=torch.int64, device=rng.device)
    k0 = seed & _U32
    k1 = ((seed >> 32) & _U32) ^ ((offset >> 32) & _U32)  # arithmetic shifts: the uint64 bits of a negative value
    if coords is not None:  # one draw per element, at its global coordinates
        c = coords.to(**i64)
        bh, i, j = c[:b * h].view(-1, 1, 1), c[b * h:b * h + sq].view(1, -1, 1), c[b * h + sq:].view(1, 1, -1)
        zero = torch.zeros((b * h, sq, sk), **i64)
        words = _philox4x32_10(zero + ((j >> 2) & _U32), zero + (i & _U32), zero + (bh & _U32),
                               zero + (offset & _U32), k0 + zero, k1 + zero)
        bits = torch.gather(torch.stack(words, dim=-1), -1, (zero + (j & 3)).unsqueeze(-1)).squeeze(-1)
    else:
        j4 = torch.arange((sk + 3) // 4, **i64).view(1, 1, -1)
        i = torch.arange(sq, **i64).view(1, -1, 1)
        bh = torch.arange(b * h, **i64).view(-1, 1, 1)
        zero = torch.zeros((b * h, sq, (sk + 3) // 4), **i64)  # the counters, broadcast to (B * H, S_q, S_k / 4)
        words = _philox4x32_10(zero + j4, zero + i, zero + bh, zero + (offset & _U32), k0 + zero, k1 + zero)
        bits = torch.stack(words, dim=-1).flatten(-2)[..., :sk]  # (B * H, S_q, 4 * ceil(S_k / 4)) -> S_k
    # u >= p in float32, as the kernels compare: (x >> 8) >= p32 * 2**24 (a power-of-two scale is exact)
    threshold = math.ceil(struct.unpack("f", struct.pack("f", p))[0] * 16777216.0)
    return ((bits >> 8) >= threshold).view(b, h, sq, sk)


def linformer_attention(q: Tensor, k: Tensor, v: Tensor, proj_k: Tensor, proj_v: Optional[Tensor] = None, *,
                        scale: Optional[float] = None) -> Tensor:
    """Linformer (Wang et al. 2020): k' = proj_k k, v' = proj_v v along the sequence (proj (r, S_k)
    shared by the heads, or (H_k, r, S_k) per head; proj_v defaults to proj_k), then softmax
    attention of q over the r projected keys, non-causal. Returns (B, H, S_q, D_v)."""
    proj_v = proj_k if proj_v is None else proj_v
    return attention(q, torch.matmul(proj_k, k), torch.matmul(proj_v, v), scale=scale)[0]
