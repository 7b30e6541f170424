"""attention_ext.block_sparse_attention / topk_attention against the float64 references on the
CPU: the builders' patterns, odd lengths, causal, GQA, padding and empty query blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import attention_ext as ae
from attention_ext.sparse import layouts as L
from attention_ext.sparse.reference import block_sparse_attention_ref, topk_attention_ref

f64 = torch.float64


def qkv(b, h, hk, sq, sk, d=24):
    return (torch.randn(b, h, sq, d, dtype=f64), torch.randn(b, hk, sk, d, dtype=f64),
            torch.randn(b, hk, sk, d, dtype=f64))


def check(out_lse, ref):
    out, lse = out_lse
    ro, rl = ref
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ro, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, rl, rtol=1e-10, atol=1e-10)


PATTERNS = {
    "sliding_window": lambda n, bs, h: L.sliding_window(1, seq_len=n, block_size=bs),
    "bigbird": lambda n, bs, h: L.bigbird(1, 1, 1, 3, seq_len=n, block_size=bs, heads=h),
    "strided": lambda n, bs, h: L.strided(2, seq_len=n, block_size=bs, causal=True),
    "fixed": lambda n, bs, h: L.fixed(2, seq_len=n, block_size=bs),
    "longformer": lambda n, bs, h: L.longformer(0, [1], seq_len=n, block_size=bs),
    "random": lambda n, bs, h: L.random(0.5, 1, seq_len=n, block_size=bs, heads=h),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("bs", [32, 64])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_matches_reference(pattern, bs, causal):
    b, h, hk, n = 2, 4, 2, 100  # GQA, an odd length
    q, k, v = qkv(b, h, hk, n, n)
    lay = PATTERNS[pattern](n, bs, h)
    got = ae.block_sparse_attention(q, k, v, lay, block_size=bs, causal=causal, return_lse=True)
    check(got, block_sparse_attention_ref(q, k, v, lay, bs, causal=causal))


def test_block_sparse_empty_query_block_and_padding():
    b, h, n, bs = 2, 2, 100, 32
    q, k, v = qkv(b, h, 1, n, n)
    lay = L.sliding_window(1, seq_len=n, block_size=bs, heads=h).clone()
    lay[:, 1, :] = False  # query rows 32..63 compute nothing
    kpm = torch.ones(b, n, dtype=torch.bool)
    kpm[1, 70:] = False
    out, lse = ae.block_sparse_attention(q, k, v, lay, block_size=bs, key_mask=kpm, return_lse=True)
    assert (out[:, :, 32:64] == 0).all() and not torch.isnan(out).any()
    assert torch.isneginf(lse[:, :, 32:64]).all()
    check((out, lse), block_sparse_attention_ref(q, k, v, lay, bs, key_mask=kpm))


def test_block_sparse_bshd_and_cross_lengths():
    b, h, sq, sk, bs = 1, 2, 70, 130, 32
    q, k, v = qkv(b, h, h, sq, sk)
    lay = L.random(0.5, 2, seq_len=sq, seq_len_k=sk, block_size=bs, heads=h)
    got = ae.block_sparse_attention(*(t.transpose(1, 2) for t in (q, k, v)), lay, block_size=bs,
                                    layout="bshd")
    ref, _ = block_sparse_attention_ref(q, k, v, lay, bs)
    torch.testing.assert_close(got.transpose(1, 2), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("k_top", [1, 5, 100, 200])
@pytest.mark.parametrize("causal", [False, True])
def test_topk_matches_reference(k_top, causal):
    q, k, v = qkv(2, 4, 2, 100, 100)
    got = ae.topk_attention(q, k, v, k_top, causal=causal, return_lse=True)
    check(got, topk_attention_ref(q, k, v, k_top, causal=causal))


def test_topk_ties_and_padding():
    d = 8
    q = torch.zeros(1, 1, 3, d, dtype=f64)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 7, d, dtype=f64)
    k[0, 0, [2, 4, 5], 0] = 3.0  # three tied best keys
    v = torch.randn(1, 1, 7, d, dtype=f64)
    kpm = torch.ones(1, 7, dtype=torch.bool)
    kpm[0, 2] = False
    got = ae.topk_attention(q, k, v, 2, key_mask=kpm, return_lse=True)
    check(got, topk_attention_ref(q, k, v, 2, key_mask=kpm))
    torch.testing.assert_close(got[0][0, 0, 0], (v[0, 0, 4] + v[0, 0, 5]) / 2)


@pytest.mark.parametrize("aligned", [True, False])
def test_sparse_mask_from_mask(aligned):
    """from_mask -> block_sparse_attention takes the SparseMask itself; sparse_mask_args gives the
    same keywords to the reference."""
    n, bs = 100, 32
    if aligned:
        fn = lambda i, j: (j // bs <= i // bs) & (i // bs - j // bs <= 1)  # noqa: E731
    else:
        fn = lambda i, j: (j <= i) & ((i - j < 40) | (j < 5))  # noqa: E731  a causal window with 5 sink keys
    sm = L.from_mask(fn, bs, seq_len=n)
    assert (sm.mask is None) == aligned
    q, k, v = qkv(2, 2, 1, n, n)
    got = ae.block_sparse_attention(q, k, v, sm, return_lse=True)
    check(got, block_sparse_attention_ref(q, k, v, **L.sparse_mask_args(sm)))
    if not aligned:
        allowed = fn(torch.arange(n).view(n, 1), torch.arange(n).view(1, n))
        check(got, block_sparse_attention_ref(q, k, v, torch.ones(1, 4, 4, dtype=torch.bool), bs, attn_mask=allowed))


def test_block_size_must_be_an_int():
    """A float block_size is refused by name (16.9 ran as 16 before), in attention() and
    attention_weights() alike."""
    q = torch.randn(1, 2, 40, 8)
    lay = torch.ones(1, 3, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="block_size must be an int"):
        ae.block_sparse_attention(q, q, q, lay, block_size=16.9)
    with pytest.raises(TypeError, match="block_size must be an int"):
        ae.attention_weights(q, q, block_layout=lay, block_size=16.0)
    assert ae.block_sparse_attention(q, q, q, lay, block_size=16).shape == q.shape
    ref = ae.block_sparse_attention(q, q, q, lay, block_size=16)
    for n in (np.int64(16), torch.tensor(16)):  # integers of other kinds are ints
        torch.testing.assert_close(ae.block_sparse_attention(q, q, q, lay, block_size=n), ref, rtol=0, atol=0)
