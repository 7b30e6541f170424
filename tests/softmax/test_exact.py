"""Exactness the softmax must keep: a row with one visible key has probability exactly 1, so
out == v and dV == dO bit for bit, in the forward and the backward alike (they compute the
logit and its exponent with one formula: q.k in gemm's order (fwd.cpp's direct mode too),
tile.h's exp2_arg, simd.h's vexp2_nonpos(0) = 1). Causal top-left: query 0 sees key 0 only.
ALiBi / softcap (non-plain) and the plain path (scale folded into the exp pass) alike."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.softmax import ops

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [40, 64])
@pytest.mark.parametrize("score", ["alibi", "alibi_softcap", "plain"])
@pytest.mark.parametrize("s", [5, 33])  # 5: the forward's direct mode (q.k without packing)
def test_one_visible_key_is_exact(dtype, d, score, s):
    b, h = 2, 4
    for _ in range(5):
        q, k = torch.randn(b, h, s, d).to(dtype), torch.randn(b, h, s, d).to(dtype)
        v = torch.randn(b, h, s, d).to(dtype).requires_grad_()
        kw = dict(alibi_slopes=torch.rand(h) * 0.5 + 0.1) if score != "plain" else {}
        if score == "alibi_softcap":
            kw["softcap"] = 3.0
        out = ae.attention(q, k, v, causal=True, **kw)
        assert torch.equal(out[:, :, 0], v[:, :, 0].detach()), "forward: P(0, 0) != 1"
        g = torch.zeros_like(out)
        g[:, :, 0] = torch.randn(b, h, d).to(dtype)
        out.backward(g)
        # dV of key 0 = sum_i P(i, 0) dO_i, and only row 0 has a nonzero dO
        assert torch.equal(v.grad[:, :, 0], g[:, :, 0]), "backward: P(0, 0) != 1"
