"""The rank side of the context-parallel fuzz test (tests/fuzz/test_fuzz_cp.py), imported by the
spawned ranks of a harness.Group.

A case is a plain dict (picklable) drawn by the parent. Every rank builds the same global tensors
from the case's seed (make_inputs, which the parent also calls for its references), pads and
shards them, and runs context_parallel_attention three ways:
  1. on contiguous shards with a contiguous grad_output: the result returned to the parent;
  2. on the same values in the case's storage (transposed, sliced, every other row of a longer
     tensor) with a non-contiguous grad_output: bit-identical to 1 (layout invariance);
  3. with NaN in every padded position (past seq_len) of q, k and v, which the call must not
     read: out, lse and every gradient at real positions bit-identical to 1.
The bitwise checks run on the ranks after every collective of the case, so a failing rank stays
in step with its peers.
"""
from __future__ import annotations

from typing import Dict

import torch

from attention_ext import distributed as cp

F64 = torch.float64
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def make_inputs(c: dict) -> Dict[str, torch.Tensor]:
    """The case's global tensors (unpadded, (B, H, S, D) / (B, H_k, S, D), in float64; the
    call's dtype is a cast of them): q, k, v, the grad_output g, and the optional slopes / sinks."""
    gen = torch.Generator().manual_seed(c["seed"])
    b, h, hk, s, d = c["b"], c["h"], c["hk"], c["real"], c["d"]
    t = {n: torch.randn(shape, generator=gen, dtype=F64) for n, shape in
         (("q", (b, h, s, d)), ("k", (b, hk, s, d)), ("v", (b, hk, s, d)), ("g", (b, h, s, d)))}
    # slopes and sinks hold float32 values: the call takes them in float32 (float64 for float64 q)
    t["slopes"] = (torch.rand(h, generator=gen, dtype=F64) * 0.5 + 0.1).float().double() if c["alibi"] else None
    t["sinks"] = torch.randn(h, generator=gen, dtype=F64).float().double() if c["sinks"] else None
    return t


def _stored(x: torch.Tensor, storage: str) -> torch.Tensor:
    """x (a shard in the call's layout) with the same values in another storage; last dim stride 1."""
    if storage == "transposed":  # the two middle dims swapped in memory
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if storage == "sliced":  # rows wider than the head dim
        wide = torch.zeros(*x.shape[:-1], x.shape[-1] + 3, dtype=x.dtype)
        wide[..., 1:x.shape[-1] + 1] = x
        return wide[..., 1:x.shape[-1] + 1]
    if storage == "strided_seq":  # every other row of a tensor twice as long along dim 2
        long = torch.zeros(*x.shape[:2], 2 * x.shape[2], x.shape[3], dtype=x.dtype)
        long[:, :, ::2] = x
        return long[:, :, ::2]
    return x


def fuzz_rank(rank: int, world: int, c: dict) -> Dict[str, torch.Tensor]:
    """Run one case on this rank; returns its shards of out, lse and (with c["grad"]) dq, dk, dv,
    dsinks (this rank's part), in the (B, H, n, D) order, with the shard's global positions."""
    dtype = DTYPES[c["dtype"]]
    t = make_inputs(c)
    shard_layout, bshd = c["shard_layout"], c["layout"] == "bshd"
    mult = cp.sequence_multiple(world, shard_layout)
    real, cu = c["real"], c.get("cu")
    shards = {}
    for n in ("q", "k", "v", "g"):
        x = cp.pad_to_multiple(t[n].to(dtype), 2, mult)[0]
        x = cp.shard_sequence(x, dim=2, shard_layout=shard_layout, cu_seqlens=cu)
        shards[n] = x.transpose(1, 2).contiguous() if bshd else x.contiguous()
    s = shards["q"].shape[1 if bshd else 2] * world
    pos = cp.global_positions(s, rank=rank, world_size=world, shard_layout=shard_layout, cu_seqlens=cu)
    slopes = t["slopes"].float() if t["slopes"] is not None else None
    acc = F64 if dtype == F64 else torch.float32
    opts = dict(mode=c["mode"], shard_layout=shard_layout, causal=c["causal"], window_size=c["window"],
                alibi_slopes=slopes, softcap=c["softcap"], return_lse=True, layout=c["layout"], seq_len=real,
                cu_seqlens=cu)

    def run(q, k, v, g, storage="contig"):
        # leaves in `storage` (views of other tensors for all but contig), for their gradients
        leaves = [_stored(x.clone(), storage).requires_grad_(c["grad"]) for x in (q, k, v)]
        sinks = t["sinks"].to(acc, copy=True).requires_grad_(c["grad"]) if t["sinks"] is not None else None
        with torch.set_grad_enabled(c["grad"]):
            out, lse = cp.context_parallel_attention(*leaves, sinks=sinks, **opts)
        grads = [None] * 4
        if c["grad"]:
            out.backward(g if storage == "contig" else _stored(g, "transposed"))  # strided: a non-contiguous dout
            grads = [x.grad for x in leaves] + [sinks.grad if sinks is not None else None]
            for x in leaves:  # the documented rule: a gradient has its input's strides, or is contiguous
                assert x.grad.stride() == x.stride() or x.grad.is_contiguous(), \
                    f"rank {rank}: grad strides {x.grad.stride()} for an input with strides {x.stride()}"
        return dict(zip(("out", "lse", "dq", "dk", "dv", "dsinks"), [out.detach(), lse.detach(), *grads]))

    q, k, v, g = shards["q"], shards["k"], shards["v"], shards["g"]
    clean = run(q, k, v, g)
    strided = run(q, k, v, g, c["storage"]) if c["storage"] != "contig" else None
    padded = pos >= real  # this shard's padded positions
    poisoned = None
    if s > real:  # on every rank (the same collectives), even one whose shard has no padding
        seq = 1 if bshd else 2
        idx = (slice(None),) * seq + (padded,)
        qp, kp, vp = q.clone(), k.clone(), v.clone()
        qp[idx], kp[idx], vp[idx] = float("nan"), float("nan"), float("nan")
        poisoned = run(qp, kp, vp, g)

    # the bitwise checks, after every collective of the case
    for name, other in (("strided inputs / grad_output", strided), ("NaN in padded positions", poisoned)):
        if other is None:
            continue
        for what, x in clean.items():
            y = other[what]
            if x is None:
                continue
            keep = ~padded if (name.startswith("NaN") and what in ("out", "lse", "dq", "dk", "dv")) else None
            if keep is not None:
                seq = 1 if (bshd and what != "lse") else 2
                x, y = x.index_select(seq, keep.nonzero().flatten()), y.index_select(seq, keep.nonzero().flatten())
            assert torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)) and torch.equal(x.isnan(), y.isnan()), \
                f"rank {rank}: {name}: {what} differs from the contiguous run"
    res = {n: (x.transpose(1, 2) if (bshd and x is not None and n in ("out", "dq", "dk", "dv")) else x)
           for n, x in clean.items()}
    res["pos"] = pos
    return res
