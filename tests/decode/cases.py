"""Decode problems shared by the emulated CUDA test (tests/cuda_emu/test_decode_emulated.py) and
the GPU test (tests/decode/test_cuda.py): random caches in flash-attn's layout, contiguous or
paged (a shuffled page pool), ragged cache_seqlens, cache_batch_idx, leftpad and the score
options; `check` compares a kernel's (out, lse) with reference.decode_attention in float64 under
the project rule (tests/helpers.assert_close_fa2: <= 2x PyTorch's same-dtype error + a floor)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from attention_ext.decode import reference
from tests.helpers import assert_close_fa2

f64 = torch.float64


@dataclass
class Case:
    b: int = 4
    h: int = 8
    hk: int = 2
    sq: int = 1
    d: int = 64
    dtype: torch.dtype = torch.bfloat16
    seqlens: Sequence[int] = (0, 1, 37, 100)
    page: Optional[int] = None          # paged cache with this page size; None = contiguous
    batch_idx: bool = False             # cache_batch_idx into a larger contiguous cache
    leftpad: bool = False
    window: tuple = (-1, -1)            # causal = (-1, 0)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    num_splits: int = 1


def option_sets(w: int) -> dict:
    """The option combinations every decode test runs (Case keywords), windows of 13 w to 30 w
    keys: w = 10 for the CPU and GPU tests, 1 for the emulator's small caches."""
    return {
        "window": dict(window=(13 * w, -1)),
        "window_lr": dict(window=(20 * w, 3)),
        "causal": dict(window=(-1, 0)),
        "sinks": dict(sinks=True),
        "alibi": dict(alibi=True),
        "softcap": dict(softcap=5.0),
        "batch_idx": dict(batch_idx=True),
        "leftpad": dict(leftpad=True),
        "leftpad_paged": dict(leftpad=True, page=5),
        "all": dict(window=(30 * w, 0), sinks=True, alibi=True, softcap=8.0, leftpad=True, batch_idx=True),
    }


def make_inputs(c: Case, device="cpu"):
    """q (B, Sq, H, D); caches (B_cache, S_cache, H_k, D) or (num_pages, page, H_k, D); kwargs of
    reference.decode_attention / ops.decode_fwd (index tensors int32 on `device`)."""
    b = c.b
    lens = torch.tensor(list(c.seqlens), dtype=torch.int32)
    assert lens.numel() == b
    cap = int(lens.max()) + 3  # room past the longest sequence (never read)
    q = torch.randn(b, c.sq, c.h, c.d).to(c.dtype)
    kw = dict(softmax_scale=c.d ** -0.5, window_size=c.window, softcap=c.softcap)
    idx = {}
    if c.page is not None:
        per = math.ceil(cap / c.page)
        n_pages = b * per + 3
        k = torch.randn(n_pages, c.page, c.hk, c.d).to(c.dtype)
        v = torch.randn(n_pages, c.page, c.hk, c.d).to(c.dtype)
        idx["block_table"] = torch.randperm(n_pages)[: b * per].reshape(b, per).to(torch.int32)
    else:
        n_cache = b + 2 if c.batch_idx else b
        k = torch.randn(n_cache, cap, c.hk, c.d).to(c.dtype)
        v = torch.randn(n_cache, cap, c.hk, c.d).to(c.dtype)
        if c.batch_idx:
            idx["cache_batch_idx"] = torch.randperm(n_cache)[:b].to(torch.int32)
    idx["cache_seqlens"] = lens
    if c.leftpad:
        idx["cache_leftpad"] = (torch.rand(b) * (lens.float() + 1)).floor().clamp(max=lens.float()).to(torch.int32)
    alibi = torch.rand(c.h, dtype=torch.float32) * 0.5 if c.alibi else None
    sinks = torch.randn(c.h, dtype=torch.float32) if c.sinks else None
    idx = {n: t.to(device) for n, t in idx.items()}
    return (q.to(device), k.to(device), v.to(device), idx, kw,
            None if alibi is None else alibi.to(device), None if sinks is None else sinks.to(device))


def op_args(c: Case, q, k, v, idx, kw, alibi, sinks):
    """The positional arguments of torch.ops.attention_ext.decode_fwd (q and caches as the
    (B, H, S, D) views ops.decode_fwd passes), without num_splits."""
    return (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), idx.get("cache_seqlens"),
            idx.get("block_table"), idx.get("cache_batch_idx"), idx.get("cache_leftpad"), alibi, sinks,
            float(kw["softmax_scale"]), float(kw["softcap"]), int(kw["window_size"][0]), int(kw["window_size"][1]))


def reference_at(rdt, q, k, v, idx, kw, alibi, sinks):
    out, lse = reference.decode_attention(
        q.to(rdt), k.to(rdt), v.to(rdt), alibi_slopes=None if alibi is None else alibi.to(rdt),
        sinks=None if sinks is None else sinks.to(rdt), **idx, **kw)
    return out, lse


def check(c: Case, out, lse, q, k, v, idx, kw, alibi, sinks, what=""):
    """out (B, Sq, H, D) in c.dtype and lse (B, H, Sq) float32 against the float64 reference."""
    assert out.shape == q.shape and out.dtype == c.dtype, (out.shape, out.dtype)
    assert lse.shape == (c.b, c.h, c.sq) and lse.dtype == torch.float32
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    args = (cpu(q), cpu(k), cpu(v), {n: t.cpu() for n, t in idx.items()}, kw, cpu(alibi), cpu(sinks))
    ref, ref_lse = reference_at(f64, *args)
    low, _ = reference_at(c.dtype, *args)
    _, lse32 = reference_at(torch.float32, *args)
    out, lse = out.cpu(), lse.cpu()
    assert not torch.isnan(out).any(), f"{what}: NaN in out (an element the kernel did not write?)"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    assert_close_fa2(out, low, ref, c.dtype, f"{what} out")
    # rows that see no key (and have no sink): lse = -inf exactly; the rest to fp32 accuracy
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), f"{what}: lse -inf pattern"
    assert_close_fa2(lse, lse32, ref_lse, torch.float32, f"{what} lse")
