"""Option values at the edges of their types, and paths that must not change the math: each case
was a crash, a silent wrong answer or an error that named nothing (an audit of the public API,
2026-11-30). Sizes past 32 bits, non-finite options, offsets given as int64 or floats, NaN under
padding on every path, sparse layers over caches, float32 LSH with lone queries."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import attention_ext as ae
from attention_ext.softmax import ops

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")


def test_block_size_past_int32_is_an_error():
    """It was cut to 32 bits in the params and the kernel read past the layout (a segfault):
    run in a subprocess, which must exit 1 with the ValueError."""
    code = ("import torch, attention_ext as ae\n"
            "q = torch.randn(1, 2, 40, 8)\n"
            "ae.block_sparse_attention(q, q, q, torch.ones(1, 1, 1, dtype=torch.bool), block_size=2**32 + 16)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "block_size must be a positive multiple of 16 up to 2^30" in r.stderr, r.stderr[-800:]


@pytest.mark.parametrize("window", [(2 ** 32, 2 ** 32), (2 ** 31 - 1, 2 ** 31 - 1), (2 ** 40, 0), (10 ** 6, 3)])
def test_wide_windows_are_unbounded(window):
    """A window side at least Sq + Sk wide reaches every key: it equals -1 (unbounded). It was cut
    to 32 bits (2^32 ran as 0) and 2^31 - 1 overflowed the kernels' int32 sums."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 8, generator=g) for _ in range(3))
    want = ae.attention(q, k, v, window=tuple(-1 if w >= 14 else w for w in window))
    torch.testing.assert_close(ae.attention(q, k, v, window=window), want, atol=0, rtol=0)
    qd = torch.randn(2, 1, 4, 8, generator=g)
    kc, vc = torch.randn(2, 20, 2, 8, generator=g), torch.randn(2, 20, 2, 8, generator=g)
    lens = torch.tensor([20, 11], dtype=torch.int32)
    got = ae.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens, window_size=window)
    want = ae.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=lens,
                                      window_size=tuple(-1 if w >= 24 else w for w in window))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("fn", ["attention", "kvcache"])
def test_softcap_must_be_finite(fn):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="softcap must be finite"):
        if fn == "attention":
            ae.attention(q, q, q, softcap=float("inf"))
        else:
            c = torch.randn(1, 5, 2, 8)
            ae.flash_attn_with_kvcache(q.transpose(1, 2)[:, :1], c, c, softcap=float("inf"))


def test_cu_seqlens_dtypes_and_range():
    """int32 and int64 offsets run alike; int64 past int32's range and float offsets are errors
    naming the argument (they were truncated silently)."""
    q = torch.randn(10, 2, 8)
    c32 = torch.tensor([0, 3, 10], dtype=torch.int32)
    want = ae.softmax.attention_varlen(q, q, q, c32, c32, 7, 7)
    torch.testing.assert_close(ae.softmax.attention_varlen(q, q, q, c32.long(), c32.long(), 7, 7), want, atol=0,
                               rtol=0)
    big = torch.tensor([0, 3, 2 ** 32 + 10])
    with pytest.raises(ValueError, match="cu_seqlens_q holds 4294967306, outside int32's range"):
        ae.softmax.attention_varlen(q, q, q, big, big, 2 ** 31 - 1, 2 ** 31 - 1)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 \\(or int64\\) tensor of offsets"):
        ae.softmax.attention_varlen(q, q, q, torch.tensor([0, 3.7, 10]), c32, 8, 8)
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor"):
        ae.softmax.attention_varlen(q, q, q, c32, [0, 3, 10], 8, 8)
    lq = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="cu_seqlens holds 4294967306"):
        ae.linear_attention(lq, lq, lq, cu_seqlens=big)
    with pytest.raises(TypeError, match="cu_seqlens must be an int32"):
        ae.delta_rule_attention(lq, torch.nn.functional.normalize(lq, dim=-1), lq, torch.rand(1, 2, 10),
                                cu_seqlens=torch.tensor([0.0, 10.0]))
    pack = q.transpose(0, 1)[None]  # (1, H, total, D)
    with pytest.raises(ValueError, match="max_seqlen_q/k must be in \\[0, 2\\^31 - 1\\]"):
        ops.fwd(pack, pack, pack, **dict(ops._NEUTRAL_OPTIONS, cu_seqlens_q=c32, cu_seqlens_k=c32,
                                         max_seqlen_q=2 ** 32, max_seqlen_k=2 ** 32))


def test_per_feature_decay_with_key_mask_keeps_nan_out():
    """GLA's per-feature gates with a key mask: a padded key's v, NaN here, reaches nothing (the
    per-head decay path already kept it out; the per-feature one zeroed only phi(k))."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    decay = -torch.rand(1, 2, 6, 4, generator=g)
    km = torch.tensor([[False, False, True, True, True, True]])
    bad = v.clone()
    bad[:, :, :2] = float("nan")
    out = ae.linear_attention(q, k, bad, causal=True, decay=decay, key_mask=km)
    want = ae.linear_attention(q, k, v.masked_fill(~km.view(1, 1, 6, 1), 0.0), causal=True, decay=decay, key_mask=km)
    assert not out[:, :, 2:].isnan().any()
    torch.testing.assert_close(out[:, :, 2:], want[:, :, 2:], atol=1e-6, rtol=1e-6)


def test_lsh_lone_queries_float32():
    """A query alone in every round (row 0 under causal) gets its own value: the rounds' weights are
    a softmax over equal LSEs, 1 / R each exactly (exp(lse - total) lost 0.3% to float32 at -1e5)."""
    g = torch.Generator().manual_seed(2)
    qk, v = torch.randn(1, 1, 16, 8, generator=g), torch.randn(1, 1, 16, 8, generator=g)
    rot = torch.randn(3, 8, 2, generator=g)
    out = ae.lsh_attention(qk, v, n_buckets=4, n_hashes=3, chunk_size=4, causal=True, rotations=rot)
    ref = ae.lsh_attention(qk.double(), v.double(), n_buckets=4, n_hashes=3, chunk_size=4, causal=True,
                           rotations=rot)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("pattern", ["topk", "sliding_window"])
def test_sparse_layers_over_caches(pattern):
    """A sparse layer's steps over an 8-bit KVCache run its own kernel on the cache's rows (they
    ran the dense decode kernel: 0.71 off with top-2); over a PagedKVCache they refuse."""
    from attention_ext.nn import AttentionConfig, KVCache, PagedKVCache, make_attention

    torch.manual_seed(3)
    kw = dict(topk=2) if pattern == "topk" else dict(sparse_block_size=16, sparse_kwargs=dict(window_blocks=1))
    cfg = AttentionConfig(d_model=32, n_heads=4, causal=True, attention_type="sparse", sparse_pattern=pattern, **kw)
    layer = make_attention(cfg).eval()
    x = torch.randn(1, 64, 32)
    with torch.no_grad():
        full = layer(x)
        f32 = KVCache(1, 64, layer.n_kv_heads, layer.head_dim)
        steps = [layer(x[:, :48], cache=f32)] + [layer(x[:, t:t + 1], cache=f32) for t in range(48, 64)]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
        q8 = KVCache(1, 64, layer.n_kv_heads, layer.head_dim, dtype=torch.int8)
        steps = [layer(x[:, :48], cache=q8)] + [layer(x[:, t:t + 1], cache=q8) for t in range(48, 64)]
        err = (torch.cat(steps, 1)[:, 48:] - full[:, 48:]).abs().max()
        assert err < 0.03, err  # the int8 rows' rounding, not another attention
        with pytest.raises(NotImplementedError, match="does not step through a PagedKVCache"):
            layer(x[:, :48], cache=PagedKVCache(1, 8, 16, layer.n_kv_heads, layer.head_dim))


def test_errors_name_the_argument():
    """Non-integer windows, lists where tensors go, K = 0, a k_top past int32: each a clear error
    naming the argument (they were truncations, AttributeErrors or a ZeroDivisionError)."""
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match="window must be a pair of ints"):
        ae.attention(q, q, q, window=(1.5, 0))
    with pytest.raises(TypeError, match="window must be a pair of ints"):
        ae.attention(q, q, q, window=(float("nan"), 0))
    torch.testing.assert_close(ae.attention(q, q, q, window=(2.0, 0)), ae.attention(q, q, q, window=(2, 0)))
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        ae.flash_attn_func(q, q, q, window_size=(1.5, 0))
    p = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7])
    for name in ("alibi_slopes", "sinks"):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            ae.softmax.attention_varlen(p, p, p, cu, cu, 4, 4, **{name: [0.5, 0.5]})
    with pytest.raises(TypeError, match="kv must be a torch.Tensor"):
        ae.flash_attn_kvpacked_func(q, [q, q])
    with pytest.raises(TypeError, match="decay_t must be a torch.Tensor"):
        ae.linear_attention_step(q[:, :, :1], q[:, :, :1], q[:, :, :1], None, decay_t=[0.5])
    c = torch.randn(1, 5, 2, 8)
    with pytest.raises(TypeError, match="sinks must be a torch.Tensor"):
        ae.flash_attn_with_kvcache(q.transpose(1, 2)[:, :1], c, c, sinks=[0.0, 0.0])
    z = torch.randn(1, 2, 5, 0)
    with pytest.raises(ValueError, match="K|head dim"):
        ae.delta_rule_attention(z, z, torch.randn(1, 2, 5, 4), torch.rand(1, 2, 5))
    with pytest.raises(ValueError, match="k_top must be in \\[1, 2\\^31 - 1\\]"):
        ae.topk_attention(q, q, q, 2 ** 31)


def test_compile_fullgraph_weights_probs_and_varlen():
    """attention_weights, flash_attn_func(return_attn_probs=True) and flash_attn_varlen_func compile
    with fullgraph=True on the CPU (the route op's str and reads of cu_seqlens broke the graph)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    torch._dynamo.reset()
    w = torch.compile(lambda q, k: ae.attention_weights(q, k, causal=True), fullgraph=True)(q, k)
    torch.testing.assert_close(w, ae.attention_weights(q, k, causal=True))
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    got = torch.compile(lambda a, b, c: ae.flash_attn_func(a, b, c, causal=True, return_attn_probs=True),
                        fullgraph=True)(qs, ks, vs)
    want = ae.flash_attn_func(qs, ks, vs, causal=True, return_attn_probs=True)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)
    p = torch.randn(9, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    got = torch.compile(lambda a: ae.flash_attn_varlen_func(a, a, a, cu, cu, 5, 5, causal=True), fullgraph=True)(p)
    torch.testing.assert_close(got, ae.flash_attn_varlen_func(p, p, p, cu, cu, 5, 5, causal=True))


@pytest.mark.parametrize("sq", [2, 4, 8])
@pytest.mark.parametrize("opt", ["causal", "window", "alibi"])
def test_few_rows_top_left_with_lengths(sq, opt):
    """Few-row CPU calls (Sq = Sk <= 8, nothing to differentiate) run the decode kernel, which aligns
    positions bottom-right: with seqlens_k below Sk the alignments differ, so top-left calls with
    lengths stay on the fused kernel (they ran the decode kernel: up to 3.4 off)."""
    from attention_ext.softmax import reference

    g = torch.Generator().manual_seed(sq)
    q, k, v = (torch.randn(2, 2, sq, 16, generator=g) for _ in range(3))
    lens = torch.tensor([max(sq - 2, 1), sq], dtype=torch.int32)
    slopes = torch.rand(2, generator=g)
    kw, rkw = {"causal": (dict(causal=True), dict(window=(-1, 0))), "window": (dict(window=(1, 0)), dict(window=(1, 0))),
               "alibi": (dict(alibi_slopes=slopes), dict(alibi_slopes=slopes.double()))}[opt]
    with torch.no_grad():
        out = ae.attention(q, k, v, seqlens_k=lens, **kw)
    ref, _ = reference.attention(q.double(), k.double(), v.double(), seqlens_k=lens, **rkw)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


def test_qk_int8_layout_with_float_mask_oracle():
    """The int8 Q.K^T with a block layout and a float mask: the kernel leaves the keys the layout
    hides from every row out of the mean and scales, and so does its oracle (the layout kept apart
    from the float bias, `visible`): they agree, and NaN in such keys reaches nothing."""
    from attention_ext.softmax import reference

    g = torch.Generator().manual_seed(7)
    b, h, s, d = 1, 2, 96, 32
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    k = k + 1.0
    lay = torch.ones(h, 3, 3, dtype=torch.bool)
    lay[:, :, 1] = False  # keys 32-63: no block
    fm = torch.randn(b, 1, s, s, generator=g)
    dense = lay.repeat_interleave(32, 1).repeat_interleave(32, 2)[None]
    with torch.no_grad():
        out = ae.attention(q, k, v, qk_quant="int8", block_layout=lay, block_size=32, attn_mask=fm)
        bad = k.clone()
        bad[:, :, 32:64] = float("nan")
        out_nan = ae.attention(q, bad, v, qk_quant="int8", block_layout=lay, block_size=32, attn_mask=fm)
    ref, _ = reference.attention_qk_int8(q, k, v, bias=fm.masked_fill(~dense, float("-inf")), visible=dense)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out_nan, out, atol=0, rtol=0)
