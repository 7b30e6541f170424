"""Property-based fuzzing of the linear family: ae.linear_attention with the fused feature maps,
causal or not, normalized or not, decay, initial state, key padding, varlen packs, GQA, Dv != D,
both layouts and unusual strides. Forward, final state and every gradient against the float64
reference under the project's rule (tests/fuzz/common.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note, reproduce_failure
from hypothesis import strategies as st

import attention_ext as ae
from attention_ext.linear import ops, reference
from tests.fuzz.common import (F64, run_with_references, STORAGES, check_grad, check_out, dtypes, head_dims, lengths,
                               log_example, seeds, strided)

pytestmark = pytest.mark.skipif(not ops.has_kernel(torch.device("cpu")), reason="linear op has no CPU kernel")
CODES = {"identity": 0, "elu": 1, "relu": 2}


@given(data=st.data())
def test_fuzz_linear(data):
    draw = data.draw
    dtype = draw(dtypes)
    fmap = draw(st.sampled_from(sorted(CODES)))
    # identity has signed features: its normalizer can cross 0 (an ill-posed division), so it
    # runs unnormalized, as the feature-map tests do
    normalize = fmap != "identity" and draw(st.booleans())
    causal = draw(st.booleans())
    varlen = draw(st.booleans())
    b = 1 if varlen else draw(st.integers(1, 3))
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 3))
    m = draw(head_dims.filter(lambda x: x <= 128))
    dv = draw(st.sampled_from([1, 3, 8, 13, 24, 64, 100]))
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    storage = draw(st.sampled_from(STORAGES))
    kv_storage = draw(st.sampled_from(STORAGES + ["expanded"]))
    decay = causal and draw(st.booleans())
    init = draw(st.booleans())
    kpm = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.5, 2.0]))
    grad = draw(st.booleans())
    if varlen:
        lens = draw(st.lists(st.integers(0, 30), min_size=1, max_size=4))
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        if int(cu[-1]) == 0:
            cu[-1] = 1  # an empty pack is not what this fuzzes
        s, nb = int(cu[-1]) + draw(st.integers(0, 2)), len(lens)  # a tail of rows past the pack's end
    else:
        s, cu, nb = draw(lengths), None, b
    torch.manual_seed(draw(seeds))
    note(dict(dtype=dtype, fmap=fmap, normalize=normalize, causal=causal, b=b, h=h, hk=hk, s=s, m=m, dv=dv,
              layout=layout, storage=(storage, kv_storage), decay=decay, init=init, kpm=kpm, cu=cu))
    shp = (lambda heads, d: (b, heads, s, d)) if layout == "bhsd" else (lambda heads, d: (b, s, heads, d))
    seq_dim, head_dim = (2, 1) if layout == "bhsd" else (1, 2)
    q, fq = strided(shp(h, m), dtype, storage, seq_dim, heads=head_dim, gen_scale=0.5)
    k, fk = strided(shp(hk, m), dtype, kv_storage, seq_dim, heads=head_dim, gen_scale=0.5)
    v, fv = strided(shp(hk, dv), dtype, kv_storage, seq_dim, heads=head_dim)
    acc = ops.acc_dtype(dtype)
    g = (-0.2 * torch.rand(b, h, s, dtype=acc)).requires_grad_(grad) if decay else None
    s0 = torch.rand(nb, h, m, dv + normalize, dtype=acc).requires_grad_(grad) if init else None
    kpm_t = (torch.rand(b, s) > 0.25) if kpm else None
    to_bhsd = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))

    def call(L):
        out, st_ = ae.linear_attention(fq(L[0]), fk(L[1]), fv(L[2]), feature_map=fmap, causal=causal,
                                       normalize=normalize, scale=scale, decay=L[3], key_padding_mask=kpm_t,
                                       cu_seqlens=cu, layout=layout, initial_state=L[4], return_state=True)
        return to_bhsd(out), st_.augmented(normalize)

    def ref_call(L):
        o, _, f = reference.linear_attention(to_bhsd(fq(L[0])), to_bhsd(fk(L[1])), to_bhsd(fv(L[2])),
                                             feature_map=CODES[fmap], causal=causal, normalize=normalize,
                                             scale=1.0 if scale is None else scale, decay=L[3], initial_state=L[4],
                                             key_mask=kpm_t, cu_seqlens=cu)
        return o, f

    leaves = [q, k, v, g, s0]
    (out, fin), (r64, (ref, ref_fin)), (rlow, (low, low_fin)) = run_with_references(call, ref_call, leaves, grad,
                                                                                    dtype)
    if cu is not None:  # rows past the pack's end belong to no sequence
        end = int(cu[-1])
        out, ref, low = out[:, :, :end], ref[:, :, :end], low[:, :, :end]
    check_out(out, low, ref, dtype, "out")
    # the state is kept in the accumulation dtype; fp16's own state overflows where fp32's does not
    check_out(fin, low_fin, ref_fin, dtype if dtype != torch.float16 else torch.float32, "final state")
    if grad:
        dout = torch.randn(out.shape, dtype=F64).to(dtype)
        dfin = torch.randn(fin.shape, dtype=F64).to(fin.dtype)
        idx = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
        ours = torch.autograd.grad([out, fin], [leaves[i] for i in idx], [dout, dfin], allow_unused=True)
        g64 = torch.autograd.grad([ref, ref_fin], [r64[i] for i in idx], [dout.to(F64), dfin.to(F64)],
                                  allow_unused=True)
        glow = torch.autograd.grad([low, low_fin], [rlow[i] for i in idx], [dout, dfin.to(low_fin.dtype)],
                                   allow_unused=True)
        # d decay_t is a sum of dout_i . out_i-sized terms that cancel (exactly, to 0, for t = 0 with
        # no initial state, where PyTorch's autograd happens to give an exact 0): its rounding is
        # that of those terms, so its floor scales with them (found by the long profile: S = 1,
        # M = 65, unnormalized, d decay = 6.3e-5 against a 5e-5 floor)
        terms = (ref.detach().abs() * dout.double().abs()).sum(-1).max().item() if ref.numel() else 0.0
        for i, o, r, lo in zip(idx, ours, g64, glow):
            z = torch.zeros_like(leaves[i])
            o, r, lo = (z if t is None else t for t in (o, r, lo))
            assert o.shape == leaves[i].shape
            fs = max(1.0, terms / max(r.detach().abs().max().item(), 1.0)) if i == 3 else 1.0
            check_grad(o, lo, r, dtype, f"grad of {['q', 'k', 'v', 'decay', 'initial_state'][i]}", fs)
    log_example("linear", fmap)


@pytest.mark.xfail(strict=True, reason="open: the fp16 gradient of k exceeds the rule on a small relu problem with "
                   "decay, key padding and a varlen pack (error 7.1e-3 vs 3 x torch's 1.8e-3 + 5e-4); not "
                   "investigated: relu features are sparse, so the normalizer phi(q_i) . z_i can be small and amplify "
                   "the fp16 rounding of the stored output the backward reads")
@reproduce_failure("6.155.2", b"AEECQQIBAQFBAUEBQQRBA0EAQQBBAAEAAUEBAQFBEQBBAkEB")
@given(data=st.data())
def test_fp16_relu_decay_grad_k(data):
    """Found by test_fuzz_linear (long profile): fp16, relu, normalized, causal, decay, B = H = 1,
    S = 19 with a pack of one 17-row sequence (2 tail rows), M = 7, Dv = 13, key_padding_mask."""
    test_fuzz_linear.hypothesis.inner_test(data)
