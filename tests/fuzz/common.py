"""Shared pieces of the fuzz tests: the error rule, input builders with unusual strides, and the
dtype / shape strategies."""
from __future__ import annotations

import os

import torch
from hypothesis import settings
from hypothesis import strategies as st

from tests.helpers import FLOOR, rel_err

F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
LOW = (torch.bfloat16, torch.float16)

# head dims: the tile widths' edges and odd sizes that are no multiple of 8 (the SIMD tails)
HEAD_DIMS = [1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 24, 31, 33, 40, 63, 64, 65, 72, 100, 127, 128, 129, 160, 200, 255, 256]
# lengths: 1, primes, and the CPU tiles' edges (16, 32, 48, 64) +- 1
LENGTHS = [1, 2, 3, 5, 7, 11, 13, 15, 16, 17, 23, 31, 32, 33, 37, 47, 48, 49, 53, 63, 64, 65, 71]

dtypes = st.sampled_from(DTYPES)
head_dims = st.sampled_from(HEAD_DIMS)
lengths = st.one_of(st.sampled_from(LENGTHS), st.integers(1, 72))
seeds = st.integers(0, 2**31 - 1)


def at_least(n):
    """@settings of a family's fuzz test: at least n examples under the `ci` profile (issue 17's
    few hundred per family), the profile's own count when larger (`long`: 10,000). Evaluated
    when the test module is imported, after pytest has loaded the profile."""
    return settings(max_examples=max(n, settings.default.max_examples))


def log_example(family, entry):
    """With ATTENTION_EXT_FUZZ_LOG=path, one line per example run (family, entry point): the count
    of a long run cut short by a time limit (hypothesis reports its statistics only at the end)."""
    path = os.environ.get("ATTENTION_EXT_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{family} {entry}\n")


def few_keys(ok):
    """tests/softmax/test_cpu.py's known limit: in bf16 / fp16 the backward's D_i = dO_i . O_i
    from the rounded output loses to cancellation on rows that see a few keys; the gradients of
    such problems (and of any with sinks, whose gradient is -sum_i P_sink,i D_i) are held to the
    rule in fp32 / fp64 only, finite in bf16 / fp16 (docs/known-gaps.md). ok: (..., S_q, S_k) bool,
    the allowed pairs."""
    seen = ok.sum(-1)
    return ((seen > 0) & (seen < 16)).sum().item() > 0.25 * max((seen > 0).sum().item(), 1)


def check(ours, low, ref, dtype, what, factor, floor_scale=1.0):
    """The project's rule: ours vs the float64 reference within `factor` x the error of PyTorch
    doing the same math in `dtype` (low), plus the floor of tests/helpers.py (times floor_scale,
    for a gradient that is a difference of much larger terms)."""
    e_ours, e_low = rel_err(ours, ref), rel_err(low, ref)
    floor = FLOOR[dtype] * floor_scale
    assert e_ours <= factor * e_low + floor, \
        f"{what}: error {e_ours:.3g} > {factor:g} x torch {e_low:.3g} + floor {floor:.3g}"


def check_out(ours, low, ref, dtype, what="out"):
    check(ours, low, ref, dtype, what, 2.0)


def check_grad(ours, low, ref, dtype, what, floor_scale=1.0):
    check(ours, low, ref, dtype, what, 3.0, floor_scale)


STORAGES = ["contig", "transposed", "sliced", "strided_seq"]


def strided(shape, dtype, storage, seq_dim, swap=(1, 2), heads=1, gen_scale=1.0):
    """A leaf (requires grad) and a function leaf -> the tensor of `shape` the op is given:
    contig: the leaf itself; transposed: the leaf holds the dims `swap` (heads and rows) swapped,
    the op gets the transposed view (bshd storage read as bhsd and back); sliced: the leaf's last dim is 3 wider, the op gets [..., 1:d+1]
    (row strides no multiple of the head dim); strided_seq: every other row of a leaf twice as
    long along seq_dim; expanded: a leaf with one head expanded (stride 0) to the heads at dim
    `heads`, as a GQA caller broadcasting one kv head. The last dim always keeps stride 1, as the ops require (else they copy)."""
    shape = tuple(shape)
    if storage == "contig":
        leaf_shape, fn = shape, (lambda t: t)
    elif storage == "transposed":
        ls = list(shape)
        ls[swap[0]], ls[swap[1]] = ls[swap[1]], ls[swap[0]]
        leaf_shape, fn = tuple(ls), (lambda t: t.transpose(*swap))
    elif storage == "sliced":
        d = shape[-1]
        leaf_shape, fn = shape[:-1] + (d + 3,), (lambda t: t[..., 1:d + 1])
    elif storage == "strided_seq":
        ls = list(shape)
        ls[seq_dim] *= 2
        leaf_shape = tuple(ls)
        fn = lambda t: t[(slice(None),) * seq_dim + (slice(None, None, 2),)]  # noqa: E731
    elif storage == "expanded":
        ls = list(shape)
        ls[heads] = 1
        leaf_shape, fn = tuple(ls), (lambda t: t.expand(shape))
    else:
        raise ValueError(storage)
    leaf = (gen_scale * torch.randn(leaf_shape, dtype=F64)).to(dtype).requires_grad_()
    return leaf, fn


def copies(leaves, dtype):
    """Detached copies of the leaves in `dtype` (float side inputs too, as tests/helpers.py's
    reference_in casts them), each requiring grad as its original does; non-float ones as they are."""
    return [t.detach().to(dtype).requires_grad_(t.requires_grad) if t is not None and t.is_floating_point() else t
            for t in leaves]


def run_with_references(call, ref_call, leaves, grad, dtype):
    """The kernel's result call(leaves) (under no_grad unless grad) and the reference's
    ref_call on float64 and on `dtype` copies of the leaves: (out, (r64 leaves, ref), (rlow
    leaves, low)), the leaf copies kept for their gradients."""
    if grad:
        out = call(leaves)
    else:
        with torch.no_grad():
            out = call(leaves)
    r64, rlow = copies(leaves, F64), copies(leaves, dtype)
    return out, (r64, ref_call(r64)), (rlow, ref_call(rlow))
