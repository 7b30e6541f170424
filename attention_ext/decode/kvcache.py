"""Tier 2 of the decode family: flash-attn 2.x's `flash_attn_with_kvcache` on the decode op.

One call does what flash-attn's does, in its order: rotary on the new keys (and on q), the new
keys / values written IN PLACE into the (paged) cache at rows cache_seqlens[b] + t, then
attention of q over the cache_seqlens[b] + S_new keys of every sequence (decode_fwd). Every
argument is validated first, so bad input is a clear ValueError / TypeError and never a crash,
a write out of bounds or a silent wrong answer.

While a CUDA graph is being captured the values of the index tensors cannot be read on the host
(a sync); shapes, dtypes and devices are still checked, but a bad index value (a length past the
capacity, a page outside the pool, ...) is found on the device instead: the index is clamped into
the cache, so nothing is read or written out of bounds, and that sequence's rows of out and lse
come back NaN. The cache rows such a clamped append lands on are then unspecified.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _ext
from .._args import not_a_tensor
from .._dtypes import acc_dtype
from ..softmax.functional import window_size_pair
from .ops import check_decode, decode_fwd
from .quant import QMAX, quantize_rows

__all__ = ["flash_attn_with_kvcache", "apply_rotary"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of x (B, S, H, D) at integer positions pos (B, S), with cos / sin
    (seqlen_ro, rotary_dim / 2); the first rotary_dim channels rotate, the rest pass through.
    interleaved (GPT-J): pairs (x[2i], x[2i+1]); else (GPT-NeoX) pairs (x[i], x[i + rotary_dim/2]).
    The math runs in float32 (float64 for float64 x) and the result is in x's dtype."""
    rd = 2 * cos.shape[1]
    acc = acc_dtype(x.dtype)
    c = cos.to(acc)[pos][:, :, None, :]  # (B, S, 1, rd/2)
    s = sin.to(acc)[pos][:, :, None, :]
    xr = x[..., :rd].to(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _fault(cond: Tensor, bad: Optional[Tensor], msg) -> None:
    """cond (B,) bool: the sequences with a bad index value. Outside a capture (bad is None):
    ValueError(msg()) if any; under one: marked in bad (B,), whose rows of out / lse become NaN."""
    if bad is None:
        if bool(cond.any()):
            raise ValueError(msg())
    else:
        bad |= cond


def _int_vector(name: str, t: Optional[Tensor], b: int, device: torch.device) -> Optional[Tensor]:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"flash_attn_with_kvcache: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"flash_attn_with_kvcache: {name} must be int32, got {t.dtype}")
    if t.shape != (b,):
        raise ValueError(f"flash_attn_with_kvcache: {name} must be ({b},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"flash_attn_with_kvcache: {name} must be on {device}, got {t.device}")
    return t.contiguous()  # (a strided view: the op takes dense index vectors)


def _quantize_append(x: Tensor, descale: Tensor, page: Tensor, slot: Tensor, dtype: torch.dtype) -> Tensor:
    """New rows x (B, S_new, H_k, D) quantized for cache rows (page, slot) (B, S_new): per-row
    descales (3-D) get a fresh scale written there (amax over D / the type's largest value);
    per batch entry ones (B, H_k) are used as given (finite values beyond them saturate). A
    per-entry scale cannot hold a non-finite value: the entry's scale becomes NaN in the tensor
    passed, so reads through it are NaN from then on, as attention over a NaN / inf key or value
    gives (a gathered copy, descale[cache_batch_idx], takes the NaN, not the caller's original;
    a scale of 0 or +-inf for nonzero rows is refused first: _check_append_scales)."""
    if descale.dim() == 3:
        scale = x.float().abs().amax(-1) / QMAX[dtype]  # (B, S_new, H_k)
        descale[page, slot] = scale
        return quantize_rows(x, scale[..., None], dtype)
    finite = x.float().isfinite().all(-1).all(1)  # (B, H_k)
    if not bool(finite.all()):  # the entries that receive a NaN / inf read NaN from now on
        descale.masked_fill_(~finite, float("nan"))
    return quantize_rows(x, descale[:, None, :, None], dtype)


def _check_append_scales(x: Tensor, descale: Tensor, name: str) -> None:
    """_quantize_append's refusals, for k and v both before either is written."""
    if not isinstance(descale, Tensor) or descale.dtype != torch.float32:
        raise TypeError("flash_attn_with_kvcache: k_descale / v_descale must be float32 tensors")
    if descale.dim() == 3:
        return
    xf = x.float()
    nonzero = (xf != 0).any(-1).any(1)  # (B, H_k): the entries that receive a nonzero value
    finite = xf.isfinite().all(-1).all(1)
    if bool((nonzero & finite & ((descale == 0) | descale.isinf())).any()):
        raise ValueError(f"flash_attn_with_kvcache: {name}_descale holds a scale of 0 or +-inf for a (sequence, kv "
                         f"head) that new nonzero rows are appended to; a per-head scale is used as given, so these "
                         f"rows would read back as zeros or NaN: quantize the cache with scales that cover the new "
                         f"rows, or per token (quantize_kv(..., granularity='token'), whose appends write fresh "
                         f"scales)")


def _collisions(flat: Tensor, bad: Optional[Tensor], name: str) -> None:
    """flat (B, S_new): the cache row each new row is written to (page * page_size + slot). Two new
    rows bound for one cache row would keep only the last write, and the other sequence would
    attend over a key that is not its own: refused (under a capture: both sequences marked in
    bad, so that they write back what they find and give NaN)."""
    b, s_new = flat.shape
    if bad is None and torch.unique(flat).numel() == flat.numel():
        return  # the common case, checked by one op (the per-sequence marking below only on a fault)
    order = flat.flatten().argsort()
    srt = flat.flatten()[order]
    dup = srt[1:] == srt[:-1]  # (N - 1,): neighbours in sorted order that share a row
    hit = torch.zeros(b * s_new, dtype=torch.bool, device=flat.device)
    hit[1:] |= dup
    hit[:-1] |= dup
    hit = torch.zeros_like(hit).scatter_(0, order, hit).view(b, s_new).any(1)  # (B,): back in batch order

    def msg():
        seqs = hit.nonzero().flatten().tolist()
        return (f"flash_attn_with_kvcache: the new rows of sequences {seqs} go to the same cache row (an append "
                f"writes each new row once, so all but one would be lost and the others would attend over "
                f"keys that are not theirs): give every sequence's appended rows their own cache rows in "
                f"{name} (pages may be shared only where the sequences read them)")
    _fault(hit, bad, msg)


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors' byte spans of one storage intersect (exact for dense views,
    conservative for strided ones)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.untyped_storage().data_ptr() != \
            b.untyped_storage().data_ptr():
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    sinks: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Drop-in for flash_attn.flash_attn_with_kvcache (flash-attn 2.x semantics).

    q (B, Sq, H, D). k_cache / v_cache (B_cache, S_cache, H_k, D), or paged
    (num_pages, page_size, H_k, D) with block_table (B, max_pages) int32: row r of sequence b is
    row r % page_size of page block_table[b, r // page_size]. H must be a multiple of H_k
    (MQA / GQA read the shared K/V heads, never repeated).

    cache_seqlens: int (same for every sequence) or (B,) int32: how many cache rows each
    sequence holds (absolute rows, the left pad included). None: the whole cache (then k / v
    cannot be appended). cache_batch_idx (B,) int32: the cache row of sequence b (contiguous
    caches only, as in flash-attn). cache_leftpad (B,) int32: sequence b's keys start at cache
    row leftpad[b].

    k / v (B, S_new, H_k, D), optional: written IN PLACE into the cache at rows
    cache_seqlens[b] + t (t < S_new), after rotary on k; nothing else in the cache changes.
    Attention then covers rows [leftpad[b], cache_seqlens[b] + S_new). The rows must fit the
    capacity (S_cache, or max_pages * page_size) or a ValueError is raised before any write, as it
    is when two new rows would land on one cache row (a repeated cache_batch_idx entry, block_table
    pages shared where sequences append; sharing pages that are only read is fine).

    rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2): rotary_dim = 2 * cos.shape[1] <= D.
    k_new row t rotates at position cache_seqlens[b] + t; q row t at cache_seqlens[b] + t when
    causal or local (a window), else every q row at cache_seqlens[b] (flash-attn's rule).
    rotary_interleaved: GPT-J pairs (True) or GPT-NeoX halves (False).

    causal: window_size = (left, 0), aligned bottom-right (the last query row sees the last
    key). softcap: cap * tanh(s / cap). alibi_slopes (H,) or (B, H) float32. sinks (H,) float32
    (extension, keyword only): a learnable logit per head in the denominator.
    num_splits: key splits, 0 = heuristic (on the CPU from the batch and cache length only, so the
    result does not depend on the thread count).

    k_descale / v_descale (keyword only): the float32 scales of an int8 / float8_e4m3fn cache
    (cache value = stored value x descale), per row (B_cache, S_cache, H_k) / paged (num_pages,
    page_size, H_k), or per batch entry and kv head (B, H_k), indexed by q's batch entry (flash-attn
    3's rule: with cache_batch_idx, pass descale[cache_batch_idx] for scales in the cache's order, as
    quantize_kv returns them); decode.quantize_kv makes both. New
    k / v rows (q's dtype) are quantized into such a cache in place: per row, with a fresh scale
    (amax / 127 for int8, / 448 for e4m3) written into the descales at the same rows; per batch
    entry, with the given scale (saturating).

    Returns out (B, Sq, H, D), and lse (B, H, Sq) float32 with return_softmax_lse.

    Not differentiable (flash-attn's has no backward either): a ValueError is raised when grad
    mode is on and q, k or v requires grad. Call it under torch.no_grad() / inference_mode().
    """
    # ---- shapes and dtypes
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t, "flash_attn_with_kvcache")
        if t.dim() != 4:
            raise ValueError(f"flash_attn_with_kvcache: {name} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in _FLOATS and not (name != "q" and t.dtype in QMAX):
            raise TypeError(f"flash_attn_with_kvcache: {name} must be fp32 / bf16 / fp16 / fp64 (the caches also "
                            f"int8 / float8_e4m3fn with k_descale and v_descale), got {t.dtype}")
    quantized = k_cache.dtype in QMAX
    if not quantized and not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"flash_attn_with_kvcache: q, k_cache, v_cache must share a dtype, got "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    dev = q.device
    if k_cache.device != dev or v_cache.device != dev:
        raise ValueError("flash_attn_with_kvcache: q, k_cache and v_cache must be on one device")
    b, sq, h, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"flash_attn_with_kvcache: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must have one shape")
    n_rows, rows_per, hk, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"flash_attn_with_kvcache: head dim of q ({d}) and the cache ({dk}) differ")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"flash_attn_with_kvcache: query heads ({h}) must be a multiple of kv heads ({hk}), read "
                         f"as q (B, Sq, H, D) = {tuple(q.shape)} and k_cache (B_cache, S_cache, H_k, D) (paged: "
                         f"(num_pages, page_size, H_k, D)) = {tuple(k_cache.shape)}: a (B, H, S, D) tensor reads "
                         f"in place as .transpose(1, 2)")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
        raise ValueError("flash_attn_with_kvcache is not differentiable (as flash-attn's): call it under "
                         "torch.no_grad() or detach q / k / v")

    # ---- index tensors
    if block_table is not None:
        if not isinstance(block_table, Tensor):
            raise TypeError("flash_attn_with_kvcache: block_table must be a tensor")
        if block_table.dtype != torch.int32:
            raise TypeError(f"flash_attn_with_kvcache: block_table must be int32, got {block_table.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != b or block_table.shape[1] == 0:
            raise ValueError(f"flash_attn_with_kvcache: block_table must be (B={b}, max_pages >= 1), got "
                             f"{tuple(block_table.shape)}")
        if block_table.device != dev:
            raise ValueError(f"flash_attn_with_kvcache: block_table must be on {dev}")
        if cache_batch_idx is not None:
            raise ValueError("flash_attn_with_kvcache: cache_batch_idx is not supported with a paged cache "
                             "(block_table), as in flash-attn")
        capacity = block_table.shape[1] * rows_per
    else:
        capacity = rows_per
    cache_batch_idx = _int_vector("cache_batch_idx", cache_batch_idx, b, dev)
    cache_leftpad = _int_vector("cache_leftpad", cache_leftpad, b, dev)
    # index values: checked on the host, or under a capture marked per sequence (module docstring)
    bad = torch.zeros(b, dtype=torch.bool, device=dev) if _ext.capturing(dev) else None
    if cache_batch_idx is not None and cache_batch_idx.numel():
        _fault((cache_batch_idx < 0) | (cache_batch_idx >= n_rows), bad,
               lambda: f"flash_attn_with_kvcache: cache_batch_idx entries must lie in [0, {n_rows})")
        if bad is not None:
            cache_batch_idx = cache_batch_idx.clamp(0, n_rows - 1)
    if block_table is None and cache_batch_idx is None and n_rows < b:
        raise ValueError(f"flash_attn_with_kvcache: the cache holds {n_rows} sequences, q has {b}")
    if block_table is None and cache_batch_idx is None and n_rows > b:
        # flash-attn reads sequence b from cache row b of a larger cache; the decode op takes
        # exactly B rows, so it gets views of the first B (an append still writes the caller's
        # cache), rather than raising after the append below has written
        k_cache, v_cache = k_cache[:b], v_cache[:b]
        # and the descales of an 8-bit cache, per row (B_cache, S_cache, H_k) or per cache row and kv
        # head (B_cache, H_k, as quantize_kv gives them for the whole cache), the same rows
        k_descale, v_descale = (s[:b] if isinstance(s, torch.Tensor) and s.dim() in (2, 3) and s.shape[0] == n_rows
                                else s for s in (k_descale, v_descale))

    if cache_seqlens is None:
        if k is not None or v is not None:
            raise ValueError("flash_attn_with_kvcache: appending k / v needs cache_seqlens (where to write)")
        seqlens = None
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, Tensor)):
        raise TypeError("flash_attn_with_kvcache: cache_seqlens must be an int or a (B,) int32 tensor")
    elif isinstance(cache_seqlens, int):
        # the conversion to int32 below would fail in torch's words, which name no argument
        if not -2 ** 31 <= cache_seqlens < 2 ** 31:
            raise ValueError(f"flash_attn_with_kvcache: cache_seqlens={cache_seqlens} does not fit int32 (the "
                             "cache's rows are counted in int32): pass the number of rows already in the cache")
        seqlens = torch.full((b,), cache_seqlens, dtype=torch.int32, device=dev)
    else:
        seqlens = _int_vector("cache_seqlens", cache_seqlens, b, dev)
    if seqlens is not None and b:
        _fault(seqlens < 0, bad, lambda: "flash_attn_with_kvcache: cache_seqlens must be >= 0")
        if bad is not None:
            seqlens = seqlens.clamp(min=0)
    if cache_leftpad is not None and b:
        _fault(cache_leftpad < 0, bad, lambda: "flash_attn_with_kvcache: cache_leftpad must be >= 0")
        ends = seqlens if seqlens is not None else torch.full_like(cache_leftpad, capacity)
        _fault(cache_leftpad > ends, bad, lambda: "flash_attn_with_kvcache: cache_leftpad must be <= cache_seqlens")
        if bad is not None:
            cache_leftpad = torch.minimum(cache_leftpad.clamp(min=0), ends)

    # ---- new keys / values
    s_new = 0
    if (k is None) != (v is None):
        raise ValueError("flash_attn_with_kvcache: pass k and v together")
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor):
                raise not_a_tensor(name, t, "flash_attn_with_kvcache")
            if t.dtype != q.dtype:
                raise TypeError(f"flash_attn_with_kvcache: {name} must be {q.dtype} like q, got {t.dtype}")
            if t.device != dev:
                raise ValueError(f"flash_attn_with_kvcache: {name} must be on {dev}")
            if t.dim() != 4 or t.shape[0] != b or t.shape[2:] != (hk, d):
                raise ValueError(f"flash_attn_with_kvcache: {name} must be (B={b}, S_new, H_k={hk}, D={d}), got "
                                 f"{tuple(t.shape)}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"flash_attn_with_kvcache: k and v must have one S_new, got {k.shape[1]}, {v.shape[1]}")
        s_new = k.shape[1]
        if s_new and k_cache.numel() and k_cache.data_ptr() == v_cache.data_ptr() and \
                k_cache.stride() == v_cache.stride():
            raise ValueError("flash_attn_with_kvcache: k_cache and v_cache are one tensor (the same memory, laid out "
                             "alike): the new values would overwrite the new keys, and attention would read values "
                             "as keys; append into separate caches (or separate views of a packed KV cache, "
                             "kv[:, :, 0] and kv[:, :, 1])")
    end = seqlens + s_new if seqlens is not None else None

    def overflow():
        i = int(torch.argmax(end))
        return (f"flash_attn_with_kvcache: cache overflow: sequence {i} would hold {int(end[i])} rows "
                f"(cache_seqlens {int(seqlens[i])} + {s_new} new) but the cache holds {capacity}")
    if end is not None and b:
        _fault(end > capacity, bad, overflow)
    if block_table is not None and b:
        # every page a sequence reads or writes must exist (entries past its end may be anything)
        used = (end if end is not None else torch.full((b,), capacity, device=dev, dtype=torch.int32))
        # (B,); a pool of 0-row pages uses none here: the op's rule names it (an empty pool)
        n_used = (used.long() + rows_per - 1) // max(rows_per, 1)
        live = torch.arange(block_table.shape[1], device=dev)[None, :] < n_used[:, None]
        _fault((live & ((block_table < 0) | (block_table >= n_rows))).any(1), bad,
               lambda: f"flash_attn_with_kvcache: block_table holds a page outside [0, {n_rows}) among the pages "
                       "the sequences use")
        if bad is not None:
            block_table = block_table.clamp(0, n_rows - 1)

    # ---- rotary
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("flash_attn_with_kvcache: pass rotary_cos and rotary_sin together")
    local = window_size_pair(window_size, "flash_attn_with_kvcache") != (-1, -1)
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, Tensor):
                raise not_a_tensor(name, t, "flash_attn_with_kvcache")
        if rotary_cos.dim() != 2 or rotary_cos.shape != rotary_sin.shape:
            raise ValueError(f"flash_attn_with_kvcache: rotary_cos / rotary_sin must be (seqlen_ro, rotary_dim / 2), "
                             f"got {tuple(rotary_cos.shape)}, {tuple(rotary_sin.shape)}")
        if not (rotary_cos.is_floating_point() and rotary_sin.is_floating_point()):
            raise TypeError("flash_attn_with_kvcache: rotary_cos / rotary_sin must be floating point")
        if rotary_cos.device != dev or rotary_sin.device != dev:
            raise ValueError(f"flash_attn_with_kvcache: rotary_cos / rotary_sin must be on {dev}")
        rd = 2 * rotary_cos.shape[1]
        if rd == 0 or rd > d:
            raise ValueError(f"flash_attn_with_kvcache: rotary_dim = 2 * cos.shape[1] = {rd} must be in [2, D={d}]")
        base = seqlens if seqlens is not None else torch.zeros((b,), dtype=torch.int32, device=dev)
        base = base.long()[:, None]  # (B, 1)
        q_pos = base + torch.arange(sq, device=dev)[None, :] if (causal or local) else base.expand(b, sq)
        need = [q_pos]
        if s_new:
            k_pos = base + torch.arange(s_new, device=dev)[None, :]
            need.append(k_pos)
        n_ro = rotary_cos.shape[0]
        top = [t.amax(1) for t in need if t.shape[1]]  # each (B,)
        if b and top:
            _fault(torch.stack(top).amax(0) >= n_ro, bad,
                   lambda: f"flash_attn_with_kvcache: rotary position past seqlen_ro = {n_ro}")
        if bad is not None:
            q_pos = q_pos.clamp(max=n_ro - 1)
            if s_new:
                k_pos = k_pos.clamp(max=n_ro - 1)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        if s_new:
            k = apply_rotary(k, rotary_cos, rotary_sin, k_pos, rotary_interleaved)

    # ---- side tensors
    acc = acc_dtype(q.dtype)
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and not isinstance(t, Tensor):
            raise not_a_tensor(name, t, "flash_attn_with_kvcache")
    if alibi_slopes is not None:
        if alibi_slopes.dtype not in (torch.float32, acc):
            raise TypeError(f"flash_attn_with_kvcache: alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if alibi_slopes.shape not in ((h,), (b, h)):
            raise ValueError(f"flash_attn_with_kvcache: alibi_slopes must be (H={h},) or (B, H), got "
                             f"{tuple(alibi_slopes.shape)}")
        alibi_slopes = alibi_slopes.to(device=dev, dtype=acc)
    if sinks is not None:
        if not sinks.is_floating_point() or sinks.shape != (h,):
            raise ValueError(f"flash_attn_with_kvcache: sinks must be a float (H={h},) tensor")
        sinks = sinks.to(device=dev, dtype=acc)
    wl, wr = window_size_pair(window_size, "flash_attn_with_kvcache")
    if causal:
        wr = 0
    if softcap < 0:
        raise ValueError("flash_attn_with_kvcache: softcap must be >= 0")
    # (a head dim of 0 is the op's to refuse, by its rule, below)
    scale = (d ** -0.5 if d else 1.0) if softmax_scale is None else float(softmax_scale)

    if bad is not None and end is not None:
        end = end.clamp(max=capacity)
    # ---- the in-place append: row seqlens[b] + t of sequence b, after every rule of the op
    # (C++) has passed: a call it refuses writes nothing
    if s_new and b:
        check_decode(q, k_cache, v_cache, cache_seqlens=end, block_table=block_table,
                     cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes,
                     sinks=sinks, scale=scale, softcap=float(softcap), window_left=wl, window_right=wr,
                     num_splits=int(num_splits), k_descale=k_descale, v_descale=v_descale)
        with torch.no_grad():
            rows = seqlens.long()[:, None] + torch.arange(s_new, device=dev)[None, :]  # (B, S_new)
            if bad is not None:
                rows = rows.clamp(max=capacity - 1)
            if block_table is not None:
                page = torch.gather(block_table.long(), 1, rows // rows_per)
                slot = rows % rows_per
            else:
                seq = cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(b, device=dev)
                page = seq[:, None].expand(b, s_new)
                slot = rows
            if block_table is not None or cache_batch_idx is not None:
                _collisions(page * rows_per + slot, bad, "block_table" if block_table is not None else
                            "cache_batch_idx")
            if quantized:
                if bad is not None:
                    raise ValueError("flash_attn_with_kvcache: appending to an int8 / float8_e4m3fn cache is not "
                                     "supported under CUDA-graph capture")
                if k_descale.dim() == 3 and _overlap(k_descale, v_descale):
                    raise ValueError("flash_attn_with_kvcache: k_descale and v_descale share memory; an append writes "
                                     "fresh per-row scales into both (the keys' would be overwritten by the values'): "
                                     "pass separate tensors (quantize_kv returns one per cache)")
                _check_append_scales(k, k_descale, "k")
                _check_append_scales(v, v_descale, "v")
                k, v = _quantize_append(k, k_descale, page, slot, k_cache.dtype), \
                    _quantize_append(v, v_descale, page, slot, v_cache.dtype)
            if bad is None:
                k_cache[page, slot] = k
                v_cache[page, slot] = v
            else:  # a bad sequence writes back what its clamped rows held
                keep = bad[:, None, None, None]
                k_cache[page, slot] = torch.where(keep, k_cache[page, slot], k)
                v_cache[page, slot] = torch.where(keep, v_cache[page, slot], v)

    out, lse = decode_fwd(q, k_cache, v_cache, cache_seqlens=end, block_table=block_table,
                          cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, alibi_slopes=alibi_slopes,
                          sinks=sinks, scale=scale, softcap=float(softcap), window_left=wl, window_right=wr,
                          num_splits=int(num_splits), k_descale=k_descale, v_descale=v_descale)
    if bad is not None:
        out = out.masked_fill(bad[:, None, None, None], float("nan"))
        lse = lse.masked_fill(bad[:, None, None], float("nan"))
    return (out, lse) if return_softmax_lse else out
