"""Property-based fuzzing of the sparse family: block_sparse_attention on drawn layouts (per head
or shared, any density, block sizes 16-64, lengths that do not divide the block) with the
element-wise options inside the blocks, and topk_attention. Forward and every gradient against
the float64 reference under the project's rule (tests/fuzz/common.py)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

import attention_ext as ae
from attention_ext.softmax import ops
from attention_ext.softmax import reference
from attention_ext.sparse import reference as sparse_reference
from tests.fuzz.common import (F64, LOW, STORAGES, at_least, check_grad, check_out, dtypes, few_keys, head_dims,
                               lengths, log_example, run_with_references, seeds, strided)

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")


@at_least(300)
@given(data=st.data(), entry=st.sampled_from(["block_sparse", "topk"]))
def test_fuzz_sparse(data, entry):
    draw = data.draw
    dtype = draw(dtypes)
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 3))
    sq, sk = draw(lengths), draw(lengths)
    if draw(st.booleans()):  # a few problems over several blocks
        sq, sk = sq + 64, sk + 64
    d = draw(head_dims)
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    storage, kv_storage = draw(st.sampled_from(STORAGES)), draw(st.sampled_from(STORAGES + ["expanded"]))
    causal = draw(st.booleans())
    bottom_right = draw(st.booleans())
    kpm = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (5, 3), (20, 0)]))
    softcap = draw(st.sampled_from([0.0, 0.0, 4.0]))
    alibi = entry == "block_sparse" and draw(st.booleans())
    sinks = entry == "block_sparse" and draw(st.booleans())
    grad = draw(st.booleans())
    if entry == "block_sparse":
        bs = draw(st.sampled_from([16, 32, 48, 64]))
        per_head = draw(st.booleans())
        density = draw(st.sampled_from([0.0, 0.2, 0.5, 0.8, 1.0]))
    else:
        k_top = draw(st.sampled_from([1, 2, 3, 7, 16, 100]))
    seed = draw(seeds)
    torch.manual_seed(seed)
    note(dict(entry=entry, dtype=dtype, b=b, h=h, hk=hk, sq=sq, sk=sk, d=d, layout=layout,
              storage=(storage, kv_storage)))

    def shp(heads, s):
        return (b, heads, s, d) if layout == "bhsd" else (b, s, heads, d)

    seq_dim, head_dim = (2, 1) if layout == "bhsd" else (1, 2)
    q, fq = strided(shp(h, sq), dtype, storage, seq_dim, heads=head_dim)
    k, fk = strided(shp(hk, sk), dtype, kv_storage, seq_dim, heads=head_dim)
    v, fv = strided(shp(hk, sk), dtype, kv_storage, seq_dim, heads=head_dim)
    acc = ops.acc_dtype(dtype)
    kpm_t = (torch.rand(b, sk) > 0.25) if kpm else None
    slopes = torch.rand(h, dtype=acc) * 0.5 if alibi else None
    sink_t = torch.randn(h, dtype=acc).requires_grad_(grad) if sinks else None
    wl, wr = (window[0], 0) if causal else window
    to_bhsd = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
    ok = reference.mask_structure(sq, sk, window=(wl, wr), bottom_right=bottom_right, batch=b)
    if kpm_t is not None:
        ok = ok & kpm_t.view(b, 1, 1, sk)
    scale = 1.0 / math.sqrt(d)
    opts = dict(causal=causal, key_mask=kpm_t, layout=layout, return_lse=True,
                bottom_right=bottom_right, window=window, softcap=softcap)
    if entry == "block_sparse":
        nbq, nbk = -(-sq // bs), -(-sk // bs)
        lay = torch.rand(h if per_head else 1, nbq, nbk) < density
        elem = lay.repeat_interleave(bs, 1).repeat_interleave(bs, 2)[:, :sq, :sk].unsqueeze(0)
        allowed = ok & elem

        def call(L):
            out, lse = ae.block_sparse_attention(fq(L[0]), fk(L[1]), fv(L[2]), lay, block_size=bs,
                                                 alibi_slopes=slopes, sinks=L[3], **opts)
            return to_bhsd(out), lse
    else:
        with torch.no_grad():  # the f64 logits the selection ranks, as the op ranks them
            qq, kk = to_bhsd(fq(q)).double(), to_bhsd(fk(k)).double().repeat_interleave(h // hk, 1)
            s = (qq @ kk.transpose(-1, -2)) * scale
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
        keep = sparse_reference.topk_select(s, ok.expand_as(s), k_top)
        # a near-tie at the cut would let rounding pick the other key: not a defect of the op
        srt = s.masked_fill(~ok, -math.inf).sort(-1, descending=True).values
        if k_top < sk:
            kth, nxt = srt[..., k_top - 1], srt[..., k_top]
            gap = (kth - nxt)[torch.isfinite(kth) & torch.isfinite(nxt)]
            assume(gap.numel() == 0 or gap.min().item() > 1e-3)
        allowed = keep

        def call(L):
            out, lse = ae.topk_attention(fq(L[0]), fk(L[1]), fv(L[2]), k_top, **opts)
            return to_bhsd(out), lse

    def ref_call(L):
        return reference.attention(to_bhsd(fq(L[0])), to_bhsd(fk(L[1])), to_bhsd(fv(L[2])), softcap=softcap,
                                   window=(wl, wr), bottom_right=bottom_right, bias=allowed,
                                   alibi_slopes=None if slopes is None else slopes.to(L[0].dtype), sinks=L[3])

    leaves = [q, k, v, sink_t]
    (out, lse), (r64, (ref, ref_lse)), (rlow, (low, _)) = run_with_references(call, ref_call, leaves, grad, dtype)
    check_out(out, low, ref, dtype, entry + " out")
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin), "lse finiteness"
    if fin.any():
        assert (lse[fin].double() - ref_lse[fin]).abs().max().item() <= 1e-3, "lse"
    if grad:
        dout = torch.randn(out.shape, dtype=F64).to(dtype)
        idx = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
        ours = torch.autograd.grad(out, [leaves[i] for i in idx], dout, allow_unused=True)
        g64 = torch.autograd.grad(ref, [r64[i] for i in idx], dout.to(F64), allow_unused=True)
        glow = torch.autograd.grad(low, [rlow[i] for i in idx], dout, allow_unused=True)
        exempt = dtype in LOW and (few_keys(allowed.expand(b, h, sq, sk)) or sinks)
        for i, o, r, lo in zip(idx, ours, g64, glow):
            z = torch.zeros_like(leaves[i])
            o, r, lo = (z if t is None else t for t in (o, r, lo))
            if exempt:
                assert torch.isfinite(o).all()
                continue
            check_grad(o, lo, r, dtype if leaves[i].dtype == dtype else torch.float32, f"grad of leaf {i}")
    log_example("sparse", entry)


@at_least(100)
@given(data=st.data())
def test_fuzz_lsh(data):
    """lsh_attention on drawn sizes, buckets, rounds, chunk sizes (shorter or longer than the
    sequence), layouts and storages: out and the gradients of qk and v against the float64
    reference, hashed with the op's buckets (a near-tie may round to the other bucket in low
    precision; the hash is tested against float64 in tests/sparse/test_lsh.py)."""
    draw = data.draw
    dtype = draw(dtypes)
    b, h, s, d = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(lengths), draw(head_dims)
    nb = draw(st.sampled_from([1, 2, 4, 8, 16]))
    nh = draw(st.integers(1, 3))
    chunk = draw(st.sampled_from([1, 2, 5, 8, 16, 33, 64, 100]))
    causal, grad = draw(st.booleans()), draw(st.booleans())
    layout = draw(st.sampled_from(["bhsd", "bshd"]))
    storage = draw(st.sampled_from(STORAGES))
    torch.manual_seed(draw(seeds))
    note(dict(dtype=dtype, b=b, h=h, s=s, d=d, nb=nb, nh=nh, chunk=chunk, causal=causal, layout=layout,
              storage=storage))
    shape = (b, h, s, d) if layout == "bhsd" else (b, s, h, d)
    seq_dim, head_dim = (2, 1) if layout == "bhsd" else (1, 2)
    qk, fqk = strided(shape, dtype, storage, seq_dim, heads=head_dim)
    v, fv = strided(shape, dtype, storage, seq_dim, heads=head_dim)
    rot = torch.randn(nh, d, nb // 2, dtype=F64)
    to_bhsd = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
    buckets = ae.sparse.lsh_buckets(to_bhsd(fqk(qk)).detach(), rot, nb)

    def call(L):
        return to_bhsd(ae.lsh_attention(fqk(L[0]), fv(L[1]), n_buckets=nb, n_hashes=nh, chunk_size=chunk,
                                        causal=causal, rotations=rot, layout=layout))

    def ref_call(L):
        return sparse_reference.lsh_attention_ref(to_bhsd(fqk(L[0])), to_bhsd(fv(L[1])), rot, nb, chunk,
                                                  causal=causal, buckets=buckets)[0]

    leaves = [qk, v]
    out, (r64, ref), (rlow, low) = run_with_references(call, ref_call, leaves, grad, dtype)
    check_out(out, low, ref, dtype, "lsh out")
    if grad:
        dout = torch.randn(out.shape, dtype=F64).to(dtype)
        ours = torch.autograd.grad(out, leaves, dout)
        g64 = torch.autograd.grad(ref, r64, dout.to(F64))
        glow = torch.autograd.grad(low, rlow, dout)
        # rows that see few keys (short chunks, many buckets): the low-precision backward's known
        # limit (tests/fuzz/common.py, few_keys) holds such gradients to the rule in fp32 / fp64
        allowed, _ = sparse_reference.lsh_allowed_ref(buckets, chunk, causal=causal)
        exempt = dtype in LOW and few_keys(allowed)
        for name, o, r, lo in zip(("dqk", "dv"), ours, g64, glow):
            if exempt:
                assert torch.isfinite(o).all()
                continue
            check_grad(o, lo, r, dtype, f"lsh {name}")
    log_example("sparse", "lsh")
