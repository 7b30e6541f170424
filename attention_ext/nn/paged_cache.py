"""A paged KV cache for batched generation of sequences of different lengths (vLLM's PagedAttention
layout, read by attention_ext.decode.decode_fwd).

One PagedKVCache per attention layer, like KVCache. Each holds a preallocated page pool
(num_pages, page_size, H_k, D) for keys and values, a block table (B, max_pages) int32 mapping a
sequence's logical page i to a pool page, and per-sequence lengths (B,) int32. Pages are taken
from a free list when a sequence grows past its last page, and `free(seq)` gives them back.

Which sequences the next layer call feeds is `rows` (set with `select`): a prefill feeds one
sequence (or a few), a decode step feeds every active sequence; finished sequences are simply left
out of `rows`. The attention layer calls `positions()`, `append(k, v)` and `attend(q, ...)`.

dtype=torch.int8 or torch.float8_e4m3fn stores the pools in 8 bits with a float32 scale per row
and kv head (k_descale / v_descale, (num_pages, page_size, H_k)): each appended row is quantized
with scale amax / 127 (int8) or amax / 448 (e4m3), and decode_fwd reads the bytes with their
scales (decode/quant.py).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .._args import as_int, not_a_tensor
from ..decode import decode_fwd
from ..decode.quant import QMAX, check_cache_dtype, dequantize_kv, quantize_rows
from ..softmax.functional import window_pair


class PagedKVCache:
    """A paged KV cache of one attention layer: page pools (num_pages, page_size, H_k, D) for keys
    and values, a block table (B, max_pages) int32 and lengths (B,) int32, with KVCache's interface
    (`positions()`, `append(k, v)`, `attend(q, ...)`) plus `select(rows)` and `free(seq)`; the
    module docstring describes the protocol."""

    paged = True
    static = False

    def __init__(self, batch: int, num_pages: int, page_size: int, n_kv_heads: int, head_dim: int, *,
                 max_len: Optional[int] = None, device=None, dtype=torch.float32):
        for name, x in (("batch", batch), ("num_pages", num_pages), ("page_size", page_size),
                        ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if as_int(x) is None or as_int(x) < 1:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {x!r}")
        batch, num_pages, page_size, n_kv_heads, head_dim = (
            as_int(x) for x in (batch, num_pages, page_size, n_kv_heads, head_dim))
        check_cache_dtype(dtype, "PagedKVCache")
        self.page_size = page_size
        self.k_pages = torch.zeros(num_pages, page_size, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.v_pages = torch.zeros_like(self.k_pages)
        if dtype in QMAX:  # 8-bit pools: a scale per row and kv head
            self.k_descale = torch.zeros(num_pages, page_size, n_kv_heads, device=device, dtype=torch.float32)
            self.v_descale = torch.zeros_like(self.k_descale)
        else:
            self.k_descale = self.v_descale = None
        if max_len is not None and (as_int(max_len) is None or as_int(max_len) < 1):
            raise ValueError(f"PagedKVCache: max_len must be a positive int (rows per sequence) or None, got "
                             f"{max_len!r}")
        self.max_len = as_int(max_len) if max_len is not None else num_pages * page_size  # the pool's by default
        max_pages = -(-self.max_len // page_size)
        self.block_table = torch.zeros(batch, max_pages, dtype=torch.int32, device=device)  # (B, max_pages)
        self._len: List[int] = [0] * batch           # rows filled per sequence (host; `lengths` is the tensor)
        self._pages: List[List[int]] = [[] for _ in range(batch)]
        self.free_pages: List[int] = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives page 0 first
        self.rows: List[int] = list(range(batch))
        self.packed: Optional[List[int]] = None
        self._rows_t: Optional[Tensor] = None

    # -- bookkeeping -------------------------------------------------------------------------------
    @property
    def lengths(self) -> Tensor:
        """(B,) int32 rows filled per sequence."""
        return torch.tensor(self._len, dtype=torch.int32, device=self.block_table.device)

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def select(self, rows: Sequence[int], packed: Optional[Sequence[int]] = None) -> "PagedKVCache":
        """The sequences the next layer call feeds, in its batch order: distinct indices in [0,
        batch). `packed`: their new-row counts when the call feeds them packed into one (1,
        sum(packed)) row (a ragged prefill of sequences with no rows yet)."""
        rows = list(rows)
        if not all(isinstance(r, int) and 0 <= r < self.batch for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"PagedKVCache.select: rows must be distinct sequence indices in [0, {self.batch}), "
                             f"got {rows}")
        if packed is not None:
            packed = list(packed)
            if len(packed) != len(rows) or not all(isinstance(t, int) and t >= 0 for t in packed):
                raise ValueError(f"PagedKVCache.select: packed must give a row count >= 0 for each of the "
                                 f"{len(rows)} rows, got {packed}")
        self.rows = rows
        self.packed = packed
        self._rows_t = None
        return self

    def _rows_tensor(self) -> Tensor:
        if self._rows_t is None:
            self._rows_t = torch.tensor(self.rows, dtype=torch.long, device=self.block_table.device)
        return self._rows_t

    def positions(self) -> Tensor:
        """(b,) int64: the position of the first new row of each selected sequence; packed: (1,
        total) the position of every packed row."""
        if self.packed is not None:
            pos = [j for r, t in zip(self.rows, self.packed) for j in range(self._len[r], self._len[r] + t)]
            return torch.tensor([pos], dtype=torch.long, device=self.block_table.device)
        return torch.tensor([self._len[r] for r in self.rows], dtype=torch.long, device=self.block_table.device)

    def empty(self) -> bool:
        """True when every selected sequence has no rows yet (a prefill from scratch)."""
        return all(self._len[r] == 0 for r in self.rows)

    def _grow(self, seq: int, new_len: int) -> None:
        """Claim pages for new_len rows of seq (append checked new_len against max_len)."""
        need = -(-new_len // self.page_size)
        pages = self._pages[seq]
        while len(pages) < need:
            if not self.free_pages:
                raise RuntimeError(f"paged KV cache pool exhausted: sequence {seq} needs page {len(pages) + 1} "
                                   f"for {new_len} rows, all {self.k_pages.shape[0]} pages of {self.page_size} "
                                   f"rows are in use (free finished sequences or allocate more pages)")
            p = self.free_pages.pop()
            self.block_table[seq, len(pages)] = p
            pages.append(p)

    def free(self, seq: int) -> None:
        """Return sequence `seq`'s pages to the free list and empty it."""
        self.free_pages.extend(reversed(self._pages[seq]))
        self._pages[seq] = []
        self._len[seq] = 0
        self.block_table[seq].zero_()

    def reset(self) -> None:
        for s in range(self.batch):
            self.free(s)
        self.select(range(self.batch))

    # -- data --------------------------------------------------------------------------------------
    def append(self, k: Tensor, v: Tensor) -> None:
        """k, v (b, T, H_k, D): T new rows for each selected sequence (b = len(rows)); packed: (1,
        sum(packed), H_k, D), sequence i's rows next in line."""
        # checked before any page is claimed: a failure past _grow would leave the lengths advanced
        # over rows that were never written
        pool = self.k_pages.shape[2:]
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 4 or tuple(x.shape[2:]) != tuple(pool):
                raise ValueError(f"PagedKVCache.append: {name} must be (b, T, H_k, D) with (H_k, D) = {tuple(pool)}, "
                                 f"got {tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
            if x.device != self.k_pages.device:
                raise ValueError(f"PagedKVCache.append: {name} must be on the cache's device {self.k_pages.device}, "
                                 f"got {x.device}")
            if not x.is_floating_point():
                raise TypeError(f"PagedKVCache.append: {name} must be floating point, got {x.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"PagedKVCache.append: k and v must have one shape, got {tuple(k.shape)} and "
                             f"{tuple(v.shape)}")
        b, t = k.shape[:2]
        counts = self.packed if self.packed is not None else [t] * b
        if len(counts) != len(self.rows) or sum(counts) != b * t:
            raise ValueError(f"append got {tuple(k.shape[:2])} rows for {len(self.rows)} selected sequences")
        ps = self.page_size
        # every sequence's pages sized before any is claimed: a pool that runs out for the last
        # sequence leaves the earlier ones as they were (no length advanced over unwritten rows)
        short = 0
        for r, t in zip(self.rows, counts):
            need = -(-(self._len[r] + t) // ps)
            if self._len[r] + t > self.max_len:
                raise ValueError(f"paged KV cache: sequence {r} needs {self._len[r] + t} rows, more than max_len="
                                 f"{self.max_len} (build the cache with a larger max_len)")
            short += max(0, need - len(self._pages[r]))
        if short > len(self.free_pages):
            raise RuntimeError(f"paged KV cache pool exhausted: this append needs {short} new pages of {ps} rows, "
                               f"{len(self.free_pages)} of {self.k_pages.shape[0]} are free (free finished sequences "
                               "or allocate more pages); nothing was written")
        idx = []
        for r, t in zip(self.rows, counts):
            p0 = self._len[r]
            self._grow(r, p0 + t)
            pages = self._pages[r]
            idx.extend(pages[j // ps] * ps + j % ps for j in range(p0, p0 + t))
            self._len[r] = p0 + t
        idx_t = torch.tensor(idx, dtype=torch.long, device=k.device)  # (b * T,) flat pool rows
        h, d = k.shape[2:]
        for x, pool, scales in ((k, self.k_pages, self.k_descale), (v, self.v_pages, self.v_descale)):
            rows = x.reshape(-1, h, d)
            if scales is not None:  # quantized: a fresh scale per row and kv head
                s = rows.float().abs().amax(-1) / QMAX[pool.dtype]  # (b * T, H_k)
                scales.view(-1, h).index_copy_(0, idx_t, s)
                rows = quantize_rows(rows, s[..., None], pool.dtype)
            rows = rows.to(pool.dtype)
            if pool.dtype == torch.float8_e4m3fn:  # index_copy_ has no fp8 kernel: copy the bytes
                pool, rows = pool.view(torch.uint8), rows.view(torch.uint8)
            pool.view(-1, h, d).index_copy_(0, idx_t, rows)

    def view(self, seq: int) -> Tuple[Tensor, Tensor]:
        """Sequence `seq`'s keys and values, gathered contiguous: (len, H_k, D) each (a copy)."""
        n = self._len[seq]
        pages = torch.tensor(self._pages[seq], dtype=torch.long, device=self.k_pages.device)
        h, d = self.k_pages.shape[2:]
        k = self.k_pages[pages].reshape(-1, h, d)[:n]
        v = self.v_pages[pages].reshape(-1, h, d)[:n]
        if self.k_descale is not None:  # 8-bit: dequantized (float32)
            k = dequantize_kv(k[None], self.k_descale[pages].reshape(-1, h)[:n][None])[0]
            v = dequantize_kv(v[None], self.v_descale[pages].reshape(-1, h)[:n][None])[0]
        return k, v

    def attend(self, q: Tensor, *, scale: float, causal: bool = True, window: Tuple[int, int] = (-1, -1),
               alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
               softcap: float = 0.0) -> Tensor:
        """q (b, S_q, H, D), the selected sequences' newest query rows (already appended) -> out
        (b, S_q, H, D) over their cached keys; causal is aligned bottom-right. GQA reads the H_k
        kv heads directly (no repeat). A float pool of another dtype than q's (a bf16 cache under
        a float32 model) reads q in the pool's dtype and returns out in q's."""
        if not isinstance(q, Tensor):
            raise not_a_tensor("q", q, "PagedKVCache.attend")
        if q.dim() != 4 or q.shape[0] != len(self.rows):
            raise ValueError(f"PagedKVCache.attend: q must be (b, S_q, H, D) with b = {len(self.rows)}, the "
                             f"sequences select() chose, got {tuple(q.shape)} (select() the rows q feeds first)")
        bt = self.block_table if self.rows == list(range(self.batch)) else self.block_table[self._rows_tensor()]
        seqlens = torch.tensor([self._len[r] for r in self.rows], dtype=torch.int32, device=q.device)  # (b,)
        wl, wr = window_pair(window, causal)
        pool = self.k_pages.dtype
        qc = q if (self.k_descale is not None or pool == q.dtype) else q.to(pool)
        out, _ = decode_fwd(qc, self.k_pages, self.v_pages, cache_seqlens=seqlens, block_table=bt,
                            alibi_slopes=alibi_slopes, sinks=sinks, scale=scale, softcap=softcap,
                            window_left=wl, window_right=wr, k_descale=self.k_descale, v_descale=self.v_descale)
        return out.to(q.dtype)
