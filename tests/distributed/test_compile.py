"""context_parallel_attention under torch.compile (aot_eager, the CPU-safe backend): every mode
compiles with graph breaks at its collectives and gives eager's output and gradients; all-gather
and Ulysses also compile with fullgraph=True. Ring does not (torch.compile refuses to trace
batch_isend_irecv's P2POp), which docs/context-parallel.md states. Packed documents (the balanced
layout) compile in every mode with graph breaks (their plans are made on the host)."""
from __future__ import annotations

import pytest
import torch

from attention_ext import distributed as cp
from tests.distributed import harness

CASES = [("allgather", False), ("allgather", True), ("ring", False), ("ulysses", False), ("ulysses", True),
         ("allgather", "docs"), ("ring", "docs"), ("ulysses", "docs")]  # (mode, fullgraph or "docs")
PACK = [0, 5, 6, 19, 24]


def _compile_suite(rank, world):
    res = {}
    for mode, fullgraph in CASES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 4, 24, 16) for _ in range(3))
        docs = dict(shard_layout="balanced", cu_seqlens=PACK) if fullgraph == "docs" else dict(shard_layout="zigzag")
        shards = [cp.shard_sequence(t, dim=2, **docs) for t in (q, k, v)]

        def run(fn):
            a, b, c = (t.clone().requires_grad_() for t in shards)
            out = fn(a, b, c)
            (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            return [out.detach(), a.grad, b.grad, c.grad]

        f = lambda a, b, c: cp.context_parallel_attention(a, b, c, mode=mode, causal=True,  # noqa: E731
                                                          window_size=(9, -1), **docs)
        torch._dynamo.reset()
        want = run(f)
        got = run(torch.compile(f, backend="aot_eager", fullgraph=fullgraph is True))
        res[(mode, fullgraph)] = max(float((x - y).abs().max()) for x, y in zip(got, want))
    return res


@pytest.fixture(scope="module")
def suite():
    return harness.run(_compile_suite, 2, timeout=300)


@pytest.mark.parametrize("mode,fullgraph", CASES,
                         ids=[f"{m}-{f if f == 'docs' else 'fullgraph' if f else 'breaks'}" for m, f in CASES])
def test_compiled_matches_eager(suite, mode, fullgraph):
    for rank, res in enumerate(suite):
        assert res[(mode, fullgraph)] <= 1e-6, (rank, res)
