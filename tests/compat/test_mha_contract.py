"""attention_ext.nn.MultiheadAttention against the input rules of torch.nn.MultiheadAttention:
the inputs torch refuses are refused (is_causal without attn_mask, masks of integers, masks of the
wrong shape), ours with a ValueError / TypeError that names the argument where torch asserts.
The numbers against torch's module are tests/test_nn.py's."""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext.nn import MultiheadAttention
from attention_ext.softmax import ops

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")


def _pair():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    ours = MultiheadAttention(32, 4, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batched", [True, False])
def test_is_causal_needs_attn_mask(batched, need_weights):
    """is_causal is a hint about attn_mask: without the mask torch raises RuntimeError, and so do we
    (ours says what mask to pass)."""
    ref, ours = _pair()
    x = torch.randn(2, 5, 32) if batched else torch.randn(5, 32)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        ref(x, x, x, is_causal=True, need_weights=need_weights)
    with pytest.raises(RuntimeError, match=r"is_causal=True .* needs that mask: pass "
                                           r"attn_mask=nn.Transformer.generate_square_subsequent_mask\(L\)"):
        ours(x, x, x, is_causal=True, need_weights=need_weights)


@pytest.mark.parametrize("name", ["key_padding_mask", "attn_mask"])
@pytest.mark.parametrize("dtype", [torch.long, torch.uint8, torch.int32])
def test_integer_masks_are_refused(name, dtype):
    """A mask of integers has no meaning in either convention: torch asserts, ours raises a
    TypeError naming the mask (it was added to the scores as numbers before)."""
    ref, ours = _pair()
    x = torch.randn(2, 5, 32)
    mask = torch.zeros((2, 5) if name == "key_padding_mask" else (5, 5), dtype=dtype)
    with pytest.raises(AssertionError):
        ref(x, x, x, **{name: mask})
    with pytest.raises(TypeError, match=rf"{name} must be bool or floating point .*, got {dtype}$"):
        ours(x, x, x, **{name: mask})


@pytest.mark.parametrize("name,shape,msg", [
    ("key_padding_mask", (2, 4), r"key_padding_mask must be \(N, S\) = \(2, 5\)"),
    ("key_padding_mask", (5,), r"key_padding_mask must be \(N, S\) = \(2, 5\)"),
    ("attn_mask", (3, 5, 5), r"attn_mask must be \(L, S\) = \(5, 5\) or \(N \* num_heads, L, S\) = \(8, 5, 5\)"),
    ("attn_mask", (1, 2, 5, 5), r"attn_mask must be \(L, S\) = \(5, 5\) or \(N \* num_heads, L, S\)"),
])
def test_mask_shapes_are_named(name, shape, msg):
    """A mask of the wrong shape: an error that names the mask and the shape it must have, where
    it failed inside a view before."""
    ref, ours = _pair()
    x = torch.randn(2, 5, 32)
    mask = torch.zeros(shape, dtype=torch.bool)
    with pytest.raises((AssertionError, RuntimeError)):
        ref(x, x, x, **{name: mask})
    with pytest.raises(ValueError, match=msg):
        ours(x, x, x, **{name: mask})


def test_constructor_errors():
    """torch asserts that embed_dim divides by num_heads; ours raises ValueError with both numbers."""
    with pytest.raises(AssertionError):
        torch.nn.MultiheadAttention(30, 4)
    with pytest.raises(ValueError, match="embed_dim=30 must be divisible by num_heads=4"):
        MultiheadAttention(30, 4)
    for mha in (torch.nn.MultiheadAttention, MultiheadAttention):
        with pytest.raises(ValueError):
            mha(0, 4)


def test_weights_under_autocast():
    """need_weights=True (the default) under torch.autocast, as torch's module allows: the weights
    are recomputed with autocast off (a bf16 recompute did not sum to the kernel's float32 LSE and
    raised), and match torch's module with the same parameters to bf16's rounding."""
    torch.manual_seed(0)
    ours = MultiheadAttention(32, 4, batch_first=True)
    peer = torch.nn.MultiheadAttention(32, 4, batch_first=True)
    peer.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, w = ours(x, x, x)
        out_t, w_t = peer(x, x, x)
        w_f = ae.attention_weights(*(torch.randn(1, 2, 4, 8) for _ in range(2)))  # the functional form
    torch.testing.assert_close(out.float(), out_t.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(w.float(), w_t.float(), atol=1e-2, rtol=0)
    assert w_f.dtype == torch.float32


@pytest.mark.parametrize("need_weights", [False, True])
def test_dropout_one_in_training_as_torch(need_weights):
    """dropout=1.0 in training drops every weight as torch's module does: out is out_proj's bias,
    the gradients of the inputs are zero, the weights (before dropout, docstring) still returned."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 2, dropout=1.0, batch_first=True)
    ours = MultiheadAttention(16, 2, dropout=1.0, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for m in (ref, ours):
            m.out_proj.bias.fill_(0.25)
    x = torch.randn(2, 5, 16, requires_grad=True)
    outs = [m(x, x, x, need_weights=need_weights)[0] for m in (ref, ours)]
    for out in outs:
        torch.testing.assert_close(out, torch.full_like(out, 0.25))
    (gx,) = torch.autograd.grad(outs[1].sum(), x)
    assert torch.equal(gx, torch.zeros_like(gx))
