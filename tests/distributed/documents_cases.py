"""The rank side of tests/distributed/test_documents.py: context-parallel attention over packed
documents (cu_seqlens) in every mode and shard layout against flash_attn_varlen_func on the whole
pack in one process (out, LSE, dq, dk, dv, dsinks), with the collectives counted and, in ring
mode, the steps that share no document skipped. Each case runs on several document packs: a
document longer than a shard, shards made only of document boundaries (1-token documents), empty
documents, a padded tail. Failures are recorded, not raised, so every rank runs the same
collectives; {case: None or the traceback} comes back per rank."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from attention_ext import distributed as cp
from attention_ext.softmax.functional import attention_varlen
from attention_ext.softmax import reference
from tests.distributed.cases import ALLGATHER_COLLECTIVES, GatherCounter as Counter
from tests.distributed.harness import case_table
from tests.helpers import assert_close_fa2, rel_err

H, D, S = 12, 16, 48         # H, S: multiples of P and 2P for P = 2, 3, 4 (ulysses shards the heads)
PACKS = (
    [0, 5, 5, 6, 30, 31, 44],                        # a long document, an empty one, a padded tail
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 48],  # shards of 1-token documents, then one long one
    [0, 48],                                         # one document: the plain sequence
)
VARIANTS = {
    "causal": dict(causal=True),
    "plain": dict(),
    "causal-gqa": dict(causal=True, hk=2),
    "causal-window": dict(causal=True, window=(5, -1)),
    "window": dict(window=(4, 3), hk=1),
    "causal-alibi": dict(causal=True, alibi=True),
    "alibi-sinks": dict(alibi=True, sinks=True),
    "causal-softcap-sinks": dict(causal=True, softcap=2.0, sinks=True, hk=2),
    "bshd-causal": dict(causal=True, layout="bshd"),
    "causal-dropout": dict(causal=True, dropout=0.3, hk=2),
    "window-alibi-dropout": dict(window=(6, 2), alibi=True, dropout=0.3),
    # bf16 without sinks: with a sink and 1-token documents the kernel's own bf16 backward misses
    # the 2x rule in one process too (docs/known-gaps.md, "Backward in bf16 / fp16")
    "bf16-causal-gqa": dict(causal=True, hk=2, dtype=torch.bfloat16),
}
CASES = [f"{mode}-{shard_layout}-{v}" for mode in cp.MODES for shard_layout in cp.SHARD_LAYOUTS for v in VARIANTS]
TOL = 1e-5


def _single(q, k, v, cu, o: dict, slopes, sinks, dtype):
    """attention_varlen (flash_attn_varlen_func's kernel) on the whole pack (B = 1, (1, H, S, D) tensors cut at cu[-1]):
    (out, lse) as (1, H, real, D) / (1, H, real), differentiable; in float64 through the PyTorch
    reference for bf16 cases (with PyTorch's own bf16 result beside it)."""
    real = cu[-1]
    cu_t = torch.tensor(cu, dtype=torch.int32)
    mx = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    flat = [t[0, :, :real].transpose(0, 1) for t in (q, k, v)]
    win = o.get("window", (-1, -1))
    if dtype == torch.float32:  # flash_attn_varlen_func's call, with sinks and a dropout seed
        out, lse = attention_varlen(*flat, cu_t, cu_t, mx, mx, causal=o.get("causal", False), bottom_right=True,
                                    window=win, alibi_slopes=slopes, softcap=o.get("softcap", 0.0), sinks=sinks,
                                    dropout_p=o.get("dropout", 0.0), seed=o.get("seed"), return_lse=True)
    else:
        wl, wr = win
        out, lse = reference.attention_varlen(*flat, cu_t, cu_t, window=(wl, 0) if o.get("causal") else (wl, wr),
                                              bottom_right=True, alibi_slopes=slopes, softcap=o.get("softcap", 0.0),
                                              sinks=sinks)
    return out.transpose(0, 1).unsqueeze(0), lse.unsqueeze(0)


def documents_case(rank: int, world: int, name: str, counter: Counter, group=None) -> None:
    mode, shard_layout, variant = name.split("-", 2)
    o = dict(VARIANTS[variant])
    dtype = o.get("dtype", torch.float32)
    hk, layout = o.get("hk", H), o.get("layout", "bhsd")
    if "dropout" in o:
        o["seed"] = 4242
    errors = []
    for pi, cu in enumerate(PACKS):
        torch.manual_seed(100 * CASES.index(name) + pi)  # the same global tensors on every rank
        q, k, v = torch.randn(1, H, S, D), torch.randn(1, hk, S, D), torch.randn(1, hk, S, D)
        g = torch.randn(1, H, S, D)
        slopes = torch.rand(H) * 0.5 + 0.1 if o.get("alibi") else None
        sinks = torch.randn(H) if o.get("sinks") else None
        real = cu[-1]
        ref_dt = torch.float32 if dtype == torch.float32 else torch.float64
        leaves = [t.to(ref_dt, copy=True).requires_grad_() for t in (q, k, v)]
        sr = sinks.to(ref_dt, copy=True).requires_grad_() if sinks is not None else None
        out, lse = _single(*leaves, cu, o, slopes, sr, dtype)
        (out * g[:, :, :real].to(ref_dt)).sum().backward()
        want = dict(out=out.detach(), lse=lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
        if dtype != torch.float32:  # PyTorch's own math in bf16, the error yardstick
            same = [t.to(dtype).requires_grad_() for t in (q, k, v)]
            ss = sinks.to(dtype).requires_grad_() if sinks is not None else None
            t_out, t_lse = _single(*same, cu, o, slopes.to(dtype) if slopes is not None else None, ss, dtype)
            (t_out * g[:, :, :real].to(dtype)).sum().backward()
            torch_same = dict(out=t_out, lse=t_lse, dq=same[0].grad, dk=same[1].grad, dv=same[2].grad)

        pos = cp.global_positions(S, rank=rank, world_size=world, shard_layout=shard_layout, cu_seqlens=cu)
        shard = lambda t: cp.shard_sequence(t.to(dtype), dim=2, group=group, shard_layout=shard_layout,  # noqa: E731
                                            cu_seqlens=cu)
        ql, kl, vl = (shard(t) for t in (q, k, v))
        if layout == "bshd":
            ql, kl, vl = (t.transpose(1, 2).contiguous() for t in (ql, kl, vl))
        ql, kl, vl = (t.requires_grad_() for t in (ql, kl, vl))
        sl = sinks.clone().requires_grad_() if sinks is not None else None
        stats = {} if mode == "ring" else None
        extra = dict(_stats=stats) if mode == "ring" else {}
        counter.take()
        ol, lsel = cp.context_parallel_attention(
            ql, kl, vl, group=group, mode=mode, shard_layout=shard_layout, cu_seqlens=torch.tensor(cu),
            causal=o.get("causal", False),
            window_size=o.get("window", (-1, -1)), alibi_slopes=slopes, softcap=o.get("softcap", 0.0), sinks=sl,
            dropout_p=o.get("dropout", 0.0), seed=o.get("seed"), layout=layout, return_lse=True, **extra)
        n_fwd = counter.take()
        gl = shard(g)
        (ol * (gl.transpose(1, 2) if layout == "bshd" else gl)).sum().backward()
        n_bwd = counter.take()
        ds = None
        if sinks is not None:
            ds = sl.grad.float()
            dist.all_reduce(ds, group=group)
            counter.take()
        try:  # the checks, after every collective of the pack; raised after the last pack's
            _check_pack(f"pack {pi} ({cu})", mode, shard_layout, variant, o, dtype, layout, rank, world, cu, pos,
                        n_fwd, n_bwd, stats, ol, lsel, ql, kl, vl, ds, sr, want,
                        torch_same if dtype != torch.float32 else None)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


def _check_pack(where, mode, shard_layout, variant, o, dtype, layout, rank, world, cu, pos, n_fwd, n_bwd, stats, ol,
                lsel, ql, kl, vl, ds, sr, want, torch_same) -> None:
    real = cu[-1]
    if mode == "allgather":
        assert (n_fwd, n_bwd) == ALLGATHER_COLLECTIVES[True], \
            f"{where}: collectives {n_fwd} / {n_bwd}: want {ALLGATHER_COLLECTIVES[True]}"
    bhsd = (lambda t: t.transpose(1, 2)) if layout == "bshd" else (lambda t: t)  # noqa: E731
    keep = pos < real
    idx = pos[keep]
    got = dict(out=bhsd(ol), lse=lsel, dq=bhsd(ql.grad), dk=bhsd(kl.grad), dv=bhsd(vl.grad))
    for what, x in got.items():
        x, w = x[:, :, keep], want[what][:, :, idx]
        if dtype == torch.float32:
            e = rel_err(x, w)
            assert e <= TOL, f"{where}: {what} relative error {e:.3g} > {TOL:g}"
        else:
            assert_close_fa2(x, torch_same[what][:, :, idx], w, dtype, f"{where}: {what}")
    if ds is not None and dtype == torch.float32:
        e = rel_err(ds, sr.grad)
        assert e <= TOL, f"{where}: dsinks relative error {e:.3g}"
    if mode == "ring" and variant == "plain":  # a step computes iff the shards share a document
        doc = lambda p: set(torch.searchsorted(torch.tensor(cu[1:]), p[p < real], right=True).tolist())  # noqa
        mine = doc(pos)
        sharing = sum(bool(mine & doc(cp.global_positions(S, rank=r, world_size=world, shard_layout=shard_layout,
                                                          cu_seqlens=cu))) for r in range(world))
        assert stats["fwd_steps"] == sharing, f"{where}: {stats['fwd_steps']} steps computed, {sharing} share"


# -- linear attention: the state resets at each document start -------------------------------------

LINEAR_CASES = {
    "linear-elu": dict(),
    "linear-decay-gqa": dict(decay=True, hk=2),
    "linear-relu-unnormalized-init-state": dict(fm="relu", normalize=False, init=True, return_state=True),
    "linear-decay-mask-state": dict(decay=True, mask=True, return_state=True),
    "linear-feature-gates-gqa-state": dict(decay="feature", hk=2, return_state=True),  # GLA's (B, H, S, M)
}


def linear_documents_case(rank: int, world: int, name: str, counter: Counter = None, group=None) -> None:
    """context_parallel_linear_attention(cu_seqlens=...) on contiguous shards against
    linear_attention run per document in one process (the first document from initial_state):
    out, dq, dk, dv, ddecay and the final state, for every pack."""
    from attention_ext.linear import linear_attention

    o = LINEAR_CASES[name]
    hk, dv = o.get("hk", 4), 6
    errors = []
    for pi, cu in enumerate(PACKS):
        torch.manual_seed(700 + 10 * list(LINEAR_CASES).index(name) + pi)
        q, k = torch.randn(1, 4, S, 8), torch.randn(1, hk, S, 8)
        v, g = torch.randn(1, hk, S, dv), torch.randn(1, 4, S, dv)
        decay = -torch.rand(1, 4, S, *((8,) if o.get("decay") == "feature" else ())) if o.get("decay") else None
        mask = torch.rand(1, S) > 0.3 if o.get("mask") else None
        # the op's (B, H, M, Dv') state: M = D for elu / relu, Dv' = Dv + 1 under normalize
        init = torch.randn(1, 4, 8, dv + int(o.get("normalize", True))).abs() if o.get("init") else None
        kw = dict(feature_map=o.get("fm", "elu"), normalize=o.get("normalize", True), causal=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        dl = decay.clone().requires_grad_() if decay is not None else None
        real, outs, state = cu[-1], [], None
        for i, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
            if e == a:
                continue
            r = linear_attention(*(t[:, :, a:e] for t in leaves), decay=None if dl is None else dl[:, :, a:e],
                                 key_mask=None if mask is None else mask[:, a:e],
                                 initial_state=init if a == 0 else None, return_state=True, **kw)
            outs.append(r[0])
            state = r[1]
        out = torch.cat(outs, 2)
        (out * g[:, :, :real]).sum().backward()
        shard = lambda t: cp.shard_sequence(t, dim=2, group=group, shard_layout="contiguous")  # noqa: E731
        ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
        dr = shard(decay).requires_grad_() if decay is not None else None
        ml = cp.shard_sequence(mask, dim=1, group=group, shard_layout="contiguous") if mask is not None else None
        ol, st = cp.context_parallel_linear_attention(ql, kl, vl, group=group, decay=dr, key_mask=ml,
                                                      initial_state=init, return_state=True, cu_seqlens=cu, **kw)
        (ol * shard(g)).sum().backward()
        try:
            pos = cp.global_positions(S, rank=rank, world_size=world, shard_layout="contiguous")
            keep = pos < real
            got = dict(out=ol, dq=ql.grad, dk=kl.grad, dv=vl.grad)
            want = dict(out=out.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
            if decay is not None:
                got["ddecay"], want["ddecay"] = dr.grad, dl.grad
            for what in got:
                x, w = got[what][:, :, keep], want[what][:, :, pos[keep]]
                e = rel_err(x, w)
                assert e <= TOL, f"pack {pi}: {what} relative error {e:.3g}"
            if o.get("return_state") and cu[-1] == S:  # the last document's state (no padding after it)
                e = rel_err(st.S, state.S)
                assert e <= TOL, f"pack {pi}: final state relative error {e:.3g}"
        except AssertionError as ex:
            errors.append(str(ex))
    assert not errors, "\n".join(errors)


# -- block-sparse layouts (block_layout=), with and without documents -------------------------------

BLOCK_VARIANTS = {
    "causal": dict(causal=True),
    "heads-window-alibi": dict(heads=True, window=(20, 5), alibi=True),
    "causal-dropout": dict(causal=True, dropout=0.3),
    "docs-causal-sinks": dict(causal=True, sinks=True, docs=True),
    "docs-heads-plain": dict(heads=True, docs=True),
    # only block (0, 0) on: most rows see nothing (out 0, lse the sink's) and the last shards have
    # no call at all; the loss reads the lse too (its gradient reaches the sinks)
    "holes-sinks": dict(holes=True, sinks=True),
}
BLOCK_CASES = [f"block-{mode}-{sl}-{v}" for mode in ("allgather", "allgather/nooverlap", "ring", "ulysses")
               for sl in ("contiguous", "zigzag", "stripe") for v in BLOCK_VARIANTS]


def block_case(rank: int, world: int, name: str, counter: Counter = None, group=None) -> None:
    """A block layout of the whole sequence (16-token blocks: a 3 x 3 grid, some shards on block
    boundaries, some not) against attention_ext.attention with the layout's element mask (and the
    documents' same-document mask), every mode: out, lse, dq, dk, dv, dsinks."""
    import attention_ext as ae

    _, mode, shard_layout, variant = name.split("-", 3)
    o = BLOCK_VARIANTS[variant]
    overlap = not mode.endswith("/nooverlap")
    mode = mode.split("/")[0]
    torch.manual_seed(3000 + BLOCK_CASES.index(name))
    cu = PACKS[0] if o.get("docs") else None
    real = cu[-1] if cu else S
    q, k, v, g = (torch.randn(1, H, S, D) for _ in range(4))
    lay = torch.rand(H if o.get("heads") else 1, 3, 3) < 0.5
    lay |= torch.eye(3, dtype=torch.bool)  # every row sees a block
    if o.get("holes"):
        lay[:] = False
        lay[:, 0, 0] = True
    slopes = torch.rand(H) * 0.5 + 0.1 if o.get("alibi") else None
    sinks = torch.randn(H) if o.get("sinks") else None
    drop = dict(dropout_p=o["dropout"], seed=99) if "dropout" in o else {}
    win = o.get("window", (-1, -1))
    # one process: the layout as an element mask, with the documents' mask, on the real positions
    i = torch.arange(real)
    mask = lay[:, i // 16][:, :, i // 16]
    if cu:
        doc = torch.searchsorted(torch.tensor(cu[1:]), i, right=True)
        mask = mask & (doc.view(-1, 1) == doc.view(1, -1))
    leaves = [t[:, :, :real].clone().requires_grad_() for t in (q, k, v)]
    sr = sinks.clone().requires_grad_() if sinks is not None else None
    out, lse = ae.attention(*leaves, causal=o.get("causal", False), window=win, alibi_slopes=slopes, sinks=sr,
                            attn_mask=mask.unsqueeze(0), return_lse=True, **drop)
    gl = torch.randn(1, H, S) if o.get("holes") else None  # a gradient through the lse
    ((out * g[:, :, :real]).sum() + ((lse * gl[:, :, :real]).sum() if gl is not None else 0)).backward()
    want = dict(out=out.detach(), lse=lse.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)

    shard = lambda t: cp.shard_sequence(t, dim=2, group=group, shard_layout=shard_layout)  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
    sl = sinks.clone().requires_grad_() if sinks is not None else None
    extra = dict(overlap=overlap) if mode == "allgather" else {}
    ol, lsel = cp.context_parallel_attention(ql, kl, vl, group=group, mode=mode, shard_layout=shard_layout,
                                             block_layout=lay,
                                             block_size=16, cu_seqlens=cu, causal=o.get("causal", False),
                                             window_size=win, alibi_slopes=slopes, sinks=sl, return_lse=True,
                                             seq_len=None if cu else real, **drop, **extra)
    lse_part = (lsel * shard(gl.unsqueeze(-1)).squeeze(-1)).sum() if gl is not None else 0
    ((ol * shard(g)).sum() + lse_part).backward()
    ds = None
    if sinks is not None:
        ds = sl.grad.clone()
        dist.all_reduce(ds, group=group)
    pos = cp.global_positions(S, rank=rank, world_size=world, shard_layout=shard_layout)
    keep = pos < real
    got = dict(out=ol, lse=lsel, dq=ql.grad, dk=kl.grad, dv=vl.grad)
    for what, x in got.items():
        e = rel_err(x[:, :, keep], want[what][:, :, pos[keep]])
        assert e <= TOL, f"{what} relative error {e:.3g}"
    if ds is not None:
        e = rel_err(ds, sr.grad)
        assert e <= TOL, f"dsinks relative error {e:.3g}"


def uneven_linear(rank: int, world: int) -> str:
    """context_parallel_linear_attention with cu_seqlens on shards of 20 and 12 tokens: every rank
    must raise the same error (none may raise before the all-gather, or its peers would hang)."""
    n = 20 if rank == 0 else 12
    q, k, v = torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 4)
    try:
        cp.context_parallel_linear_attention(q, k, v, cu_seqlens=[0, 10, 32])
    except ValueError as e:
        return str(e)
    return "no error"


CASE_FNS = {**{n: documents_case for n in CASES}, **{n: linear_documents_case for n in LINEAR_CASES},
            **{n: block_case for n in BLOCK_CASES}}


def _case(rank: int, world: int, name: str, counter: Counter, group) -> None:
    CASE_FNS[name](rank, world, name, counter, group)


def suite(rank: int, world: int, sizes: List[int], names: List[str]) -> Dict[str, Optional[str]]:
    """Every case on every group size of `sizes` (harness.case_table)."""
    return case_table(_case, Counter(), rank, world, sizes, names)
