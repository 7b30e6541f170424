"""The CPU decode kernel (csrc/decode/cpu) against reference.decode_attention in float64, through
ops.decode_fwd (flash-attn layout) and the registered op: the shared cases of tests/decode/cases.py
(contiguous and paged caches, splits, ragged lengths with 0 and 1, q_len 1 / 2 / 7, GQA / MQA,
window, causal, sinks, ALiBi, softcap, cache_batch_idx, leftpad, odd head dims), float64 to
rounding, the layouts against each other, the input checks and opcheck."""
from __future__ import annotations

import pytest
import torch

from attention_ext.decode import ops, reference
from tests.decode.cases import Case, check, make_inputs, op_args, option_sets

pytestmark = pytest.mark.skipif(not ops.has_kernel(torch.device("cpu")), reason="needs the compiled CPU kernels")


def call(c: Case, q, k, v, idx, kw, alibi, sinks, num_splits=None):
    return ops.decode_fwd(q, k, v, **idx, alibi_slopes=alibi, sinks=sinks, scale=kw["softmax_scale"],
                          softcap=kw["softcap"], window_left=kw["window_size"][0], window_right=kw["window_size"][1],
                          num_splits=c.num_splits if num_splits is None else num_splits)


def run(c: Case, what=""):
    args = make_inputs(c)
    out, lse = call(c, *args)
    check(c, out, lse, *args, what or repr(c))
    return args, out, lse


@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("page", [None, 16, 5, 256], ids=["contiguous", "page16", "page5", "page256"])
@pytest.mark.parametrize("sq", [1, 2, 7])
def test_layouts(page, splits, sq):
    run(Case(sq=sq, page=page, num_splits=splits, dtype=torch.bfloat16 if sq != 2 else torch.float16,
             seqlens=(0, 1, 377, 1000)))


OPTIONS = option_sets(10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_options(opt, splits, dtype):
    run(Case(sq=7 if splits == 1 else 2, num_splits=splits, dtype=dtype, seqlens=(0, 1, 500, 2000), **OPTIONS[opt]))


@pytest.mark.parametrize("h,hk,sq", [(8, 1, 7), (8, 8, 1), (8, 2, 1), (32, 8, 1), (16, 2, 3), (6, 3, 5)], ids=str)
def test_heads(h, hk, sq):
    run(Case(h=h, hk=hk, sq=sq, num_splits=0, sinks=True, window=(-1, 0), b=3, seqlens=(1, 700, 4000)))


@pytest.mark.parametrize("d", [8, 13, 40, 64, 80, 128, 144, 200])
@pytest.mark.parametrize("hk", [3, 5, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_one_row_per_kv_head(dtype, hk, d):
    """MHA at q_len 1: one row per kv head, the scores in blocks of up to four kv heads
    (head_blocks: 3 and 5 heads leave partial blocks), or for float32 on AVX2 at d 128 / 144, 8
    keys at a time per kv head (key_blocks: 450 and 33 keys leave partial key blocks), and P V in
    passes of 8 / 4 / 2 / 1 vectors by head dim; a page of 5 keys moves the row pointers inside
    a key block and splits start mid-cache; causal with q_len 2 runs the same heads one row at a
    time at the chunk edge."""
    run(Case(d=d, dtype=dtype, b=2, h=hk, hk=hk, sq=1, seqlens=(450, 33), num_splits=0))
    run(Case(d=d, dtype=dtype, b=2, h=hk, hk=hk, sq=1, seqlens=(97, 8), num_splits=3, page=5))
    run(Case(d=d, dtype=dtype, b=2, h=hk, hk=hk, sq=2, seqlens=(70, 2), window=(-1, 0), num_splits=1, page=16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("h,hk,sq,d", [(40, 40, 1, 128), (40, 40, 3, 200), (64, 16, 2, 256)], ids=str)
def test_short_chunks(h, hk, sq, d, dtype):
    """Wide kv rows (H_k * D * element past 4 KB): the chunks shrink below 32 keys (to fit
    kChunkBytes, down to a vector's lanes), so chunk edges, the softmax's online updates, the
    compensated flushes every 256 keys, windows and splits all land at other keys; the default
    split count gives such rows 256-key splits (decode_num_splits), so 700 keys take two."""
    run(Case(b=2, h=h, hk=hk, sq=sq, d=d, dtype=dtype, seqlens=(700, 29), num_splits=0, window=(-1, 0)))
    run(Case(b=2, h=h, hk=hk, sq=sq, d=d, dtype=dtype, seqlens=(1, 270), num_splits=3, page=5, sinks=True))


@pytest.mark.parametrize("d", [8, 13, 40, 64, 80, 128, 200, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_head_dims(d, dtype):
    run(Case(d=d, dtype=dtype, b=2, h=4, hk=2, sq=2, seqlens=(450, 9), num_splits=0, page=16))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("page", [None, 7])
def test_float64_to_rounding(page, splits):
    c = Case(dtype=torch.float64, page=page, num_splits=splits, sq=3, sinks=True, alibi=True, softcap=4.0,
             window=(50, 0), leftpad=True, seqlens=(0, 1, 90, 260))
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    alibi, sinks = alibi.double(), sinks.double()
    out, lse = call(c, q, k, v, idx, kw, alibi, sinks)
    ref, ref_lse = reference.decode_attention(q, k, v, alibi_slopes=alibi, sinks=sinks, **idx, **kw)
    assert out.dtype == lse.dtype == torch.float64
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)


def test_paged_equals_contiguous_and_splits_agree():
    # the same keys through a shuffled page pool or a contiguous cache: the same arithmetic,
    # so the same bits; splits merge through their LSEs to rounding
    c = Case(b=3, h=8, hk=2, sq=2, d=64, dtype=torch.bfloat16, seqlens=(5, 300, 1000), sinks=True, num_splits=1)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    out, lse = call(c, q, k, v, idx, kw, alibi, sinks)
    for page in (16, 5, 1024):
        n = -(-k.shape[1] // page)
        perm = torch.randperm(c.b * n)
        pools = []
        for t in (k, v):
            padded = torch.cat([t, t.new_zeros(c.b, n * page - t.shape[1], c.hk, c.d)], 1).reshape(c.b * n, page, c.hk, c.d)
            pool = torch.empty_like(padded)
            pool[perm] = padded
            pools.append(pool)
        bt = perm.view(c.b, n).int()
        out_p, lse_p = call(c, q, pools[0], pools[1], dict(idx, block_table=bt), kw, alibi, sinks)
        assert torch.equal(out_p, out) and torch.equal(lse_p, lse), page
    for splits in (2, 5, 0):
        out_s, lse_s = call(c, q, k, v, idx, kw, alibi, sinks, num_splits=splits)
        torch.testing.assert_close(out_s.float(), out.float(), atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse_s, lse, atol=1e-5, rtol=1e-5)


def test_empty_rows_and_empty_calls():
    c = Case(b=2, seqlens=(0, 0), dtype=torch.float32)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    out, lse = call(c, q, k, v, idx, kw, alibi, sinks)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isinf(lse).all() and (lse < 0).all()
    sinks = torch.zeros(c.h)
    out, lse = call(c, q, k, v, idx, kw, alibi, sinks)  # only the sink: lse = sink, out = 0
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(lse, torch.zeros_like(lse))
    out, lse = ops.decode_fwd(q[:0], k[:0], v[:0], cache_seqlens=idx["cache_seqlens"][:0], scale=1.0)
    assert out.shape == (0, 1, c.h, c.d) and lse.shape == (0, c.h, 1)


def test_threads_do_not_change_the_answer():
    c = Case(b=1, h=16, hk=4, d=64, dtype=torch.float32, seqlens=(3000,), num_splits=0)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out1, _ = call(c, q, k, v, idx, kw, alibi, sinks, num_splits=4)
        torch.set_num_threads(max(2, n))
        out2, _ = call(c, q, k, v, idx, kw, alibi, sinks, num_splits=4)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(out1, out2)


# ---------------------------------------------------------------------------------- bad input
def _base():
    c = Case(b=2, h=4, hk=2, d=32, dtype=torch.float32, seqlens=(10, 20), page=8)
    return c, make_inputs(c)


@pytest.mark.parametrize("bad,err,msg", [
    (lambda i: i["block_table"].fill_(10 ** 6), ValueError, "block_table"),
    (lambda i: i["block_table"].fill_(-1), ValueError, "block_table"),
    (lambda i: i.update(block_table=i["block_table"].long()), TypeError, "block_table must be int32"),
    (lambda i: i.update(block_table=i["block_table"][:1]), ValueError, "block_table must be"),
    (lambda i: i.update(cache_seqlens=torch.tensor([10, 10 ** 6], dtype=torch.int32)), ValueError, "seqlens"),
    (lambda i: i.update(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, "seqlens"),
    (lambda i: i.update(cache_leftpad=torch.tensor([11, 0], dtype=torch.int32)), ValueError, "cache_leftpad"),
    (lambda i: i.update(cache_seqlens=torch.tensor([1, 2], dtype=torch.int64)), TypeError, "int32"),
], ids=["page_too_big", "page_negative", "table_dtype", "table_shape", "seqlen_too_big", "seqlen_negative",
        "leftpad", "seqlens_dtype"])
def test_bad_index_tensors(bad, err, msg):
    c, (q, k, v, idx, kw, alibi, sinks) = _base()
    bad(idx)
    with pytest.raises(err, match=msg):
        call(c, q, k, v, idx, kw, alibi, sinks)


def test_bad_shapes_and_batch_idx():
    c = Case(b=2, h=4, hk=2, d=32, dtype=torch.float32, seqlens=(10, 20), batch_idx=True)
    q, k, v, idx, kw, alibi, sinks = make_inputs(c)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        call(c, q, k, v, dict(idx, cache_batch_idx=torch.tensor([0, 4], dtype=torch.int32)), kw, alibi, sinks)
    with pytest.raises(ValueError, match="cache_batch_idx"):
        call(c, q, k, v, dict(idx, cache_batch_idx=None), kw, alibi, sinks)  # 4 cache rows, batch 2
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(c, q[:, :, :3], k, v, idx, kw, alibi, sinks)
    with pytest.raises(ValueError, match="head dim"):
        call(c, q[..., :16], k, v, idx, kw, alibi, sinks)
    with pytest.raises(TypeError, match="dtype"):
        call(c, q.double(), k, v, idx, kw, alibi, sinks)
    with pytest.raises(ValueError, match="num_splits"):
        call(c, q, k, v, idx, kw, alibi, sinks, num_splits=-1)


def test_opcheck():
    c = Case(b=3, h=4, hk=2, sq=2, d=32, dtype=torch.float32, seqlens=(0, 5, 40), page=8, sinks=True, alibi=True)
    args = make_inputs(c)
    torch.library.opcheck(torch.ops.attention_ext.decode_fwd.default, (*op_args(c, *args), 0))
    c = Case(b=2, h=4, hk=1, sq=1, d=16, dtype=torch.bfloat16, seqlens=(7, 1), batch_idx=True, leftpad=True)
    args = make_inputs(c)
    torch.library.opcheck(torch.ops.attention_ext.decode_fwd.default, (*op_args(c, *args), 2))


def test_meta_shapes():
    c = Case(b=2, h=4, hk=2, sq=3, d=32, dtype=torch.bfloat16, seqlens=(5, 6), page=4)
    args = list(op_args(c, *make_inputs(c)))
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    out, lse = torch.ops.attention_ext.decode_fwd(*meta, 0)
    assert out.shape == (2, 4, 3, 32) and lse.shape == (2, 4, 3) and lse.dtype == torch.float32


def test_backward_raises():
    """decode_fwd has no backward; a backward through it says so. Without an autograd kernel,
    torch's fallback ran it with a deprecation warning and gave q and the caches no gradient."""
    q, kc, vc = torch.randn(2, 1, 4, 16, requires_grad=True), torch.randn(2, 9, 2, 16), torch.randn(2, 9, 2, 16)
    out, _ = ops.decode_fwd(q, kc, vc, cache_seqlens=torch.tensor([9, 4], dtype=torch.int32), scale=0.25)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="decode_fwd has no backward"):
        out.sum().backward()
    with torch.no_grad():  # the decoding path: nothing recorded
        out, _ = ops.decode_fwd(q, kc, vc, cache_seqlens=torch.tensor([9, 4], dtype=torch.int32), scale=0.25)
    assert not out.requires_grad


def test_decode_check_op():
    """decode_check, the reference fallback's check: decode_fwd's shape, dtype and device rules on
    any device (meta tensors here), the same errors as the op, and opcheck."""
    c = Case(b=2, h=4, hk=2, sq=1, d=32, dtype=torch.float32, seqlens=(5, 9), page=4)
    args = (*op_args(c, *make_inputs(c)), 0)
    torch.library.opcheck(torch.ops.attention_ext.decode_check.default, args)
    meta = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in args]
    torch.ops.attention_ext.decode_check(*meta)
    bad = list(args)
    bad[0] = bad[0][..., :16]  # q's head dim
    with pytest.raises(ValueError) as op:
        torch.ops.attention_ext.decode_fwd(*bad)
    with pytest.raises(ValueError) as check:
        torch.ops.attention_ext.decode_check(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in bad])
    assert str(check.value).splitlines()[0] == str(op.value).splitlines()[0]


def test_set_cuda_kernels_selection():
    """decode.set_cuda_kernels returns the previous selection (so **old restores it); on the CPU it
    changes nothing."""
    import attention_ext as ae

    old = ae.decode.set_cuda_kernels(tensor_cores=True, quantized=True)
    try:
        assert ae.decode.cuda_kernels() == dict(tensor_cores=True, quantized=True)
        c = Case(sq=2, seqlens=(0, 3, 40, 9))
        q, k, v, idx, kw, alibi, sinks = make_inputs(c)
        out, lse = ops.decode_fwd(q, k, v, **idx, scale=kw["softmax_scale"])
        check(c, out, lse, q, k, v, idx, kw, alibi, sinks)
    finally:
        assert ae.decode.set_cuda_kernels(**old) == dict(tensor_cores=True, quantized=True)
    assert ae.decode.cuda_kernels() == old
