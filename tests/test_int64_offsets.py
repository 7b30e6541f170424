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
  chosen so that every mean is a bf16 number). One query row keeps the compute small.

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


@pytest.mark.int64_big
def test_numel_past_2_31(request):
    # opt-in (pytest -m int64_big, tests/conftest.py OPT_IN): 4.3 GB and ~40 s
    B, H, S, D = 1, 2 ** 13 + 8, 2048, 128  # v: 2,149,580,800 elements > 2^31
    dt = torch.bfloat16
    need(B * H * S * D * 2)
    v = torch.empty(B, H, S, D, dtype=dt)
    assert v.numel() > BIG
    # v[b, h, j, :] = (h % 7) + (j % 4) / 4: every mean over j is (h % 7) + 0.375, a bf16 number
    hh = (torch.arange(H) % 7).to(dt).view(1, H, 1, 1)
    jj = ((torch.arange(S) % 4) * 0.25).to(dt).view(1, 1, S, 1)
    for h0 in range(0, H, 512):
        v[:, h0:h0 + 512] = (hh[:, h0:h0 + 512] + jj).expand(B, min(512, H - h0), S, D)
    k = torch.zeros(D, dtype=dt).expand(B, H, S, D)  # q = k = 0: uniform attention (k costs no memory)
    q = torch.zeros(B, H, 1, D, dtype=dt)
    expect = ((torch.arange(H) % 7).float() + 0.375)[:, None].expand(H, D)
    t0 = time.perf_counter()
    out = ae.attention(q, k, v)
    print(f"attention over {v.numel()} elements of v: {time.perf_counter() - t0:.1f} s")
    assert torch.equal(out[0, :, 0, :].float(), expect)
