"""The float64 references themselves: against softmax attention where they must agree, and on
constructed cases (ties, argmax, empty rows)."""
from __future__ import annotations

import pytest
import torch

from attention_ext import reference as softmax_ref
from attention_ext.sparse import layouts as L
from attention_ext.sparse.reference import block_sparse_attention_ref, topk_attention_ref

f64 = torch.float64


def qkv(b=2, h=4, hk=2, sq=37, sk=45, d=16):
    return (torch.randn(b, h, sq, d, dtype=f64), torch.randn(b, hk, sk, d, dtype=f64),
            torch.randn(b, hk, sk, d, dtype=f64))


@pytest.mark.parametrize("causal", [False, True])
def test_dense_layout_is_softmax_attention(causal):
    q, k, v = qkv(sq=45)
    lay = torch.ones(1, 3, 3, dtype=torch.bool)
    out, lse = block_sparse_attention_ref(q, k, v, lay, 16, causal=causal)
    ro, rl = softmax_ref.attention(q, k, v, window=(-1, 0) if causal else (-1, -1))
    torch.testing.assert_close(out, ro)
    torch.testing.assert_close(lse, rl)


def test_block_sparse_ref_masks_blocks_and_empty_rows():
    q, k, v = qkv(h=2, hk=1, sq=40, sk=40)
    lay = torch.zeros(2, 3, 3, dtype=torch.bool)
    lay[:, 0, 0] = lay[:, 2, 1] = True  # query block 1 computes nothing
    out, lse = block_sparse_attention_ref(q, k, v, lay, 16)
    assert torch.isfinite(out).all()
    assert (out[:, :, 16:32] == 0).all() and torch.isinf(lse[:, :, 16:32]).all() and (lse[:, :, 16:32] < 0).all()
    # query block 2 sees exactly keys 16..31
    ro, _ = softmax_ref.attention(q[:, :, 32:], k[:, :, 16:32], v[:, :, 16:32])
    torch.testing.assert_close(out[:, :, 32:], ro)


def test_topk_ge_sk_is_dense():
    q, k, v = qkv()
    for causal in (False, True):
        out, lse = topk_attention_ref(q, k, v, 45, causal=causal)
        ro, rl = softmax_ref.attention(q, k, v, window=(-1, 0) if causal else (-1, -1))
        torch.testing.assert_close(out, ro)
        torch.testing.assert_close(lse, rl)
        torch.testing.assert_close(topk_attention_ref(q, k, v, 1000, causal=causal)[0], ro)


def test_topk_one_is_argmax():
    q, k, v = qkv(hk=4)
    out, lse = topk_attention_ref(q, k, v, 1)
    s = q @ k.transpose(-1, -2) / 4.0
    idx = s.argmax(-1)  # (B, H, S_q)
    torch.testing.assert_close(out, torch.gather(v, 2, idx.unsqueeze(-1).expand(-1, -1, -1, 16)))
    torch.testing.assert_close(lse, s.amax(-1))


def test_topk_ties_lower_index_wins():
    # keys 1, 3 and 4 equal (the highest score); k_top = 2 keeps keys 1 and 3
    d = 4
    q = torch.tensor([1.0, 0, 0, 0], dtype=f64).view(1, 1, 1, d)
    k = torch.zeros(1, 1, 6, d, dtype=f64)
    k[0, 0, [1, 3, 4], 0] = 2.0
    k[0, 0, 5, 0] = 1.0
    v = torch.arange(6 * d, dtype=f64).view(1, 1, 6, d)
    out, _ = topk_attention_ref(q, k, v, 2)
    torch.testing.assert_close(out[0, 0, 0], (v[0, 0, 1] + v[0, 0, 3]) / 2)
    out, _ = topk_attention_ref(q, k, v, 4)  # the three ties, then the 1.0 key
    w = torch.softmax(torch.tensor([1.0, 1.0, 1.0, 0.5], dtype=f64), 0)
    torch.testing.assert_close(out[0, 0, 0], w @ v[0, 0, [1, 3, 4, 5]])


def test_topk_respects_masks_and_empty_rows():
    q, k, v = qkv(b=2, h=2, hk=2, sq=8, sk=8)
    kpm = torch.ones(2, 8, dtype=torch.bool)
    kpm[1] = False
    out, lse = topk_attention_ref(q, k, v, 3, causal=True, key_mask=kpm)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()
    # row 0 (causal) has one allowed key whatever k_top
    torch.testing.assert_close(out[0, :, 0], v[0, :, 0])
    torch.testing.assert_close(topk_attention_ref(q, k, v, 0)[0], torch.zeros_like(q))


def test_from_mask_args_feed_the_reference():
    q, k, v = qkv(sq=50, sk=50)
    sm = L.from_mask(lambda i, j: (j <= i) & (i - j < 20), 16, seq_len=50)
    args = L.sparse_mask_args(sm)
    out, _ = block_sparse_attention_ref(q, k, v, **args)
    ro, _ = softmax_ref.attention(q, k, v, window=(19, 0))
    torch.testing.assert_close(out, ro)
