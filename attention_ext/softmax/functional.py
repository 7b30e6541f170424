"""Tier 2 of the softmax family: the functional API. Turns the caller's conventions (layouts,
masks, causal, seeds) into the op's options, then calls the fused op.

- attention():          every option of the fused kernel, (B, H, S, D) or (B, S, H, D)
- attention_varlen():   variable-length packs (total, H, D) with cu_seqlens
- attention_weights():  the probabilities of the same options, from the LSE (checked) or computed here

Input rules the op states itself (shapes, dtypes, head dim, GQA, option ranges) are checked by the
op's one C++ check: on a compiled kernel, in its Meta kernel under torch.compile and on meta
tensors, and (ops.check_inputs) before the reference fallback. This layer checks only what the op cannot see: layouts, masks before they
become the op's bias, and the values inside cu_seqlens.
"""
from __future__ import annotations

import functools
import math
import operator
import re
import warnings
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_true, sym_or

from .. import _ext
from .._args import as_int, as_offsets, key_padding_mask_renamed, layout_mismatch, not_a_tensor
from . import ops, reference

__all__ = ["attention", "attention_varlen", "attention_weights"]

_warned_fallback = set()


def _check(cond: bool, msg, exc=ValueError):
    """Raise exc(msg) unless cond; msg may be a callable, so that an f-string message (formatting
    shapes costs microseconds) is only built when the check fails."""
    if not cond:
        raise exc(msg() if callable(msg) else msg)


def _rng_state(seed: Union[int, Tensor, None], generator: Optional[torch.Generator]) -> Tensor:
    """The dropout's (seed, offset) as the op's rng_state: a CPU int64 (2) tensor, as torch's SDPA
    keeps its Philox seed / offset. Without `seed`, both are drawn with torch.randint from
    `generator` (default: torch's global generator, so torch.manual_seed reproduces a call); a
    given seed has offset 0. A tensor, never .item(): torch.compile traces the draw into the
    graph (a fresh mask per step, no graph break) and a seed passed as a value does not
    specialize the graph. The backward reuses the forward's tensor, hence its mask."""
    if seed is None:
        dev = generator.device if generator is not None else torch.device("cpu")
        return torch.randint(0, 2**62, (2,), generator=generator, dtype=torch.int64, device=dev).cpu()
    if isinstance(seed, Tensor):
        _check(seed.numel() == 1 and not seed.is_floating_point() and not seed.is_complex(),
               lambda: f"seed must be an int or a one-element integer tensor, got {seed.dtype} {tuple(seed.shape)}",
               TypeError)
        return torch.cat([seed.reshape(1).to(device="cpu", dtype=torch.int64), torch.zeros(1, dtype=torch.int64)])
    if not torch.compiler.is_compiling():  # traced, no int() or compare: a SymInt seed stays symbolic
        n = as_int(seed)
        _check(n is not None, lambda: f"seed must be an int or a one-element integer tensor, got "
                                      f"{type(seed).__name__} {seed!r}", TypeError)
        _check(-2 ** 63 <= n < 2 ** 63, lambda: f"seed must be in int64's range [-2**63, 2**63), got {n}")
        seed = n
    return torch.tensor([seed, 0], dtype=torch.int64, device="cpu")


def _not_a_pair(arg: str, value, fn: str = "") -> Exception:
    """The error for a window argument that is not a (left, right) pair. A single number is the
    likely slip (a window "of 256 keys"): the message spells out the two pairs it may have meant."""
    p = f"{fn}: " if fn else ""
    if isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.dim() == 0):
        n = int(value)
        return TypeError(f"{p}{arg} must be a (left, right) pair of key counts around the diagonal (-1 = unbounded), "
                         f"got the number {n}: {arg}=({n}, 0) is a causal sliding window (each query sees itself and "
                         f"the {n} keys before it), {arg}=({n}, {n}) sees {n} keys on each side")
    got = tuple(value) if isinstance(value, (list, tuple)) else repr(value)
    return ValueError(f"{p}{arg} must be (left, right), got {got}")


def _window_side(x, what: str) -> int:
    """One side of a window as an int: an integer (a Python, numpy or 0-d integer tensor one) or a
    float with an integral value; anything else (1.5, NaN) is a TypeError naming `what`."""
    try:
        return operator.index(x)
    except TypeError:
        pass
    if isinstance(x, float) and x.is_integer():
        return int(x)
    raise TypeError(f"{what} must be a pair of ints (-1 = unbounded), got {x!r} on one side")


def window_pair(window, causal: bool) -> Tuple[int, int]:
    """A `window=(left, right)` argument as sizes with -1 = unbounded; causal caps the right side
    at 0 (no future keys). The check of that argument for every function taking it (the ops check
    their window_left / window_right again, for direct op calls)."""
    try:
        wl, wr = window
    except (TypeError, ValueError):
        raise _not_a_pair("window", window) from None
    wl, wr = _window_side(wl, "window"), _window_side(wr, "window")
    _check(wl >= -1 and wr >= -1, lambda: f"window sizes must be >= -1 (-1 = unbounded), got ({wl}, {wr})")
    return (wl, 0) if causal else (wl, wr)


def window_size_pair(window_size: Sequence[int], fn: str) -> Tuple[int, int]:
    """A `window_size=(left, right)` argument (flash-attn's spelling: the drop-ins, and
    context parallelism) as ints, each -1 (unbounded) or a key count; `fn` prefixes the error.
    The one check of that argument, as window_pair is of `window`."""
    try:
        wl, wr = window_size
    except (TypeError, ValueError):
        raise _not_a_pair("window_size", window_size, fn) from None
    wl, wr = _window_side(wl, f"{fn}: window_size"), _window_side(wr, f"{fn}: window_size")
    if wl < -1 or wr < -1:
        raise ValueError(f"{fn}: window_size must be >= -1 on both sides (-1 = unbounded), got ({wl}, {wr})")
    return wl, wr


def _default_scale(d: int) -> float:
    return 1.0 / math.sqrt(max(d, 1))  # d = 0 is the op's error to report


def _max_seqlen(x, name: str):
    """max_seqlen_q / max_seqlen_k as an int >= 0 (a Python, numpy or 0-d tensor integer, or a
    float with an integral value); anything else is an error naming `name`. Traced values
    (torch.compile) pass as they are."""
    if torch.compiler.is_compiling():
        return x
    n = as_int(x)
    if n is None and isinstance(x, float) and x.is_integer():
        n = int(x)
    _check(n is not None, lambda: f"{name} must be an int (the longest sequence's length), got "
                                  f"{type(x).__name__} {x!r}", TypeError)
    _check(n >= 0, lambda: f"{name} must be >= 0 (the longest sequence's length), got {n}")
    return n


def _lengths(t: Tensor, device) -> Tensor:
    """seqlens_k as the op reads it (int32, contiguous, on `device`) from any integer dtype. A
    float, complex or bool tensor is passed on unconverted, for the op's dtype rule to name: a
    conversion would read 3.5 keys as 3 (and True as 1) without a word."""
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        return t
    return t.to(device=device, dtype=torch.int32).contiguous()


def _logits(t: Tensor, acc: torch.dtype, device=None) -> Tensor:
    """alibi_slopes / sinks in the op's float side dtype `acc` (from any float dtype; moved to
    `device` when given). Another kind (bool, integer, complex) is passed on unconverted, for the
    op's dtype rule to name: a conversion would read a bool sink as the logit 1.0."""
    if not t.is_floating_point():
        return t
    if device is not None:
        return t.to(device=device, dtype=acc).contiguous()
    return t if t.dtype == acc else t.to(acc)


def _broadcasts(got, want) -> bool:
    """Whether a mask dim of size `got` broadcasts to `want` (it is 1 or `want`). Symbolic sizes
    (torch.compile, torch.export) are compared without a guard the trace cannot take: a
    data-dependent size (an export's unbacked batch) that the trace cannot decide becomes a
    runtime assert, and only a size known not to fit fails here."""
    if type(got) is int and type(want) is int:
        return got == 1 or got == want
    ok = sym_or(got == want, got == 1)
    if not guard_or_true(ok):
        return False
    torch._check(ok, lambda: f"attn_mask dim of size {got} does not broadcast to {want}")
    return True


def _as_bias(attn_mask: Optional[Tensor], key_mask: Optional[Tensor], b: int, h: int, sq: int, sk: int,
             device, acc: torch.dtype) -> Optional[Tensor]:
    """Combine a bool/float mask and a (B, Sk) key mask (True = a real key) into the op's 4-D
    bias (bool True = attend, or additive in `acc`, the op's float side dtype), broadcast dims
    kept at size 1."""
    bias = None
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise not_a_tensor("attn_mask", attn_mask)
        _check(attn_mask.device == device, lambda: f"attn_mask must be on {device}, got {attn_mask.device}")
        _check(attn_mask.dim() <= 4, lambda: f"attn_mask must have at most 4 dims, got shape {tuple(attn_mask.shape)}")
        m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
        for got, want in zip(m.shape, (b, h, sq, sk)):
            _check(_broadcasts(got, want),
                   lambda: f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                           f"(B, H, Sq, Sk) = {(b, h, sq, sk)}")
        if m.dtype == torch.bool:
            bias = m
        else:
            _check(m.is_floating_point(), lambda: f"attn_mask must be bool or floating point, got {m.dtype}", TypeError)
            bias = m.to(acc)
    if key_mask is not None:
        if not isinstance(key_mask, Tensor):
            raise not_a_tensor("key_mask", key_mask)
        _check(key_mask.dim() == 2 and tuple(key_mask.shape) == (b, sk),
               lambda: f"key_mask must be (B, Sk) = {(b, sk)} (True = a real key), got {tuple(key_mask.shape)}")
        _check(key_mask.dtype == torch.bool,
               lambda: f"key_mask must be bool (True = a real key), got {key_mask.dtype}", TypeError)
        kpm = key_mask.view(b, 1, 1, sk)
        if bias is None:
            bias = kpm
        elif bias.dtype == torch.bool:
            bias = bias & kpm
        else:
            bias = bias.masked_fill(~kpm, float("-inf"))
    return bias


def _merge_block_layout(bias: Optional[Tensor], lay: Tensor, bs: int, sq: int, sk: int) -> Tensor:
    """A block layout (H or 1, ceil(Sq / bs), ceil(Sk / bs)) as an element mask merged into the
    op's bias: the reference's form of block-sparse attention (the kernels walk the layout)."""
    m = lay.repeat_interleave(bs, 1).repeat_interleave(bs, 2)[:, :sq, :sk].unsqueeze(0)
    return m if bias is None else (bias & m if bias.dtype == torch.bool else bias.masked_fill(~m, float("-inf")))


def _block_size(block_size) -> int:
    """block_size of a block layout: an integer (numpy's and 0-d tensors too; a float is refused,
    not truncated)."""
    n = as_int(block_size)
    _check(n is not None, lambda: f"block_size must be an int (the layout's block edge in tokens), got {block_size!r}",
           TypeError)
    return n


def _quantized(q: Tensor, k: Tensor, v: Tensor, opts: dict, qk_quant: str) -> Tuple[Tensor, Tensor]:
    """The forward with a quantized Q.K^T (softmax_fwd_quant) on (B, H, S, D) views: the compiled
    kernel of q's device (int8: CPU, and CUDA fp16 / bf16 with a head dim a multiple of 16 up to
    128, dense, sm_80+; fp8: the same on sm_90 only), else reference.attention_qk_quant under the
    op's input rules, with a warning."""
    _check(isinstance(qk_quant, str), lambda: f"qk_quant must be None, 'int8' or 'fp8', got {qk_quant!r}",
           TypeError)
    grads = [n for n, t in (("q", q), ("k", k), ("v", v), ("attn_mask", opts["bias"]), ("sinks", opts["sinks"]))
             if isinstance(t, Tensor) and t.requires_grad]
    _check(not (torch.is_grad_enabled() and grads),
           lambda: f"qk_quant={qk_quant!r} is forward-only (inference), but {', '.join(grads)} require grad: run it "
                   "under torch.no_grad() / torch.inference_mode(), or leave qk_quant=None to train")
    why = f"no compiled {qk_quant} Q.K^T kernel on {q.device}"
    if ops.has_quant_kernel(q.device):
        try:
            return ops.fwd_quant(q, k, v, qk_quant=qk_quant, **opts)
        except NotImplementedError as e:  # a config the device's kernel does not take (the op's message)
            if f"qk_quant='{qk_quant}' on CUDA runs on" not in str(e) and "qk_quant='fp8' runs on" not in str(e):
                raise
            why = str(e).split("\n")[0].removeprefix("attention_ext: ")
    ops.check_quant_inputs(q, k, v, qk_quant=qk_quant, **opts)
    key = (q.device.type, qk_quant, q.dtype, q.shape[-1])
    if key not in _warned_fallback:
        _warned_fallback.add(key)
        warnings.warn(f"attention_ext: {why}; running the PyTorch reference of the method "
                      "(reference.attention_qk_quant)", RuntimeWarning)
    return _reference(q, k, v, opts, quantized=qk_quant)


def _fused(q: Tensor, k: Tensor, v: Tensor, opts: dict, num_splits: int, deterministic: bool,
           topk: int = 0, qk_quant: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """The fused op on (B, H, S, D) views where a compiled kernel serves q's device and dtype
    (the routed op: the decode kernel for few-row CPU calls, ops.fwd_route); else reference.py under the
    op's own input rules (ops.check_inputs), with a warning. topk > 0: top-k attention, the
    threshold pass first (its rows join the options). qk_quant: _quantized."""
    if qk_quant is not None:
        if topk > 0:  # the op's rule refuses top-k rows: stated in C++, reached with placeholders
            rows = torch.empty(q.shape[:3], device="meta")
            opts = dict(opts, topk_thr=rows, topk_jcut=rows.int())
        return _quantized(q, k, v, opts, qk_quant)
    if ops.has_kernel(q.device, q.dtype):
        if topk > 0:
            # the selection: the scores before dropout (the fused op drops from the kept keys), and
            # no autograd (piecewise constant: a bias / ALiBi / sinks that requires grad is detached)
            sel = {n: t.detach() if isinstance(t, Tensor) else t for n, t in opts.items()}
            thr, jcut = ops.topk_threshold(q.detach(), k.detach(), topk, **dict(sel, dropout_p=0.0))
            opts = dict(opts, topk_thr=thr, topk_jcut=jcut)
        return ops.fwd(q, k, v, num_splits=num_splits, deterministic=deterministic, routed=True, **opts)
    ops.check_inputs(q, k, v, **opts)
    _check(topk == 0, "top-k attention needs a compiled kernel (no reference fallback runs it)", NotImplementedError)
    key = (q.device.type, q.dtype)
    if key not in _warned_fallback:
        _warned_fallback.add(key)
        warnings.warn(f"attention_ext: no compiled kernel for {q.dtype} on {q.device}; running the PyTorch reference",
                      RuntimeWarning)
    return _reference(q, k, v, opts)


def _reference(q: Tensor, k: Tensor, v: Tensor, opts: dict, quantized: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """reference.attention (quantized "int8" / "fp8": attention_qk_quant) of the fused op's call:
    (out, lse) in q's dtype and the acc dtype."""
    acc = ops.acc_dtype(q.dtype)
    o = opts
    cu_q, cu_k = o["cu_seqlens_q"], o["cu_seqlens_k"]
    nb = q.shape[0] if cu_q is None else cu_q.numel() - 1
    sq, sk = (q.shape[2], k.shape[2]) if cu_q is None else (o["max_seqlen_q"], o["max_seqlen_k"])
    dmask = None
    if o["dropout_p"] > 0:  # the kernels' Philox mask, bit for bit
        rng = o["rng_state"] if o.get("rng_state") is not None else torch.tensor([o["seed"], o["offset"]])
        dmask = reference.dropout_mask(nb, q.shape[1], sq, sk, o["dropout_p"], rng, device=q.device,
                                       coords=o.get("dropout_coords"))
    bias = o["bias"]
    if o.get("block_layout") is not None:
        bias = _merge_block_layout(bias, o["block_layout"], o["block_size"], sq, sk)
    kw = dict(scale=o["scale"], softcap=o["softcap"], window=(o["window_left"], o["window_right"]),
              bottom_right=o["bottom_right"], bias=bias, alibi_slopes=o["alibi_slopes"], sinks=o["sinks"],
              dropout_p=o["dropout_p"], dropout_mask=dmask)
    if quantized and o.get("block_layout") is not None:  # the layout's hidden keys, as the kernels see them
        kw["visible"] = _merge_block_layout(None, o["block_layout"], o["block_size"], sq, sk)
    fn = functools.partial(reference.attention_qk_quant, qk_quant=quantized) if quantized else reference.attention
    if cu_q is None:
        out, lse = fn(q.to(acc), k.to(acc), v.to(acc), seqlens_k=o["seqlens_k"], **kw)
    else:  # (1, H, total, D) packs -> (total, H, D) and back
        unpack = lambda t: t[0].transpose(0, 1).to(acc)  # noqa: E731
        out, lse = reference.attention_varlen(unpack(q), unpack(k), unpack(v), cu_q, cu_k, attend=fn, **kw)
        out, lse = out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)
    return out.to(q.dtype), lse.to(acc)


# The dtypes with a fused kernel on the CPU / on CUDA
_PLAIN_DTYPES = {dev: frozenset(t for t in ops.DTYPES if ops.has_kernel(torch.device(dev), t)) for dev in ("cpu", "cuda")}


def _plain_call(q, k, v, layout, scale, causal, bottom_right, window, num_splits, deterministic, attn_mask=None,
                key_mask=None):
    """attention() without tensor options but a mask, its arguments checked by the op alone
    (ops.fwd_plain):
    (out, lse), or None where the general path must run (subclassed or non-4-D tensors, a device
    or dtype without a kernel, an unusual window, a mask that is not one 4-D tensor or one (B, Sk)
    key mask, functorch transforms, or any error: the general path then raises it in attention()'s
    words). A 4-D attn_mask goes to the op as it is (_as_bias's rule: bool, or additive in the
    op's float dtype, which the op checks); a key mask as its (B, 1, 1, Sk) view. Small calls are
    where the Python in front of the op shows (it took as long as the kernel): each tensor
    attribute read here counts (benchmarks/results/2026-11-29-figures-from-comments.md)."""
    if not (type(q) is Tensor and type(k) is Tensor and type(v) is Tensor and q.dim() == 4 and k.dim() == 4
            and v.dim() == 4):
        return None
    if type(window) is tuple and window == (-1, -1):
        wl = wr = -1
    else:
        if type(window) is not tuple or len(window) != 2:
            return None
        wl, wr = window
        if type(wl) is not int or type(wr) is not int or wl < -1 or wr < -1:
            return None
    if causal:  # window_pair's rule
        wr = 0
    if q.is_cpu:
        if q.dtype not in _PLAIN_DTYPES["cpu"]:
            return None
    elif not q.is_cuda or q.dtype not in _PLAIN_DTYPES["cuda"]:
        return None
    if torch._C._are_functorch_transforms_active():  # the general path: the transforms see fwd
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (type(attn_mask) is Tensor and attn_mask.requires_grad)):
        return None  # the general path: its eager autograd (ops._EagerFwd) costs less than the op's layer
    bias = None
    if attn_mask is not None:
        if key_mask is not None or type(attn_mask) is not Tensor or attn_mask.dim() != 4:
            return None
        bias = attn_mask
    elif key_mask is not None:
        if (type(key_mask) is not Tensor or key_mask.dtype != torch.bool
                or key_mask.shape != (q.shape[0], k.shape[2 if layout == "bhsd" else 1])):
            return None
        bias = key_mask[:, None, None, :]
    try:
        return ops.fwd_plain(q, k, v, scale, wl, wr, bool(bottom_right), layout, num_splits, deterministic, bias)
    except (ValueError, TypeError, RuntimeError, OverflowError):  # OverflowError: an int past int64
        return None


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
    key_mask: Optional[Tensor] = None,
    seqlens_k: Optional[Tensor] = None,
    alibi_slopes: Optional[Tensor] = None,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    seed: Union[int, Tensor, None] = None,
    dropout_coords: Optional[Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    num_splits: int = 0,
    block_layout: Optional[Tensor] = None,
    block_size: int = 64,
    topk: int = 0,
    qk_quant: Optional[str] = None,
    key_padding_mask: None = None,
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
        key_mask: (B, Sk) bool, True = a real key (flash-attn's and Hugging Face's sense). torch's
            key_padding_mask means the opposite (True = padding): pass key_mask=~key_padding_mask.
        seqlens_k: (B,) int: keys >= seqlens_k[b] are padding. With bottom_right=True the
            diagonal follows each sequence's length (diag = seqlens_k[b] - Sq: the last query
            sees the last real key, as a decode step over a padded cache needs); a padded batch
            of whole sequences (query i is key i) wants bottom_right=False.
        alibi_slopes: (H,) or (B, H): adds -slope * |i + diag - j|.
        softcap: > 0 squashes the scaled scores: softcap * tanh(s / softcap).
        sinks: (H,) learnable logits that join each softmax denominator (attention sinks).
        dropout_p: dropout on the probabilities, drawn in-kernel (Philox) from (seed, offset):
            `seed` (an int, or a one-element int tensor) with offset 0, else both drawn from
            `generator` (default: torch's, so torch.manual_seed reproduces it). Compiles with
            torch.compile(fullgraph=True) with a fresh mask per call and no recompile.
        dropout_coords: for a call that computes one piece of a larger attention (context
            parallelism: attention_ext.distributed): an int (B * H + Sq + Sk) tensor giving the
            larger problem's b * H_global + h of each local (b, h), then the global index of each
            query row, then of each key. The dropout mask is drawn at those coordinates, so the
            pieces drop exactly what one call on the whole problem drops.
        return_lse: also return the (B, H, Sq) log-sum-exp (float32; float64 for float64
            inputs).
        deterministic: the backward uses no atomics (CUDA).
        num_splits: split-KV forward on CUDA (flash-decoding), flash-attn's convention: N splits
            of the keys (at most 128), 1 = never split, 0 (the default) = a heuristic picks: it
            splits only grids too small to fill the GPU (few queries over many keys), which ran
            faster than unsplit (benchmarks/results/2026-11-24-h100.md).
            The CPU ignores it.
        block_layout: block-sparse attention (attention_ext.block_sparse_attention): a bool
            (H or 1, ceil(Sq / block_size), ceil(Sk / block_size)) grid; only the on blocks
            are computed, every other rule applies inside them element-wise.
        block_size: the layout's block, a multiple of 16.
        topk: > 0 keeps, per query, only the topk highest logits among the keys the other
            rules allow (ties to the lower key; attention_ext.topk_attention).
        qk_quant: "int8" runs Q.K^T in int8 (SageAttention's method, for inference): K is
            smoothed by its mean over the sequence (q.mean is added back exactly), Q and K are
            rounded to int8 with one scale per block (48 query rows, 128 keys on the CPU) and
            their products summed in int32; P.V stays in q's dtype. Every mask and score
            option composes with it except topk (the K mean and block scales leave out the
            keys no query row of a kv group may attend, so NaN there reaches nothing); a call
            that needs gradients raises. The CPU kernel uses AVX512-VNNI at the avx512bf16
            level; CUDA runs an mma.sync int8 kernel (fp16 / bf16, head dims multiples of 16
            up to 128, dense), other CUDA calls reference.attention_qk_quant with a warning.
            "fp8" rounds to fp8 e4m3 instead (amax to 448) and sums in float32 on Hopper's
            wgmma (sm_90, the same configs; 16 query rows, 128 keys per scale): no faster
            than int8 there and about 3x its error; elsewhere it runs the reference, with a
            warning.
        key_padding_mask: not read: a TypeError says to pass key_mask=~key_padding_mask (the
            name is torch's, with the opposite polarity).

    Returns out with q's layout (and the LSE). Rows with nothing to attend give 0 (lse -inf).
    """
    if (seqlens_k is None and alibi_slopes is None and sinks is None and not dropout_p and block_layout is None
            and not topk and not softcap and key_padding_mask is None and qk_quant is None):
        fast = _plain_call(q, k, v, layout, scale, causal, bottom_right, window, num_splits, deterministic, attn_mask,
                           key_mask)
        if fast is not None:
            return fast if return_lse else fast[0]
    return _attention(q, k, v, layout, scale, causal, bottom_right, window, attn_mask, key_mask, seqlens_k,
                      alibi_slopes, softcap, sinks, dropout_p, generator, seed, dropout_coords, return_lse,
                      deterministic, num_splits, block_layout, block_size, topk, key_padding_mask, qk_quant)


def _attention(q, k, v, layout, scale, causal, bottom_right, window, attn_mask, key_mask, seqlens_k, alibi_slopes,
               softcap, sinks, dropout_p, generator, seed, dropout_coords, return_lse, deterministic, num_splits,
               block_layout, block_size, topk, key_padding_mask, qk_quant=None):
    """attention() past its plain call (the lambdas of its messages make cells of these
    names, which a Python function builds on every call: kept out of attention()'s own frame)."""
    if key_padding_mask is not None:
        raise key_padding_mask_renamed("attention()")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t)
        _check(t.dim() == 4, lambda: f"{name} must be 4-D ({'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'}), "
               f"got shape {tuple(t.shape)}")
    _check(layout in ("bhsd", "bshd"), lambda: f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copy
    _check(q.device == k.device == v.device,
           lambda: f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, h, sq, d = q.shape
    sk = k.shape[2]
    wl, wr = window_pair(window, causal)
    if scale is None:
        scale = _default_scale(d)
    acc = ops.acc_dtype(q.dtype)
    bias = _as_bias(attn_mask, key_mask, b, h, sq, sk, q.device, acc)
    if seqlens_k is not None:
        if not isinstance(seqlens_k, Tensor):
            raise not_a_tensor("seqlens_k", seqlens_k)
        _check(tuple(seqlens_k.shape) == (b,), lambda: f"seqlens_k must be (B,) = ({b},), got {tuple(seqlens_k.shape)}")
        seqlens_k = _lengths(seqlens_k, q.device)
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor):
            raise not_a_tensor("alibi_slopes", alibi_slopes)
        # a meta tensor has no data to move: name it here, not in a failed copy
        _check(not alibi_slopes.is_meta or q.is_meta, lambda: f"alibi_slopes must be on {q.device}, got meta")
        alibi_slopes = _logits(alibi_slopes, acc, q.device)
    if sinks is not None:
        if not isinstance(sinks, Tensor):
            raise not_a_tensor("sinks", sinks)
        _check(sinks.device == q.device, lambda: f"sinks must be on {q.device}, got {sinks.device}")
        sinks = _logits(sinks, acc)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    rng_state = _rng_state(seed, generator) if dropout_p > 0.0 else None
    if dropout_coords is not None:
        _check(isinstance(dropout_coords, Tensor) and tuple(dropout_coords.shape) == (b * h + sq + sk,),
               lambda: f"dropout_coords must be a (B * H + Sq + Sk,) = ({b * h + sq + sk},) int tensor, got "
                       f"{tuple(dropout_coords.shape) if isinstance(dropout_coords, Tensor) else type(dropout_coords)}")
        dropout_coords = dropout_coords.to(device=q.device, dtype=torch.int32).contiguous() if dropout_p > 0.0 else None
    if block_layout is not None:
        _check(isinstance(block_layout, Tensor) and block_layout.dtype == torch.bool,
               lambda: f"block_layout must be a bool tensor, got {getattr(block_layout, 'dtype', type(block_layout))}",
               TypeError)
        if block_layout.dim() == 2:
            block_layout = block_layout.unsqueeze(0)
        block_layout = block_layout.to(q.device).contiguous()
    _check(isinstance(topk, int) and topk >= 0, lambda: f"topk must be an int >= 0, got {topk!r}")
    _check(topk == 0 or block_layout is None, "topk and block_layout do not combine")

    opts = dict(bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, seqlens_k=seqlens_k, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=sq, max_seqlen_k=sk, scale=float(scale), softcap=float(softcap),
                window_left=wl, window_right=wr, bottom_right=bool(bottom_right), dropout_p=float(dropout_p),
                seed=0, offset=0, rng_state=rng_state, dropout_coords=dropout_coords, block_layout=block_layout,
                block_size=_block_size(block_size) if block_layout is not None else 0)
    try:
        out, lse = _fused(q, k, v, opts, num_splits, deterministic, topk, qk_quant)
    except ValueError as e:  # the op's shape errors: name `layout` where the shapes prove a mix-up
        given = (q, k, v) if layout == "bhsd" else tuple(t.transpose(1, 2) for t in (q, k, v))
        mix = layout_mismatch(*given, layout, e)
        if mix is not None:
            raise mix from e
        if layout == "bshd" and re.search(r"\[\d+(, \d+)*\]", str(e)):
            # a shape error prints the op's (B, H, S, D) views ([2, 4, 16, 32]): add the shapes as passed
            raise ValueError(f"{e.args[0] if e.args else e} (shapes in the op's (B, H, S, D) order; as passed, "
                             f"(B, S, H, D): " + ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip("qkv", given))
                             + ")") from e
        raise
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    bottom_right: bool = False,
    window: Tuple[int, int] = (-1, -1),
    alibi_slopes: Optional[Tensor] = None,
    softcap: float = 0.0,
    sinks: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    seed: Union[int, Tensor, None] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    num_splits: int = 0,
    qk_quant: Optional[str] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """attention() over variable-length packs: q (total_q, H, D), k / v (total_k, H_k, D);
    sequence b holds rows [cu_seqlens[b], cu_seqlens[b+1]) and is at most max_seqlen_q /
    max_seqlen_k long. The options are attention()'s. Returns out (total_q, H, D) (and the LSE,
    (H, total_q))."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t)
        _check(t.dim() == 3, lambda: f"{name} must be (total, H, D), got {tuple(t.shape)}")
    _check(q.device == k.device == v.device,
           lambda: f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t)
        _check(t.dim() == 1 and t.numel() >= 2, lambda: f"{name} must be (B + 1,), got {tuple(t.shape)}")
    _check(cu_seqlens_q.numel() == cu_seqlens_k.numel(), "cu_seqlens_q and cu_seqlens_k must have the same length")
    max_seqlen_q, max_seqlen_k = _max_seqlen(max_seqlen_q, "max_seqlen_q"), _max_seqlen(max_seqlen_k, "max_seqlen_k")
    cq = as_offsets(cu_seqlens_q, "cu_seqlens_q", q.device)
    ck = as_offsets(cu_seqlens_k, "cu_seqlens_k", q.device)
    lens_q, lens_k = (cq[1:] - cq[:-1]), (ck[1:] - ck[:-1])
    # the op checks these on the CPU only: on a GPU, reading them would synchronize; a graph
    # (torch.compile) cannot read them, and leaves them to the op
    if not torch.compiler.is_compiling():
        _check(int(cq[0]) == 0 and int(ck[0]) == 0, "cu_seqlens must start at 0")
        _check(bool((lens_q >= 0).all()) and bool((lens_k >= 0).all()), "cu_seqlens must be non-decreasing")
        _check(int(cq[-1]) <= q.shape[0] and int(ck[-1]) <= k.shape[0], "cu_seqlens end past the packed tensors")
        _check(int(lens_q.max()) <= max_seqlen_q and int(lens_k.max()) <= max_seqlen_k,
               "a sequence is longer than max_seqlen_q / max_seqlen_k")
    if scale is None:
        scale = _default_scale(q.shape[2])
    wl, wr = window_pair(window, causal)
    acc = ops.acc_dtype(q.dtype)
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and not isinstance(t, Tensor):
            raise not_a_tensor(name, t)
    if alibi_slopes is not None:
        # a meta tensor has no data to move: name it here, not in a failed copy
        _check(not alibi_slopes.is_meta or q.is_meta, lambda: f"alibi_slopes must be on {q.device}, got meta")
        alibi_slopes = _logits(alibi_slopes, acc, q.device)
    if sinks is not None:
        sinks = _logits(sinks, acc)
    rng_state = _rng_state(seed, generator) if dropout_p > 0.0 else None
    # (total, H, D) -> (1, H, total, D) views
    q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
    opts = dict(bias=None, alibi_slopes=alibi_slopes, sinks=sinks, seqlens_k=None, cu_seqlens_q=cq, cu_seqlens_k=ck,
                max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k), scale=float(scale),
                softcap=float(softcap), window_left=wl, window_right=wr, bottom_right=bool(bottom_right),
                dropout_p=float(dropout_p), seed=0, offset=0, rng_state=rng_state)
    out4, lse = _fused(q4, k4, v4, opts, num_splits, deterministic, qk_quant=qk_quant)
    out = out4.transpose(1, 2).squeeze(0)
    return (out, lse.squeeze(0)) if return_lse else out


def attention_weights(q: Tensor, k: Tensor, lse: Optional[Tensor] = None, *, layout: str = "bhsd",
                      scale: Optional[float] = None, causal: bool = False, bottom_right: bool = False,
                      window: Tuple[int, int] = (-1, -1), attn_mask: Optional[Tensor] = None,
                      key_mask: Optional[Tensor] = None, seqlens_k: Optional[Tensor] = None,
                      alibi_slopes: Optional[Tensor] = None, softcap: float = 0.0, sinks: Optional[Tensor] = None,
                      block_layout: Optional[Tensor] = None, block_size: int = 64, topk: int = 0,
                      key_padding_mask: None = None) -> Tensor:
    """The attention probabilities (B, H, Sq, Sk) of attention(q, k, v, **options) for the same
    score options (every option of attention() that decides the probabilities: layout, scale,
    causal, bottom_right, window, attn_mask, key_mask, seqlens_k, alibi_slopes, softcap, sinks,
    block_layout, block_size, topk). One Q K^T and an exp, no second softmax pass; dropout is not
    applied. Returns float32 (float64 for float64 inputs); a row with no key to attend is 0.

    lse: the (B, H, Sq) LSE of that attention() call (return_lse=True), which saves the
    logsumexp here; None computes it from the scores. A given lse must belong to the options:
    each row's probabilities plus the sinks' share must sum to 1 within float32's rounding (1e-3;
    1e-6 for float64), else a ValueError names lse (an LSE of other options would give rows that
    do not sum to 1). With sinks the returned rows sum to 1 minus the sink's share.
    """
    if key_padding_mask is not None:
        raise key_padding_mask_renamed("attention_weights()")
    for name, t in (("q", q), ("k", k), ("lse", lse)):
        if not isinstance(t, Tensor) and (t is not None or name != "lse"):
            raise not_a_tensor(name, t)
    for name, t in (("q", q), ("k", k)):
        _check(t.dim() == 4, lambda: f"{name} must be 4-D ({'B, H, S, D' if layout == 'bhsd' else 'B, S, H, D'}), "
               f"got shape {tuple(t.shape)}")
    _check(layout in ("bhsd", "bshd"), lambda: f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    q0, k0 = q, k
    if layout == "bshd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    b, h, sq, d = q.shape
    sk = k.shape[2]
    try:
        if lse is not None:
            _check(tuple(lse.shape) == (b, h, sq),
                   lambda: f"lse must be (B, H, Sq) = {(b, h, sq)} (attention()'s return_lse), got {tuple(lse.shape)}")
            _check(lse.device == q.device, lambda: f"lse must be on {q.device}, got {lse.device}")
        wl, wr = window_pair(window, causal)
        scale = scale if scale is not None else _default_scale(d)
        acc = ops.acc_dtype(q.dtype)
        bias = _as_bias(attn_mask, key_mask, b, h, sq, sk, q.device, acc)
        if seqlens_k is not None:
            seqlens_k = _lengths(seqlens_k, q.device)
        if alibi_slopes is not None:
            # a meta tensor has no data to move: name it here, not in a failed copy
            _check(not alibi_slopes.is_meta or q.is_meta, lambda: f"alibi_slopes must be on {q.device}, got meta")
            alibi_slopes = _logits(alibi_slopes, acc, q.device)
        if sinks is not None:
            _check(sinks.device == q.device, lambda: f"sinks must be on {q.device}, got {sinks.device}")
            sinks = _logits(sinks, acc)
        if block_layout is not None:
            _check(isinstance(block_layout, Tensor) and block_layout.dtype == torch.bool,
                   lambda: f"block_layout must be a bool tensor, got "
                           f"{getattr(block_layout, 'dtype', type(block_layout))}", TypeError)
            block_layout = (block_layout.unsqueeze(0) if block_layout.dim() == 2 else block_layout).to(q.device)
        _check(isinstance(topk, int) and topk >= 0, lambda: f"topk must be an int >= 0, got {topk!r}")
        _check(topk == 0 or block_layout is None, "topk and block_layout do not combine")
        ops.check_inputs(q, k, k, bias=bias, alibi_slopes=alibi_slopes, sinks=sinks, seqlens_k=seqlens_k,
                         max_seqlen_q=sq, max_seqlen_k=sk, scale=float(scale), softcap=float(softcap), window_left=wl,
                         window_right=wr, bottom_right=bool(bottom_right), block_layout=block_layout,
                         block_size=_block_size(block_size) if block_layout is not None else 0)
    except ValueError as e:  # name `layout` where the shapes prove a mix-up
        mix = layout_mismatch(q0, k0, None, layout, e)
        if mix is not None:
            raise mix from e
        raise
    if block_layout is not None:
        bias = _merge_block_layout(bias, block_layout, int(block_size), sq, sk)
    # in the acc dtype whatever autocast is on (the kernel's LSE is float32; a bf16 recompute of
    # the scores under autocast would not sum to it)
    with torch.autocast(q.device.type, enabled=False):
        s = reference.attention_scores(q.to(acc), k.to(acc), scale=scale, softcap=softcap, window=(wl, wr),
                                       bottom_right=bottom_right, bias=bias, alibi_slopes=alibi_slopes,
                                       seqlens_k=seqlens_k)  # (B, H, Sq, Sk), -inf where hidden
    if topk > 0:
        from ..sparse.reference import topk_select  # deferred: the sparse family imports this module

        s = s.masked_fill(~topk_select(s, s > float("-inf"), topk), float("-inf"))
    own = torch.logsumexp(s, -1)  # (B, H, Sq); -inf for a row with no visible key
    if sinks is not None:
        own = torch.logaddexp(own, sinks.view(1, h, 1))
    if lse is None:
        lse = own
    else:
        lse = lse.to(acc)
        _check_lse(lse, own)
    return reference.probs_from_scores(s, lse)


def _check_lse(lse: Tensor, own: Tensor) -> None:
    """A given LSE against the one of the options (`own`): row i's probabilities sum to
    exp(own_i - lse_i), which must be 1 within the accumulation dtype's rounding. Rows where both
    are -inf (nothing to attend) agree; rows the inputs made NaN are the inputs' to report."""
    atol, rtol = (1e-6, 1e-12) if own.dtype == torch.float64 else (1e-3, 1e-5)
    diff = (lse - own).abs()  # inf where exactly one of them is infinite
    ok = (lse == own) | (diff <= atol + rtol * own.abs().nan_to_num(posinf=0.0)) | torch.isnan(own)
    if torch.compiler.is_compiling():
        torch._assert_async(ok.all(), "attention_weights: lse does not belong to the options (rows do not sum to 1)")
        return
    if bool(ok.all()):
        return
    bad = ~ok
    worst = torch.where(bad, diff.nan_to_num(float("inf")), torch.zeros_like(diff)).flatten().argmax()
    b_, h_, i_ = (int(x) for x in torch.unravel_index(worst, own.shape))
    total = float(torch.exp(own[b_, h_, i_] - lse[b_, h_, i_]))
    raise ValueError(
        f"lse does not belong to these options: {int(bad.sum())} of {own.numel()} rows of probabilities would sum "
        f"to other than 1 (row b={b_}, h={h_}, query {i_} sums to {total:.4g}). Pass attention_weights the options "
        f"of the attention() call that returned lse (causal, bottom_right, window, attn_mask, key_mask, seqlens_k, "
        f"scale, softcap, alibi_slopes, sinks, block_layout, topk), or lse=None to compute it here")
