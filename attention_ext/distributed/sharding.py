"""Sequence sharding for context parallelism: which global tokens each rank holds, and the
collectives that move shards (torch.distributed only).

Shard layouts (`shard_layout`; `layout` is the tensors' "bhsd" / "bshd", as everywhere) of a
sequence of length S over P ranks (every shard has S / P tokens):
- "contiguous": rank r holds chunk r of P.
- "zigzag":     S is cut into 2P chunks; rank r holds chunks r and 2P-1-r, in that order, so that
                causal work (sum of query positions) is equal across ranks.
- "stripe":     token t goes to rank t mod P.
- "balanced":   packed documents (cu_seqlens, the global document offsets) split so that every rank
                gets the same causal attention work (the sum over its tokens of the keys each sees in
                its own document) and the same number of tokens, S / P; each shard holds its
                positions in ascending order, so documents stay in order. Needs cu_seqlens wherever
                the sharding is named (balanced_positions: how).

Length rule: S must be a multiple of P (of 2P for zigzag), else ValueError. Pad with
pad_to_multiple (which returns the real length) and pass that length as `seq_len` to
context_parallel_attention, which then masks the padded keys; the padded queries' outputs are
to be dropped by the caller.

Collectives: the all-gather is an autograd.Function whose backward reduce-scatters (sums) the
gradient back to the owning rank: with a loss that is the sum of every rank's local loss, each
rank's gradient of its shard is the sum of the gradients all ranks computed for it.
"""
from __future__ import annotations

import functools
import operator
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .._args import layout_mismatch as _layout_mismatch, misplaced as _misplaced, not_a_tensor as _not_a_tensor
from .._args import TENSOR_LAYOUT as _TENSOR_LAYOUT, as_int, renamed as _renamed
from ..softmax import ops as _ops

__all__ = ["LAYOUTS", "SHARD_LAYOUTS", "global_positions", "shard_sequence", "unshard_sequence", "pad_to_multiple",
           "sequence_multiple", "shard_work"]

LAYOUTS = ("contiguous", "zigzag", "stripe")     # the layouts of any sequence
SHARD_LAYOUTS = LAYOUTS + ("balanced",)           # and the one of packed documents (needs cu_seqlens)


_SHARD_LAYOUT = f"the sequence sharding, one of {SHARD_LAYOUTS}"


def _check_layout(shard_layout: str) -> None:
    """`shard_layout` is how the sequence is sharded; a tensor layout given to it is the likely
    slip, so the error names `layout`."""
    if shard_layout not in SHARD_LAYOUTS:
        if shard_layout in ("bhsd", "bshd"):
            raise _misplaced("", "shard_layout", shard_layout, _SHARD_LAYOUT, "the tensors' layout goes in layout",
                             ValueError)
        raise ValueError(f"shard_layout must be one of {SHARD_LAYOUTS}, got {shard_layout!r}")


def check_cu_seqlens(cu_seqlens: Union[Tensor, Sequence[int], None], padded_len: int) -> Optional[Tuple[int, ...]]:
    """The global document offsets of a packed sequence as host ints (None stays None), checked:
    a 1-D integer tensor or a sequence of ints, at least [0, end], starting at 0, non-decreasing,
    ending at most at padded_len (positions from cu_seqlens[-1] on are padding). Document i holds
    positions [cu_seqlens[i], cu_seqlens[i + 1]). The one home of these rules for context
    parallelism (sharding and attention alike); a CUDA tensor is read once (a sync)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32 / int64 tensor of document offsets, got "
                             f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
        cu = tuple(int(x) for x in cu_seqlens.tolist())
    else:
        try:
            cu = tuple(operator.index(x) for x in cu_seqlens)  # ints only: 10.7 is refused, not truncated
        except TypeError:
            raise TypeError(f"cu_seqlens must be a 1-D int tensor or a sequence of ints (document offsets), got "
                            f"{cu_seqlens!r:.80}") from None
    if len(cu) < 2 or cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0 and hold at least [0, end], got {list(cu[:8])}")
    if any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError("cu_seqlens must be non-decreasing (document i is [cu_seqlens[i], cu_seqlens[i + 1]))")
    if cu[-1] > padded_len:
        raise ValueError(f"cu_seqlens ends at {cu[-1]}, past the sequence's {padded_len} positions (the shards' "
                         f"length times the group size)")
    return cu


def _causal_work(length: int) -> int:
    """Query-key pairs of causal attention over one document of `length` tokens."""
    return length * (length + 1) // 2


@functools.lru_cache(maxsize=64)
def balanced_positions(seq_len: int, world_size: int, cu: Tuple[int, ...]) -> Tuple[Tuple[int, ...], ...]:
    """Every rank's global positions under shard_layout="balanced" (ascending): S / P tokens each,
    causal work as equal as documents allow. Deterministic from (S, P, cu) alone, so every rank
    computes the same plan with no communication.

    A document whose causal work is more than 1 / (4P) of a rank's share is cut into 2P chunks of
    near-equal length and dealt as zigzag deals a sequence (rank r gets chunks r and 2P - 1 - r),
    which gives every rank the same work from it up to the chunks' rounding; a chunk's extra token
    goes to the rank with the fewest tokens so far. The other documents go whole, largest work first,
    to the rank with the least work among those with room for them; one that fits nowhere whole is
    cut into pieces that fill the ranks with room, least work first. Padding (positions from
    cu[-1] to S) fills what room is left."""
    p = world_size
    n = seq_len // p
    docs = [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    share = sum(_causal_work(b - a) for a, b in docs) / p
    pos: List[List[Tuple[int, int]]] = [[] for _ in range(p)]   # per rank: (start, end) ranges
    count, work = [0] * p, [0] * p

    def give(r: int, a: int, b: int, doc_start: int) -> None:
        pos[r].append((a, b))
        count[r] += b - a
        work[r] += _causal_work(b - doc_start) - _causal_work(a - doc_start)

    small = []
    for a, b in docs:
        length = b - a
        if p > 1 and length >= 2 * p and _causal_work(length) * 4 * p > share:
            base, extra = divmod(length, 2 * p)
            sizes = [base] * (2 * p)
            owner = [i if i < p else 2 * p - 1 - i for i in range(2 * p)]
            for _ in range(extra):  # each extra token to the chunk of the rank with the fewest tokens
                r = min(range(p), key=lambda r: (count[r] + sum(s for s, o in zip(sizes, owner) if o == r), r))
                sizes[owner.index(r)] += 1
            x = a
            for i in range(2 * p):
                give(owner[i], x, x + sizes[i], a)
                x += sizes[i]
        else:
            small.append((a, b))
    for a, b in sorted(small, key=lambda d: (-(d[1] - d[0]), d[0])):
        room = [r for r in range(p) if n - count[r] >= b - a]
        if room:
            give(min(room, key=lambda r: (work[r], r)), a, b, a)
            continue
        x = a
        for r in sorted(range(p), key=lambda r: (work[r], r)):  # fits nowhere whole: cut to fill the room
            take = min(n - count[r], b - x)
            if take > 0:
                give(r, x, x + take, a)
                x += take
    x = cu[-1]
    for r in range(p):  # padding
        take = n - count[r]
        if take > 0:
            pos[r].append((x, x + take))
            count[r] += take
            x += take
    return tuple(tuple(t for a, b in sorted(rs) for t in range(a, b)) for rs in pos)


def shard_work(seq_len: int, world_size: int, shard_layout: str, cu_seqlens: Union[Tensor, Sequence[int], None] = None
               ) -> List[int]:
    """Each rank's causal attention work under `shard_layout`: the number of (query, key) pairs its
    queries attend, a query seeing the keys of its own document up to itself (one document
    [0, seq_len) without cu_seqlens). max / mean of the list is the layout's imbalance."""
    cu = check_cu_seqlens(cu_seqlens, seq_len) or (0, seq_len)
    starts = torch.tensor(cu[:-1], dtype=torch.int64)
    out = []
    for r in range(world_size):
        pos = global_positions(seq_len, rank=r, world_size=world_size, shard_layout=shard_layout, cu_seqlens=cu)
        pos = pos[pos < cu[-1]]
        doc = torch.searchsorted(torch.tensor(cu[1:], dtype=torch.int64), pos, right=True)
        out.append(int((pos - starts[doc] + 1).sum()))
    return out


def _no_layout(fn: str, layout: None) -> None:
    """The refusal of `layout` by a function whose sharding argument is shard_layout (its old name
    `layout` means the tensors' layout everywhere else)."""
    if layout is not None:
        raise _renamed(fn, "layout", "shard_layout", _SHARD_LAYOUT)


def sequence_multiple(world_size: int, shard_layout: Optional[str] = None, *, layout: None = None) -> int:
    """The multiple a sequence length must be of for `shard_layout` over `world_size` ranks
    (P, or 2P for zigzag). `layout` is not read: a TypeError names shard_layout."""
    _no_layout("sequence_multiple()", layout)
    if shard_layout is None:
        raise TypeError(f"sequence_multiple() missing shard_layout ({_SHARD_LAYOUT})")
    _check_layout(shard_layout)
    return 2 * world_size if shard_layout == "zigzag" else world_size  # "balanced": any S = n P


def _check_len(seq_len: int, world_size: int, shard_layout: str) -> None:
    m = sequence_multiple(world_size, shard_layout)
    if seq_len % m != 0:
        raise ValueError(f"sequence length {seq_len} is not a multiple of {m} (shard_layout {shard_layout!r} over "
                         f"{world_size} ranks): pad it with attention_ext.distributed.pad_to_multiple(x, dim, {m}) "
                         f"and pass the real length as seq_len to context_parallel_attention")


def _documents_for(shard_layout: str, cu_seqlens: Union[Tensor, Sequence[int], None],
                   seq_len: int) -> Optional[Tuple[int, ...]]:
    """The checked document offsets, which shard_layout="balanced" cannot do without."""
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    if shard_layout == "balanced" and cu is None:
        raise ValueError("shard_layout='balanced' balances the work of packed documents: pass their offsets as "
                         "cu_seqlens (the same on every rank)")
    return cu


def global_positions(seq_len: int, *, rank: int, world_size: int, shard_layout: str = "zigzag",
                     cu_seqlens: Union[Tensor, Sequence[int], None] = None, layout: None = None) -> Tensor:
    """The global token indices (int64, (seq_len / world_size,)) of `rank`'s shard, in the
    shard's order. seq_len must be a multiple of sequence_multiple(world_size, shard_layout).
    cu_seqlens: the packed documents' offsets, which shard_layout="balanced" needs (the others
    ignore them). `layout` is not read: a TypeError names shard_layout."""
    _no_layout("global_positions()", layout)
    _check_layout(shard_layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    _check_len(seq_len, world_size, shard_layout)
    if shard_layout == "balanced":
        cu = _documents_for(shard_layout, cu_seqlens, seq_len)
        return torch.tensor(balanced_positions(seq_len, world_size, cu)[rank], dtype=torch.int64)
    if shard_layout == "contiguous":
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n)
    if shard_layout == "zigzag":
        c = seq_len // (2 * world_size)
        j = 2 * world_size - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(j * c, (j + 1) * c)])
    return torch.arange(rank, seq_len, world_size)


def real_rows(seq_len: int, padded_len: int, *, rank: int, world_size: int, shard_layout: str,
              cu_seqlens: Optional[Tuple[int, ...]] = None) -> int:
    """How many of `rank`'s shard positions are below seq_len (the real tokens of a sequence padded
    to padded_len). A shard's positions ascend (global_positions), so these are its first rows
    and the padding is a suffix. Plain ints, for torch.compile: no tensor, no data-dependent branch."""
    n = padded_len // world_size
    if shard_layout == "balanced":
        return sum(1 for t in balanced_positions(padded_len, world_size, cu_seqlens)[rank] if t < seq_len)
    if shard_layout == "contiguous":
        return max(0, min(n, seq_len - rank * n))
    if shard_layout == "zigzag":
        c = n // 2
        return sum(max(0, min(c, seq_len - j * c)) for j in (rank, 2 * world_size - 1 - rank))
    return max(0, min(n, -(-(seq_len - rank) // world_size)))  # stripe: rank, rank + P, ...


def _check_tensor_layout(layout: str) -> None:
    """`layout` is the tensors' layout; a sharding given to it (its old meaning in context
    parallelism) is the likely slip, so the error names shard_layout."""
    if layout not in ("bhsd", "bshd"):
        if layout in LAYOUTS:
            raise _misplaced("", "layout", layout, _TENSOR_LAYOUT, "the sequence sharding goes in shard_layout",
                             ValueError)
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")


def shards_bhsd(q: Tensor, k: Tensor, v: Tensor, *, layout: str) -> Tuple[Tensor, Tensor, Tensor]:
    """Three 4-D shards in layout ("bhsd" or "bshd") as (B, H, n, D) views (no copy). A sharding
    given as `layout` (its old meaning in context parallelism) raises an error naming shard_layout."""
    _check_tensor_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise _not_a_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got {tuple(t.shape)}")
    # before any collective: a peer's transport would fail on these with a message naming no argument
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v shards must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.dtype not in _ops.DTYPES:
        raise TypeError(f"q, k, v shards must be float32, float16, bfloat16 or float64, got {q.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v shards must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return q, k, v


def check_shards(q: Tensor, k: Tensor, v: Tensor, *, layout: str) -> Tuple[Tensor, Tensor, Tensor]:
    """The checks every context-parallel attention mode makes of its (q, k, v) shards, one home
    (the options' own checks: options.py): returns them as (B, H, n, D) / (B, H_k, n, D) views
    (bshd transposed, no copy)."""
    q0, k0, v0 = q, k, v
    q, k, v = shards_bhsd(q, k, v, layout=layout)
    # ulysses reshapes q and k by (B, D) before any kernel sees them: its message would name nothing
    if k.shape != v.shape or k.shape[2] != q.shape[2] or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        e = ValueError(f"q, k, v shards must have one local length, batch and head dim, and k, v one shape, got "
                       f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} (B, H, n, D)")
        raise _layout_mismatch(q0, k0, v0, layout, e, arg="layout", same_len=True) or e
    return q, k, v


# ----------------------------------------------------------------------------------- dropout
# Dropout under context parallelism draws, for every local element, the Philox decision of its
# GLOBAL (b * H + h, query position, key position) (the op's dropout_coords), from one
# (seed, offset) that every rank of the group shares: the mask is the one a single process
# draws for the whole sequence with the same seed, whatever the mode, shard_layout or world size.
def dropout_seed(dropout_p: float, seed: Union[int, Tensor, None], group: Optional[dist.ProcessGroup],
                 device: torch.device) -> Union[int, Tensor, None]:
    """The dropout seed every rank of the group uses (offset 0, as attention_ext.attention's for a
    given seed), or None without dropout. seed=None: group rank 0 draws one from torch's global
    generator and broadcasts it (one small collective, returned as a one-element CPU int64
    tensor), so the ranks agree whatever their generators' states."""
    if dropout_p == 0.0:
        return None
    if seed is not None:
        return seed
    drawn = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(drawn, src=src, group=group)
    return drawn.cpu()


def dropout_coords(b: int, h: int, rows: Tensor, cols: Tensor, *, h_total: int, h0: int = 0,
                   device: torch.device) -> Tensor:
    """The op's dropout_coords for a call on local heads [0, h) that are global heads
    [h0, h0 + h) of h_total, local query rows at global positions `rows` and local keys at
    `cols`: int32 (B * h + len(rows) + len(cols))."""
    bh = (torch.arange(b).view(-1, 1) * h_total + h0 + torch.arange(h).view(1, -1)).flatten()
    return torch.cat([bh, rows.cpu().long(), cols.cpu().long()]).to(device=device, dtype=torch.int32)


def _rank_size(group) -> Tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def pad_to_multiple(x: Tensor, dim: int, multiple: int) -> Tuple[Tensor, int]:
    """Zero-pad x along `dim` at the end to a multiple of `multiple`; returns (padded, real_len).
    Pass real_len as seq_len to context_parallel_attention so the padded keys are masked."""
    n = x.shape[dim]
    pad = (-n) % multiple
    if pad == 0:
        return x, n
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim), n


def shard_sequence(x: Tensor, *, dim: int, group: Optional[dist.ProcessGroup] = None,
                   shard_layout: str = "zigzag", cu_seqlens: Union[Tensor, Sequence[int], None] = None,
                   layout: None = None) -> Tensor:
    """This rank's shard of the full tensor x (the same on every rank) along `dim`: an
    index_select by global_positions, differentiable, no communication. cu_seqlens: the packed
    documents' offsets (shard_layout="balanced" needs them). `layout` is not read: a TypeError
    names shard_layout."""
    _no_layout("shard_sequence()", layout)
    if not isinstance(x, Tensor):
        raise _not_a_tensor("x", x, "shard_sequence()")
    if as_int(dim) is None or not -x.dim() <= as_int(dim) < x.dim():
        raise ValueError(f"shard_sequence(): dim must be an int in [{-x.dim()}, {x.dim()}) (x's sequence dim), "
                         f"got {dim!r} for x of shape {tuple(x.shape)}")
    dim = as_int(dim)
    rank, world = _rank_size(group)
    pos = global_positions(x.shape[dim], rank=rank, world_size=world, shard_layout=shard_layout,
                           cu_seqlens=cu_seqlens)
    return x.index_select(dim, pos.to(x.device))


def _gather_fn():
    # all_gather_single is the newer name of all_gather_into_tensor (looked up per call so that a
    # test can wrap it to count collectives)
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """(n, ...) on each rank -> (P * n, ...), rank r's rows at [r n, (r+1) n). Backward: the
    gradient reduce-scattered (summed over ranks, in float32 for 16-bit dtypes), this rank's rows."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        _gather_fn()(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        world = dist.get_world_size(ctx.group)
        dtype = g.dtype
        # 16-bit gradients are summed in float32 (twice the bytes): a key's gradient is the sum of
        # every rank's part, and summing P parts in bf16 rounds after each addition, where one
        # process rounds once (mode="ring" carries float32 accumulators for the same reason)
        g = g.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else g.contiguous()
        out = g.new_empty((g.shape[0] // world,) + tuple(g.shape[1:]))
        _reduce_scatter_fn()(out, g, group=ctx.group)
        return out.to(dtype), None


def all_gather_sequence(x_local: Tensor, *, dim: int, group: Optional[dist.ProcessGroup] = None,
                        shard_layout: str = "zigzag", cu_seqlens: Union[Tensor, Sequence[int], None] = None,
                        layout: None = None) -> Tensor:
    """Gather every rank's shard along `dim` and reorder into the full sequence (one
    all-gather; its backward is one reduce-scatter). Used by unshard_sequence and the
    attention's K/V gather. cu_seqlens: as shard_sequence. `layout` is not read: a TypeError
    names shard_layout."""
    _no_layout("all_gather_sequence()", layout)
    rank, world = _rank_size(group)
    dim = dim % x_local.dim()
    seq_len = x_local.shape[dim] * world
    _check_len(seq_len, world, shard_layout)
    # gathered row r * n + i holds global token pos_r[i]; full[g] = gathered[inv[g]]
    src = torch.cat([global_positions(seq_len, rank=r, world_size=world, shard_layout=shard_layout,
                                      cu_seqlens=cu_seqlens) for r in range(world)])
    inv = torch.argsort(src).to(x_local.device)
    g = _AllGather.apply(x_local.movedim(dim, 0), group)  # (P * n, ...)
    return g.index_select(0, inv).movedim(0, dim)


def unshard_sequence(x_local: Tensor, *, dim: int, group: Optional[dist.ProcessGroup] = None,
                     shard_layout: str = "zigzag", cu_seqlens: Union[Tensor, Sequence[int], None] = None,
                     layout: None = None) -> Tensor:
    """The full sequence on every rank from the shards along `dim` (the inverse of
    shard_sequence). Differentiable: the backward sums every rank's gradient of the full tensor
    and hands each rank its shard's part (a reduce-scatter). cu_seqlens: as shard_sequence.
    `layout` is not read: a TypeError names shard_layout."""
    _no_layout("unshard_sequence()", layout)
    return all_gather_sequence(x_local, dim=dim, group=group, shard_layout=shard_layout, cu_seqlens=cu_seqlens)
