"""Tier 1 of the softmax family: the registered custom ops torch.ops.attention_ext.{fwd, bwd,
dropout_mask, set_cuda_kernels}, with fake kernels and autograd.

The schemas are defined once, in C++ (csrc/). This module adds what the dispatcher needs from
Python: `register_fake` (shapes for torch.compile and meta tensors, after `check_inputs`) and
`register_autograd` (the backward op), so autograd, torch.compile and opcheck all work. The
option names come from the registered schemas (`OPTION_NAMES`).
"""
from __future__ import annotations

import inspect
import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import sym_or
from torch.types import Device

from .. import _ext
from .._dtypes import DTYPES, acc_dtype, dtype_name, shape_of
from .._ext import HAS_EXT, registered

# device type -> a compiled kernel is registered; read once at import so the lookup stays
# traceable by torch.compile
_KERNELS = {dev: registered("attention_ext::softmax_fwd", key) for dev, key in (("cpu", "CPU"), ("cuda", "CUDA"))}


def has_kernel(device: torch.device, dtype: Optional[torch.dtype] = None) -> bool:
    """True when a compiled kernel serves tensors on `device` (and of `dtype`, when given)."""
    if not _KERNELS.get(device.type, False):
        return False
    return dtype is None or (dtype in DTYPES and (dtype != torch.float64 or device.type == "cpu"))


# ---------------------------------------------------------------------------------- input checks
def _check_index(t: Optional[Tensor], name: str, numel, q: Tensor) -> None:
    if t is None:
        return
    torch._check_type(t.dtype == torch.int32, lambda: f"attention_ext: {name} must be int32, got {dtype_name(t.dtype)}")
    torch._check(t.dim() == 1 and t.numel() == numel,
                 lambda: f"attention_ext: {name} must have shape ({numel}), got {shape_of(t)}")
    torch._check(t.device == q.device, lambda: f"attention_ext: {name} must be on {q.device}, got {t.device}")
    torch._check(t.is_contiguous(), lambda: f"attention_ext: {name} must be contiguous")


def check_inputs(q: Tensor, k: Tensor, v: Tensor, *, bias: Optional[Tensor] = None,
                 alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                 seqlens_k: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                 cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                 scale: float = 1.0, softcap: float = 0.0, window_left: int = -1, window_right: int = -1,
                 bottom_right: bool = False, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                 rng_state: Optional[Tensor] = None, dropout_coords: Optional[Tensor] = None,
                 block_layout: Optional[Tensor] = None, block_size: int = 0,
                 topk_thr: Optional[Tensor] = None, topk_jcut: Optional[Tensor] = None) -> None:
    """The op's input rules, as the C++ check_inputs (csrc/torch/softmax_binding.cpp) states them,
    with the same error types (ValueError, TypeError, RuntimeError) and messages. Run by the fake
    kernels (torch.compile, meta tensors) and before the reference fallback; the compiled kernels
    run the C++ copy. The values inside cu_seqlens are the caller's to check (reading them would
    synchronize a GPU)."""
    torch._check_value(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                       lambda: f"attention_ext: q, k, v must be 4-D (B, H, S, D), got q {shape_of(q)}, k {shape_of(k)}, "
                               f"v {shape_of(v)}")
    torch._check_type(q.dtype == k.dtype == v.dtype,
                      lambda: f"attention_ext: q, k, v must share a dtype, got {dtype_name(q.dtype)}, {dtype_name(k.dtype)}, {dtype_name(v.dtype)}")
    torch._check_type(q.dtype in DTYPES,
                      lambda: f"attention_ext: q, k, v must be float32, float16, bfloat16 or float64, got {dtype_name(q.dtype)}")
    torch._check(q.device == k.device == v.device,
                 lambda: f"attention_ext: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, h, _, d = q.shape
    hk = k.shape[1]
    torch._check_value(k.shape[0] == b and v.shape[0] == b,
                       lambda: f"attention_ext: batch mismatch: q {shape_of(q)}, k {shape_of(k)}, v {shape_of(v)}")
    torch._check_value(k.shape == v.shape,
                       lambda: f"attention_ext: k and v must have the same shape, got {shape_of(k)} and {shape_of(v)}")
    torch._check_value(k.shape[3] == d, lambda: f"attention_ext: head dim mismatch: q has {d}, k and v have {k.shape[3]}")
    torch._check_value(1 <= d <= 256, lambda: f"attention_ext: head dim must be in [1, 256], got {d}")
    torch._check_value(hk >= 1 and h % hk == 0,
                       lambda: f"attention_ext: query heads ({h}) must be a multiple of kv heads ({hk})")
    for t in (q, k, v):
        torch._check_value(t.stride(3) == 1 or t.shape[3] == 1,
                           lambda: f"attention_ext: the head dim of q, k, v must be contiguous (stride 1), got "
                                   f"strides {list(t.stride())}")
    torch._check_value(window_left >= -1 and window_right >= -1,
                       lambda: f"attention_ext: window sizes must be >= -1, got ({window_left}, {window_right})")
    torch._check_value(0.0 <= dropout_p < 1.0, lambda: f"attention_ext: dropout_p must be in [0, 1), got {dropout_p:g}")
    torch._check_value(softcap >= 0.0, lambda: f"attention_ext: softcap must be >= 0, got {softcap:g}")
    torch._check_value(math.isfinite(scale), lambda: f"attention_ext: scale must be finite, got {scale:g}")
    varlen = cu_seqlens_q is not None
    torch._check_value(varlen == (cu_seqlens_k is not None),
                       lambda: "attention_ext: cu_seqlens_q and cu_seqlens_k go together")
    nb = b
    if varlen:
        torch._check_value(b == 1, lambda: f"attention_ext: varlen inputs are one (1, H, total, D) pack, got batch {b}")
        nb = cu_seqlens_q.numel() - 1
        torch._check_value(nb >= 1, lambda: "attention_ext: cu_seqlens_q needs at least 2 entries")
        _check_index(cu_seqlens_q, "cu_seqlens_q", nb + 1, q)
        _check_index(cu_seqlens_k, "cu_seqlens_k", nb + 1, q)
        torch._check_value(seqlens_k is None, lambda: "attention_ext: seqlens_k is for padded batches, not varlen")
        torch._check_value(max_seqlen_q >= 0 and max_seqlen_k >= 0,
                           lambda: "attention_ext: max_seqlen_q/k must be >= 0")
    _check_index(seqlens_k, "seqlens_k", nb, q)
    sq, sk = (max_seqlen_q, max_seqlen_k) if varlen else (q.shape[2], k.shape[2])
    acc = acc_dtype(q.dtype)
    if bias is not None:
        torch._check_type(bias.dtype in (acc, torch.bool),
                          lambda: f"attention_ext: bias must be {dtype_name(acc)} (additive; float64 goes with float64 inputs, "
                                  f"float32 with the others) or bool (True = attend), got {dtype_name(bias.dtype)}")
        torch._check(bias.device == q.device, lambda: f"attention_ext: bias must be on {q.device}, got {bias.device}")
        torch._check_value(bias.dim() == 4,
                           lambda: f"attention_ext: bias must be 4-D, broadcastable to (B, H, Sq, Sk) = "
                                   f"({nb}, {h}, {sq}, {sk}), got {shape_of(bias)}")
        for got, want in zip(bias.shape, (nb, h, sq, sk)):
            # sym_or, not `or`: a data-dependent size (torch.export) is asserted at run time, not guarded on
            torch._check_value(sym_or(got == want, got == 1),
                               lambda: f"attention_ext: bias of shape {shape_of(bias)} does not broadcast to "
                                       f"(B, H, Sq, Sk) = ({nb}, {h}, {sq}, {sk})")
    if alibi_slopes is not None:
        a = alibi_slopes
        torch._check_type(a.dtype == acc, lambda: f"attention_ext: alibi_slopes must be {dtype_name(acc)}, got {dtype_name(a.dtype)}")
        torch._check(a.device == q.device, lambda: f"attention_ext: alibi_slopes must be on {q.device}")
        torch._check_value((a.dim() == 1 and a.shape[0] == h) or (a.dim() == 2 and a.shape[0] == nb and a.shape[1] == h),
                           lambda: f"attention_ext: alibi_slopes must be (H) or (B, H) = ({nb}, {h}), got {shape_of(a)}")
        torch._check_value(a.stride(-1) == 1, lambda: "attention_ext: alibi_slopes must be contiguous over heads")
    if rng_state is not None:  # (seed, offset), read on the host: overrides the int seed / offset
        r = rng_state
        torch._check_type(r.dtype == torch.int64,
                          lambda: f"attention_ext: rng_state must be int64, got {dtype_name(r.dtype)}")
        torch._check_value(r.dim() == 1 and r.shape[0] == 2 and r.is_contiguous(),
                           lambda: f"attention_ext: rng_state must be a contiguous (2) tensor (seed, offset), got "
                                   f"{shape_of(r)}")
        torch._check(r.device.type == "cpu",
                     lambda: f"attention_ext: rng_state must be a CPU tensor (read on the host), got {r.device}")
    if dropout_coords is not None:  # Philox counters, never addresses: any value is safe
        torch._check_value(not varlen, lambda: "attention_ext: dropout_coords do not combine with varlen (cu_seqlens)")
        _check_index(dropout_coords, "dropout_coords", nb * h + sq + sk, q)
    if sinks is not None:
        s = sinks
        torch._check_type(s.dtype == acc, lambda: f"attention_ext: sinks must be {dtype_name(acc)}, got {dtype_name(s.dtype)}")
        torch._check(s.device == q.device, lambda: f"attention_ext: sinks must be on {q.device}")
        torch._check_value(s.dim() == 1 and s.shape[0] == h and s.is_contiguous(),
                           lambda: f"attention_ext: sinks must be a contiguous (H) = ({h}) tensor, got {shape_of(s)}")
    if block_layout is not None:
        lay, bs = block_layout, block_size
        torch._check_value(bs >= 16 and bs % 16 == 0,
                           lambda: f"attention_ext: block_size must be a positive multiple of 16, got {bs}")
        torch._check_type(lay.dtype == torch.bool, lambda: f"attention_ext: block_layout must be bool, got {dtype_name(lay.dtype)}")
        torch._check(lay.device == q.device, lambda: f"attention_ext: block_layout must be on {q.device}, got {lay.device}")
        torch._check_value(lay.is_contiguous(), lambda: "attention_ext: block_layout must be contiguous")
        nqb, nkb = -(-sq // bs), -(-sk // bs)
        torch._check_value(lay.dim() == 3 and lay.shape[0] in (1, h) and lay.shape[1] == nqb and lay.shape[2] == nkb,
                           lambda: f"attention_ext: block_layout must be (H or 1, ceil(Sq / block_size), ceil(Sk / "
                                   f"block_size)) = ({h} or 1, {nqb}, {nkb}), got {shape_of(lay)}")
    torch._check_value((topk_thr is None) == (topk_jcut is None),
                       lambda: "attention_ext: topk_thr and topk_jcut go together")
    if topk_thr is not None:
        torch._check_type(topk_thr.dtype == acc and topk_jcut.dtype == torch.int32,
                          lambda: f"attention_ext: topk_thr must be {dtype_name(acc)} and topk_jcut int32, got "
                                  f"{dtype_name(topk_thr.dtype)} and {dtype_name(topk_jcut.dtype)}")
        for t in (topk_thr, topk_jcut):
            torch._check(t.device == q.device, lambda: f"attention_ext: topk_thr / topk_jcut must be on {q.device}")
            torch._check_value(t.dim() == 3 and tuple(t.shape) == (b, h, q.shape[2]) and t.is_contiguous(),
                               lambda: f"attention_ext: topk_thr / topk_jcut must be contiguous (B, H, Sq) = "
                                       f"({b}, {h}, {q.shape[2]}), got {shape_of(t)}")


# ---------------------------------------------------------------------------------- schema
def _arg_names(op: str) -> Tuple[str, ...]:
    return tuple(a.name for a in getattr(torch.ops.attention_ext, op).default._schema.arguments)


def _common_prefix(a, b) -> Tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return tuple(a[:n])


if HAS_EXT:
    FWD_ARGS = _arg_names("softmax_fwd")  # q, k, v, the options, num_splits, deterministic
    BWD_ARGS = _arg_names("softmax_bwd")  # dout, q, k, v, out, lse, the options, bias_grad, deterministic, dlse
    # The options fwd and bwd share, in schema order (bias ... offset, rng_state).
    OPTION_NAMES = _common_prefix(FWD_ARGS[3:], BWD_ARGS[6:])
else:
    # Without the extension no op is called; check_inputs' keywords name the same options (a test
    # holds the two equal when the extension is built).
    OPTION_NAMES = tuple(n for n, p in inspect.signature(check_inputs).parameters.items()
                         if p.kind is inspect.Parameter.KEYWORD_ONLY)
    FWD_ARGS = ("q", "k", "v", *OPTION_NAMES, "num_splits", "deterministic")
    BWD_ARGS = ("dout", "q", "k", "v", "out", "lse", *OPTION_NAMES, "bias_grad", "deterministic", "dlse")
_FWD_OP = torch.ops.attention_ext.softmax_fwd.default if HAS_EXT else None
_ROUTED_OP = torch.ops.attention_ext.softmax_fwd_routed.default if HAS_EXT else None
_OPTION_TENSORS = ("bias", "alibi_slopes", "sinks", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k", "rng_state",
                   "dropout_coords", "block_layout", "topk_thr", "topk_jcut")
# options a caller may leave out of ops.fwd: the dropout mask at its own coordinates, dense, no top-k
_OPTION_DEFAULTS = dict(rng_state=None, dropout_coords=None, block_layout=None, block_size=0, topk_thr=None,
                        topk_jcut=None)


def _check_num_splits(num_splits: int) -> None:
    torch._check_value(num_splits >= 0,
                       lambda: f"attention_ext: num_splits must be >= 0 (0 = heuristic), got {num_splits}")


def _empty_like_layout(t: Tensor) -> Tensor:
    # mirrors attn::api::empty_like_layout: keep (B, S, H, D) storage when heads are inner
    if t.stride(1) < t.stride(2):
        b, h, s, d = t.shape
        return t.new_empty((b, s, h, d)).transpose(1, 2)
    return t.new_empty(t.shape)


# ---------------------------------------------------------------------------------- fakes, autograd
if HAS_EXT:

    @torch.library.register_fake("attention_ext::softmax_fwd")
    def _fwd_fake(*args):
        a = dict(zip(FWD_ARGS, args))
        q = a["q"]
        check_inputs(q, a["k"], a["v"], **{n: a[n] for n in OPTION_NAMES})
        _check_num_splits(a.get("num_splits", 1))  # the dispatcher may drop defaulted arguments
        b, h, sq, _ = q.shape
        return _empty_like_layout(q), q.new_empty((b, h, sq), dtype=acc_dtype(q.dtype))

    @torch.library.register_fake("attention_ext::softmax_bwd")
    def _bwd_fake(*args, **kwargs):
        a = dict(zip(BWD_ARGS, args), **kwargs)
        q, k, v, bias, cu_q = a["q"], a["k"], a["v"], a["bias"], a["cu_seqlens_q"]
        check_inputs(q, k, v, **{n: a[n] for n in OPTION_NAMES})
        torch._check_value(a["dout"].shape == q.shape and a["out"].shape == q.shape,
                           lambda: f"attention_ext.softmax_bwd: dout and out must have q's shape {shape_of(q)}")
        nb = cu_q.shape[0] - 1 if cu_q is not None else q.shape[0]
        sq = a["max_seqlen_q"] if cu_q is not None else q.shape[2]
        sk = a["max_seqlen_k"] if cu_q is not None else k.shape[2]
        acc = dict(dtype=acc_dtype(q.dtype))
        if a["bias_grad"] and bias is not None and bias.dtype.is_floating_point:
            dbias = q.new_empty((nb, q.shape[1], 1 if bias.shape[2] == 1 else sq, sk), **acc)
        else:
            dbias = q.new_empty((0,), **acc)
        dsinks = q.new_empty((nb, q.shape[1]), **acc) if a["sinks"] is not None else q.new_empty((0,), **acc)
        return _empty_like_layout(q), _empty_like_layout(k), _empty_like_layout(v), dbias, dsinks

    @torch.library.register_fake("attention_ext::topk_threshold")
    def _topk_threshold_fake(q, k, *args):
        a = dict(zip(OPTION_NAMES, args[:len(OPTION_NAMES)]))
        check_inputs(q, k, k, **a)
        k_top = args[len(OPTION_NAMES)]
        torch._check_value(k_top >= 1, lambda: f"attention_ext: k_top must be >= 1, got {k_top}")
        b, h, sq, _ = q.shape
        return q.new_empty((b, h, sq), dtype=acc_dtype(q.dtype)), q.new_empty((b, h, sq), dtype=torch.int32)

    @torch.library.register_fake("attention_ext::dropout_mask")
    def _dropout_mask_fake(b, h, sq, sk, p, seed, offset, device=None):
        return torch.empty((b, h, sq, sk), dtype=torch.bool, device=device or "cpu")

    _GRAD_INPUTS = ("q", "k", "v", "bias", "sinks")  # the inputs the backward differentiates

    def _setup_context(ctx, inputs, output):
        a = dict(zip(FWD_ARGS, inputs))
        need = {n: ctx.needs_input_grad[FWD_ARGS.index(n)] for n in _GRAD_INPUTS}
        bias = a["bias"]
        ctx.bias_grad = need["bias"] and bias is not None and bias.dtype.is_floating_point
        ctx.sinks_grad = need["sinks"] and a["sinks"] is not None
        ctx.any_grad = any(need.values())
        if not ctx.any_grad:  # e.g. only alibi_slopes requires grad: nothing to save or compute
            return
        ctx.scalars = {n: a[n] for n in OPTION_NAMES if n not in _OPTION_TENSORS}
        ctx.deterministic = a.get("deterministic", False)
        out, lse = output
        # the backward recomputes the scores from q, k and every option tensor; sinks only enter
        # the (saved) LSE and their own gradient, so they are kept only for that gradient
        sinks = a["sinks"] if ctx.sinks_grad else None
        # rng_state: the backward redraws the forward's dropout mask from the same (seed, offset)
        ctx.save_for_backward(a["q"], a["k"], a["v"], out, lse, bias, a["alibi_slopes"], sinks, a["seqlens_k"],
                              a["cu_seqlens_q"], a["cu_seqlens_k"], a.get("rng_state"), a.get("dropout_coords"),
                              a.get("block_layout"), a.get("topk_thr"), a.get("topk_jcut"))

    def _backward(ctx, dout, dlse):
        if not ctx.any_grad:
            return (None,) * len(FWD_ARGS)
        (q, k, v, out, lse, bias, alibi, sinks, seqlens_k, cu_q, cu_k, rng_state, dropout_coords, block_layout,
         topk_thr, topk_jcut) = ctx.saved_tensors
        if dout.stride(-1) != 1:  # e.g. the expanded ones of out.sum().backward()
            dout = dout.contiguous()
        if dlse is not None:
            # rows that saw nothing have lse = -inf and no gradient to pass on
            dlse = dlse.to(lse.dtype).masked_fill(torch.isinf(lse), 0.0).contiguous()
        a = dict(ctx.scalars, dout=dout, q=q, k=k, v=v, out=out, lse=lse, bias=bias, alibi_slopes=alibi, sinks=sinks,
                 seqlens_k=seqlens_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, rng_state=rng_state,
                 dropout_coords=dropout_coords, block_layout=block_layout, topk_thr=topk_thr, topk_jcut=topk_jcut,
                 bias_grad=ctx.bias_grad, deterministic=ctx.deterministic, dlse=dlse)
        dq, dk, dv, dbias, dsinks = torch.ops.attention_ext.softmax_bwd(*[a[n] for n in BWD_ARGS])
        grads = dict(q=dq, k=dk, v=dv, bias=dbias.sum_to_size(bias.shape) if ctx.bias_grad else None,
                     sinks=dsinks.sum(0) if ctx.sinks_grad else None)
        return tuple(grads.get(n) for n in FWD_ARGS)

    torch.library.register_autograd("attention_ext::softmax_fwd", _backward, setup_context=_setup_context)


_MISSING = object()
_FWD_INDEX = {n: i for i, n in enumerate(FWD_ARGS)}
# fwd's argument list with the defaults filled in: a call copies it and sets what it was given
_FWD_TEMPLATE = [_OPTION_DEFAULTS.get(n, _MISSING) for n in FWD_ARGS]
# the tensor arguments: a call needs autograd's layer only when one of them requires grad
_FWD_TENSOR_SLOTS = tuple(_FWD_INDEX[n] for n in ("q", "k", "v", *_OPTION_TENSORS) if n in _FWD_INDEX)


def call_below_autograd(op, args) -> Tuple[Tensor, ...]:
    """op(*args) for a call with nothing to differentiate: straight to the device kernel below the
    Autograd key, which is what a registered Python autograd layer would do itself, without its
    Python (a pytree walk over every argument, most of a small call's fixed cost:
    benchmarks/results/2026-11-29-newcomer-cpu-zen5.md).
    torch.compile and functorch transforms keep the full dispatch. The one home of that rule
    (fwd's calls and the decode kernel's)."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def call_fwd(args: list, op=None) -> Tuple[Tensor, Tensor]:
    """torch.ops.attention_ext.softmax_fwd (or `op`, of the same schema) on its full argument list
    (FWD_ARGS order), below the Autograd key (call_below_autograd) when grad mode is off or no
    tensor argument requires grad."""
    op = op or _FWD_OP
    if not torch.is_grad_enabled() or not any(args[i] is not None and args[i].requires_grad
                                               for i in _FWD_TENSOR_SLOTS):
        return call_below_autograd(op, args)
    return op(*args)


def fwd(q: Tensor, k: Tensor, v: Tensor, *, num_splits: int = 1, deterministic: bool = False, routed: bool = False,
        **options):
    """torch.ops.attention_ext.softmax_fwd with keyword options (every name of OPTION_NAMES; those of
    _OPTION_DEFAULTS may be left out). Returns (out, lse). num_splits: key splits of the CUDA forward (1 = none, 0 =
    the heuristic); deterministic: the backward adds no atomics (CUDA). routed: the functional API's
    op, softmax_fwd_routed, which runs the decode kernel for the few-row CPU calls fwd_route
    names (softmax_fwd always runs the fused kernels)."""
    a = _FWD_TEMPLATE.copy()
    a[0], a[1], a[2] = q, k, v
    a[_FWD_INDEX["num_splits"]], a[_FWD_INDEX["deterministic"]] = num_splits, deterministic
    for n, x in options.items():
        i = _FWD_INDEX.get(n)
        if i is None or i < 3:
            raise TypeError(f"attention_ext.softmax.ops.fwd: unknown option {n!r} (options: {', '.join(OPTION_NAMES)})")
        a[i] = x
    try:
        return call_fwd(a, _ROUTED_OP if routed else None)
    except (TypeError, RuntimeError, AttributeError):
        missing = [n for n, x in zip(FWD_ARGS, a) if x is _MISSING]  # looked for only when the call failed
        if missing:
            raise TypeError(f"attention_ext.softmax.ops.fwd: missing option(s) {', '.join(missing)}") from None
        raise


# torch.ops.attention_ext.softmax_fwd_plain (csrc/torch/softmax_plain.cpp): fwd with no tensor option but
# the bias, a composite op of 11 arguments; _C.softmax_fwd_plain calls it without torch.ops' argument
# conversion.
_PLAIN_OP = torch.ops.attention_ext.softmax_fwd_plain.default if HAS_EXT else None
_PLAIN_ENTRY = _ext._C.softmax_fwd_plain if HAS_EXT else None


def fwd_plain(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float] = None, window_left: int = -1,
              window_right: int = -1, bottom_right: bool = False, layout: str = "bhsd", num_splits: int = 0,
              deterministic: bool = False, bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """fwd for a call with no tensor option but a 4-D mask (bias: fwd's; no lengths, ALiBi,
    sinks, dropout, block layout or top-k): the op softmax_fwd_plain, which takes the layout and the
    default scale itself and goes below the Autograd key in C++ when nothing needs a gradient.
    Small calls are where the argument handling in front of a kernel shows. Returns (out, lse),
    out in q's layout."""
    if (type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor
            or (bias is not None and type(bias) is not Tensor) or _plain_traced()):
        return _PLAIN_OP(q, k, v, scale, window_left, window_right, bottom_right, layout, num_splits, deterministic,
                         bias)
    return _PLAIN_ENTRY(q, k, v, scale, window_left, window_right, bottom_right, layout, num_splits, deterministic,
                        bias)


def _plain_traced() -> bool:
    """Whether a call must take torch.ops' full path: torch.compile tracing it, functorch
    transforms, or a torch function mode (which torch.ops hands the call to)."""
    return (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch._C._is_torch_function_mode_enabled())


def fwd_route(q: Tensor, k: Tensor, v: Tensor, **options) -> str:
    """Which kernel the functional API's forward (softmax_fwd_routed, fwd(routed=True)) runs for
    these inputs and options (fwd's keywords), and why: "decode: ..." (a CPU call of few query
    rows with nothing to differentiate runs on the decode kernel) or "fused: ..." (the reason it
    does not). The rule lives in C++ (route_fwd, csrc/torch/softmax_route.cpp); the inputs are
    checked first, as the call would check them. Options left out take the op's neutral values (no tensor option, scale
    1 / sqrt(D), no window, softcap or dropout)."""
    a = {n: None for n in _OPTION_TENSORS}
    a.update(max_seqlen_q=0, max_seqlen_k=0, scale=1.0 / math.sqrt(max(q.shape[-1], 1)), softcap=0.0, window_left=-1,
             window_right=-1, bottom_right=False, dropout_p=0.0, seed=0, offset=0, block_size=0)
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"attention_ext.softmax.ops.fwd_route: unknown option(s) {sorted(unknown)} "
                        f"(options: {', '.join(OPTION_NAMES)})")
    a.update(options)
    return torch.ops.attention_ext.softmax_fwd_route(q, k, v, *[a[n] for n in OPTION_NAMES])


def topk_threshold(q: Tensor, k: Tensor, k_top: int, **options) -> Tuple[Tensor, Tensor]:
    """torch.ops.attention_ext.topk_threshold with fwd's keyword options: top-k's (B, H, Sq)
    thresholds and cut keys (csrc/common/block_sparse.h), which fwd / bwd take as topk_thr /
    topk_jcut. Not differentiable (the selection is piecewise constant): call it on detached
    tensors."""
    a = {**_OPTION_DEFAULTS, **options}
    return torch.ops.attention_ext.topk_threshold(q, k, *[a[n] for n in OPTION_NAMES], int(k_top))


def dropout_mask(b: int, h: int, sq: int, sk: int, p: float, seed: int, offset: int = 0,
                 device: Device = None) -> Tensor:
    """The (B, H, Sq, Sk) bool keep-mask the kernels draw for (seed, offset): Philox4x32-10,
    identical on the CPU and the GPU. A call that drew its own (seed, offset) as a rng_state
    tensor rebuilds its mask with dropout_mask(..., *rng_state.tolist())."""
    return torch.ops.attention_ext.dropout_mask(b, h, sq, sk, p, seed, offset, device)


# ---------------------------------------------------------------------------------- kernel selection
_DEFAULT_KERNELS: Dict[str, int] = dict(hopper_fwd=1, hopper_bwd=1, tune_fwd=0, tune_bwd=0, force_simt=False)
_kernels = dict(_DEFAULT_KERNELS)


def set_cuda_kernels(hopper_fwd: int = 1, hopper_bwd: int = 1, tune_fwd: int = 0, tune_bwd: int = 0,
                     force_simt: bool = False) -> Dict[str, int]:
    """Process-wide: which CUDA kernels the dispatcher may pick. The defaults are the product's
    kernels; every call sets all five fields.

        hopper_fwd  1 the sm_90a wgmma forward where it applies (the default: it beat the mma.sync
                    forward at every shape measured, benchmarks/results/2026-11-24-h100.md), 0 the
                    mma.sync forward there
        hopper_bwd  1 the sm_90a wgmma backward where it applies (the default, likewise), 0 off
        tune_fwd,   the -DATTN_TUNING candidate of the mma.sync forward / backward (0 = the
        tune_bwd    default kernel; a build without -DATTN_TUNING has only 0)
        force_simt  route every call to the SIMT kernels (the sm < 80 path)

    Returns the previous selection, so that `set_cuda_kernels(**old)` restores it."""
    new = dict(hopper_fwd=int(hopper_fwd), hopper_bwd=int(hopper_bwd), tune_fwd=int(tune_fwd),
               tune_bwd=int(tune_bwd), force_simt=bool(force_simt))
    torch._check_value(new["hopper_fwd"] in (0, 1), lambda: f"hopper_fwd must be 0 or 1, got {hopper_fwd}")
    torch._check_value(new["hopper_bwd"] in (0, 1), lambda: f"hopper_bwd must be 0 or 1, got {hopper_bwd}")
    torch._check_value(new["tune_fwd"] >= 0 and new["tune_bwd"] >= 0,
                       lambda: f"tune_fwd and tune_bwd must be >= 0, got {tune_fwd}, {tune_bwd}")
    if HAS_EXT:
        torch.ops.attention_ext.set_cuda_kernels(*new.values())
    old = dict(_kernels)
    _kernels.update(new)
    return old


def cuda_kernels() -> Dict[str, int]:
    """The current selection of set_cuda_kernels (its five keywords)."""
    return dict(_kernels)
