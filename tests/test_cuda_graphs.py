"""CUDA graphs and streams, for every family's CUDA op (issue 17, "on a device session"):

- a call on a non-default stream gives the same bits as on the default stream (the kernels
  launch on the current stream, and the host steps do not use the default one behind its back);
- a call captured in a CUDA graph and replayed, after new values are copied into its static
  inputs, gives the same bits as the eager call on those values (atol 0): nothing is baked in at
  capture time, and nothing in the op synchronizes with the host while capturing.

The backward of the softmax and linear ops is captured with the forward (deterministic=True where
the op has it: a dQ summed by atomics could differ in its last bits between any two runs).
Block-sparse calls take their layout's tile index from the cache the warm-up filled (building it
syncs; csrc/torch/block_index.h). Decode skips its host checks of the index values while a graph
is captured (they would need a device-to-host copy): a bad value replayed from the graph gives NaN
rows for its sequence (attention_ext/decode/kvcache.py), never a read or write out of bounds
(test_graph_decode_bad_index).

Skips without a GPU or without the compiled CUDA kernels.
"""
from __future__ import annotations

import pytest
import torch

import attention_ext as ae
from attention_ext._ext import HAS_EXT

CUDA = torch.cuda.is_available() and HAS_EXT
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a GPU and the compiled CUDA kernels")
DEV = "cuda"


def _rand(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape, device=DEV, dtype=dtype).requires_grad_(grad)


def softmax_case():
    q, k, v = _rand(2, 4, 200, 64, grad=True), _rand(2, 2, 333, 64, grad=True), _rand(2, 2, 333, 64, grad=True)
    do = _rand(2, 4, 200, 64)

    def fn(q, k, v, do):
        out = ae.attention(q, k, v, causal=True, bottom_right=True, deterministic=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))
    return [q, k, v, do], fn


def softmax_options_case():
    q, k, v = _rand(1, 4, 129, 128), _rand(1, 4, 257, 128), _rand(1, 4, 257, 128)
    slopes = torch.rand(4, device=DEV, dtype=torch.float32)

    def fn(q, k, v, slopes):
        return ae.attention(q, k, v, window=(64, 0), bottom_right=True, alibi_slopes=slopes, softcap=20.0,
                            return_lse=True)
    return [q, k, v, slopes], fn


def linear_case():
    q, k, v = (_rand(2, 4, 300, 64, dtype=torch.float32, grad=True) for _ in range(3))
    do = _rand(2, 4, 300, 64, dtype=torch.float32)

    def fn(q, k, v, do):
        out = ae.linear_attention(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), do))
    return [q, k, v, do], fn


def sparse_case():
    q, k, v = _rand(1, 4, 512, 64), _rand(1, 4, 512, 64), _rand(1, 4, 512, 64)
    layout = torch.rand(4, 8, 8, device=DEV) < 0.5
    layout |= torch.eye(8, dtype=torch.bool, device=DEV)  # every query block sees a key block

    def fn(q, k, v):
        return ae.block_sparse_attention(q, k, v, layout, block_size=64)
    return [q, k, v], fn


def topk_case():
    q, k, v = _rand(1, 2, 100, 64), _rand(1, 2, 300, 64), _rand(1, 2, 300, 64)

    def fn(q, k, v):
        return ae.topk_attention(q, k, v, 16)
    return [q, k, v], fn


def decode_case():
    # the in-place append of one token, then attention over the cache. Explicit splits: under a
    # capture the heuristic sizes them by the capacity (the lengths are not read on the host), in
    # an eager call by the longest sequence, and another split count rounds differently
    b, h, hk, d, cap = 3, 8, 2, 128, 1024
    q, kn, vn = _rand(b, 1, h, d), _rand(b, 1, hk, d), _rand(b, 1, hk, d)
    kc, vc = _rand(b, cap, hk, d), _rand(b, cap, hk, d)
    seqlens = torch.tensor([0, 17, 1000], device=DEV, dtype=torch.int32)

    def fn(q, kn, vn, kc, vc, seqlens):
        return ae.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=True, num_splits=4,
                                          return_softmax_lse=True)
    return [q, kn, vn, kc, vc, seqlens], fn


CASES = {"softmax_fwd_bwd": softmax_case, "softmax_options": softmax_options_case, "linear_fwd_bwd": linear_case,
         "block_sparse": sparse_case, "topk": topk_case, "decode": decode_case}


def _flat(x):
    return [t.detach().clone() for t in (x if isinstance(x, (tuple, list)) else (x,))]


def _same(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and x.dtype == y.dtype, (what, i)
        assert torch.equal(x, y), f"{what}: output {i} differs (max {(x.float() - y.float()).abs().max().item()})"


def _refill(inputs):
    with torch.no_grad():
        for t in inputs:
            if t.is_floating_point():
                t.copy_(torch.randn_like(t) if t.dtype != torch.float32 or t.dim() > 1 else torch.rand_like(t))


@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_side_stream(name):
    torch.manual_seed(0)
    inputs, fn = CASES[name]()
    ref = _flat(fn(*inputs))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _flat(fn(*inputs))
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    _same(ref, got, f"{name} on a side stream")


@needs_cuda
@pytest.mark.parametrize("name", list(CASES))
def test_graph_replay(name):
    torch.manual_seed(0)
    inputs, fn = CASES[name]()
    # warm-up on a side stream (lazy initialization, the caching allocator), as torch's docs do
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = fn(*inputs)
    for rnd in range(2):
        _refill(inputs)  # new values in the same storage: the replay must read them
        g.replay()
        torch.cuda.synchronize()
        got = _flat(static_out)
        _same(_flat(fn(*inputs)), got, f"{name}: graph replay {rnd}")


@needs_cuda
def test_graph_decode_bad_index():
    # a sequence whose length passes the cache after the capture: NaN rows for it, the others as
    # the eager call with a good length gives them
    torch.manual_seed(0)
    inputs, fn = CASES["decode"]()
    q, kn, vn, kc, vc, seqlens = inputs
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(*inputs)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = fn(*inputs)
    k0, v0 = kc.clone(), vc.clone()
    seqlens.copy_(torch.tensor([5, kc.shape[1] + 3, 9]))
    g.replay()
    torch.cuda.synchronize()
    got = (out.clone(), lse.clone())
    assert got[0][1].isnan().all() and got[1][1].isnan().all()
    kc.copy_(k0), vc.copy_(v0)
    seqlens.copy_(torch.tensor([5, 3, 9]))
    want = fn(*inputs)
    for a, b in zip(got, want):
        assert torch.equal(a[0::2], b[0::2])


@needs_cuda
def test_dropout_refused_in_capture():
    q = _rand(1, 2, 64, 64)
    ae.attention(q, q, q, dropout_p=0.1)  # the warm-up, eager: fine
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="one dropout mask"):
        with torch.cuda.graph(g):
            ae.attention(q, q, q, dropout_p=0.1)


# the rule on any machine: tests/cuda_emu/test_emulated.py::test_dropout_refused_under_capture
