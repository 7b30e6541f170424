"""Reformer's shared-QK LSH attention (Kitaev et al. 2020): lsh_attention and lsh_buckets.

The op (attention_ext::lsh_attention, csrc/torch/sparse_lsh.cpp) hashes, sorts and gathers in
ATen and runs the chunked attention on the fused softmax kernel with a (C, 2C) mask per chunk:
memory O(S * chunk_size) per hash round, never S x S. This module draws the random rotations
when none are given and moves between layouts; the op states and checks every input rule.
"""
from __future__ import annotations

import warnings
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .._args import as_int, not_a_tensor
from .._ext import HAS_EXT
from ..softmax import ops as softmax_ops
from . import reference

__all__ = ["lsh_attention", "lsh_buckets"]

_warned = set()


def _bhsd(t, layout: str, fn: str):
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"{fn}: layout must be 'bhsd' or 'bshd', got {layout!r}")
    return t.transpose(1, 2) if layout == "bshd" and isinstance(t, Tensor) and t.dim() == 4 else t


def _draw_rotations(qk: Tensor, n_buckets, n_hashes, generator: Optional[torch.Generator]) -> Optional[Tensor]:
    """(n_hashes, D, n_buckets // 2) standard normal rotations from `generator` (default: torch's),
    in the float side dtype on qk's device; None where the arguments are not ints (the op names
    what is wrong). Negative sizes draw nothing: the op's check reports them."""
    if not (isinstance(qk, Tensor) and qk.dim() == 4 and type(n_buckets) is int and type(n_hashes) is int):
        return None
    dtype = torch.float64 if qk.dtype == torch.float64 else torch.float32
    dev = generator.device if generator is not None else qk.device
    r = torch.randn(max(n_hashes, 0), qk.shape[-1], max(n_buckets // 2, 0), generator=generator, device=dev,
                    dtype=dtype)
    return r.to(qk.device)


def lsh_buckets(qk: Tensor, rotations: Tensor, n_buckets: int, *, layout: str = "bhsd") -> Tensor:
    """The hash of lsh_attention alone: (B, H, n_hashes, S) int64 buckets of qk's rows,
    argmax([x R_r ; -x R_r]) per round r (rotations (n_hashes, D, n_buckets // 2))."""
    qk = _bhsd(qk, layout, "lsh_buckets")
    if not HAS_EXT:
        return reference.lsh_buckets_ref(qk, rotations, n_buckets)
    return torch.ops.attention_ext.lsh_buckets(qk, rotations, n_buckets)


def lsh_attention(qk: Tensor, v: Tensor, *, n_buckets: int, n_hashes: int = 1, chunk_size: int = 64,
                  causal: bool = False, rotations: Optional[Tensor] = None,
                  generator: Optional[torch.Generator] = None, layout: str = "bhsd",
                  return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Reformer's LSH attention with shared queries and keys.

    Args:
        qk: (B, H, S, D) (or (B, S, H, D) with layout="bshd"): the shared query / key projection.
            Queries are its rows; keys its rows scaled to unit length; the scale is 1 / sqrt(D).
        v: (B, H, S, D), qk's shape and layout.
        n_buckets: hash buckets per round, 1 or even: bucket(x) = argmax([x R ; -x R]), R a
            (D, n_buckets / 2) random rotation. About S / chunk_size buckets keeps each bucket
            near one chunk (the paper's choice).
        n_hashes: hash rounds; their outputs combine by their log-sum-exps.
        chunk_size: positions sorted by (bucket, position) are cut into chunks of this many;
            a query attends the keys of its bucket in its chunk and the one before.
        causal: a query attends no later position.
        rotations: (n_hashes, D, n_buckets // 2) float, else drawn (standard normal) from
            `generator` (default: torch's, so torch.manual_seed reproduces them). Pass them to
            hash the same way on every call (a model's forward draws fresh ones, as Reformer's).
        layout: "bhsd" or "bshd".
        return_lse: also return the (B, H, S) log-sum-exp over every round (float32; float64
            for float64 inputs).

    A query with no other key in its bucket and chunks attends itself alone, at logit -1e5 (its
    output is its value, and its round's weight against the others about 0). Memory is
    O(S * chunk_size) per round and time O(S log S + S * chunk_size * D): the sort, then the
    chunks on the fused softmax kernel. Differentiable in qk and v (the buckets are not).
    Returns out (B, H, S, D) in qk's layout (and the LSE).
    """
    for name, t in (("qk", qk), ("v", v), ("rotations", rotations)):
        if not isinstance(t, Tensor) and (t is not None or name != "rotations"):
            raise not_a_tensor(name, t, "lsh_attention")
    for name, x in (("n_buckets", n_buckets), ("n_hashes", n_hashes), ("chunk_size", chunk_size)):
        if as_int(x) is None:
            raise TypeError(f"lsh_attention: {name} must be an int, got {x!r}")
    n_buckets, n_hashes, chunk_size = as_int(n_buckets), as_int(n_hashes), as_int(chunk_size)
    qk, v = _bhsd(qk, layout, "lsh_attention"), _bhsd(v, layout, "lsh_attention")
    if rotations is None:
        rotations = _draw_rotations(qk, n_buckets, n_hashes, generator)
    if HAS_EXT and isinstance(qk, Tensor) and softmax_ops.has_kernel(qk.device, qk.dtype):
        out, lse = torch.ops.attention_ext.lsh_attention(qk, v, rotations, n_buckets, n_hashes, chunk_size, causal)
    else:
        if HAS_EXT:  # the op's input rules, on meta tensors (no kernel runs)
            meta = lambda t: t.to("meta") if isinstance(t, Tensor) else t  # noqa: E731
            torch.ops.attention_ext.lsh_attention(meta(qk), meta(v), meta(rotations), n_buckets, n_hashes, chunk_size,
                                                  causal)
        key = (qk.device.type, qk.dtype)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"attention_ext: no compiled kernel for {qk.dtype} on {qk.device}; lsh_attention runs the "
                          "dense PyTorch reference (S x S memory)", RuntimeWarning)
        # hashed as the op hashes (in the float side dtype), computed in it
        buckets = torch.ops.attention_ext.lsh_buckets(qk, rotations, n_buckets) if HAS_EXT else None
        acc = softmax_ops.acc_dtype(qk.dtype)
        out, lse = reference.lsh_attention_ref(qk.to(acc), v.to(acc), rotations, n_buckets, chunk_size, causal=causal,
                                               buckets=buckets)
        out, lse = out.to(qk.dtype), lse.to(acc)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
