"""64-bit indexing on the CPU: tensors whose element offsets pass 2^31.

- test_offsets_past_2_31: q, k, v (and a KV cache written in place, and a linear state) as
  strided views into one buffer of 2^31 + 2^20 elements, batch 1 starting past element 2^31 of
  each view, through the softmax forward and backward (the fused tiles and the decode path),
  decode_fwd, flash_attn_with_kvcache (the append writes past 2^31), block-sparse, top-k, and
  linear attention forward and backward. Only the pages written are touched (torch.empty does not
  commit the buffer), so the footprint is ~10 MB of 4.3 GB reserved; checked against the same
  call on contiguous copies.
- test_numel_past_2_31 (marker int64_big): v with more than 2^31 elements (4.3 GB in bf16),
  q = k = 0, so attention is uniform and out = mean(v) over the keys, exactly (v's values are
  chosen so that every mean is a bf16 number). One query row (the decode kernel) keeps the
  compute small.
- test_numel_past_2_31_families (marker int64_big): the same v through every other kernel that
  reads it: 16 query rows (the softmax tiles, forward, and the backward's dv, 4.3 GB more, every
  element 16 / 2048 exactly), block-sparse over a full layout, top-k keeping every key, and
  non-causal linear attention (elu + 1 of 0 is 1: out = mean(v) again, an out of 4.3 GB).

Each test reads MemAvailable and skips, saying why, when the footprint plus 4 GB headroom does
not fit (other processes share the machine).
"""
import time

import pytest
import torch

import attention_ext as ae

BIG = 2 ** 31
GB = 2 ** 30


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def need(footprint):
    have = mem_available()
    if have < footprint + 4 * GB:
        pytest.skip(f"needs {footprint / GB:.1f} GB + 4 GB headroom, MemAvailable is {have / GB:.1f} GB")


def strided(buf, off, shape, bstride):
    """A 4-D view of buf at element `off`, rows contiguous, batch stride `bstride` elements."""
    b, x, y, d = shape
    return buf.as_strided(shape, (bstride, y * d, d, 1), off)


def close(a, b):
    return (a.float() - b.float()).abs().max().item() == 0.0  # the same kernel on the same values: bit-equal


def test_offsets_past_2_31():
    need(64 * 2 ** 20)
    torch.manual_seed(0)
    dt = torch.bfloat16
    buf = torch.empty(BIG + 2 ** 20, dtype=dt)  # virtual: only the views' pages get committed
    B, H, S, D = 2, 2, 40, 32
    bs = BIG + 4096  # batch 1 of every view starts past element 2^31
    n = H * S * D
    q, k, v = (strided(buf, i * n, (B, H, S, D), bs) for i in range(3))
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, dtype=dt))
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    assert close(ae.attention(q, k, v, causal=True), ae.attention(qc, kc, vc, causal=True))
    # backward: the gradients of the strided views against those of the copies
    grads = []
    for args in ((q, k, v), (qc, kc, vc)):
        leaves = [t.detach().requires_grad_() for t in args]
        ae.attention(*leaves, causal=True).float().sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(close(a, b) for a, b in zip(*grads))
    # one query row: attention() runs the decode kernel
    assert close(ae.attention(q[:, :, :1], k, v), ae.attention(qc[:, :, :1], kc, vc))
    T = lambda t: t.transpose(1, 2)  # noqa: E731  (bshd views)
    assert close(ae.decode.decode_fwd(T(q[:, :, :1]), T(k), T(v), scale=0.2)[0],
                 ae.decode.decode_fwd(T(qc[:, :, :1]), T(kc), T(vc), scale=0.2)[0])
    lay = torch.ones(1, 1, 1, dtype=torch.bool)
    assert close(ae.block_sparse_attention(q, k, v, lay), ae.block_sparse_attention(qc, kc, vc, lay))
    assert close(ae.topk_attention(q, k, v, 5), ae.topk_attention(qc, kc, vc, 5))
    assert close(ae.linear_attention(q, k, v, causal=True), ae.linear_attention(qc, kc, vc, causal=True))
    grads = []
    for args in ((q, k, v), (qc, kc, vc)):
        leaves = [t.detach().requires_grad_() for t in args]
        ae.linear_attention(*leaves, causal=True).float().sum().backward()
        grads.append([t.grad for t in leaves])
    assert all(close(a, b) for a, b in zip(*grads))
    # a KV cache written in place past 2^31 (the append), read back by the decode kernel
    kcache, vcache = (strided(buf, i * n, (B, S, H, D), bs) for i in (3, 4))
    for t in (kcache, vcache):
        t.copy_(torch.randn(t.shape, dtype=dt))
    kc2, vc2 = kcache.contiguous(), vcache.contiguous()
    qn, kn, vn = (torch.randn(B, 1, H, D, dtype=dt) for _ in range(3))
    lens = torch.tensor([10, 20], dtype=torch.int32)
    o1 = ae.flash_attn_with_kvcache(qn, kcache, vcache, kn, vn, cache_seqlens=lens)
    o2 = ae.flash_attn_with_kvcache(qn, kc2, vc2, kn, vn, cache_seqlens=lens)
    assert close(o1, o2) and close(kcache, kc2) and close(vcache, vc2)
    assert close(kcache[1, 20], kn[1, 0])


B_, H_, S_, D_ = 1, 2 ** 13 + 8, 2048, 128  # v: 2,149,580,800 elements > 2^31


def uniform_case(q_rows, qk_dim=D_):
    """(q, k, v, expect): v (B, H, S, D) bf16 of more than 2^31 elements with v[b, h, j, :] =
    (h % 7) + (j % 4) / 4, so every mean over j is (h % 7) + 0.375, a bf16 number; q = k = 0 of
    width qk_dim (k expanded: no memory); expect (H, D) float32, the mean."""
    dt = torch.bfloat16
    v = torch.empty(B_, H_, S_, D_, dtype=dt)
    assert v.numel() > BIG
    hh = (torch.arange(H_) % 7).to(dt).view(1, H_, 1, 1)
    jj = ((torch.arange(S_) % 4) * 0.25).to(dt).view(1, 1, S_, 1)
    for h0 in range(0, H_, 512):
        v[:, h0:h0 + 512] = (hh[:, h0:h0 + 512] + jj).expand(B_, min(512, H_ - h0), S_, D_)
    k = torch.zeros(qk_dim, dtype=dt).expand(B_, H_, S_, qk_dim)
    q = torch.zeros(B_, H_, q_rows, qk_dim, dtype=dt)
    expect = ((torch.arange(H_) % 7).float() + 0.375)[:, None].expand(H_, D_)
    return q, k, v, expect


def uniform_rows(out, expect):
    """Every query row of out (1, H, S_q, D) equals expect (H, D)."""
    return torch.equal(out[0].float(), expect[:, None, :].expand(out.shape[1:]))


@pytest.mark.int64_big
def test_numel_past_2_31(request):
    # opt-in (pytest -m int64_big, tests/conftest.py OPT_IN): 4.3 GB and ~40 s
    need(B_ * H_ * S_ * D_ * 2)
    q, k, v, expect = uniform_case(1)
    t0 = time.perf_counter()
    out = ae.attention(q, k, v)
    print(f"attention over {v.numel()} elements of v: {time.perf_counter() - t0:.1f} s")
    assert uniform_rows(out, expect)


@pytest.mark.int64_big
def test_numel_past_2_31_families():
    # opt-in as above: 8.6 GB at the peak (v and dv, or v and linear's out)
    need(2 * B_ * H_ * S_ * D_ * 2)
    q, k, v, expect = uniform_case(16)
    t0 = time.perf_counter()
    assert uniform_rows(ae.attention(q, k, v), expect), "softmax tiles"
    lay = torch.ones(1, 1, S_ // 128, dtype=torch.bool)  # (H, S_q blocks, S_k blocks), block 128
    assert uniform_rows(ae.block_sparse_attention(q, k, v, lay, block_size=128), expect), "block-sparse"
    assert uniform_rows(ae.topk_attention(q, k, v, S_), expect), "top-k keeping every key"
    # the backward's dv: P^T dout with uniform P = 1 / S and dout = 1 over 16 rows, 16 / 2048 = 2^-7
    v.requires_grad_()
    out = ae.attention(q, k, v)
    (dv,) = torch.autograd.grad(out, [v], torch.ones_like(out))
    assert dv.numel() > BIG and bool((dv == 2.0 ** -7).all()), "softmax backward dv"
    del dv, out
    v.requires_grad_(False)
    # linear, non-causal: phi(0) = elu(0) + 1 = 1 for every feature of width 1, out_i = mean(v)
    ql = torch.zeros(B_, H_, S_, 1, dtype=v.dtype)
    kl = torch.zeros(1, dtype=v.dtype).expand(B_, H_, S_, 1)
    out = ae.linear_attention(ql, kl, v, causal=False)
    assert out.numel() > BIG and uniform_rows(out, expect), "linear"
    print(f"softmax fwd/bwd, block-sparse, top-k, linear over {v.numel()} elements of v: "
          f"{time.perf_counter() - t0:.1f} s")
