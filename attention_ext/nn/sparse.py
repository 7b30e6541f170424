"""Sparse attention layers: `SparseAttention`, the module of attention_type="sparse".

The same projections, RoPE, ALiBi, KV cache and call signature as `Attention` (it is one, with a
layout): the config names a pattern (config.sparse_pattern, its options in config.sparse_kwargs)
and the layer builds its block layout once per sequence length and device. "topk" keeps each
query's config.topk best keys instead of a layout.

Generation: the KV cache is the ordinary one. A prefill is block-sparse attention as in training;
a step (fewer new queries than keys) reads the layout's rows for its queries as an element mask
through the fused op (`nn.layers._sparse_attention`). Causal layouts are built so that row r does
not depend on the sequence length, so a cached step equals recomputing the whole sequence.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from .._args import as_int
from ..softmax import attention_weights
from ..sparse import layouts as L
from ..sparse.layouts import _window_blocks_arg
from .layers import ATTENTION_MODULES, ATTENTION_TYPES, Attention, AttentionConfig, KVCache, sparse_rows_mask


# The patterns' window_blocks counts blocks; the old key `window` (attention()'s (left, right) pair
# of keys elsewhere) is refused with an error that names window_blocks.
def _local_global(window_blocks: int = 1, n_global: int = 1, *, seq_len, block_size, heads, causal, device=None,
                  window=None):
    """sliding_window(window_blocks) union the first n_global blocks as global tokens."""
    window_blocks = _window_blocks_arg("sparse_kwargs of sparse_pattern='local_global'", window_blocks, window)
    n_global = L._int("n_global (sparse_kwargs of sparse_pattern='local_global')", n_global, 0)
    nb = -(-seq_len // block_size)
    kw = dict(seq_len=seq_len, block_size=block_size, heads=heads, device=device)
    lay = L.sliding_window(window_blocks, causal=causal, **kw)
    if n_global:
        lay = lay | L.global_tokens(range(min(n_global, nb)), **kw)
    return lay


def _longformer(window_blocks: int = 1, global_indices=(0,), *, seq_len, block_size, heads, causal, device=None,
                window=None):
    window_blocks = _window_blocks_arg("sparse_kwargs of sparse_pattern='longformer'", window_blocks, window)
    nb = -(-seq_len // block_size)
    # a global block past a short sequence's end does not exist yet
    g = [i for i in global_indices if i < nb]
    return L.longformer(window_blocks, g, seq_len=seq_len, block_size=block_size, heads=heads, device=device)


def _bigbird(window_blocks: int = 1, n_global: int = 1, n_random: int = 1, seed: int = 0, *, seq_len, block_size,
             heads, causal, device=None, window=None):
    window_blocks = _window_blocks_arg("sparse_kwargs of sparse_pattern='bigbird'", window_blocks, window)
    nb = -(-seq_len // block_size)
    return L.bigbird(window_blocks, min(n_global, nb), n_random, seed, seq_len=seq_len, block_size=block_size,
                     heads=heads, causal=causal, device=device)


def _with_causal(builder: Callable) -> Callable:
    def build(*args, causal, **kw):
        return builder(*args, causal=causal, **kw)
    return build


def _without_causal(builder: Callable) -> Callable:
    def build(*args, causal, **kw):
        return builder(*args, **kw)
    return build


# name -> build(**pattern_kwargs, seq_len=, block_size=, heads=, causal=) -> (heads, n, n) bool
PATTERNS: Dict[str, Callable] = {
    "local_global": _local_global,
    "longformer": _longformer,
    "sliding_window": _with_causal(L.sliding_window),
    "bigbird": _bigbird,
    "strided": _with_causal(L.strided),
    "fixed": _with_causal(L.fixed),
    "random": _without_causal(L.random),
}

_MAX_CACHED_LAYOUTS = 32


class SparseAttention(Attention):
    """Multi-head block-sparse (or top-k) attention from an AttentionConfig (attention_type="sparse").

    config.sparse_pattern is one of "local_global" (a sliding window of `window_blocks` blocks each
    side plus the first `n_global` blocks global; window_blocks=1, n_global=1), "longformer"
    (window_blocks, global_indices), "sliding_window" (window_blocks, dilation), "bigbird"
    (window_blocks, n_global, n_random, seed), "strided" / "fixed" (stride, c), "random" (density,
    seed) or "topk" (config.topk keys per query); config.sparse_kwargs holds the pattern's options
    (see attention_ext.sparse.layouts), config.sparse_block_size the block size. Random patterns draw one layout per query head.

    Causal layers build causal layouts (blocks above the diagonal dropped) whose rows do not depend
    on the sequence length; "strided" and "fixed" then need an explicit stride (the default one
    grows with the length) and "random" is refused (its rows change with the length).

    Cross-attention (cross=True) is dense softmax attention: a pattern over positions has no
    meaning between two sequences. Window, ALiBi, sinks, softcap, dropout and masks compose with
    every pattern, top-k included (it ranks the final logits).
    """

    def __init__(self, config: AttentionConfig, cross: bool = False):
        super().__init__(config, cross=cross)
        c = config
        self.pattern = c.sparse_pattern
        self.pattern_kwargs = dict(c.sparse_kwargs or {})
        self.block_size = c.sparse_block_size
        self.causal = c.causal and not cross
        self._layouts: Dict[Tuple[int, torch.device], Tensor] = {}
        L._check_block_size(self.block_size)
        if self.pattern == "topk":
            if as_int(c.topk) is None or as_int(c.topk) < 1:
                raise ValueError(f"sparse_pattern='topk' needs topk >= 1, an int (keys kept per query), got {c.topk!r}")
            if self.pattern_kwargs:
                raise ValueError(f"sparse_pattern='topk' takes no sparse_kwargs (its option is topk), got "
                                 f"{sorted(self.pattern_kwargs)}")
        elif self.pattern not in PATTERNS:
            raise ValueError(f"unknown sparse_pattern {self.pattern!r}; known: {sorted(PATTERNS) + ['topk']}")
        elif self.causal and self.pattern in ("strided", "fixed") and self.pattern_kwargs.get("stride") is None:
            raise ValueError(f"a causal {self.pattern!r} layer needs an explicit stride in sparse_kwargs: the default "
                             f"grows with the sequence length, which would change earlier rows as a sequence grows")
        elif self.causal and self.pattern == "random":
            raise ValueError("a causal 'random' layer would draw different rows for every sequence length; "
                             "use 'bigbird' (its random blocks are drawn per row)")
        if self.pattern != "topk" and not cross:
            # the pattern's options fail here, not mid-forward: a few blocks, so that every part of
            # the pattern (global, random, strided blocks) is built
            try:
                PATTERNS[self.pattern](**self.pattern_kwargs, seq_len=8 * self.block_size, block_size=self.block_size,
                                       heads=self.n_heads, causal=self.causal)
            except TypeError as e:  # a missing or unknown option: name where options go
                raise TypeError(f"sparse_pattern={self.pattern!r}: {e} (the pattern's options go in "
                                f"sparse_kwargs)") from e

    @classmethod
    def allocate_cache(cls, config: AttentionConfig, batch: int, max_len: int, *, device=None, dtype=torch.float32,
                       static: bool = False) -> KVCache:
        return KVCache(batch, max_len, config.n_kv_heads, config.head_dim, device=device, dtype=dtype, static=static)

    def layout(self, seq_len: int, device=None) -> Tensor:
        """The (heads, n, n) bool layout of a sequence of seq_len positions, n = ceil(seq_len /
        block_size); cached per (n, device)."""
        n = -(-seq_len // self.block_size)
        device = torch.device(device) if device is not None else torch.device("cpu")
        cache = self._layouts
        key = (n, device)
        if key not in cache:
            lay = PATTERNS[self.pattern](**self.pattern_kwargs, seq_len=n * self.block_size,
                                         block_size=self.block_size, heads=self.n_heads, causal=self.causal)
            if self.causal:
                lay = lay & torch.ones(n, n, dtype=torch.bool).tril()
            if len(cache) >= _MAX_CACHED_LAYOUTS:
                cache.pop(next(iter(cache)))
            cache[key] = lay.to(device)
        return cache[key]

    def _kernel(self, q: Tensor, k: Tensor, opts: dict) -> Tuple[Callable, dict]:
        if self.cross:
            return ATTENTION_TYPES["softmax"], opts
        if self.pattern == "topk":
            return ATTENTION_TYPES["sparse"], dict(opts, k_top=as_int(self.config.topk))
        lay = self.layout(k.shape[1], q.device)
        return ATTENTION_TYPES["sparse"], dict(opts, block_layout=lay, block_size=self.block_size)

    def _decode_kernel_ok(self) -> bool:
        return self.cross  # the layout / top-k are not the decode kernel's

    def _weights(self, q: Tensor, k: Tensor, lse: Tensor, opts: dict) -> Tensor:
        w = {n: o for n, o in opts.items() if n not in ("block_layout", "block_size", "k_top")}
        if self.cross:
            return attention_weights(q, k, lse, layout="bshd", **w)
        if self.pattern == "topk":
            return attention_weights(q, k, lse, layout="bshd", topk=as_int(self.config.topk), **w)
        mask = sparse_rows_mask(opts["block_layout"], self.block_size, q.shape[1], k.shape[1]).unsqueeze(0)
        user = w.get("attn_mask")
        if user is None or user.dtype == torch.bool:
            w["attn_mask"] = mask if user is None else mask & user
        else:
            w["attn_mask"] = user.masked_fill(~mask, float("-inf"))
        return attention_weights(q, k, lse, layout="bshd", **w)

    @classmethod
    def build(cls, d_model: int, n_heads: int, *, n_kv_heads: Optional[int] = None, pattern: str = "local_global",
              block_size: int = 64, causal: bool = False, topk: int = 0, **pattern_kwargs) -> "SparseAttention":
        """A layer from plain arguments: SparseAttention.build(256, 8, pattern="bigbird",
        window_blocks=1, n_global=1, n_random=2, seed=0)."""
        cfg = AttentionConfig(d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads, attention_type="sparse",
                              causal=causal, sparse_pattern=pattern, sparse_block_size=block_size,
                              sparse_kwargs=pattern_kwargs, topk=topk)
        return cls(cfg)


ATTENTION_MODULES["sparse"] = SparseAttention
