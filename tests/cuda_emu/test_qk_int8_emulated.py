"""The CUDA forward with the int8 Q.K^T (softmax_fwd_quant on CUDA: softmax/cuda/q8.cuh's quantize
pass, then fwd_kernel.cuh's FwdQ8 instance on mma.m16n8k32.s8) in the host emulator, sm_80 and
sm_90, against its float64 oracle reference.qk_int8_scores at the kernel's blocks (one q scale per
warp's 32 rows, one k scale per key tile: 64 keys at head dim 64, 48 at 128), under the project
rule on those scores: every mask and score option, GQA, padding (seqlens_k, key masks), varlen,
dropout, odd lengths; the non-finite rules; the configs the kernel refuses."""
from __future__ import annotations

import pytest
import torch

from attention_ext.softmax import ops, reference
from tests.cuda_emu import emulator as cuda_emu
from tests.helpers import assert_close_fa2
from tests.softmax import test_cuda as tc

F64 = torch.float64
ARCHS = (90, 80)
# (block_q, block_k) of the kernel per head-dim bucket: softmax/cuda/traits.h FwdTraits
BLOCKS = {64: (32, 64), 128: (32, 48)}


@pytest.fixture(scope="module")
def emu():
    e = cuda_emu.load()
    if e is None:
        pytest.skip(f"CUDA emulator unavailable: {cuda_emu.why}")
    e.set_cuda_kernels(0, 0, 0, 0, False)
    e.set_schedule(True, False)
    return e


def make(b, h, hk, sq, sk, d, dtype, *, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, sq, d, generator=g)
    k = torch.randn(b, hk, sk, d, generator=g) + offset
    v = torch.randn(b, hk, sk, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check(emu, q, k, v, arch, what="", blocks=None, fmt="int8", **o):
    """The emulated kernel against the oracle at its blocks (blocks: {bucket: (block_q, block_k)},
    the mma.sync kernel's by default) in format fmt ("int8" / "fp8"); o: test_cuda.call_fwd's
    options (window_left / window_right, bias, seqlens_k, alibi_slopes, softcap, sinks, dropout_p ...)."""
    dt = q.dtype
    out, lse = emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v, **o), fmt, arch)
    bq, bk = (blocks or BLOCKS)[64 if q.shape[-1] <= 64 else 128]
    rkw = dict(scale=o.get("scale"), window=(o.get("window_left", -1), o.get("window_right", -1)),
               bottom_right=o.get("bottom_right", False), bias=o.get("bias"), seqlens_k=o.get("seqlens_k"),
               alibi_slopes=o.get("alibi_slopes"), softcap=o.get("softcap", 0.0), sinks=o.get("sinks"))
    dmask = None
    if o.get("dropout_p", 0.0) > 0:
        dmask = reference.dropout_mask(q.shape[0], q.shape[1], q.shape[2], k.shape[2], o["dropout_p"],
                                       torch.tensor([o.get("seed", 0), o.get("offset", 0)]))
        rkw.update(dropout_p=o["dropout_p"], dropout_mask=dmask)
    x = reference.qk_quant_scores(q, k, qk_quant=fmt, window=rkw["window"], bottom_right=rkw["bottom_right"],
                                  seqlens_k=rkw["seqlens_k"], bias=rkw["bias"], block_q=bq, block_k=bk)

    def cast(kw, t):
        return {n: (a.to(t) if isinstance(a, torch.Tensor) and a.is_floating_point() else a) for n, a in kw.items()}

    ref, ref_lse = reference.attention(q.to(F64), k.to(F64), v.to(F64), logits=x, **cast(rkw, F64))
    low, _ = reference.attention(q, k, v, logits=x.to(dt), **cast(rkw, dt))
    _, lse32 = reference.attention(q.float(), k.float(), v.float(), logits=x.float(), **cast(rkw, torch.float32))
    assert out.dtype == dt and out.shape == q.shape
    assert_close_fa2(out, low, ref, dt, f"{what} out")
    assert_close_fa2(lse, lse32, ref_lse, torch.float32, f"{what} lse")
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 70, 130, 64), (1, 2, 1, 33, 97, 128), (1, 3, 3, 129, 50, 96),
                                   (2, 2, 1, 1, 1, 16), (1, 1, 1, 20, 700, 64)],
                         ids=["gqa_d64", "mqa_d128", "mha_d96", "one_d16", "three_mean_chunks"])
def test_matches_quantized_oracle(emu, arch, dtype, shape):
    b, h, hk, sq, sk, d = shape
    q, k, v = make(b, h, hk, sq, sk, d, dtype, offset=2.0)
    check(emu, q, k, v, arch, f"{shape}")
    check(emu, q, k, v, arch, f"{shape} causal", window_left=-1, window_right=0)


@pytest.mark.parametrize("option", ["window", "bottom_right", "seqlens_k", "key_mask", "bool_mask", "float_mask",
                                    "alibi", "softcap", "sinks", "dropout"])
def test_options(emu, option):
    b, h, hk, sq, sk, d = 2, 4, 2, 77, 150, 64
    q, k, v = make(b, h, hk, sq, sk, d, torch.bfloat16, offset=1.0, seed=1)
    o = {}
    if option == "window":
        o = dict(window_left=37, window_right=5)
    elif option == "bottom_right":
        o = dict(window_left=-1, window_right=0, bottom_right=True)
    elif option == "seqlens_k":
        o = dict(seqlens_k=torch.tensor([100, 1], dtype=torch.int32))
    elif option == "key_mask":  # a bool bias over keys only: its hidden keys leave the mean and scales
        o = dict(bias=(torch.rand(b, 1, 1, sk) > 0.3).expand(b, 1, 1, sk))
    elif option == "bool_mask":
        o = dict(bias=torch.rand(b, 1, sq, sk) > 0.5)
    elif option == "float_mask":
        o = dict(bias=torch.randn(1, h, sq, sk))
    elif option == "alibi":
        o = dict(alibi_slopes=torch.rand(h), window_left=-1, window_right=0)
    elif option == "softcap":  # not shift-invariant: q . mean must come back exactly
        o = dict(softcap=3.0)
    elif option == "sinks":
        o = dict(sinks=torch.randn(h))
    elif option == "dropout":
        if not ops.HAS_EXT:
            pytest.skip("the dropout reference needs attention_ext's compiled dropout_mask")
        o = dict(dropout_p=0.3, seed=7)
    check(emu, q, k, v, 90, option, **o)


def varlen_case(emu, lens_q, lens_k, d, blocks=None, fmt="int8"):
    """A causal bottom-right varlen pack through cu_seqlens against each sequence as its own call
    (its own mean and blocks), at the kernel's blocks (check's `blocks`) in format fmt."""
    cq = torch.tensor([0] + lens_q).cumsum(0).int()
    ck = torch.tensor([0] + lens_k).cumsum(0).int()
    h, hk = 4, 2
    g = torch.Generator().manual_seed(3)
    q = torch.randn(int(cq[-1]), h, d, generator=g).bfloat16()
    k = (torch.randn(int(ck[-1]), hk, d, generator=g) + 1.5).bfloat16()
    v = torch.randn(int(ck[-1]), hk, d, generator=g).bfloat16()
    pack = lambda t: t.transpose(0, 1)[None]  # noqa: E731  (1, H, total, D), as the op takes a pack
    out, _ = emu.fwd_quant(pack(q), pack(k), pack(v),
                           *tc.call_fwd(pack(q), pack(k), pack(v), cu_seqlens_q=cq, cu_seqlens_k=ck,
                                        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), window_left=-1,
                                        window_right=0, bottom_right=True), fmt, 90)
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])
        if q1 == q0:
            continue
        one = lambda t, a, z: t[a:z].transpose(0, 1)[None].contiguous()  # noqa: E731
        want = check(emu, one(q, q0, q1), one(k, k0, k1), one(v, k0, k1), 90, f"seq {i}", blocks=blocks, fmt=fmt,
                     window_left=-1, window_right=0, bottom_right=True)
        torch.testing.assert_close(out[0, :, q0:q1], want[0], atol=0, rtol=0)


def test_varlen(emu):
    """Each sequence its own mean and blocks; rows of a pack addressed through cu_seqlens."""
    varlen_case(emu, [5, 0, 70, 33], [7, 3, 130, 33], 64)


def test_padding_keys_reach_nothing(emu):
    """Keys past seqlens_k and keys a key mask hides may hold NaN: the mean, the scales and the
    output do not see them."""
    q, k, v = make(2, 2, 1, 40, 600, 64, torch.bfloat16, offset=3.0, seed=4)
    lens = torch.tensor([60, 600], dtype=torch.int32)
    km = torch.ones(2, 1, 1, 600, dtype=torch.bool)
    km[1, ..., 10:20] = False
    km[1, ..., 300:520] = False  # most of the second mean chunk
    want = check(emu, q, k, v, 90, "clean", seqlens_k=lens, bias=km)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 60:] = float("nan")
    v2[0, :, 60:] = float("nan")
    k2[1, :, 10:20] = float("nan")
    k2[1, :, 300:520] = float("nan")
    out, _ = emu.fwd_quant(q, k2, v2, *tc.call_fwd(q, k2, v2, seqlens_k=lens, bias=km), "int8", 90)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("how", ["causal_top_left", "window", "row_mask", "head_mask"])
def test_unseen_keys_reach_nothing(emu, how):
    """Keys no row of a kv group may see (past the last causal row, left of every window, False in
    every row of a mask for every head of the group) leave the mean and the scales: NaN there
    changes nothing; a key one head of the group sees stays in (q8_seen_keys, PolicyT::key_seen)."""
    b, h, hk, sq, sk = 2, 4, 2, 40, 300
    q, k, v = make(b, h, hk, sq, sk, 64, torch.bfloat16, offset=2.0, seed=6)
    heads = torch.rand(b, h, sq, sk, generator=torch.Generator().manual_seed(2)) > 0.5
    heads[..., 60:90] = False
    heads[:, 1, :, 70:80] = True
    rows = torch.rand(b, 1, sq, sk, generator=torch.Generator().manual_seed(1)) > 0.5
    rows[..., 250:290] = False  # most of the second mean chunk
    o, rkw = {
        "causal_top_left": (dict(window_left=-1, window_right=0), dict(window=(-1, 0))),
        "window": (dict(window_left=20, window_right=0, bottom_right=True), dict(window=(20, 0), bottom_right=True)),
        "row_mask": (dict(bias=rows), dict(bias=rows)),
        "head_mask": (dict(bias=heads), dict(bias=heads)),
    }[how]
    seen = reference.seen_keys(b, h, hk, sq, sk, **rkw)
    assert not seen.all()
    want = check(emu, q, k, v, 90, how, **o)
    k2, v2 = k.clone(), v.clone()
    k2[~seen] = float("nan")
    v2[~seen] = float("nan")
    out, _ = emu.fwd_quant(q, k2, v2, *tc.call_fwd(q, k2, v2, **o), "int8", 90)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_nonfinite_inputs_show(emu):
    """As on the CPU: a NaN in a key some row sees reaches the K mean, so every score of its
    (sequence, kv head) is NaN, causal rows that never read the key included (docs/known-gaps.md);
    one in a key no row sees (past the last causal row's) reaches nothing; a NaN in q makes its
    block's scale NaN: the 32 rows of that warp are NaN, the others are not."""
    q, k, v = make(1, 1, 1, 70, 130, 64, torch.float16, seed=5)
    causal = dict(window_left=-1, window_right=0)
    k2 = k.clone()
    k2[0, 0, 30, 3] = float("nan")
    for o in ({}, causal):
        out, _ = emu.fwd_quant(q, k2, v, *tc.call_fwd(q, k2, v, **o), "int8", 80)
        assert out.isnan().all()
    k3, v3 = k.clone(), v.clone()
    k3[0, 0, 70:] = float("nan")
    v3[0, 0, 70:] = float("nan")
    out, _ = emu.fwd_quant(q, k3, v3, *tc.call_fwd(q, k3, v3, **causal), "int8", 80)
    clean, _ = emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v, **causal), "int8", 80)
    torch.testing.assert_close(out, clean, atol=0, rtol=0)
    q2 = q.clone()
    q2[0, 0, 40, 5] = float("nan")
    out, _ = emu.fwd_quant(q2, k, v, *tc.call_fwd(q2, k, v), "int8", 80)
    bad = out[0, 0].isnan().any(-1)
    assert bad[32:64].all() and not bad[:32].any() and not bad[64:].any()


def test_configs_it_refuses(emu):
    """float32, head dims that are no multiple of 16 or past 128, and block layouts raise
    NotImplementedError naming what the kernel takes (the Python layer falls back on it)."""
    for dtype, d in ((torch.float32, 64), (torch.bfloat16, 40), (torch.bfloat16, 256)):
        q, k, v = make(1, 1, 1, 8, 8, d, dtype)
        with pytest.raises(NotImplementedError, match="multiple of 16 up to 128"):
            emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), "int8", 90)
    q, k, v = make(1, 1, 1, 8, 8, 64, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="no block_layout"):
        emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v, block_layout=torch.ones(1, 1, 1, dtype=torch.bool),
                                            block_size=16), "int8", 90)
    with pytest.raises(ValueError, match="qk_quant must be None, 'int8' or 'fp8'"):
        emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), "int4", 90)


def test_launch_sequence(emu):
    """The quantize pass (K partial sums, K mean, K blocks, Q blocks), then the FwdQ8 instance of
    the mma.sync forward: the int8 products run on mma.m16n8k32.s8."""
    q, k, v = make(1, 2, 1, 64, 128, 64, torch.bfloat16)
    emu.launches()
    emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), "int8", 90)
    names = emu.launches()
    assert len(names) == 5, names
    for i, name in enumerate(("q8_mean_kernel", "q8_mean_finalize_kernel", "q8_quant_k_kernel", "q8_quant_q_kernel")):
        assert name in names[i], names
    assert "fwd_kernel" in names[4] and "FwdQ8" in names[4]


def test_strides_empty_keys_and_expanded_k(emu):
    """Found by review: (1) q / k rows 8 elements past a multiple of 16 (a sliced last dim): the
    int8 copies are contiguous, so their rows stay 16-byte aligned (with q's strides cp.async read
    misaligned rows); (2) no keys: out 0 and lse -inf as the 16-bit forward, no empty launch; (3)
    k expanded over the batch with a length per sequence: each sequence its own mean and blocks
    (with k's strides the sequences wrote one shared copy)."""
    q, k, v = make(2, 2, 1, 40, 90, 64, torch.bfloat16, offset=1.0, seed=6)
    wide = lambda t: torch.cat([t, torch.zeros(*t.shape[:-1], 8, dtype=t.dtype)], -1)[..., :64]  # noqa: E731
    qs, ks, vs = wide(q), wide(k), wide(v)
    assert qs.stride(2) == 72
    want = check(emu, q, k, v, 90, "contiguous", window_left=-1, window_right=0)
    got, _ = emu.fwd_quant(qs, ks, vs, *tc.call_fwd(qs, ks, vs, window_left=-1, window_right=0), "int8", 90)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    k0, v0 = k[:, :, :0], v[:, :, :0]
    out, lse = emu.fwd_quant(q, k0, v0, *tc.call_fwd(q, k0, v0), "int8", 80)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse < 0).all()
    lens = torch.tensor([90, 20], dtype=torch.int32)
    ke, ve = k[:1].expand(2, -1, -1, -1), v[:1].expand(2, -1, -1, -1)
    want = check(emu, q, ke.contiguous(), ve.contiguous(), 90, "expanded k", seqlens_k=lens)
    got, _ = emu.fwd_quant(q, ke, ve, *tc.call_fwd(q, ke, ve, seqlens_k=lens), "int8", 90)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---------------------------------------------------------------- the wgmma forms (sm_90a)
# The 8-bit Q.K^T on the wgmma forward (sm90/fwd_kernel.cuh's quantized instances): int8 on
# m64nNk32.s32.s8.s8, selected at hopper_fwd 2; fp8 e4m3 on m64nNk32.f32.e4m3.e4m3, at 1 and 2 (its
# only kernel). A q scale per warp's 16 rows, a k scale per 128-key tile.
HOPPER_BLOCKS = {64: (16, 128), 128: (16, 128)}
FMTS = ["int8", "fp8"]


@pytest.fixture
def wgmma(emu):
    emu.set_cuda_kernels(2, 0, 0, 0, False)
    yield emu
    emu.set_cuda_kernels(0, 0, 0, 0, False)


def test_wgmma_launch_sequence(wgmma):
    """The quantize pass, then the wgmma kernel's quantized instance (not FwdQ8); at sm_80 FwdQ8
    for int8, and fp8 refused by name."""
    q, k, v = make(1, 2, 1, 64, 128, 64, torch.bfloat16)
    for fmt in FMTS:
        wgmma.launches()
        wgmma.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), fmt, 90)
        names = wgmma.launches()
        assert len(names) == 5 and "q8_quant_q_kernel" in names[3], names
        assert "hopper" in names[4] and "fwd_kernel" in names[4], names
        assert f", {FMTS.index(fmt) + 1}>(" in names[4], names  # the instance: kQkInt8 = 1, kQkFp8 = 2
    wgmma.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), "int8", 80)
    assert "FwdQ8" in wgmma.launches()[4]
    with pytest.raises(NotImplementedError, match="qk_quant='fp8' on CUDA runs on .* sm_90"):
        wgmma.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), "fp8", 80)


def test_fp8_selection_levels(emu):
    """fp8 runs at the selection's levels 1 and 2 (level 1: not int8, which stays on FwdQ8 there),
    and is refused at 0 (the wgmma forward turned off) rather than run as int8."""
    q, k, v = make(1, 2, 1, 40, 70, 64, torch.bfloat16)
    try:
        emu.set_cuda_kernels(1, 0, 0, 0, False)
        emu.launches()
        check(emu, q, k, v, 90, "level 1", blocks=HOPPER_BLOCKS, fmt="fp8")
        assert "hopper" in emu.launches()[4]
        emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), "int8", 90)
        assert "FwdQ8" in emu.launches()[4]
        emu.set_cuda_kernels(0, 0, 0, 0, False)
        with pytest.raises(NotImplementedError, match="not turned off by set_cuda_kernels"):
            emu.fwd_quant(q, k, v, *tc.call_fwd(q, k, v), "fp8", 90)
    finally:
        emu.set_cuda_kernels(0, 0, 0, 0, False)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, 2, 70, 130, 64), (1, 2, 1, 33, 260, 128), (1, 3, 3, 129, 50, 96),
                                   (2, 2, 1, 1, 1, 16), (1, 1, 1, 150, 700, 64)],
                         ids=["gqa_d64", "mqa_d128", "mha_d96", "one_d16", "three_mean_chunks"])
def test_wgmma_matches_quantized_oracle(wgmma, dtype, shape, fmt):
    b, h, hk, sq, sk, d = shape
    q, k, v = make(b, h, hk, sq, sk, d, dtype, offset=2.0)
    check(wgmma, q, k, v, 90, f"{shape}", blocks=HOPPER_BLOCKS, fmt=fmt)
    check(wgmma, q, k, v, 90, f"{shape} causal", blocks=HOPPER_BLOCKS, fmt=fmt, window_left=-1, window_right=0)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("option", ["window", "bottom_right", "seqlens_k", "key_mask", "bool_mask", "float_mask",
                                    "alibi", "softcap", "sinks", "dropout", "unseen"])
def test_wgmma_options(wgmma, option, fmt):
    b, h, hk, sq, sk, d = 2, 4, 2, 77, 300, 64
    q, k, v = make(b, h, hk, sq, sk, d, torch.bfloat16, offset=1.0, seed=1)
    o = {
        "window": dict(window_left=37, window_right=5),
        "bottom_right": dict(window_left=-1, window_right=0, bottom_right=True),
        "seqlens_k": dict(seqlens_k=torch.tensor([200, 1], dtype=torch.int32)),
        "key_mask": dict(bias=(torch.rand(b, 1, 1, sk) > 0.3).expand(b, 1, 1, sk)),
        "bool_mask": dict(bias=torch.rand(b, 1, sq, sk) > 0.5),
        "float_mask": dict(bias=torch.randn(1, h, sq, sk)),
        "alibi": dict(alibi_slopes=torch.rand(h), window_left=-1, window_right=0),
        "softcap": dict(softcap=3.0),
        "sinks": dict(sinks=torch.randn(h)),
        "dropout": dict(dropout_p=0.3, seed=7),
        # keys 77.. no row sees: NaN in their K is left out of the mean and the scales (NaN in a
        # hidden key's V: test_hopper_emulated.py's test_nan_v_hidden_key_reaches_readers_only)
        "unseen": dict(window_left=-1, window_right=0),
    }[option]
    if option == "dropout" and not ops.HAS_EXT:
        pytest.skip("the dropout reference needs attention_ext's compiled dropout_mask")
    want = check(wgmma, q, k, v, 90, option, blocks=HOPPER_BLOCKS, fmt=fmt, **o)
    if option == "unseen":
        k2 = k.clone()
        k2[:, :, sq:] = float("nan")
        out, _ = wgmma.fwd_quant(q, k2, v, *tc.call_fwd(q, k2, v, **o), fmt, 90)
        torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("fmt", FMTS)
def test_wgmma_varlen(wgmma, fmt):
    """Each sequence its own mean and blocks, through cu_seqlens, on the wgmma forms."""
    varlen_case(wgmma, [5, 0, 140, 33], [7, 3, 260, 33], 128, blocks=HOPPER_BLOCKS, fmt=fmt)


def test_fp8_outlier_and_nonfinite(wgmma):
    """An outlier channel (its block's codes spread over the whole e4m3 range) matches the oracle;
    a NaN or an inf in a key some row sees makes its kv group's scores NaN (its mean and its block's
    scale) and no other's, in Q its 16-row block's rows alone, as in the int8 form."""
    q, k, v = make(1, 4, 2, 40, 130, 64, torch.bfloat16, offset=0.5, seed=4)
    k[0, 0, 5, 3] = 300.0  # one huge channel: its block's step is 448 / (300 - mean)
    check(wgmma, q, k, v, 90, "outlier", blocks=HOPPER_BLOCKS, fmt="fp8")
    for bad in (float("nan"), float("inf")):
        k2 = k.clone()
        k2[0, 0, 7, 1] = bad  # kv head 0: query heads 0, 1
        out, _ = wgmma.fwd_quant(q, k2, v, *tc.call_fwd(q, k2, v), "fp8", 90)
        assert out[:, :2].isnan().all() and out[:, 2:].isfinite().all(), bad
        q2 = q.clone()
        q2[0, 3, 20, 5] = bad  # head 3, rows 16..31 share its block's scale
        out, _ = wgmma.fwd_quant(q2, k, v, *tc.call_fwd(q2, k, v), "fp8", 90)
        rows = torch.zeros(40, dtype=torch.bool)
        rows[16:32] = True
        assert out[0, 3, rows].isnan().all() and out[0, 3, ~rows].isfinite().all(), bad
        assert out[0, :3].isfinite().all(), bad


def test_e4m3_encoder_matches_torch(emu):
    """common/fp8.h's float_to_e4m3, the quantize pass's rounding, against torch's float8_e4m3fn
    conversion (which the oracle uses) on 2^20 float32 patterns inside +-448: every high 16 bits
    (sign, exponent, 7 mantissa bits) with 16 low-bit patterns, ties and their neighbours among
    them; above 448 the kernel saturates where torch gives NaN (the quantize pass never goes
    there: its codes are x * 448 / amax)."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lo = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0FFF, 0x1000, 0x1001, 0x3FFF, 0x4000, 0x4001,
                       0x5555, 0xAAAA, 0x7FFE, 0x0002], dtype=torch.int64)
    bits = (hi[:, None] | lo[None, :]).flatten()
    x = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x) & (x.abs() <= 448)]
    got = emu.e4m3_encode(x)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), int(got[i]), int(want[i])) for i in bad[:8]]
    assert x.numel() > 500_000
