"""Block layouts: which (query block, key block) pairs block-sparse attention computes.

Every builder returns a bool tensor (heads, n_q_blocks, n_k_blocks), n_q_blocks =
ceil(seq_len / block_size) and n_k_blocks = ceil(seq_len_k / block_size), True = computed. Block
indices are aligned top-left: query block r and key block c start at rows r * block_size and
c * block_size. Causal, padding and element masks are not part of a layout; the attention applies
them element-wise inside the computed blocks (`block_sparse_attention(..., causal=True)`).

The size keywords are shared: `seq_len`, `seq_len_k` (default seq_len), `block_size` (a positive
multiple of 16, default 64), `heads` (default 1; the random patterns draw each head on its own)
and `device`. Each builder's example is a doctest (`draw` prints '#' computed, '.' skipped) and
runs in tests/sparse/test_layouts.py.

`from_mask` goes the other way: from an element mask (a mask function of (q_idx, kv_idx), as
FlexAttention's mask_mod, or a dense bool tensor) to the smallest layout that covers it, plus the
element mask itself where some computed block is only partly allowed (`SparseMask`).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.types import Device

from .._args import renamed

__all__ = [
    "sliding_window", "global_tokens", "random", "strided", "fixed", "bigbird", "longformer",
    "union", "intersection", "from_mask", "SparseMask", "sparse_mask_args", "draw", "num_blocks",
]


# ----------------------------------------------------------------------------------------------
# validation


def _int(name: str, x, lo: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    return x


_WINDOW_BLOCKS = ("key blocks on each side of the diagonal, an int; `window` is attention()'s (left, right) pair "
                  "of keys")


def _window_blocks_arg(fn: str, window_blocks, window) -> int:
    """The checked `window_blocks` of a builder (or a pattern of the nn layers), refusing the old
    name `window`, whose meaning elsewhere is attention()'s (left, right) pair of keys."""
    if window is not None:
        raise renamed(fn, "window", "window_blocks", _WINDOW_BLOCKS)
    if window_blocks is None:
        raise TypeError(f"{fn} missing window_blocks ({_WINDOW_BLOCKS})")
    return _int("window_blocks", window_blocks, 0)


def _check_block_size(block_size) -> int:
    _int("block_size", block_size, 1)
    if block_size % 16:
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size}")
    return block_size


def num_blocks(seq_len: int, seq_len_k: Optional[int] = None, block_size: int = 64) -> Tuple[int, int]:
    """(n_q_blocks, n_k_blocks) = (ceil(seq_len / block_size), ceil(seq_len_k / block_size))."""
    _int("seq_len", seq_len, 1)
    seq_len_k = seq_len if seq_len_k is None else _int("seq_len_k", seq_len_k, 1)
    _check_block_size(block_size)
    return -(-seq_len // block_size), -(-seq_len_k // block_size)


def _grid(seq_len, seq_len_k, block_size, heads, device) -> Tuple[Tensor, Tensor, int]:
    """Block row and column indices (n_q, 1) and (1, n_k), and the validated head count."""
    nq, nk = num_blocks(seq_len, seq_len_k, block_size)
    _int("heads", heads, 1)
    r = torch.arange(nq, device=device).view(nq, 1)
    c = torch.arange(nk, device=device).view(1, nk)
    return r, c, heads


def _heads(layout2d: Tensor, heads: int) -> Tensor:
    """(n_q, n_k) -> (heads, n_q, n_k), the same pattern in every head."""
    return layout2d.unsqueeze(0).expand(heads, *layout2d.shape).contiguous()


def _generator(seed) -> torch.Generator:
    _int("seed", seed, 0)
    return torch.Generator(device="cpu").manual_seed(seed)


def _default_stride(n_blocks: int) -> int:
    """round(sqrt(n_blocks)), at least 1: the stride that balances the local and strided parts."""
    return max(1, round(math.sqrt(n_blocks)))


# ----------------------------------------------------------------------------------------------
# builders


def sliding_window(window_blocks: Optional[int] = None, dilation: int = 1, *, seq_len: int,
                   seq_len_k: Optional[int] = None, block_size: int = 64, heads: int = 1, causal: bool = False,
                   device: Device = None, window: None = None) -> Tensor:
    """Banded layout: block (r, c) is computed iff c = r + t * dilation for some integer t in
    [-window_blocks, window_blocks] (t in [-window_blocks, 0] when `causal`). dilation=1 is the
    plain band of 2 * window_blocks + 1 blocks; a larger dilation spreads the same number of blocks
    further (a dilated sliding window, as in Longformer's upper layers). window_blocks counts
    blocks, not keys (attention()'s `window` is a (left, right) pair of keys); the old name
    `window` raises a TypeError that names window_blocks.

    >>> print(draw(sliding_window(1, seq_len=96, block_size=16)))
    ##....
    ###...
    .###..
    ..###.
    ...###
    ....##
    >>> print(draw(sliding_window(1, 2, seq_len=96, block_size=16)))
    #.#...
    .#.#..
    #.#.#.
    .#.#.#
    ..#.#.
    ...#.#
    """
    window_blocks = _window_blocks_arg("sliding_window()", window_blocks, window)
    _int("dilation", dilation, 1)
    r, c, heads = _grid(seq_len, seq_len_k, block_size, heads, device)
    d = c - r
    on = (d.abs() <= window_blocks * dilation) & (d % dilation == 0)
    if causal:
        on = on & (d <= 0)
    return _heads(on, heads)


def global_tokens(indices: Iterable[int], *, seq_len: int, seq_len_k: Optional[int] = None, block_size: int = 64,
                  heads: int = 1, device: Device = None) -> Tensor:
    """Global blocks: for each block index g, query block row g attends to every key block and key
    block column g is attended to by every query block (row g exists iff g < n_q_blocks, column g
    iff g < n_k_blocks; g must name at least one). Nothing else is computed.

    >>> print(draw(global_tokens([0, 3], seq_len=80, block_size=16)))
    #####
    #..#.
    #..#.
    #####
    #..#.
    """
    r, c, heads = _grid(seq_len, seq_len_k, block_size, heads, device)
    nq, nk = r.shape[0], c.shape[1]
    idx = list(indices) if not isinstance(indices, Tensor) else indices.flatten().tolist()
    on = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    for g in idx:
        if isinstance(g, bool) or not isinstance(g, int):
            raise TypeError(f"global block indices must be ints, got {g!r}")
        if not 0 <= g < max(nq, nk):
            raise ValueError(f"global block index {g} out of range: {nq} query blocks, {nk} key blocks")
        if g < nq:
            on[g, :] = True
        if g < nk:
            on[:, g] = True
    return _heads(on, heads)


def random(density: float, seed: int = 0, *, seq_len: int, seq_len_k: Optional[int] = None, block_size: int = 64,
           heads: int = 1, device: Device = None) -> Tensor:
    """Random blocks: every query block row of every head computes exactly
    round(density * n_k_blocks) key blocks, drawn without replacement from a torch.Generator seeded
    with `seed` (the same seed gives the same layout on every device; each head draws its own).

    >>> print(draw(random(0.5, seed=0, seq_len=64, block_size=16)))
    ..##
    #.#.
    ..##
    ##..
    """
    if isinstance(density, bool) or not isinstance(density, (int, float)):
        raise TypeError(f"density must be a number, got {type(density).__name__}")
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    g = _generator(seed)
    r, c, heads = _grid(seq_len, seq_len_k, block_size, heads, None)
    nq, nk = r.shape[0], c.shape[1]
    count = round(density * nk)
    order = torch.rand(heads, nq, nk, generator=g).argsort(dim=-1)[..., :count]  # (H, n_q, count)
    on = torch.zeros(heads, nq, nk, dtype=torch.bool).scatter_(-1, order, True)
    return on.to(device)


def strided(stride: Optional[int] = None, *, seq_len: int, seq_len_k: Optional[int] = None, block_size: int = 64,
            heads: int = 1, causal: bool = False, device: Device = None) -> Tensor:
    """The Sparse Transformer's strided pattern (Child et al. 2019) at block granularity, stride in
    blocks: block (r, c) is computed iff |r - c| < stride (the local part) or (r - c) % stride == 0
    (the strided part: every stride-th block, in both directions). With `causal` both parts keep
    c <= r only, the paper's form: r - c in [0, stride) or r - c a multiple of stride.

    The default stride is round(sqrt(n_k_blocks)) (at least 1), which balances the two parts: each
    row computes about 2 sqrt(n_k_blocks) blocks, O(N sqrt(N)) elements in all for a fixed
    block size. (Rounding the paper's sqrt(N) elements to blocks instead would give stride 1, a
    dense layout, for every N <= block_size ** 2.)

    >>> print(draw(strided(3, seq_len=112, block_size=16)))
    ####..#
    #####..
    ######.
    #######
    .######
    ..#####
    #..####
    >>> print(draw(strided(3, seq_len=112, block_size=16, causal=True)))
    #......
    ##.....
    ###....
    ####...
    .####..
    ..####.
    #..####
    """
    r, c, heads = _grid(seq_len, seq_len_k, block_size, heads, device)
    nk = c.shape[1]
    stride = _default_stride(nk) if stride is None else _int("stride", stride, 1)
    d = r - c
    on = (d.abs() < stride) | (d % stride == 0)
    if causal:
        on = on & (d >= 0)
    return _heads(on, heads)


def fixed(stride: Optional[int] = None, c: int = 1, *, seq_len: int, seq_len_k: Optional[int] = None,
          block_size: int = 64, heads: int = 1, causal: bool = False, device: Device = None) -> Tensor:
    """The Sparse Transformer's fixed pattern (Child et al. 2019) at block granularity, stride in
    blocks: the blocks fall into windows of `stride` blocks; block (r, k) is computed iff
    k // stride == r // stride (the same window) or k % stride >= stride - c (k is one of the last
    c "summary" blocks of its window, which every row reads). With `causal` both parts keep k <= r
    only. The default stride is round(sqrt(n_k_blocks)), as in `strided`, for O(N sqrt(N))
    elements at a fixed block size. 1 <= c <= stride.

    >>> print(draw(fixed(3, seq_len=128, block_size=16)))
    ###..#..
    ###..#..
    ###..#..
    ..####..
    ..####..
    ..####..
    ..#..###
    ..#..###
    >>> print(draw(fixed(3, c=1, seq_len=128, block_size=16, causal=True)))
    #.......
    ##......
    ###.....
    ..##....
    ..###...
    ..####..
    ..#..##.
    ..#..###
    """
    r, k, heads = _grid(seq_len, seq_len_k, block_size, heads, device)
    nk = k.shape[1]
    stride = _default_stride(nk) if stride is None else _int("stride", stride, 1)
    _int("c", c, 1)
    if c > stride:
        raise ValueError(f"c (summary blocks per window) must be <= stride, got c={c}, stride={stride}")
    on = (k // stride == r // stride) | (k % stride >= stride - c)
    if causal:
        on = on & (k <= r)
    return _heads(on, heads)


def _hash_uniform(seed: int, heads: int, nq: int, nk: int) -> Tensor:
    """(heads, n_q, n_k) float64 in [0, 1): a fixed function of (seed, head, row, column) alone, so a
    block's draw does not change with the grid's size (a causal layout grown by one block keeps its
    rows). Integer mixing in int64 with every product kept below 2**63."""
    m32 = 0xFFFFFFFF
    h = torch.arange(heads, dtype=torch.int64).view(heads, 1, 1)
    r = torch.arange(nq, dtype=torch.int64).view(1, nq, 1)
    c = torch.arange(nk, dtype=torch.int64).view(1, 1, nk)
    x = ((seed & m32) * 0x5BD1E995) & m32
    x = (x + h * 0x27D4EB2F) & m32
    x = (x ^ ((r * 0x165667B1) & m32)) & m32
    x = (x + c * 0x1B873593) & m32
    for _ in range(3):
        x = (((x >> 16) ^ x) * 0x045D9F3B) & m32
    x = (x >> 16) ^ x
    return x.double() / 2.0 ** 32


def bigbird(window_blocks: int = 1, n_global: int = 1, n_random: int = 1, seed: int = 0, *, seq_len: int,
            seq_len_k: Optional[int] = None, block_size: int = 64, heads: int = 1, causal: bool = False,
            device: Device = None, window: None = None) -> Tensor:
    """BigBird (Zaheer et al. 2020): a sliding window of `window_blocks` blocks on each side of the
    diagonal (|r - c| <= window_blocks; the paper's 3-block window is window_blocks=1; the old name
    `window` raises a TypeError that names window_blocks), the first `n_global`
    blocks global (their rows and columns, as `global_tokens`), and `n_random` more key blocks per
    query block row chosen at random among the blocks not already computed (all of them when fewer
    remain). Each head draws its own; the draw is a hash of (seed, head, row, column), the same on
    every device.

    With `causal` every part keeps c <= r only and the random blocks come from c < r, so row r
    does not depend on the sequence length (a KV-cache step computes the same row as the whole
    sequence would).

    >>> print(draw(bigbird(1, 1, 1, seed=0, seq_len=112, block_size=16)))
    #######
    ###.#..
    #####..
    #.###.#
    #.####.
    #..####
    #.#..##
    >>> print(draw(bigbird(1, 1, 1, seed=0, seq_len=112, block_size=16, causal=True)))
    #......
    ##.....
    ###....
    ####...
    #.###..
    #..###.
    #.#..##
    """
    window_blocks = _window_blocks_arg("bigbird()", window_blocks, window)
    _int("n_global", n_global, 0)
    _int("n_random", n_random, 0)
    _int("seed", seed, 0)
    nq, nk = num_blocks(seq_len, seq_len_k, block_size)
    if n_global > max(nq, nk):
        raise ValueError(f"n_global={n_global} exceeds the {max(nq, nk)} blocks")
    on = sliding_window(window_blocks, seq_len=seq_len, seq_len_k=seq_len_k, block_size=block_size, heads=heads)
    if n_global:
        on = on | global_tokens(range(n_global), seq_len=seq_len, seq_len_k=seq_len_k, block_size=block_size)
    taken = on
    if causal:
        above = torch.ones(nq, nk, dtype=torch.bool).triu(1)
        taken = on | above
    # blocks already taken sort after every free block, so the first n_random are free where possible
    key = _hash_uniform(seed, heads, nq, nk) + 2.0 * taken
    extra = torch.zeros_like(on).scatter_(-1, key.argsort(dim=-1)[..., :min(n_random, nk)], True)
    on = on | extra
    if causal:
        on = on & ~above
    return on.to(device)


def longformer(window_blocks: Optional[int] = None, global_indices: Iterable[int] = (), *, seq_len: int,
               seq_len_k: Optional[int] = None, block_size: int = 64, heads: int = 1, device: Device = None,
               window: None = None) -> Tensor:
    """Longformer (Beltagy et al. 2020): `sliding_window(window_blocks)` union
    `global_tokens(global_indices)` (the old name `window` raises a TypeError that names
    window_blocks).

    >>> print(draw(longformer(1, [0], seq_len=96, block_size=16)))
    ######
    ###...
    ####..
    #.###.
    #..###
    #...##
    """
    window_blocks = _window_blocks_arg("longformer()", window_blocks, window)
    kw = dict(seq_len=seq_len, seq_len_k=seq_len_k, block_size=block_size, heads=heads, device=device)
    return sliding_window(window_blocks, **kw) | global_tokens(global_indices, **kw)


def _combine(layouts: Sequence[Tensor], op, name: str) -> Tensor:
    if not layouts:
        raise ValueError(f"{name} needs at least one layout")
    for t in layouts:
        if not isinstance(t, Tensor) or t.dtype != torch.bool or t.dim() != 3:
            raise TypeError(f"{name}: layouts are 3-D bool tensors (heads, n_q_blocks, n_k_blocks), got "
                            f"{type(t).__name__ if not isinstance(t, Tensor) else (t.dtype, tuple(t.shape))}")
    if len({tuple(t.shape[1:]) for t in layouts}) > 1:
        raise ValueError(f"{name}: block grids differ: {[tuple(t.shape) for t in layouts]}")
    out = layouts[0]
    for t in layouts[1:]:
        try:
            out = op(out, t.to(out.device))
        except RuntimeError:
            raise ValueError(f"{name}: head counts do not broadcast: {[tuple(t.shape) for t in layouts]}") from None
    return out.contiguous()


def union(*layouts: Tensor) -> Tensor:
    """Blocks computed by any layout; head counts broadcast (1 with H). The first one's device.

    >>> a = sliding_window(0, seq_len=64, block_size=16)
    >>> print(draw(union(a, global_tokens([3], seq_len=64, block_size=16))))
    #..#
    .#.#
    ..##
    ####
    """
    return _combine(layouts, torch.logical_or, "union")


def intersection(*layouts: Tensor) -> Tensor:
    """Blocks computed by every layout; head counts broadcast (1 with H).

    >>> a = sliding_window(1, seq_len=64, block_size=16)
    >>> print(draw(intersection(a, strided(2, seq_len=64, block_size=16, causal=True))))
    #...
    ##..
    .##.
    ..##
    """
    return _combine(layouts, torch.logical_and, "intersection")


# ----------------------------------------------------------------------------------------------
# element masks


@dataclass
class SparseMask:
    """A block layout with the element mask it was built from.

    block_layout: bool (H or 1, n_q_blocks, n_k_blocks), the blocks with at least one allowed element.
    block_size: the layout's block size.
    mask: bool (H or 1, S_q, S_k), True = attend; None when every computed block is allowed in
        full, so the layout alone is exact.
    """
    block_layout: Tensor
    block_size: int
    mask: Optional[Tensor] = None

    def density(self) -> float:
        """The fraction of blocks computed."""
        return self.block_layout.float().mean().item()


def _n_params(fn: Callable) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 2


def from_mask(mask: Union[Callable, Tensor], block_size: int = 64, *, seq_len: Optional[int] = None,
              seq_len_k: Optional[int] = None, heads: int = 1, device: Device = None) -> SparseMask:
    """The block layout of an element mask, and the mask where the layout alone is not exact.

    `mask` is either a function of broadcasting index tensors returning bool, True = attend:
    fn(q_idx, kv_idx) with q_idx (S_q, 1) and kv_idx (1, S_k), or fn(h_idx, q_idx, kv_idx) with
    h_idx (heads, 1, 1) for per-head masks (FlexAttention's mask_mod without the batch index;
    seq_len is then required); or a dense bool tensor (S_q, S_k) or (H, S_q, S_k).

    A block is computed iff any of its elements is allowed. `SparseMask.mask` is None when every
    computed block is allowed in full (a block-aligned mask), else the dense element mask, which
    the attention then applies inside the partial blocks.

    >>> sm = from_mask(lambda q, kv: kv <= q, 16, seq_len=64)
    >>> print(draw(sm.block_layout)); sm.mask is None
    #...
    ##..
    ###.
    ####
    False
    """
    _check_block_size(block_size)
    if callable(mask) and not isinstance(mask, Tensor):
        if seq_len is None:
            raise ValueError("from_mask: a mask function needs seq_len")
        _int("seq_len", seq_len, 1)
        sk = seq_len if seq_len_k is None else _int("seq_len_k", seq_len_k, 1)
        _int("heads", heads, 1)
        q_idx = torch.arange(seq_len, device=device).view(seq_len, 1)
        kv_idx = torch.arange(sk, device=device).view(1, sk)
        if _n_params(mask) == 3:
            dense = mask(torch.arange(heads, device=device).view(heads, 1, 1), q_idx, kv_idx)
        else:
            dense = mask(q_idx, kv_idx)
        if not isinstance(dense, Tensor) or dense.dtype != torch.bool:
            raise TypeError(f"from_mask: the mask function must return a bool tensor, got "
                            f"{getattr(dense, 'dtype', type(dense).__name__)}")
        dense = torch.broadcast_to(dense, (seq_len, sk) if dense.dim() <= 2 else (dense.shape[0], seq_len, sk))
    elif isinstance(mask, Tensor):
        if mask.dtype != torch.bool or mask.dim() not in (2, 3):
            raise TypeError(f"from_mask: a dense mask is a bool (S_q, S_k) or (H, S_q, S_k) tensor, got "
                            f"{mask.dtype} of shape {tuple(mask.shape)}")
        dense = mask.to(device) if device is not None else mask
        if (seq_len is not None and seq_len != dense.shape[-2]) or \
                (seq_len_k is not None and seq_len_k != dense.shape[-1]):
            raise ValueError(f"from_mask: mask shape {tuple(dense.shape)} disagrees with seq_len={seq_len}, "
                             f"seq_len_k={seq_len_k}")
    else:
        raise TypeError(f"from_mask: expected a mask function or a bool tensor, got {type(mask).__name__}")
    if dense.dim() == 2:
        dense = dense.unsqueeze(0)
    dense = dense.contiguous()  # (H or 1, S_q, S_k)
    h, sq, sk = dense.shape
    nq, nk = -(-sq // block_size), -(-sk // block_size)
    pad = (0, nk * block_size - sk, 0, nq * block_size - sq)

    def blocks(m: Tensor) -> Tensor:  # (H, S_q', S_k') -> (H, n_q, bs, n_k, bs)
        return m.view(h, nq, block_size, nk, block_size)

    any_on = blocks(torch.nn.functional.pad(dense, pad, value=False)).any(dim=4).any(dim=2)
    # elements past the sequence ends do not exist: they count as allowed for "the block is full"
    all_on = blocks(torch.nn.functional.pad(dense, pad, value=True)).all(dim=4).all(dim=2)
    exact = bool((all_on | ~any_on).all())
    return SparseMask(block_layout=any_on, block_size=block_size, mask=None if exact else dense)


def sparse_mask_args(sm: SparseMask) -> dict:
    """The block_sparse_attention keywords of a SparseMask: block_layout, block_size and attn_mask (the
    element mask as (1, H or 1, S_q, S_k), True = attend, or None)."""
    if not isinstance(sm, SparseMask):
        raise TypeError(f"sparse_mask_args expects a SparseMask, got {type(sm).__name__}")
    return dict(block_layout=sm.block_layout, block_size=sm.block_size,
                attn_mask=None if sm.mask is None else sm.mask.unsqueeze(0))


# ----------------------------------------------------------------------------------------------


def draw(block_layout: Union[Tensor, SparseMask]) -> str:
    """ASCII picture of a block layout: one line per query block, '#' computed, '.' skipped. A
    layout with several heads draws each under a 'head h:' line."""
    if isinstance(block_layout, SparseMask):
        block_layout = block_layout.block_layout
    if not isinstance(block_layout, Tensor) or block_layout.dim() not in (2, 3):
        raise TypeError("draw expects a (n_q, n_k) or (heads, n_q, n_k) block layout tensor")
    t = block_layout.bool().cpu()
    if t.dim() == 2:
        t = t.unsqueeze(0)

    def grid(m: Tensor) -> str:
        return "\n".join("".join("#" if x else "." for x in row) for row in m.tolist())

    if t.shape[0] == 1:
        return grid(t[0])
    return "\n".join(f"head {i}:\n{grid(m)}" for i, m in enumerate(t))
