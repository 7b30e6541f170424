"""The bad-input matrix: every public function, given each kind of bad input, raises a clear Python
exception whose message names the argument; it never crashes, hangs or reads out of bounds.

The table is generated from two parts: SPECS (per public function: how to build a good call, and the
roles its tensors play) and CASES (per kind of bad input: how to spoil a good call). Every
(function, case) pair is in EXPECT: an exception type and a message regex, OK (a defined result,
checked), or NA with the reason the case cannot be expressed for that function. test_table_complete
checks that no pair is left out.

Decisions the table states:
- 0-size tensors (batch 0, or zero query rows) are not errors: they give a correct empty result,
  for every function (the shape the non-empty call would have, with 0 in that dim). A zero-length
  key sequence is not an error either: a row with no keys to attend to gives zeros (lse -inf), the
  kernels' convention for a fully masked row; a zero-length sequence inside cu_seqlens likewise.
- Mixed devices use the 'meta' device as the second device: the machine has no GPU, and a meta
  tensor has a device without storage, so a kernel that forgot the device check would fail (or
  crash reading a null pointer) rather than silently read host memory.
- Index values a kernel reads memory with (cu_seqlens, block_table, cache_seqlens, a sparse
  layout's shape) run in a subprocess (CRASH_PRONE): a missed check would read out of bounds and
  could take the test process down; the subprocess must exit 1 with the Python exception.

Per-family tests with more cases of one function: tests/softmax/test_cpu.py (BAD, RAW_BAD),
tests/decode/test_cpu.py, tests/sparse/test_kernels.py, tests/linear/test_functional.py and
test_step.py. This table covers every public function once per case, not every option.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import attention_ext as ae
from tests.helpers import one_rank_group
from attention_ext import nn as aenn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
i32 = dict(dtype=torch.int32)


class NA:
    """A (function, case) pair that cannot be expressed: the reason says why."""

    def __init__(self, reason: str):
        self.reason = reason


class OK:
    """A pair that is not an error: the call returns, and `check(result)` holds."""

    def __init__(self, check):
        self.check = check


def _zeros_like_shape(shape):
    return lambda r: (r[0] if isinstance(r, tuple) else r).shape == shape


# ------------------------------------------------------------------ the good calls
# Each spec: make() -> dict of arguments (a good call); call(a) -> the result. Shapes:
# B = 2, H = 4 query heads, H_k = 2 kv heads, S_q = 8, S_k = 9, D = 16.
B, H, HK, SQ, SK, D = 2, 4, 2, 8, 9, 16


def rn(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def _bhsd():
    return dict(q=rn(B, H, SQ, D), k=rn(B, HK, SK, D), v=rn(B, HK, SK, D))


def _bshd():
    return dict(q=rn(B, SQ, H, D), k=rn(B, SK, HK, D), v=rn(B, SK, HK, D))


def _thd():  # varlen packs: sequences of 3 and 5 queries, 4 and 5 keys
    return dict(q=rn(8, H, D), k=rn(9, HK, D), v=rn(9, HK, D), cu_seqlens_q=torch.tensor([0, 3, 8], **i32),
                cu_seqlens_k=torch.tensor([0, 4, 9], **i32), max_seqlen_q=5, max_seqlen_k=5)


def _lse():
    a = _bhsd()
    a["lse"] = ae.attention(a["q"], a["k"], a["v"], return_lse=True)[1]
    del a["v"]
    return a


def _kvcache():  # cache (B, S_cache = 16, H_k, D), 9 rows filled; one new token appended
    return dict(q=rn(B, 1, H, D), k_cache=rn(B, 16, HK, D), v_cache=rn(B, 16, HK, D), k=rn(B, 1, HK, D),
                v=rn(B, 1, HK, D), cache_seqlens=torch.tensor([9, 5], **i32))


def _paged():  # 6 pages of 4 rows; sequence b reads pages block_table[b]
    return dict(q=rn(B, 1, H, D), k_cache=rn(6, 4, HK, D), v_cache=rn(6, 4, HK, D),
                cache_seqlens=torch.tensor([9, 5], **i32), block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], **i32))


def _mha():
    return dict(m=aenn.MultiheadAttention(32, 4, batch_first=True), query=rn(B, SQ, 32), key=rn(B, SK, 32),
                value=rn(B, SK, 32))


def _paged_cache():
    c = aenn.PagedKVCache(B, 8, 4, HK, D)
    c.append(rn(B, 5, HK, D), rn(B, 5, HK, D))
    return dict(c=c, q=rn(B, 1, H, D), k=rn(B, 1, HK, D), v=rn(B, 1, HK, D))


def _state():
    return dict(S=rn(B, H, D, D), z=rn(B, H, D))


def _step():
    q = rn(B, H, 1, D)
    return dict(q=q, k=rn(B, H, 1, D), v=rn(B, H, 1, D), state=None)


def _layout():
    a = _bhsd()
    a["block_layout"] = torch.ones(1, 1, 1, dtype=torch.bool)
    return a


def _dense_args(a, *names):
    return {n: a[n] for n in names if n in a}


def _world1(call):
    """call(a) inside one_rank_group()."""
    def run(a):
        with one_rank_group():
            return call(a)
    return run


def _cp_spec(mode):
    return dict(make=lambda: dict(q=rn(B, H, SQ, D), k=rn(B, HK, SQ, D), v=rn(B, HK, SQ, D), mode=mode),
                call=_world1(lambda a: ae.distributed.context_parallel_attention(a.pop("q"), a.pop("k"), a.pop("v"),
                                                                                 **a)),
                roles=dict(q=("q", "bhsd"), k=("k", "bhsd"), v=("v", "bhsd")))


SPECS = {
    "attention": dict(make=_bhsd, call=lambda a: ae.attention(a.pop("q"), a.pop("k"), a.pop("v"), **a),
                      roles=dict(q=("q", "bhsd"), k=("k", "bhsd"), v=("v", "bhsd"))),
    "attention_varlen": dict(
        make=_thd, call=lambda a: ae.softmax.attention_varlen(
            a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"), a.pop("max_seqlen_q"),
            a.pop("max_seqlen_k"), **a),
        roles=dict(q=("q", "thd"), k=("k", "thd"), v=("v", "thd"))),
    "attention_weights": dict(make=_lse, call=lambda a: ae.attention_weights(a.pop("q"), a.pop("k"), a.pop("lse"), **a),
                              roles=dict(q=("q", "bhsd"), k=("k", "bhsd"))),
    "dropout_mask": dict(make=lambda: dict(b=B, h=H, sq=SQ, sk=SK, p=0.1, seed=1),
                         call=lambda a: ae.dropout_mask(a.pop("b"), a.pop("h"), a.pop("sq"), a.pop("sk"), a.pop("p"),
                                                        a.pop("seed"), **a),
                         roles={}),
    "scaled_dot_product_attention": dict(
        make=lambda: dict(query=rn(B, H, SQ, D), key=rn(B, HK, SK, D), value=rn(B, HK, SK, D), enable_gqa=True),
        call=lambda a: ae.scaled_dot_product_attention(a.pop("query"), a.pop("key"), a.pop("value"), **a),
        roles=dict(q=("query", "bhsd"), k=("key", "bhsd"), v=("value", "bhsd"))),
    "flash_attn_func": dict(make=_bshd, call=lambda a: ae.flash_attn_func(a.pop("q"), a.pop("k"), a.pop("v"), **a),
                            roles=dict(q=("q", "bshd"), k=("k", "bshd"), v=("v", "bshd"))),
    "flash_attn_qkvpacked_func": dict(
        make=lambda: dict(qkv=rn(B, SQ, 3, H, D)), call=lambda a: ae.flash_attn_qkvpacked_func(a.pop("qkv"), **a),
        roles=dict(q=("qkv", "bs3hd"))),
    "flash_attn_kvpacked_func": dict(
        make=lambda: dict(q=rn(B, SQ, H, D), kv=rn(B, SK, 2, HK, D)),
        call=lambda a: ae.flash_attn_kvpacked_func(a.pop("q"), a.pop("kv"), **a),
        roles=dict(q=("q", "bshd"), k=("kv", "bs2hd"))),
    "flash_attn_varlen_func": dict(
        make=_thd, call=lambda a: ae.flash_attn_varlen_func(
            a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"), a.pop("max_seqlen_q"),
            a.pop("max_seqlen_k"), **a),
        roles=dict(q=("q", "thd"), k=("k", "thd"), v=("v", "thd"))),
    "flash_attn_varlen_qkvpacked_func": dict(
        make=lambda: dict(qkv=rn(8, 3, H, D), cu_seqlens=torch.tensor([0, 3, 8], **i32), max_seqlen=5),
        call=lambda a: ae.flash_attn_varlen_qkvpacked_func(a.pop("qkv"), a.pop("cu_seqlens"), a.pop("max_seqlen"), **a),
        roles=dict(q=("qkv", "t3hd"))),
    "flash_attn_varlen_kvpacked_func": dict(
        make=lambda: dict(q=rn(8, H, D), kv=rn(9, 2, HK, D), cu_seqlens_q=torch.tensor([0, 3, 8], **i32),
                          cu_seqlens_k=torch.tensor([0, 4, 9], **i32), max_seqlen_q=5, max_seqlen_k=5),
        call=lambda a: ae.flash_attn_varlen_kvpacked_func(
            a.pop("q"), a.pop("kv"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"), a.pop("max_seqlen_q"),
            a.pop("max_seqlen_k"), **a),
        roles=dict(q=("q", "thd"), k=("kv", "t2hd"))),
    "flash_attn_with_kvcache": dict(
        make=_kvcache, call=lambda a: ae.flash_attn_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a),
        roles=dict(q=("q", "bshd"), k=("k_cache", "bshd"), v=("v_cache", "bshd"), knew=("k", "bshd"),
                   vnew=("v", "bshd"))),
    "flash_attn_with_kvcache[paged]": dict(
        make=_paged, call=lambda a: ae.flash_attn_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a),
        roles=dict(q=("q", "bshd"), k=("k_cache", "bshd"), v=("v_cache", "bshd"))),
    "decode_fwd": dict(
        make=lambda: dict(_kvcache(), scale=0.25),
        call=lambda a: (a.pop("k"), a.pop("v"),
                        ae.decode.decode_fwd(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a))[-1],
        roles=dict(q=("q", "bshd"), k=("k_cache", "bshd"), v=("v_cache", "bshd"))),
    **{f"context_parallel_attention[{m}]": _cp_spec(m) for m in ("allgather", "ring", "ulysses")},
    "context_parallel_linear_attention": dict(
        make=lambda: dict(q=rn(B, H, SQ, D), k=rn(B, HK, SQ, D), v=rn(B, HK, SQ, D)),
        call=_world1(lambda a: ae.distributed.context_parallel_linear_attention(a.pop("q"), a.pop("k"), a.pop("v"),
                                                                                **a)),
        roles=dict(q=("q", "bhsd"), k=("k", "bhsd"), v=("v", "bhsd"))),
    "linear_attention": dict(make=lambda: dict(q=rn(B, H, SQ, D), k=rn(B, HK, SQ, D), v=rn(B, HK, SQ, D)),
                             call=lambda a: ae.linear_attention(a.pop("q"), a.pop("k"), a.pop("v"), **a),
                             roles=dict(q=("q", "bhsd"), k=("k", "bhsd"), v=("v", "bhsd"))),
    "linear_attention_step": dict(
        make=_step, call=lambda a: ae.linear_attention_step(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("state"), **a),
        roles=dict(q=("q", "bhsd"), k=("k", "bhsd"), v=("v", "bhsd"))),
    "LinearAttentionState": dict(make=_state, call=lambda a: ae.LinearAttentionState(a.pop("S"), **a),
                                 roles={}),
    "block_sparse_attention": dict(
        make=_layout, call=lambda a: ae.block_sparse_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("block_layout"),
                                                               **a),
        roles=dict(q=("q", "bhsd"), k=("k", "bhsd"), v=("v", "bhsd"))),
    "topk_attention": dict(make=lambda: dict(_bhsd(), k_top=3),
                           call=lambda a: ae.topk_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("k_top"), **a),
                           roles=dict(q=("q", "bhsd"), k=("k", "bhsd"), v=("v", "bhsd"))),
    "nn.MultiheadAttention": dict(
        make=_mha, call=lambda a: a.pop("m")(a.pop("query"), a.pop("key"), a.pop("value"), **a),
        roles=dict(q=("query", "bse"), k=("key", "bse"), v=("value", "bse"))),
    "nn.PagedKVCache": dict(
        make=_paged_cache,
        call=lambda a: (a["c"].append(a.pop("k"), a.pop("v")), a.pop("c").attend(a.pop("q"), scale=0.25, **a))[-1],
        roles=dict(q=("q", "bshd"), knew=("k", "bshd"), vnew=("v", "bshd"))),
}

# ------------------------------------------------------------------ the spoilers
# Dims per layout: (batch, seq, head, headdim); None = the layout has no such dim.
DIMS = {"bhsd": (0, 2, 1, 3), "bshd": (0, 1, 2, 3), "thd": (None, 0, 1, 2), "bse": (0, 1, None, 2),
        "bs3hd": (0, 1, 3, 4), "bs2hd": (0, 1, 3, 4), "t3hd": (None, 0, 2, 3), "t2hd": (None, 0, 2, 3)}


def resized(t, dim, n):
    """A fresh tensor like t with size n along dim."""
    shape = list(t.shape)
    shape[dim] = n
    return torch.randn(shape, dtype=t.dtype) if t.is_floating_point() else torch.zeros(shape, dtype=t.dtype)


def role(a, spec, r):
    name, lay = spec["roles"][r]
    return name, lay, DIMS[lay]


def spoil_dim(r, which, n):
    def f(a, spec):
        name, lay, dims = role(a, spec, r)
        a[name] = resized(a[name], dims[which], n)
    return f


def spoil_all(fn):
    def f(a, spec):
        for r in spec["roles"]:
            name, _, _ = role(a, spec, r)
            a[name] = fn(a[name])
    return f


def set_args(**kw):
    def f(a, spec):
        a.update({k: (v() if callable(v) else v) for k, v in kw.items()})
    return f


def spoil_role(r, fn):
    def f(a, spec):
        name, _, _ = role(a, spec, r)
        a[name] = fn(a[name])
    return f


def chain(*fs):
    def f(a, spec):
        for g in fs:
            g(a, spec)
    return f


def to_meta(t):
    return t.to("meta")


CASES = {
    "ndim": spoil_role("q", lambda t: t[0]),
    "batch": spoil_dim("k", 0, 1),  # k's batch disagrees with q's
    "heads": spoil_dim("v", 2, 1),  # v's heads disagree with k's
    "head_dim": spoil_dim("k", 3, 8),  # k's head dim disagrees with q's
    "dv": spoil_dim("v", 3, 8),  # v's head dim disagrees (where Dv must equal D)
    "dtype": spoil_all(lambda t: t.long()),
    "mixed_dtype": spoil_role("k", lambda t: t.double()),
    "device": spoil_role("k", to_meta),
    "gqa": chain(spoil_dim("k", 2, 3), spoil_dim("v", 2, 3)),
    "mask_shape": set_args(attn_mask=lambda: torch.ones(3, SK, dtype=torch.bool)),
    "mask_dtype": set_args(attn_mask=lambda: torch.ones(SQ, SK, dtype=torch.long)),
    "window": set_args(window=(-2, 0)),
    "cu_not_monotonic": set_args(cu_seqlens_q=lambda: torch.tensor([0, 5, 3], **i32)),
    "cu_out_of_range": set_args(cu_seqlens_k=lambda: torch.tensor([0, 4, 900], **i32)),
    "block_table_out_of_range": set_args(block_table=lambda: torch.tensor([[0, 1, 2], [60, 4, 5]], **i32)),
    "layout_out_of_range": set_args(block_layout=lambda: torch.ones(1, 5, 5, dtype=torch.bool), block_size=16),
    "cache_seqlens_beyond_cache": set_args(cache_seqlens=lambda: torch.tensor([9, 400], **i32)),
    "empty_seq": chain(spoil_dim("k", 1, 0), spoil_dim("v", 1, 0)),  # zero keys
    "head_dim_limit": spoil_all(lambda t: torch.randn(*t.shape[:-1], 512, dtype=t.dtype)),
    "zero_size": spoil_all(lambda t: t[:0] if t.dim() > 0 else t),
    "feature_map_width": set_args(feature_map=lambda: (lambda x: torch.cat([x, x], -1)[..., :-1])),
    # the errors that say how to fix: a window given as one number, a numpy array, tensors given in
    # the other layout (every dim agrees once H and S swap: the shapes prove the mix-up)
    "window_int": set_args(window=4),
    "numpy": spoil_role("q", lambda t: t.numpy()),
    "layout_mixup": spoil_all(lambda t: t.transpose(1, 2).contiguous()),
}

CRASH_PRONE = {"cu_not_monotonic", "cu_out_of_range", "block_table_out_of_range", "layout_out_of_range",
               "cache_seqlens_beyond_cache"}



class _SkewedMap(ae.linear.FeatureMap):
    """A feature map whose key features are one wider than its query features."""

    def forward(self, x, *, is_query=False, normalized=True):
        return torch.nn.functional.elu(x) + 1 if is_query else torch.nn.functional.elu(torch.cat([x, x[..., :1]], -1)) + 1


CASES["feature_map_width"] = set_args(feature_map=_SkewedMap)

# Per-function forms of a case where the generic spoiler does not fit the function's arguments.
OVERRIDES = {
    ("attention_varlen", "batch"): set_args(cu_seqlens_k=lambda: torch.tensor([0, 4, 6, 9], **i32)),
    ("attention_varlen", "empty_seq"): set_args(cu_seqlens_k=lambda: torch.tensor([0, 0, 5], **i32)),
    ("attention_varlen", "zero_size"): chain(spoil_all(lambda t: t[:0]), set_args(
        cu_seqlens_q=lambda: torch.tensor([0, 0, 0], **i32), cu_seqlens_k=lambda: torch.tensor([0, 0, 0], **i32))),
    ("flash_attn_with_kvcache", "empty_seq"): set_args(cache_seqlens=lambda: torch.tensor([0, 5], **i32), k=None,
                                                       v=None),
    **{(fn, "window"): set_args(window_size=(-2, 0)) for fn in (
        "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
        "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
        "flash_attn_with_kvcache[paged]")},
    ("decode_fwd", "window"): set_args(window_left=-2),
    **{(fn, "window_int"): set_args(window_size=4) for fn in (
        "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
        "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
        "flash_attn_with_kvcache[paged]",
        *(f"context_parallel_attention[{m}]" for m in ("allgather", "ring", "ulysses")))},
    # the step's k and v with H_k = 2 heads: with H heads, (B, 1, H, D) reads as a legal (B, H=1, T=H, D)
    ("linear_attention_step", "layout_mixup"): lambda a, spec: a.update(q=rn(B, 1, H, D), k=rn(B, 1, HK, D),
                                                                       v=rn(B, 1, HK, D)),
    **{(f"context_parallel_attention[{m}]", "window"): set_args(window_size=(-2, 0))
       for m in ("allgather", "ring", "ulysses")},
    ("flash_attn_with_kvcache[paged]", "empty_seq"): set_args(cache_seqlens=lambda: torch.tensor([0, 5], **i32)),
    ("decode_fwd", "empty_seq"): set_args(cache_seqlens=lambda: torch.tensor([0, 5], **i32)),
    ("flash_attn_with_kvcache", "zero_size"): lambda a, spec: a.update(
        {n: a[n][:0] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens")}),
    ("decode_fwd", "zero_size"): lambda a, spec: a.update(
        {n: a[n][:0] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens")}),
    ("flash_attn_with_kvcache[paged]", "zero_size"): lambda a, spec: a.update(
        {n: a[n][:0] for n in ("q", "cache_seqlens", "block_table")}),
    ("nn.PagedKVCache", "zero_size"): spoil_all(lambda t: t[:, :0]),  # zero new tokens
    ("nn.PagedKVCache", "ndim"): spoil_role("knew", lambda t: t[0]),
    ("nn.PagedKVCache", "batch"): spoil_dim("knew", 0, 1),
    ("nn.PagedKVCache", "head_dim"): spoil_dim("knew", 3, 8),
    ("nn.PagedKVCache", "heads"): spoil_dim("vnew", 2, 1),
    ("nn.PagedKVCache", "dv"): spoil_dim("vnew", 3, 8),
    ("nn.PagedKVCache", "mixed_dtype"): spoil_role("knew", lambda t: t.double()),
    ("nn.PagedKVCache", "device"): spoil_role("knew", to_meta),
    ("nn.PagedKVCache", "gqa"): lambda a, spec: a.update(q=rn(B, 1, 3, D)),
    ("flash_attn_with_kvcache", "dv"): spoil_dim("vnew", 3, 8),  # the new v disagrees with v_cache
    ("LinearAttentionState", "ndim"): lambda a, spec: a.update(S=a["S"][0]),
    ("LinearAttentionState", "batch"): lambda a, spec: a.update(z=a["z"][:1]),
    ("LinearAttentionState", "heads"): lambda a, spec: a.update(z=a["z"][:, :1]),
    ("LinearAttentionState", "head_dim"): lambda a, spec: a.update(z=a["z"][..., :8]),
    ("LinearAttentionState", "dtype"): lambda a, spec: a.update(S=a["S"].long()),
    ("LinearAttentionState", "mixed_dtype"): lambda a, spec: a.update(z=a["z"].long()),
    ("LinearAttentionState", "device"): lambda a, spec: a.update(z=a["z"].to("meta")),
    ("LinearAttentionState", "zero_size"): lambda a, spec: a.update(S=a["S"][:0], z=a["z"][:0]),
    ("flash_attn_qkvpacked_func", "device"): set_args(alibi_slopes=lambda: torch.ones(H, device="meta")),
    ("flash_attn_varlen_qkvpacked_func", "device"): set_args(alibi_slopes=lambda: torch.ones(H, device="meta")),
    ("flash_attn_qkvpacked_func", "mixed_dtype"): set_args(alibi_slopes=lambda: torch.ones(H, dtype=torch.long)),
    ("flash_attn_varlen_qkvpacked_func", "mixed_dtype"): set_args(
        alibi_slopes=lambda: torch.ones(H, dtype=torch.long)),
    ("flash_attn_varlen_qkvpacked_func", "zero_size"): chain(
        spoil_all(lambda t: t[:0]), set_args(cu_seqlens=lambda: torch.tensor([0, 0, 0], **i32))),
    ("flash_attn_varlen_qkvpacked_func", "empty_seq"): set_args(cu_seqlens=lambda: torch.tensor([0, 0, 5], **i32)),
    ("flash_attn_varlen_func", "batch"): set_args(cu_seqlens_k=lambda: torch.tensor([0, 4, 6, 9], **i32)),
    ("flash_attn_varlen_func", "empty_seq"): set_args(cu_seqlens_k=lambda: torch.tensor([0, 0, 5], **i32)),
    ("flash_attn_varlen_func", "zero_size"): chain(spoil_all(lambda t: t[:0]), set_args(
        cu_seqlens_q=lambda: torch.tensor([0, 0, 0], **i32), cu_seqlens_k=lambda: torch.tensor([0, 0, 0], **i32))),
    ("flash_attn_varlen_kvpacked_func", "batch"): set_args(cu_seqlens_k=lambda: torch.tensor([0, 4, 6, 9], **i32)),
    ("flash_attn_varlen_kvpacked_func", "empty_seq"): set_args(
        cu_seqlens_k=lambda: torch.tensor([0, 0, 5], **i32)),
    ("flash_attn_varlen_kvpacked_func", "zero_size"): chain(spoil_all(lambda t: t[:0]), set_args(
        cu_seqlens_q=lambda: torch.tensor([0, 0, 0], **i32), cu_seqlens_k=lambda: torch.tensor([0, 0, 0], **i32))),
    ("nn.MultiheadAttention", "heads"): lambda a, spec: a.update(value=rn(B, SK, 16)),
    ("nn.MultiheadAttention", "gqa"): lambda a, spec: a.update(m=aenn.MultiheadAttention(30, 4, batch_first=True)),
    ("linear_attention", "empty_seq"): lambda a, spec: a.update({n: a[n][:, :, :0] for n in ("q", "k", "v")}),
    ("linear_attention_step", "empty_seq"): lambda a, spec: a.update({n: a[n][:, :, :0] for n in ("q", "k", "v")}),
    ("dropout_mask", "zero_size"): set_args(b=0),
    ("attention_weights", "gqa"): spoil_dim("k", 2, 3),
    # crash-prone index values, in each function's own index arguments
    ("flash_attn_varlen_qkvpacked_func", "cu_not_monotonic"): set_args(cu_seqlens=lambda: torch.tensor([0, 5, 3], **i32)),
    ("flash_attn_varlen_qkvpacked_func", "cu_out_of_range"): set_args(cu_seqlens=lambda: torch.tensor([0, 4, 900], **i32)),
    ("linear_attention", "cu_not_monotonic"): lambda a, spec: a.update(
        q=rn(1, H, 8, D), k=rn(1, HK, 8, D), v=rn(1, HK, 8, D), cu_seqlens=torch.tensor([0, 5, 3], **i32), max_seqlen=5),
    ("linear_attention", "cu_out_of_range"): lambda a, spec: a.update(
        q=rn(1, H, 8, D), k=rn(1, HK, 8, D), v=rn(1, HK, 8, D), cu_seqlens=torch.tensor([0, 4, 900], **i32),
        max_seqlen=5),
    ("decode_fwd", "block_table_out_of_range"): lambda a, spec: a.update(
        k=None, v=None, k_cache=rn(6, 4, HK, D), v_cache=rn(6, 4, HK, D),
        block_table=torch.tensor([[0, 1, 2], [60, 4, 5]], **i32)),
    ("flash_attn_varlen_func", "block_table_out_of_range"): lambda a, spec: a.update(
        k=rn(6, 4, HK, D), v=rn(6, 4, HK, D), block_table=torch.tensor([[0, 1, 2], [60, 4, 5]], **i32)),

    ("dropout_mask", "device"): set_args(device="meta"),
}


def build(fn, case):
    """The spoiled call of `fn` for `case`, as a thunk."""
    spec = SPECS[fn]
    a = spec["make"]()
    OVERRIDES.get((fn, case), CASES[case])(a, spec)
    return lambda: spec["call"](a)


# ------------------------------------------------------------------ the table
FUNCTIONS = list(SPECS)

_NO_MASK = "takes no attn_mask"
_NO_WINDOW = "takes no window"
_NO_CU = "takes no cu_seqlens"
_NO_BT = "takes no block_table"
_NO_LAYOUT = "takes no block layout"
_NO_CACHE = "takes no cache_seqlens"
_NO_FM = "takes no feature_map"
_PACKED = "q, k and v are one packed tensor: they cannot disagree"
_FA_WINDOW = (ValueError, r"window_size must be >= -1 on both sides")
_SOFTMAX_SIDES = dict(mask_shape=NA(_NO_MASK), mask_dtype=NA(_NO_MASK), feature_map_width=NA(_NO_FM))
_NO_INDEX = dict(cu_not_monotonic=NA(_NO_CU), cu_out_of_range=NA(_NO_CU), block_table_out_of_range=NA(_NO_BT),
                 layout_out_of_range=NA(_NO_LAYOUT), cache_seqlens_beyond_cache=NA(_NO_CACHE))

# Default expectation per case (exception type, regex naming the argument); NA / OK per function below.
DEFAULT = {
    "ndim": (ValueError, r"\bq\b.*(4-D|\(total, H, D\))"),
    "batch": (ValueError, r"batch mismatch: q .*, k "),
    "heads": (ValueError, r"k and v must have the same shape"),
    "head_dim": (ValueError, r"k and v must have the same shape|head dim mismatch: q"),
    "dv": (ValueError, r"k and v must have the same shape"),
    "dtype": (TypeError, r"q, k, v must be float32"),
    "mixed_dtype": (TypeError, r"q, k, v must share a dtype"),
    "device": (ValueError, r"q, k, v must be on one device"),
    "gqa": (ValueError, r"query heads \(4\) must be a multiple of kv heads \(3\)"),
    "mask_shape": (ValueError, r"attn_mask of shape \(3, 9\) does not broadcast"),
    "mask_dtype": (TypeError, r"attn_mask must be bool or floating point"),
    "window": (ValueError, r"window sizes must be >= -1"),
    "cu_not_monotonic": (ValueError, r"cu_seqlens must be non-decreasing"),
    "cu_out_of_range": (ValueError, r"cu_seqlens end past the packed tensors"),
    "block_table_out_of_range": (ValueError, r"block_table holds a page outside"),
    "layout_out_of_range": (ValueError, r"block_layout must be \(H or 1, ceil"),
    "cache_seqlens_beyond_cache": (ValueError, r"cache_seqlens"),
    "empty_seq": OK(lambda r: True),
    "head_dim_limit": (ValueError, r"head dim must be in \[1, 256\], got 512"),
    "zero_size": OK(lambda r: (r[0] if isinstance(r, tuple) else r).numel() == 0),
    "feature_map_width": NA(_NO_FM),
    "window_int": (TypeError, r"window must be a \(left, right\) pair .*window=\(4, 0\) is a causal sliding window"),
    "numpy": (TypeError, r"\bq must be a torch\.Tensor, got numpy\.ndarray: convert it with torch\.from_numpy\(q\)"),
    "layout_mixup": (ValueError, r"do not fit layout='bhsd' \(B, H, S, D\) but fit layout='bshd' \(B, S, H, D\): "
                                 r"pass layout='bshd'"),
}


def _zero_rows(dim):
    """An empty-sequence check: the rows with no keys are 0 (in sequence 0 of the batch / pack)."""
    def check(r):
        out = r[0] if isinstance(r, tuple) else r
        return bool(torch.isfinite(out).all()) and bool((out.select(0, 0) == 0).all()) if dim == 0 else True
    return check


_DECODE_ERR = dict(
    batch=(ValueError, r"k_cache .* and v_cache .* must have one shape"),
    heads=(ValueError, r"k_cache .* and v_cache .* must have one shape"),
    head_dim=(ValueError, r"k_cache .* and v_cache .* must have one shape"),
    dv=(ValueError, r"k_cache .* and v_cache .* must have one shape"),
    ndim=(ValueError, r"q must be 4-D"),
    dtype=(TypeError, r"q must be fp32"),
    mixed_dtype=(TypeError, r"q, k_cache, v_cache must share a dtype"),
    device=(ValueError, r"q, k_cache and v_cache must be on one device"),
    gqa=(ValueError, r"query heads \(4\) must be a multiple of kv heads \(3\)"),
    block_table_out_of_range=(ValueError, r"block_table holds a page outside"),
    cache_seqlens_beyond_cache=(ValueError, r"cache_seqlens 400"),
    **_SOFTMAX_SIDES, window=_FA_WINDOW,
    cu_not_monotonic=NA(_NO_CU), cu_out_of_range=NA(_NO_CU), layout_out_of_range=NA(_NO_LAYOUT),
)

_CP_ERR = dict(  # context parallelism: the shards' own checks (sharding.shards_bhsd / check_shards)
    ndim=(ValueError, r"q must be a 4-D tensor"),
    batch=(ValueError, r"q, k, v shards must"), heads=(ValueError, r"q, k, v shards must have one local length"),
    head_dim=(ValueError, r"q, k, v shards must have one local length"),
    dv=(ValueError, r"q, k, v shards must have one local length"),
    dtype=(TypeError, r"q, k, v shards must be float32"), mixed_dtype=(TypeError, r"q, k, v shards must share a dtype"),
    device=(ValueError, r"q, k, v shards must be on one device"),
    empty_seq=NA("q, k and v are shards of one sequence: k cannot be shorter than q"))

EXPECT = {
    "attention": dict(_NO_INDEX, feature_map_width=NA(_NO_FM), empty_seq=OK(_zero_rows(1)),
                      layout_out_of_range=DEFAULT["layout_out_of_range"]),
    "attention_varlen": dict(
        _NO_INDEX, **_SOFTMAX_SIDES, ndim=(ValueError, r"q must be \(total, H, D\)"),
        batch=(ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
        cu_not_monotonic=DEFAULT["cu_not_monotonic"], cu_out_of_range=DEFAULT["cu_out_of_range"],
        empty_seq=OK(lambda r: bool((r[:3] == 0).all()))),
    "attention_weights": dict(
        _NO_INDEX, feature_map_width=NA(_NO_FM), heads=NA("takes no v"), dv=NA("takes no v"),
        gqa=(ValueError, r"query heads \(4\) must be a multiple of kv heads"),
        device=(RuntimeError, r"q, k, v must be on one device"),
        empty_seq=NA("probabilities over zero keys: (B, H, Sq, 0), nothing to recompute from the LSE"),
        zero_size=(ValueError, r"lse must be \(B, H, Sq\) = \(0, 4, 8\)")),
    "dropout_mask": dict(
        {c: NA("takes sizes and a seed, no tensors") for c in CASES},
        device=OK(lambda r: r.device.type == "meta"), zero_size=DEFAULT["zero_size"]),
    "scaled_dot_product_attention": dict(
        _NO_INDEX, feature_map_width=NA(_NO_FM), window=NA(_NO_WINDOW),
        ndim=OK(lambda r: r.shape == (2, 4, 8, 16)),  # torch's SDPA broadcasts leading dims: (4, 8, 16) is legal
        batch=OK(lambda r: r.shape == (2, 4, 8, 16)),  # and a size-1 batch of k ...
        heads=OK(lambda r: r.shape == (2, 4, 8, 16)),  # ... or one head of v: torch broadcasts them
        head_dim=(RuntimeError, r"query and key head dims differ"),
        dv=OK(lambda r: r.shape[-1] == 8),  # Dv != D is legal in SDPA (torch's own kernel runs it)
        dtype=(RuntimeError, r"query, key and value must be floating point"),
        mixed_dtype=(RuntimeError, r"Expected query, key, and value to have the same dtype"),
        device=(RuntimeError, r"Expected query, key, and value to have the same device"),
        gqa=(RuntimeError, r"number of heads in key/value \(3\) must divide"),
        head_dim_limit=OK(lambda r: r.shape[-1] == 512)),  # torch's own kernel runs head dims past 256
    "flash_attn_func": dict(_NO_INDEX, **_SOFTMAX_SIDES, window=_FA_WINDOW, empty_seq=OK(_zero_rows(1))),
    "flash_attn_qkvpacked_func": dict(
        _NO_INDEX, **_SOFTMAX_SIDES, window=_FA_WINDOW, ndim=(ValueError, r"qkv must be \(B, S, 3, H, D\)"),
        batch=NA(_PACKED), heads=NA(_PACKED), head_dim=NA(_PACKED), dv=NA(_PACKED), gqa=NA(_PACKED),
        empty_seq=NA(_PACKED),
        mixed_dtype=NA(_PACKED + "; alibi_slopes of another dtype is converted, as flash-attn does"),
        device=(ValueError, r"alibi_slopes must be on cpu, got meta")),
    "flash_attn_kvpacked_func": dict(
        _NO_INDEX, **_SOFTMAX_SIDES, window=_FA_WINDOW, heads=NA("k and v are one packed kv tensor"),
        dv=NA("k and v are one packed kv tensor"), gqa=NA("kv's heads are spoiled by the gqa case of flash_attn_func"),
        empty_seq=NA("covered by flash_attn_func"), batch=(ValueError, r"batch mismatch: q .*, k ")),
    "flash_attn_varlen_func": dict(
        _NO_INDEX, **_SOFTMAX_SIDES, window=_FA_WINDOW, ndim=(ValueError, r"q must be \(total, H, D\)"),
        batch=(ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
        cu_not_monotonic=DEFAULT["cu_not_monotonic"], cu_out_of_range=DEFAULT["cu_out_of_range"],
        block_table_out_of_range=(ValueError, r"block_table"),
        empty_seq=OK(lambda r: bool((r[:3] == 0).all()))),
    "flash_attn_varlen_qkvpacked_func": dict(
        _NO_INDEX, **_SOFTMAX_SIDES, window=_FA_WINDOW, ndim=(ValueError, r"qkv must be \(total, 3, H, D\)"),
        batch=NA(_PACKED), heads=NA(_PACKED), head_dim=NA(_PACKED), dv=NA(_PACKED), gqa=NA(_PACKED),
        mixed_dtype=NA(_PACKED + "; alibi_slopes of another dtype is converted, as flash-attn does"),
        device=(ValueError, r"alibi_slopes must be on cpu, got meta"),
        cu_not_monotonic=DEFAULT["cu_not_monotonic"], cu_out_of_range=DEFAULT["cu_out_of_range"],
        empty_seq=OK(lambda r: True)),
    "flash_attn_varlen_kvpacked_func": dict(
        _NO_INDEX, **_SOFTMAX_SIDES, window=_FA_WINDOW, ndim=(ValueError, r"q must be \(total, H, D\)"),
        batch=(ValueError, r"cu_seqlens_q and cu_seqlens_k must have the same length"),
        heads=NA("k and v are one packed kv tensor"), dv=NA("k and v are one packed kv tensor"),
        gqa=NA("covered by flash_attn_varlen_func"),
        cu_not_monotonic=DEFAULT["cu_not_monotonic"], cu_out_of_range=DEFAULT["cu_out_of_range"],
        empty_seq=OK(lambda r: bool((r[:3] == 0).all()))),
    "flash_attn_with_kvcache": dict(
        _DECODE_ERR, dv=(ValueError, r"v must be \(B=2, S_new, H_k=2, D=16\)"),
        empty_seq=OK(lambda r: bool((r[0] == 0).all())),
        block_table_out_of_range=(ValueError, r"block_table holds a page outside")),
    "flash_attn_with_kvcache[paged]": dict(_DECODE_ERR, empty_seq=OK(lambda r: bool((r[0] == 0).all()))),
    "decode_fwd": dict(
        _DECODE_ERR,
        ndim=(ValueError, r"decode_fwd: q must be 4-D \(B, Sq, H, D\)"),  # its own layout, not the op's
        batch=(ValueError, r"k_cache and v_cache must have the same shape"),
        heads=(ValueError, r"k_cache and v_cache must have the same shape"),
        head_dim=(ValueError, r"k_cache and v_cache must have the same shape"),
        dv=(ValueError, r"k_cache and v_cache must have the same shape"),
        dtype=(TypeError, r"must be float32, float16, bfloat16 or float64, got Long"),
        mixed_dtype=(TypeError, r"q and the caches must share a dtype"),
        device=(RuntimeError, r"q and the caches must be on one device, got cpu, meta"),
        window=(ValueError, r"window_left and window_right must be >= -1"),
        empty_seq=OK(lambda r: bool((r[0][0] == 0).all())),
        block_table_out_of_range=(ValueError, r"block_table"),
        cache_seqlens_beyond_cache=(ValueError, r"seqlens_k\[1\] = 400 is outside")),
    **{f"context_parallel_attention[{m}]": dict(
        _NO_INDEX, **_SOFTMAX_SIDES, **_CP_ERR, window=(ValueError, r"window_size must be >= -1"),
        gqa=(ValueError, r"query heads \(?H?=?4\)? must be a multiple of (the )?(kv|KV) heads"))
       for m in ("allgather", "ring", "ulysses")},
    "context_parallel_linear_attention": dict(
        _NO_INDEX, **{**_CP_ERR, **dict(
            heads=(ValueError, r"q, k, v shards must be \(B, H, n, D\)"),
            head_dim=(ValueError, r"q, k, v shards must be \(B, H, n, D\)"),
            dv=OK(lambda r: r.shape[-1] == 8),  # Dv != D is linear attention's normal case
            gqa=(ValueError, r"with H % H_k == 0, got"))},
        mask_shape=NA(_NO_MASK), mask_dtype=NA(_NO_MASK), window=NA(_NO_WINDOW),
        head_dim_limit=OK(lambda r: r.shape[-1] == 512)),  # no head-dim limit, as linear_attention
    "linear_attention": dict(
        _NO_INDEX, mask_shape=NA(_NO_MASK), mask_dtype=NA(_NO_MASK), window=NA(_NO_WINDOW),
        heads=(ValueError, r"k and v must have the same heads"),
        head_dim=(ValueError, r"feature width mismatch: q has 16, k has 8"),
        dv=OK(lambda r: r.shape[-1] == 8),  # Dv != D is linear attention's normal case
        head_dim_limit=OK(lambda r: r.shape[-1] == 512),  # no head-dim limit: the state is (M, Dv) of any size
        cu_not_monotonic=(ValueError, r"cu_seqlens"), cu_out_of_range=(ValueError, r"cu_seqlens"),
        empty_seq=OK(lambda r: r.shape == (2, 4, 0, 16)),
        feature_map_width=(ValueError, r"feature_map gave q and k different widths: 16 and 17")),
    "linear_attention_step": dict(
        _NO_INDEX, mask_shape=NA(_NO_MASK), mask_dtype=NA(_NO_MASK), window=NA(_NO_WINDOW),
        ndim=(ValueError, r"q_t must be a 4-D Tensor"),
        batch=(ValueError, r"q_t .*, k_t .*, v_t .* do not match"), heads=(ValueError, r"q_t .*, k_t .*, v_t .* do not match"),
        head_dim=(ValueError, r"q_t .*, k_t .*, v_t .* do not match"), gqa=(ValueError, r"q_t .*, k_t .*, v_t .* do not match"),
        dv=OK(lambda r: r[0].shape[-1] == 8),
        dtype=(TypeError, r"q_t, k_t, v_t must share a floating dtype"),
        mixed_dtype=(TypeError, r"q_t, k_t, v_t must share a floating dtype"),
        device=(ValueError, r"q_t, k_t, v_t must be on one device"),
        empty_seq=OK(lambda r: r[0].shape == (2, 4, 0, 16)),
        head_dim_limit=OK(lambda r: r[0].shape[-1] == 512),
        feature_map_width=(ValueError, r"feature_map gave q and k different widths: 16 and 17")),
    "LinearAttentionState": dict(
        {c: NA("a state holds no attention inputs") for c in CASES},
        ndim=(ValueError, r"S must be a 4-D"), batch=(ValueError, r"z must be \(2, 4, 16\)"),
        heads=(ValueError, r"z must be \(2, 4, 16\)"), head_dim=(ValueError, r"z must be \(2, 4, 16\)"),
        dtype=(TypeError, r"S must be floating point"), mixed_dtype=(TypeError, r"z must be floating point"),
        device=(ValueError, r"z must be on S's device"), zero_size=OK(lambda r: r.S.numel() == 0),
        head_dim_limit=NA("a state has no head-dim limit: (M, Dv) of any size")),
    "block_sparse_attention": dict(
        _NO_INDEX, feature_map_width=NA(_NO_FM), layout_out_of_range=DEFAULT["layout_out_of_range"],
        # the layout covers ceil(Sk / block_size) key blocks: with no keys it must have 0 columns
        empty_seq=(ValueError, r"block_layout must be .* = \(4 or 1, 1, 0\)")),
    "topk_attention": dict(_NO_INDEX, feature_map_width=NA(_NO_FM), empty_seq=OK(_zero_rows(1))),
    "nn.MultiheadAttention": dict(
        _NO_INDEX, feature_map_width=NA(_NO_FM), window=NA(_NO_WINDOW),
        ndim=(ValueError, r"query, key and value must all be 3-D"),
        batch=(ValueError, r"key and value must have the same batch and length"),
        heads=(ValueError, r"value must have 32 features"), head_dim=(ValueError, r"key must have 32 features"),
        dv=(ValueError, r"value must have 32 features"), dtype=(TypeError, r"query must be floating point"),
        mixed_dtype=(TypeError, r"key must have query's dtype"), device=(ValueError, r"key must be on the module"),
        gqa=NA("heads come from embed_dim / num_heads, checked at construction"),
        head_dim_limit=(ValueError, r"query must have 32 features")),
    "nn.PagedKVCache": dict(
        _NO_INDEX, **_SOFTMAX_SIDES,
        ndim=(ValueError, r"k must be \(b, T, H_k, D\)"), batch=(ValueError, r"k and v must have one shape"),
        heads=(ValueError, r"v must be \(b, T, H_k, D\)"), head_dim=(ValueError, r"k must be \(b, T, H_k, D\)"),
        dv=(ValueError, r"v must be \(b, T, H_k, D\)"), dtype=(TypeError, r"k must be floating point"),
        mixed_dtype=OK(lambda r: True),  # append casts new rows to the pool's dtype (documented)
        device=(ValueError, r"k must be on the cache's device"),
        gqa=(ValueError, r"query heads \(3\) must be a multiple of kv heads \(2\)"),
        empty_seq=NA("a sequence of the cache with no rows is the zero_size case (zero new rows)"),
        head_dim_limit=(ValueError, r"k must be \(b, T, H_k, D\)"),
        zero_size=OK(lambda r: r.shape == (2, 0, 4, 16))),
}


# The three naming columns, per function: the function's own argument names in the message.
_FA_WINDOW_INT = (TypeError, r"window_size must be a \(left, right\) pair .*window_size=\(4, 0\)")
_NO_LAYOUT_ARG = NA("one fixed layout: no layout argument to mix up")


def _numpy(name, prefix=""):
    return (TypeError, rf"{prefix}\b{name} must be a torch\.Tensor, got numpy\.ndarray: convert it with "
                       rf"torch\.from_numpy\({name}\)")


def _mixup(arg):
    return (ValueError, rf"but fit {arg}='bshd' \(B, S, H, D\): pass {arg}='bshd'")


_NAMING = {
    "attention_varlen": dict(layout_mixup=NA("(total, H, D) packs: one layout")),
    "scaled_dot_product_attention": dict(window_int=NA(_NO_WINDOW), numpy=_numpy("query"),
                                         layout_mixup=NA("torch's (B, H, S, D): no layout argument")),
    **{fn: dict(window_int=_FA_WINDOW_INT, layout_mixup=NA("flash-attn's (B, S, H, D): no layout argument"))
       for fn in ("flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
                  "flash_attn_varlen_kvpacked_func")},
    **{fn: dict(window_int=_FA_WINDOW_INT, numpy=_numpy("qkv"),
                layout_mixup=NA("flash-attn's (B, S, H, D): no layout argument"))
       for fn in ("flash_attn_qkvpacked_func", "flash_attn_varlen_qkvpacked_func")},
    **{fn: dict(window_int=_FA_WINDOW_INT, numpy=_numpy("q", "flash_attn_with_kvcache: "),
                layout_mixup=NA("flash-attn's (B, S, H, D): no layout argument"))
       for fn in ("flash_attn_with_kvcache", "flash_attn_with_kvcache[paged]")},
    "decode_fwd": dict(window_int=NA("window_left / window_right: the op's two ints"),
                       numpy=_numpy("q", "decode_fwd: "), layout_mixup=_NO_LAYOUT_ARG),
    **{f"context_parallel_attention[{m}]": dict(window_int=_FA_WINDOW_INT) for m in ("allgather", "ring", "ulysses")},
    "context_parallel_linear_attention": dict(window_int=NA(_NO_WINDOW)),
    "linear_attention": dict(window_int=NA(_NO_WINDOW)),
    "linear_attention_step": dict(window_int=NA(_NO_WINDOW), numpy=_numpy("q_t")),
    "nn.MultiheadAttention": dict(window_int=NA(_NO_WINDOW), numpy=_numpy("query", "nn.MultiheadAttention: "),
                                  layout_mixup=NA("(N, L, E) embeddings: no heads dim to mix up")),
    "nn.PagedKVCache": dict(layout_mixup=_NO_LAYOUT_ARG),
}
for _fn, _cols in _NAMING.items():
    EXPECT[_fn].update(_cols)


def expectation(fn, case):
    return EXPECT[fn].get(case, DEFAULT[case])


ROWS = [(fn, case, expectation(fn, case)) for fn in FUNCTIONS for case in CASES]


def _id(row):
    return f"{row[0]}-{row[1]}"


def test_table_complete():
    """Every public function that takes tensors is a row group, every case a column; NA says why."""
    public = {"attention", "attention_varlen", "attention_weights", "dropout_mask", "scaled_dot_product_attention",
              "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
              "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "flash_attn_with_kvcache",
              "decode_fwd", "linear_attention", "linear_attention_step", "LinearAttentionState",
              "block_sparse_attention", "topk_attention", "nn.MultiheadAttention", "nn.PagedKVCache",
              "context_parallel_attention", "context_parallel_linear_attention"}
    assert public <= {f.split("[")[0] for f in FUNCTIONS}
    assert set(EXPECT) == set(FUNCTIONS)
    for fn in FUNCTIONS:
        assert set(EXPECT[fn]) <= set(CASES), fn
    assert len(ROWS) == len(FUNCTIONS) * len(CASES)


def _check_row(fn, case, exp):
    if isinstance(exp, NA):
        pytest.skip(f"not applicable: {exp.reason}")
    call = build(fn, case)
    if isinstance(exp, OK):
        r = call()
        assert exp.check(r), f"{fn} {case}: wrong result"
        return
    exc, msg = exp
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fn,case,exp", [r for r in ROWS if r[1] not in CRASH_PRONE],
                         ids=[_id(r) for r in ROWS if r[1] not in CRASH_PRONE])
def test_bad_input(fn, case, exp):
    _check_row(fn, case, exp)


_EMPTY = ("zero_size", "empty_seq")
_NO_BACKWARD = {"flash_attn_with_kvcache": "not differentiable (as flash-attn's): an error with grad",
                "flash_attn_with_kvcache[paged]": "not differentiable (as flash-attn's): an error with grad",
                "decode_fwd": "no backward: it raises (tests/decode/test_cpu.py::test_backward_raises)",
                "nn.PagedKVCache": "no backward: decode_fwd's raises",
                "LinearAttentionState": "a state, not an attention call"}
_EMPTY_ROWS = [(fn, case) for fn in FUNCTIONS for case in _EMPTY if isinstance(expectation(fn, case), OK)]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("fn,case", _EMPTY_ROWS, ids=[f"{fn}-{case}" for fn, case in _EMPTY_ROWS])
def test_empty_backward(fn, case):
    """Where 0-size tensors or a zero-length sequence give a result (the OK cells of those two
    columns), the backward through it runs too and gives finite gradients of the inputs' shapes:
    autograd hands it empty gradients whose strides are arbitrary."""
    spec = SPECS[fn]
    a = spec["make"]()
    OVERRIDES.get((fn, case), CASES[case])(a, spec)
    leaves = [t.requires_grad_() for t in a.values() if isinstance(t, torch.Tensor) and t.is_floating_point()
              and t.is_leaf]
    if fn in _NO_BACKWARD:
        pytest.skip(f"{fn}: {_NO_BACKWARD[fn]}")
    with one_rank_group() if fn.startswith("context_parallel") else contextlib.nullcontext():  # the backward's collectives
        r = spec["call"](a)
        out = r[0] if isinstance(r, tuple) else r
        if not out.requires_grad:
            pytest.skip(f"{fn} has no backward")
        out.sum().backward()
    for t in leaves:
        assert t.grad is None or (t.grad.shape == t.shape and bool(torch.isfinite(t.grad).all())), fn


_CHILD = """
import json, sys, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
from tests.test_bad_inputs import build
for fn, case in json.loads(sys.argv[1]):
    print(json.dumps(["begin", fn, case]), flush=True)
    try:
        build(fn, case)()
        print(json.dumps(["returned", fn, case]), flush=True)
    except Exception as e:  # noqa: BLE001
        print(json.dumps(["raised", fn, case, type(e).__name__, str(e).splitlines()[0] if str(e) else ""]),
              flush=True)
"""
_CRASH_ROWS = [r for r in ROWS if r[1] in CRASH_PRONE]
_crash_results = {}


def _run_crash_prone():
    """Every applicable crash-prone row in child processes, one child for all of them while none
    dies: {(fn, case): ("raised", type, message) | ("returned",) | ("died", exit code, stderr)}.
    A child killed by a signal is charged to the row it had begun; a new child takes the rest."""
    todo = [(fn, case) for fn, case, exp in _CRASH_ROWS if not isinstance(exp, NA)]
    while todo:
        r = subprocess.run([sys.executable, "-c", _CHILD.format(root=ROOT), json.dumps(todo)], capture_output=True,
                           text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
        current = None
        for line in r.stdout.splitlines():
            if not line.startswith("["):
                continue
            kind, fn, case, *rest = json.loads(line)
            if kind == "begin":
                current = (fn, case)
            else:
                _crash_results[(fn, case)] = (kind, *rest)
                current = None
        done = [row for row in todo if row in _crash_results]
        if current is not None:  # the child died inside this row
            _crash_results[current] = ("died", r.returncode, r.stderr[-2000:])
            done.append(current)
        elif len(done) < len(todo):  # died before its first row: charge every row left
            for row in todo:
                _crash_results.setdefault(row, ("died", r.returncode, r.stderr[-2000:]))
            done = todo
        todo = [row for row in todo if row not in done]


@pytest.mark.parametrize("fn,case,exp", _CRASH_ROWS, ids=[_id(r) for r in _CRASH_ROWS])
def test_bad_index_in_subprocess(fn, case, exp):
    """Index values a kernel reads memory with: a missed check could read out of bounds, so the
    calls run in a child process (one for every row, _run_crash_prone), in which each must raise
    the Python exception; a child killed by a signal fails the row it was in."""
    if isinstance(exp, NA):
        pytest.skip(f"not applicable: {exp.reason}")
    if not _crash_results:
        _run_crash_prone()
    exc, msg = exp
    got = _crash_results[(fn, case)]
    assert got[0] != "died", f"the child died (exit {got[1]}; negative: a signal) in this row; stderr: {got[2]}"
    assert got[0] == "raised", "the call returned instead of raising"
    assert got[1] == exc.__name__ and re.search(msg, got[2]), f"{got[1]}: {got[2]}"


@pytest.mark.parametrize("call,name", [
    (lambda m: ae.attention(*_bhsd().values(), attn_mask=m.numpy()), "attn_mask"),
    (lambda m: ae.attention(*_bhsd().values(), key_mask=m[0].expand(B, SK).numpy()), "key_mask"),
    (lambda m: ae.attention_weights(*list(_bhsd().values())[:2], key_mask=m[0].expand(B, SK).numpy()), "key_mask"),
    (lambda m: ae.linear_attention(rn(B, H, SQ, D), rn(B, HK, SQ, D), rn(B, HK, SQ, D),
                                   key_mask=m[0, :SQ].expand(B, SQ).numpy()), "key_mask"),
    (lambda m: ae.attention([[1.0]], *list(_bhsd().values())[1:]), "q"),
], ids=["attention-attn_mask", "attention-key_mask", "attention_weights-key_mask", "linear_attention-key_mask",
        "attention-list"])
def test_not_a_tensor_says_how_to_convert(call, name):
    """A mask given as a numpy array (or q as a list) names the argument and the conversion: the
    check every family's functional layer shares (attention_ext/_args.py)."""
    fix = "torch.tensor" if name == "q" else "torch.from_numpy"
    with pytest.raises(TypeError, match=rf"\b{name} must be a torch\.Tensor, got .*: convert it with {fix}\({name}\)"):
        call(torch.ones(SQ, SK, dtype=torch.bool))


def test_flash_attn_func_bhsd_inputs_get_the_drop_ins_hint():
    """Found by an audit: (B, H, S, D) tensors passed to flash_attn_func got attention()'s hint
    "pass layout='bhsd'", an argument flash_attn_func does not take; the hint now says to
    transpose (or to call attention with layout='bhsd')."""
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)  # (B, H, S, D)
    with pytest.raises(ValueError, match=r"flash_attn_func takes flash-attn's \(B, S, H, D\).*transpose"):
        ae.flash_attn_func(q, k, v)
