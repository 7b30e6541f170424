"""Shared test helpers: random problems and the FA2 error rule (kernel error <= 2x the error of
PyTorch's own same-dtype math, both against float64)."""
from __future__ import annotations

import contextlib
import math
import tempfile

import torch
import torch.distributed as dist

from attention_ext import reference


def rand_qkv(b, h, hk, sq, sk, d, dtype, device="cpu", layout="bhsd", requires_grad=True):
    def mk(heads, s):
        shape = (b, heads, s, d) if layout == "bhsd" else (b, s, heads, d)
        return torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)

    return mk(h, sq), mk(hk, sk), mk(hk, sk)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(max |ref|, 1) over finite entries (the 1 keeps all-zero references,
    e.g. dq with one key, from dividing rounding noise by zero); a NaN where ref is finite fails."""
    x = x.detach().double().cpu()
    ref = ref.detach().double().cpu()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), fin):
        return math.inf
    if fin.sum() == 0:
        return 0.0
    scale = ref[fin].abs().max().item()
    return (x[fin] - ref[fin]).abs().max().item() / max(scale, 1.0)


# Absolute floor, relative to max(|ref|, 1): about half an ulp of the dtype for the low
# precisions. The backward's D_i = dO_i . O_i uses the stored (rounded) output, as FA2 does, so a
# gradient that is exactly 0 in exact math (one visible key: dS = 0) comes out at rounding level
# where PyTorch's autograd happens to produce an exact 0.
# float64 runs through the float64 kernel and is held to the floor alone: PyTorch's "same-dtype"
# error is then the reference's own (0), and blocked summation orders differ by ~1e-15.
FLOOR = {torch.float32: 5e-5, torch.float16: 5e-4, torch.bfloat16: 4e-3, torch.float64: 1e-12}


def assert_close_fa2(ours: torch.Tensor, torch_same_dtype: torch.Tensor, ref64: torch.Tensor, dtype, what=""):
    """ours vs the float64 reference must be within 2x PyTorch's same-dtype error (+ a floor)."""
    e_ours = rel_err(ours, ref64)
    e_torch = rel_err(torch_same_dtype, ref64)
    assert e_ours <= 2.0 * e_torch + FLOOR[dtype], f"{what}: error {e_ours:.3g} > 2 x torch {e_torch:.3g} + floor"


def assert_compiled_backward_matches(m: torch.nn.Module, x: torch.Tensor, call_kwargs, rtol=1e-4, atol=1e-5):
    """torch.compile(m, backend="aot_eager", fullgraph=True) against eager m: the output and the
    gradients of x and of every parameter for out.square().sum(), once per kwargs dict in
    call_kwargs (x must require grad)."""
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    for kw in call_kwargs:
        grads = []
        for f in (m, compiled):
            m.zero_grad()
            x.grad = None
            out = f(x, **kw)
            out.square().sum().backward()
            grads.append([out.detach(), x.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=rtol, atol=atol)


def reference_in(dtype, q, k, v, **kw):
    """reference.attention run in `dtype` (PyTorch's own math at that precision); out and grads
    come back for comparison."""
    qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    kw = dict(kw)
    if kw.get("bias") is not None and kw["bias"].dtype != torch.bool:
        kw["bias"] = kw["bias"].detach().to(dtype).requires_grad_(kw["bias"].requires_grad)
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].detach().to(dtype).requires_grad_(kw["sinks"].requires_grad)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = kw["alibi_slopes"].to(dtype)
    out, lse = reference.attention(qq, kk, vv, **kw)
    return out, lse, (qq, kk, vv, kw.get("bias"), kw.get("sinks"))


@contextlib.contextmanager
def one_rank_group():
    """A one-rank gloo process group as the default group, made and destroyed around the block
    (nothing when one exists): the context-parallel functions' collectives need one; every check
    they make of their arguments is local, before any collective."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
