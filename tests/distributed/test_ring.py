"""context_parallel_attention(mode="ring") on 2, 3 and 4 gloo ranks on the CPU.

One spawned group per world size runs every ring case (tests/distributed/cases.py ring_case: the
ring vs the fused kernel on the whole sequence in one process, fp32 within 1e-5 relative for out,
LSE and every gradient (q, k, v, sinks); bf16 vs float64 under the 2x-PyTorch rule; per call
exactly P - 1 K/V sends in the forward, counted on batch_isend_irecv and in the `stats` dict).
The tests below report the cases one by one; the per-shard plans and the argument errors need no
group.
"""
import pytest
import torch

from attention_ext import distributed as cp
from attention_ext.distributed import ring, steps
from tests.distributed import cases, harness

WORLD_SIZES = (2, 3, 4)
_results = {}


def _suite(world):
    """The ring cases' results on every rank, run once per world size."""
    if world not in _results:
        try:
            _results[world] = harness.run(cases.ring_suite, world, cases.RING_CASES, timeout=150)
        except harness.RankFailed as e:
            _results[world] = e
    if isinstance(_results[world], Exception):
        raise _results[world]
    return _results[world]


def _case(world, name):
    """{what: the whole tensor's relative error} over every rank's shard; fails with the ranks'
    tracebacks if any rank failed the case."""
    res = [r[name] for r in _suite(world)]
    failed = {r: tb for r, (tb, _) in enumerate(res) if tb is not None}
    assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
    return {w: max(e[w][0] for _, e in res) / max(max(e[w][1] for _, e in res), 1.0) for w in res[0][1]}


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", cases.RING_CASES)
def test_ring(world, name):
    _case(world, name)


@pytest.mark.parametrize("name", cases.RING_GROUP_CASES)
def test_ring_subgroups(name):
    """4 ranks split into two rings of 2, each on its own process group."""
    _case(4, f"group-{name}")


def test_error_does_not_grow_with_ranks():
    """bf16 vs float64: the error at P = 4 is at most 1.5x the error at P = 2 (the merges and the
    dK / dV accumulators stay float32), for out, LSE and every gradient."""
    e2, e4 = _case(2, cases.RING_RATIO_CASE), _case(4, cases.RING_RATIO_CASE)
    bad = {w: (e2[w], e4[w]) for w in e2 if e4[w] > 1.5 * e2[w]}
    assert not bad, f"error (P=2, P=4) grows more than 1.5x: {bad}"


# -- no process group needed ---------------------------------------------------------------------

def _box(call):
    """A plan's call as its (i0, i1, j0, j1) box: queries [i0, i1) x keys [j0, j1)."""
    return call.rows.start, call.rows.stop, call.cols.start, call.cols.stop


def _causal(call):
    """The call runs top-left causal (no mask)."""
    return call.window == (-1, 0) and not call.bottom_right


def _plans(world, shard_layout, s, **kw):
    """{(rank, owner): the step's plan} for every pair of shards."""
    pos = [cp.global_positions(s, rank=r, world_size=world, shard_layout=shard_layout) for r in range(world)]
    o = dict(seq_len=s, wl=-1, wr=-1, alibi_slopes=None, acc=torch.float32, device=torch.device("cpu"))
    o.update(kw)
    return {(r, w): steps._plan(pos[r], pos[w], **o) for r in range(world) for w in range(world)}


def test_plan_zigzag_causal_needs_no_mask():
    """zigzag + causal: the own shard is the causal triangle, every other shard a full rectangle
    of half the queries or half the keys; nothing is skipped and no call has a mask."""
    n = 8
    for (r, w), st in _plans(4, "zigzag", 4 * n, wr=0).items():
        assert st is not None and st.mask is None
        if r == w:
            assert _causal(st) and _box(st) == (0, n, 0, n)
        elif w < r:  # the owner's first chunk is seen by every query, its second by none
            assert _box(st) == (0, n, 0, n // 2) and not _causal(st)
        else:        # only the second query chunk sees the owner's shard, all of it
            assert _box(st) == (n // 2, n, 0, n) and not _causal(st)


def test_plan_skips_empty_shards():
    """contiguous + causal: future shards are skipped; a window skips shards out of reach;
    shards wholly past seq_len (padding) are skipped, as queries and as keys, partly padded ones
    sliced; a window's edge
    takes a mask over its bounding box only."""
    p = _plans(4, "contiguous", 32, wr=0)
    assert all((p[r, w] is None) == (w > r) for r, w in p)
    p = _plans(4, "contiguous", 32, wl=3, wr=0)
    assert all((p[r, w] is None) == (w > r or w < r - 1) for r, w in p)
    p = _plans(4, "contiguous", 32, seq_len=20)  # 20.. are padding: shard 3 is, queries and keys
    assert all((p[r, w] is None) == (w == 3 or r == 3) for r, w in p)
    st = p[0, 2]  # keys 16..19 real: a rectangle of the shard's first 4 keys, no mask
    assert st.mask is None and _box(st) == (0, 8, 0, 4)
    st = p[2, 0]  # queries 16..19 real: the padded query rows are never computed
    assert st.mask is None and _box(st) == (0, 4, 0, 8)
    st = _plans(4, "stripe", 32, seq_len=30)[0, 3]  # stripe's padding is the last keys of two shards
    assert st.mask is None and _box(st)[2:] == (0, 7)
    st = _plans(2, "contiguous", 16, wl=2, wr=1)[1, 0]  # a window's edge: a mask on the bounding box
    assert st.mask is not None and st.mask.dtype == torch.bool and _box(st) == (0, 2, 6, 8)


@pytest.mark.parametrize("shard_layout", ["contiguous", "zigzag", "stripe"])
@pytest.mark.parametrize("causal", [False, True])
def test_plan_plain_matches_the_pair_matrix(shard_layout, causal):
    """_plan's O(n) path (no window, no ALiBi) gives the call the (n, n) pair matrix gives, or
    defers to it: same box, same causal flag, same mask, for every (rank, owner) and padding."""
    for world in (2, 3, 4):
        for s in (4 * world * 2, 4 * world * 5):
            for seq_len in (s, s - 3):
                pos = [cp.global_positions(s, rank=r, world_size=world, shard_layout=shard_layout)
                       for r in range(world)]
                for r in range(world):
                    for w in range(world):
                        wr = 0 if causal else -1
                        fast = steps._plan_plain(pos[r], pos[w], seq_len, causal=causal)
                        if fast is steps._DENSE:
                            continue
                        want = _dense_plain(pos[r], pos[w], seq_len, wr)
                        if fast is None or want is None:
                            assert fast is None and want is None, (world, s, seq_len, r, w)
                            continue
                        assert (*_box(fast), _causal(fast)) == \
                            (*_box(want), _causal(want)), (world, s, seq_len, r, w)
                        assert fast.mask is None and want.mask is None


def _dense_plain(pq, pk, seq_len, wr):
    """The pair-matrix plan with no window and no ALiBi (steps._plan's general branch)."""
    rel = pk.view(1, -1) - pq.view(-1, 1)
    ok = (pq < seq_len).view(-1, 1) & (pk < seq_len).view(1, -1)
    if wr >= 0:
        ok = ok & (rel <= wr)
    rows, cols = ok.any(1).nonzero().flatten(), ok.any(0).nonzero().flatten()
    if rows.numel() == 0:
        return None
    i0, i1, j0, j1 = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    sub = ok[i0:i1, j0:j1]
    if bool(sub.all()):
        return steps._Step(i0, i1, j0, j1)
    if i1 - i0 == j1 - j0 and torch.equal(pq[i0:i1], pk[j0:j1]) and torch.equal(sub, torch.ones_like(sub).tril()):
        return steps._Step(i0, i1, j0, j1, causal=True)
    return steps._Step(i0, i1, j0, j1, mask=sub)


def test_plan_alibi_bias():
    slopes = torch.tensor([0.5, 0.25])
    st = _plans(2, "stripe", 8, alibi_slopes=slopes)[0, 1]  # queries 0 2 4 6, keys 1 3 5 7
    assert st.mask.dtype == torch.float32 and st.mask.shape == (1, 2, 4, 4)
    rel = torch.tensor([1, 3, 5, 7]).view(1, -1) - torch.tensor([0, 2, 4, 6]).view(-1, 1)
    torch.testing.assert_close(st.mask, -slopes.view(1, 2, 1, 1) * rel.abs().float())


def test_ring_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        cp.context_parallel_attention(q, q, q, mode="ring", alibi_slopes=torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="layout"):
        cp.context_parallel_attention(q, q, q, mode="ring", layout="sbhd")
