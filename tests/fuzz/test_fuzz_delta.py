"""Property-based fuzzing of the delta rule (ae.delta_rule_attention): DeltaNet, Gated DeltaNet
and KDA gates, GVA head groups, qk_l2norm, initial states, varlen packs with empty sequences and
a tail, both layouts and unusual strides, every dtype. Forward, final state and every gradient
against the float64 recurrence under the project's rule (tests/fuzz/common.py), the same-dtype
comparison being the recurrence run in PyTorch at that dtype."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import attention_ext as ae
from attention_ext.linear import delta, reference
from tests.fuzz.common import (F64, STORAGES, at_least, check_grad, check_out, copies, dtypes, lengths, log_example,
                               seeds, strided)

pytestmark = pytest.mark.skipif(not delta.has_kernel(torch.device("cpu")), reason="no CPU delta kernel")


@at_least(150)
@given(data=st.data())
def test_fuzz_delta(data):
    delta_case(data.draw, note)


def delta_case(draw, note):
    dtype = draw(dtypes)
    varlen = draw(st.booleans())
    b = 1 if varlen else draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    hv = hk * draw(st.integers(1, 3))
    kd = draw(st.sampled_from([1, 3, 8, 16, 17, 33, 64, 100, 128]))
    vd = draw(st.sampled_from([1, 5, 16, 31, 32, 33, 64, 100]))
    gate = draw(st.sampled_from([None, "head", "key"]))
    l2 = draw(st.booleans())
    init = draw(st.booleans())
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    storage = draw(st.sampled_from(STORAGES))
    grad = draw(st.booleans())
    if varlen:
        lens = draw(st.lists(st.integers(0, 25), min_size=1, max_size=4))
        cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
        if int(cu[-1]) == 0:
            cu[-1] = 1  # an empty pack is test_delta.py's case, not this one's
        s, nb = int(cu[-1]) + draw(st.integers(0, 2)), len(lens)
    else:
        s, cu, nb = draw(lengths), None, b
    torch.manual_seed(draw(seeds))
    note(dict(dtype=dtype, b=b, hk=hk, hv=hv, s=s, kd=kd, vd=vd, gate=gate, l2=l2, init=init, layout=layout,
              storage=storage, cu=cu, grad=grad))
    shp = (lambda h, d: (b, h, s, d)) if layout == "bhsd" else (lambda h, d: (b, s, h, d))
    seq_dim, head_dim = (2, 1) if layout == "bhsd" else (1, 2)
    q, fq = strided(shp(hk, kd), dtype, storage, seq_dim, heads=head_dim)
    # |k| about 1 (as the layers' L2 norm makes it), so that I - beta k k^T does not grow the state
    k, fk = strided(shp(hk, kd), dtype, storage, seq_dim, heads=head_dim, gen_scale=kd ** -0.5)
    v, fv = strided(shp(hv, vd), dtype, storage, seq_dim, heads=head_dim)
    acc = F64 if dtype == F64 else torch.float32
    beta = torch.rand(b, hv, s, dtype=F64).to(dtype).requires_grad_(grad)
    g = None
    if gate is not None:
        g = (-0.3 * torch.rand((b, hv, s) + ((kd,) if gate == "key" else ()), dtype=acc)).requires_grad_(grad)
    h0 = (0.3 * torch.randn(nb, hv, kd, vd, dtype=acc)).requires_grad_(grad) if init else None
    to_bhsd = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
    leaves = [q, k, v, beta, g, h0]

    def call_on(qv, kv, vv, bt, gt, st):
        out, fin = ae.delta_rule_attention(qv, kv, vv, bt, gate=gt, initial_state=st, return_state=True,
                                           cu_seqlens=cu, layout=layout, qk_l2norm=l2)
        return to_bhsd(out), fin

    def call(L):
        return call_on(fq(L[0]), fk(L[1]), fv(L[2]), *L[3:])

    def ref_call(L, dt):
        qq, kk = to_bhsd(fq(L[0])), to_bhsd(fk(L[1]))
        if l2:
            qq, kk = reference._l2n(qq), reference._l2n(kk)
        return reference.delta_rule(qq, kk, to_bhsd(fv(L[2])), L[3], L[4], None, L[5], cu, acc=dt)

    out, fin = call(leaves) if grad else torch.no_grad()(call)(leaves)
    r64, rlow = copies(leaves, F64), copies(leaves, dtype)
    ref, ref_fin = ref_call(r64, F64)
    low, low_fin = ref_call(rlow, dtype)
    end = int(cu[-1]) if cu is not None else s
    check_out(out[:, :, :end], low[:, :, :end], ref[:, :, :end], dtype, "out")
    # the state is kept in float32: fp16's own state overflows where float32's does not
    check_out(fin, low_fin, ref_fin, dtype if dtype != torch.float16 else torch.float32, "final state")
    if cu is not None:
        assert torch.equal(out[:, :, end:], torch.zeros_like(out[:, :, end:]))
        if s > end:  # NaN in the rows past the last sequence changes no bit of anything
            views = [f(t).detach().clone() for f, t in ((fq, q), (fk, k), (fv, v))]
            for t in views:
                t.narrow(seq_dim, end, s - end).fill_(float("nan"))
            bt = beta.detach().clone()
            bt[:, :, end:] = float("nan")
            gt = None
            if g is not None:
                gt = g.detach().clone()
                gt[:, :, end:] = float("nan")
            with torch.no_grad():
                out_c, fin_c = call_on(*(f(t) for f, t in ((fq, q), (fk, k), (fv, v))), beta, g, h0)
                out_n, fin_n = call_on(*views, bt, gt, h0)
            assert torch.equal(out_n, out_c) and torch.equal(fin_n, fin_c)
    if grad:
        dout = torch.randn(out.shape, dtype=F64).to(dtype)
        dfin = torch.randn(fin.shape, dtype=F64).to(fin.dtype)
        idx = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
        ours = torch.autograd.grad([out, fin], [leaves[i] for i in idx], [dout, dfin], allow_unused=True)
        g64 = torch.autograd.grad([ref, ref_fin], [r64[i] for i in idx], [dout.to(F64), dfin.to(F64)],
                                  allow_unused=True)
        glow = torch.autograd.grad([low, low_fin], [rlow[i] for i in idx], [dout, dfin.to(low_fin.dtype)],
                                   allow_unused=True)
        names = ["dq", "dk", "dv", "dbeta", "dgate", "dinitial_state"]
        for i, a, lw, r in zip(idx, ours, glow, g64):
            check_grad(a, lw, r, dtype if i < 4 or dtype != torch.float16 else torch.float32, names[i])
    log_example("delta", "delta_rule_attention")
