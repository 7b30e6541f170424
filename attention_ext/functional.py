"""Tier 2: the functional API. Validates inputs with clear messages, then calls the fused op.

- attention():                     every option of the fused kernel
- scaled_dot_product_attention():  drop-in for torch.nn.functional.scaled_dot_product_attention
- flash_attn_func() and friends:   drop-ins for flash-attn 2.x ((B, S, H, D), causal bottom-right)
- attention_weights():             the probabilities, recomputed cheaply from the LSE
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import ops, reference

__all__ = [
    "attention",
    "attention_weights",
    "scaled_dot_product_attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
]

_warned_fallback = set()
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check(cond: bool, msg, exc=ValueError):
    """Raise exc(msg) unless cond; msg may be a callable, so that an f-string message (formatting
    shapes costs microseconds) is only built when the check fails."""
    if not cond:
        raise exc(msg() if callable(msg) else msg)


def _draw_seed(generator: Optional[torch.Generator]) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=generator, dtype=torch.int64).item())


@contextlib.contextmanager
def _deterministic(flag: bool):
    old = ops._deterministic.value
    ops._deterministic.value = flag
    try:
        yield
    finally:
        ops._deterministic.value = old


def _window(window, causal: bool) -> Tuple[int, int]:
    """(left, right) sizes with -1 = unbounded; causal caps the right side at 0 (no future keys)."""
    _check(len(window) == 2, lambda: f"window must be (left, right), got {window}")
    wl, wr = int(window[0]), int(window[1])
    _check(wl >= -1 and wr >= -1, lambda: f"window sizes must be >= -1, got {tuple(window)}")
    return (wl, 0) if causal else (wl, wr)


def _as_bias(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], b: int, h: int, sq: int, sk: int,
             device, acc: torch.dtype) -> Optional[Tensor]:
    """Combine a bool/float mask and a (B, Sk) key padding mask into the op's 4-D bias
    (bool True = attend, or additive in `acc`, the op's float side dtype), broadcast dims kept
    at size 1."""
    bias = None
    if attn_mask is not None:
        _check(isinstance(attn_mask, Tensor), "attn_mask must be a Tensor", TypeError)
        _check(attn_mask.device == device, lambda: f"attn_mask must be on {device}, got {attn_mask.device}")
        _check(attn_mask.dim() <= 4, lambda: f"attn_mask must have at most 4 dims, got shape {tuple(attn_mask.shape)}")
        m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        for got, want in zip(m.shape, (b, h, sq, sk)):
            _check(got in (1, want),
                   lambda: f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                           f"(B, H, Sq, Sk) = {(b, h, sq, sk)}")
        if m.dtype == torch.bool:
            bias = m
        else:
            _check(m.is_floating_point(), lambda: f"attn_mask must be bool or floating point, got {m.dtype}", TypeError)
            bias = m.to(acc)
    if key_padding_mask is not None:
        _check(key_padding_mask.dim() == 2 and tuple(key_padding_mask.shape) == (b, sk),
               lambda: f"key_padding_mask must be (B, Sk) = {(b, sk)}, got {tuple(key_padding_mask.shape)}")
        _check(key_padding_mask.dtype == torch.bool,
               lambda: f"key_padding_mask must be bool, got {key_padding_mask.dtype}",
               TypeError)
        kpm = key_padding_mask.view(b, 1, 1, sk)
        if bias is None:
            bias = kpm
        elif bias.dtype == torch.bool:
            bias = bias & kpm
        else:
            bias = bias.masked_fill(~kpm, float("-inf"))
    return bias


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    layout: str = "bhsd",
    scale: Optional[float] = None,
    causal: bool = False,
    bottom_right: bool = False,
    window: Tuple[int, int] = (-1, -1),
    attn_mask: Optional[Tensor] = None,
    key_padding_mask: Optional[Tensor] = None,
    seqlens_k: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    seed: Optional[int] = None,
    return_lse: bool = False,
    deterministic: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Fused softmax attention with every variant.

    Args:
        q: (B, H, Sq, D), or (B, Sq, H, D) with layout="bshd".
        k, v: (B, H_k, Sk, D) (or (B, Sk, H_k, D)); H % H_k == 0 gives MQA / GQA with no copy.
        scale: defaults to 1 / sqrt(D).
        causal: query i sees keys j <= i + diag, diag = 0 (top-left, as SDPA) or Sk - Sq with
            bottom_right=True (as flash-attn). Same as window=(-1, 0).
        window: sliding window (left, right) around the diagonal; -1 = unbounded.
        attn_mask: bool (True = attend) or float (added to the scores), broadcastable to
            (B, H, Sq, Sk). A float mask gets a gradient.
        key_padding_mask: (B, Sk) bool, True = a real key.
        seqlens_k: (B,) int: keys >= seqlens_k[b] are padding.
        alibi_slopes: (H,) or (B, H): adds -slope * |i + diag - j|.
        softcap: > 0 squashes the scaled scores: softcap * tanh(s / softcap).
        sinks: (H,) learnable logits that join each softmax denominator (attention sinks).
        dropout_p: dropout on the probabilities, drawn in-kernel from (seed or generator).
        return_lse: also return the (B, H, Sq) log-sum-exp (float32; float64 for float64
            inputs).
        deterministic: the backward uses no atomics (CUDA).

    Returns out with q's layout (and the LSE). Rows with nothing to attend give 0 (lse -inf).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(isinstance(t, Tensor), lambda: f"{name} must be a Tensor, got {type(t).__name__}", TypeError)
        _check(t.dim() == 4, lambda: f"{name} must be 4-D ({'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'}), "
               f"got shape {tuple(t.shape)}")
    _check(layout in ("bhsd", "bshd"), lambda: f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copy
    _check(q.dtype == k.dtype == v.dtype,
           lambda: f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}", TypeError)
    _check(q.dtype in _DTYPES,
           lambda: f"q, k, v must be float32, float16, bfloat16 or float64, got {q.dtype}", TypeError)
    _check(q.device == k.device == v.device,
           lambda: f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, h, sq, d = q.shape
    _check(k.shape[0] == b and v.shape[0] == b,
           lambda: f"batch mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check(k.shape == v.shape, lambda: f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    hk, sk = k.shape[1], k.shape[2]
    _check(k.shape[3] == d, lambda: f"head dim mismatch: q has {d}, k and v have {k.shape[3]}")
    _check(1 <= d <= 256, lambda: f"head dim must be in [1, 256], got {d}")
    _check(hk >= 1 and h % hk == 0, lambda: f"query heads ({h}) must be a multiple of key/value heads ({hk})")
    _check(0.0 <= dropout_p < 1.0, lambda: f"dropout_p must be in [0, 1), got {dropout_p}")
    _check(softcap >= 0.0, lambda: f"softcap must be >= 0, got {softcap}")
    wl, wr = _window(window, causal)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    acc = ops.acc_dtype(q.dtype)
    bias = _as_bias(attn_mask, key_padding_mask, b, h, sq, sk, q.device, acc)
    if seqlens_k is not None:
        _check(tuple(seqlens_k.shape) == (b,), lambda: f"seqlens_k must be (B,) = ({b},), got {tuple(seqlens_k.shape)}")
        seqlens_k = seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    if alibi_slopes is not None:
        _check(alibi_slopes.shape in ((h,), (b, h)),
               lambda: f"alibi_slopes must be (H,) or (B, H), got {tuple(alibi_slopes.shape)}")
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=acc).contiguous()
    if sinks is not None:
        _check(tuple(sinks.shape) == (h,), lambda: f"sinks must be (H,) = ({h},), got {tuple(sinks.shape)}")
        _check(sinks.device == q.device, lambda: f"sinks must be on {q.device}, got {sinks.device}")
        if sinks.dtype != acc:
            sinks = sinks.to(acc)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if dropout_p > 0.0 and seed is None:
        seed = _draw_seed(generator)

    opts = dict(bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, seqlens_k=seqlens_k, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=sq, max_seqlen_k=sk, scale=float(scale), softcap=float(softcap),
                window_left=wl, window_right=wr, bottom_right=bool(bottom_right), dropout_p=float(dropout_p),
                seed=int(seed or 0), offset=0)
    if _has_kernel(q):
        with _deterministic(deterministic):
            out, lse = ops.fwd(q, k, v, **opts)
    else:
        out, lse = _fallback(q, k, v, opts)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _has_kernel(q: Tensor) -> bool:
    """A compiled kernel serves q's device and dtype (float64 has a CPU kernel only)."""
    return ops.has_kernel(q.device) and (q.dtype != torch.float64 or q.device.type == "cpu")


def _fallback(q, k, v, o):
    key = (q.device.type, q.dtype)
    if key not in _warned_fallback:
        _warned_fallback.add(key)
        warnings.warn(f"attention_ext: no compiled kernel for {q.dtype} on {q.device}; running the PyTorch reference",
                      RuntimeWarning)
    dmask = None
    if o["dropout_p"] > 0:
        g = torch.Generator(device="cpu").manual_seed(o["seed"])
        dmask = (torch.rand(q.shape[0], q.shape[1], q.shape[2], k.shape[2], generator=g) >= o["dropout_p"]).to(q.device)
    acc = ops.acc_dtype(q.dtype)
    out, lse = reference.attention(
        q.to(acc), k.to(acc), v.to(acc), scale=o["scale"], softcap=o["softcap"],
        window=(o["window_left"], o["window_right"]), bottom_right=o["bottom_right"], bias=o["bias"],
        alibi_slopes=o["alibi_slopes"], sinks=o["sinks"], seqlens_k=o["seqlens_k"], dropout_p=o["dropout_p"],
        dropout_mask=dmask)
    return out.to(q.dtype), lse.to(acc)


def attention_weights(q: Tensor, k: Tensor, lse: Tensor, *, layout: str = "bhsd", scale: Optional[float] = None,
                      causal: bool = False, bottom_right: bool = False, window: Tuple[int, int] = (-1, -1),
                      attn_mask: Optional[Tensor] = None, key_padding_mask: Optional[Tensor] = None,
                      seqlens_k: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                      softcap: float = 0.0) -> Tensor:
    """The attention probabilities (B, H, Sq, Sk) recomputed from attention()'s LSE: one
    Q K^T and an exp, no second softmax pass. Dropout is not applied. Returns float32 (float64
    for float64 inputs)."""
    if layout == "bshd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    wl, wr = _window(window, causal)
    acc = ops.acc_dtype(q.dtype)
    bias = _as_bias(attn_mask, key_padding_mask, b, h, sq, sk, q.device, acc)
    return reference.attention_probs(
        q.to(acc), k.to(acc), lse.to(acc), scale=scale if scale is not None else 1.0 / math.sqrt(d), softcap=softcap,
        window=(wl, wr), bottom_right=bottom_right, bias=bias, alibi_slopes=alibi_slopes, seqlens_k=seqlens_k)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention (same arguments, same
    conventions: bool mask True = attend, is_causal aligned top-left). (N, ..., L, E) inputs;
    4-D inputs with equal q/k/v head dims run the fused kernel, other shapes run torch's own."""
    if not all(isinstance(t, Tensor) for t in (query, key, value)):
        raise TypeError("scaled_dot_product_attention: query, key and value must be Tensors")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise RuntimeError(
            f"Expected query, key, and value to have the same dtype, but got query.dtype: {query.dtype} "
            f"key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if query.device != key.device or query.device != value.device:
        raise RuntimeError(
            f"Expected query, key, and value to have the same device type, but got query.device: {query.device} "
            f"key.device: {key.device} and value.device: {value.device} instead.")
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise RuntimeError("scaled_dot_product_attention: query, key and value must have at least 2 dims")
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    if query.size(-1) != key.size(-1):
        raise RuntimeError(f"scaled_dot_product_attention: query and key head dims differ ({query.size(-1)} vs "
                           f"{key.size(-1)})")
    if query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        hq, hk = query.size(1), key.size(1)
        if hq != hk and not enable_gqa:
            raise RuntimeError(f"scaled_dot_product_attention: number of heads in query ({hq}) and key ({hk}) differ; "
                               "pass enable_gqa=True for grouped-query attention")
        if hq % hk != 0:
            raise RuntimeError(f"scaled_dot_product_attention: number of heads in key/value ({hk}) must divide the "
                               f"number of heads in query ({hq})")
    fused = (query.dim() == 4 and key.dim() == 4 and value.dim() == 4 and value.size(-1) == query.size(-1)
             and query.size(-1) <= 256 and query.dtype in _DTYPES and _has_kernel(query))
    if not fused:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa)
    return attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, causal=is_causal, scale=scale)


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """Drop-in for flash_attn.flash_attn_func: q (B, Sq, H, D), k / v (B, Sk, H_k, D); causal is
    aligned bottom-right. return_attn_probs=True returns (out, lse (B, H, Sq), probs
    (B, H, Sq, Sk)) with the real probabilities recomputed from the LSE."""
    out, lse = attention(q, k, v, layout="bshd", scale=softmax_scale, causal=causal, bottom_right=True,
                         window=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                         return_lse=True, deterministic=deterministic)
    if return_attn_probs:
        probs = attention_weights(q, k, lse, layout="bshd", scale=softmax_scale, causal=causal, bottom_right=True,
                                  window=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes)
        return out, lse, probs
    return out


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False):
    """qkv (B, S, 3, H, D): q, k, v are strided views of the pack, never copied."""
    _check(qkv.dim() == 5 and qkv.shape[2] == 3, lambda: f"qkv must be (B, S, 3, H, D), got {tuple(qkv.shape)}")
    return flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False):
    """kv (B, Sk, 2, H_k, D)."""
    _check(kv.dim() == 5 and kv.shape[2] == 2, lambda: f"kv must be (B, S, 2, H_k, D), got {tuple(kv.shape)}")
    return flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False):
    """Drop-in for flash_attn.flash_attn_varlen_func: q (total_q, H, D), k / v (total_k, H_k, D),
    sequence b in rows [cu_seqlens[b], cu_seqlens[b+1]). Returns out (total_q, H, D) (and lse
    (H, total_q) with return_attn_probs)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.dim() == 3, lambda: f"{name} must be (total, H, D), got {tuple(t.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check(t.dim() == 1 and t.numel() >= 2, lambda: f"{name} must be (B + 1,), got {tuple(t.shape)}")
    _check(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must have the same length")
    _check(q.dtype == k.dtype == v.dtype,
           lambda: f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}", TypeError)
    _check(k.shape == v.shape, lambda: f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _check(q.shape[-1] == k.shape[-1], lambda: f"head dim mismatch: q {q.shape[-1]}, k {k.shape[-1]}")
    h, d = q.shape[1], q.shape[2]
    _check(h % k.shape[1] == 0, lambda: f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]})")
    cq = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()
    ck = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()
    lens_q, lens_k = (cq[1:] - cq[:-1]), (ck[1:] - ck[:-1])
    if q.device.type == "cpu" or not torch.compiler.is_compiling():
        _check(int(cq[0]) == 0 and int(ck[0]) == 0, "cu_seqlens must start at 0")
        _check(bool((lens_q >= 0).all()) and bool((lens_k >= 0).all()), "cu_seqlens must be non-decreasing")
        _check(int(cq[-1]) <= q.shape[0] and int(ck[-1]) <= k.shape[0], "cu_seqlens end past the packed tensors")
        _check(int(lens_q.max()) <= max_seqlen_q and int(lens_k.max()) <= max_seqlen_k,
               "a sequence is longer than max_seqlen_q / max_seqlen_k")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    wl, wr = _window(window_size, causal)
    acc = ops.acc_dtype(q.dtype)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.to(device=q.device, dtype=acc).contiguous()
    seed = _draw_seed(None) if dropout_p > 0 else 0
    # (total, H, D) -> (1, H, total, D) views
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    opts = dict(bias=None, alibi_slopes=alibi_slopes, sinks=None, seqlens_k=None, cu_seqlens_q=cq, cu_seqlens_k=ck,
                max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), scale=float(softmax_scale),
                softcap=float(softcap), window_left=wl, window_right=wr, bottom_right=True,
                dropout_p=float(dropout_p), seed=seed, offset=0)
    if _has_kernel(q):
        with _deterministic(deterministic):
            out4, lse = ops.fwd(q4, k4, v4, **opts)
        out = out4.transpose(1, 2).squeeze(0)
        lse = lse.squeeze(0)
    else:
        out, lse = reference.attention_varlen(
            q, k, v, cq, ck, scale=softmax_scale, softcap=softcap, window=(wl, wr), bottom_right=True,
            alibi_slopes=alibi_slopes)
        out = out.to(q.dtype)
    if return_attn_probs:
        return out, lse, _varlen_probs(q, k, lse, cq, ck, int(max_seqlen_q), int(max_seqlen_k), softmax_scale,
                                       softcap, (wl, wr), alibi_slopes)
    return out


def _varlen_probs(q, k, lse, cq, ck, max_q, max_k, scale, softcap, window, alibi_slopes):
    """(B, H, max_seqlen_q, max_seqlen_k) probabilities of every sequence (in the LSE's dtype),
    recomputed from the (H, total_q) LSE, zero outside each sequence."""
    nb, h = cq.numel() - 1, q.shape[1]
    acc = lse.dtype
    probs = q.new_zeros((nb, h, max_q, max_k), dtype=acc)
    for b in range(nb):
        q0, q1, k0, k1 = int(cq[b]), int(cq[b + 1]), int(ck[b]), int(ck[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        slopes = None if alibi_slopes is None else (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes)
        probs[b, :, : q1 - q0, : k1 - k0] = reference.attention_probs(
            q[q0:q1].transpose(0, 1).unsqueeze(0).to(acc), k[k0:k1].transpose(0, 1).unsqueeze(0).to(acc),
            lse[:, q0:q1].unsqueeze(0), scale=scale, softcap=softcap, window=window, bottom_right=True,
            alibi_slopes=slopes)[0]
    return probs
