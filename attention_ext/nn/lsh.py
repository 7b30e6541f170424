"""LSH attention layers: `LSHAttention`, the module of attention_type="lsh" (Reformer, Kitaev et
al. 2020).

One shared projection gives queries and keys (attention_ext.lsh_attention hashes its rows into
buckets by random rotations, sorts by bucket and attends within chunks), a second the values.
Causal or not. A new position can move earlier positions into other chunks, so there is no
incremental decoding: generation recomputes the prefix (use_cache=False).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from .._args import key_padding_mask_renamed, real_tokens
from ..sparse import lsh_attention
from .layers import ATTENTION_MODULES, AttentionConfig
from .positional import RotaryEmbedding

_NO_CACHE = ("LSH attention sorts the whole sequence into buckets and chunks, so a new position can change "
             "which keys earlier positions see and no cached step equals the full computation; generate without "
             "a cache (LanguageModel.generate(use_cache=False), Transformer.greedy_decode(use_cache=False))")


class LSHAttention(nn.Module):
    """Multi-head shared-QK LSH attention from an AttentionConfig (attention_type="lsh").

    qk_proj gives the shared queries / keys, v_proj the values (n_kv_heads must equal n_heads: every
    query is also a key). config.lsh_buckets (1 or even), lsh_hashes and lsh_chunk_size are
    lsh_attention's n_buckets, n_hashes and chunk_size. Reformer sets n_buckets to about
    S / chunk_size; a layer serves many lengths, so the bucket count is a fixed config value
    (default 8, chunk 64: sequences of about 512).

    Rotations: in training (module.training) every forward draws fresh ones from torch's RNG, as
    Reformer does, so the model learns to be robust to the hash. In eval the layer hashes with
    the `rotations` buffer (n_hashes, D, n_buckets // 2), drawn at init from torch's RNG and saved
    in the state dict, so evaluation and decoding are deterministic.

    key_mask / seqlens_k: right padding only (a key mask True on a prefix of each row).
    lsh_attention has no key mask, and padding would also shift the sort's chunks, so the
    sequences are grouped by length and each group attends over its own positions (one call per
    distinct length): a padded sequence computes what it computes alone, and its padded rows output
    zeros. attn_mask, window, ALiBi, sinks and softcap are refused; dropout on probabilities is not
    applied. Self-attention only: shared queries and keys have no cross form, and
    nn.blocks.cross_config gives a decoder's cross-attention `cross_attention_type` (softmax).
    """

    cross_attention_type = "softmax"

    def __init__(self, config: AttentionConfig, cross: bool = False):
        super().__init__()
        c = config
        if cross:
            raise ValueError("attention_type='lsh' shares queries and keys, so it has no cross-attention; build the "
                             "cross layer from nn.blocks.cross_config(config) (softmax), as DecoderBlock does")
        unsupported = [n for n, bad in (("window", tuple(c.window) != (-1, -1)), ("ALiBi", c.positional == "alibi"),
                                         ("sinks", c.sinks), ("softcap", c.softcap > 0)) if bad]
        if unsupported:
            raise ValueError(f"attention_type='lsh' has no {', '.join(unsupported)}")
        if c.n_kv_heads != c.n_heads:
            raise ValueError(f"attention_type='lsh' shares queries and keys, so the keys have n_heads heads: "
                             f"n_kv_heads must equal n_heads={c.n_heads}, got {c.n_kv_heads}")
        # lsh_buckets / lsh_hashes / lsh_chunk_size by the op's own rules, now rather than at the
        # first forward: one call on meta tensors (nothing is computed)
        meta = torch.empty(1, 1, 1, c.head_dim, device="meta")
        try:
            with warnings.catch_warnings():  # the meta call's "no compiled kernel on meta" note is not the user's
                warnings.simplefilter("ignore", RuntimeWarning)
                lsh_attention(meta, meta, n_buckets=c.lsh_buckets, n_hashes=c.lsh_hashes, chunk_size=c.lsh_chunk_size,
                              rotations=torch.empty(max(c.lsh_hashes, 0), c.head_dim, max(c.lsh_buckets // 2, 0),
                                                    device="meta"))
        except (ValueError, TypeError) as e:
            raise type(e)(f"AttentionConfig(lsh_buckets={c.lsh_buckets}, lsh_hashes={c.lsh_hashes}, "
                          f"lsh_chunk_size={c.lsh_chunk_size}): {e}") from e
        self.config = config
        self.cross = False
        self.causal = c.causal
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        width = c.n_heads * c.head_dim
        self.qk_proj = nn.Linear(c.d_model, width, bias=c.bias)
        self.v_proj = nn.Linear(c.d_model, width, bias=c.bias)
        self.out_proj = nn.Linear(width, c.d_model, bias=c.bias)
        self.rope = RotaryEmbedding(c.head_dim, c.rope_base) if c.positional == "rope" else None
        self.register_buffer("rotations", torch.randn(c.lsh_hashes, c.head_dim, c.lsh_buckets // 2))

    @classmethod
    def allocate_cache(cls, config: AttentionConfig, batch: int, max_len: int, *, device=None, dtype=None,
                       static: bool = False) -> None:
        raise ValueError(f"attention_type='lsh' keeps no generation cache: {_NO_CACHE}")

    def _lengths(self, key_mask: Optional[Tensor], seqlens_k: Optional[Tensor], b: int, s: int,
                 device) -> Optional[Tensor]:
        """(B,) valid lengths of right-padded sequences, None when nothing is padded."""
        real = real_tokens(key_mask, seqlens_k, b, s, device, "LSHAttention.forward()")  # checked by name
        if real is None:
            return None
        lengths = real.sum(-1)  # a seqlens_k past S counts S
        if not torch.equal(real, torch.arange(s, device=device) < lengths.unsqueeze(-1)):
            raise ValueError("attention_type='lsh' takes right padding only: key_mask must be True on a prefix "
                             "of each row (or pass seqlens_k), since LSH attention has no per-key mask")
        return None if bool((lengths >= s).all()) else lengths

    def forward(self, x: Tensor, context: None = None, *, key_mask: Optional[Tensor] = None,
                seqlens_k: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None, cache: None = None,
                key_padding_mask: None = None) -> Tensor:
        """x (B, S, d_model) -> (B, S, d_model)."""
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("LSHAttention.forward()")
        if context is not None:
            raise ValueError("attention_type='lsh' is self-attention only (shared queries and keys): got a context")
        if cache is not None:
            raise ValueError(f"attention_type='lsh' keeps no generation cache (cache=...): {_NO_CACHE}")
        if attn_mask is not None:
            raise ValueError("attention_type='lsh' takes no attn_mask (key_mask / seqlens_k mark right padding)")
        c = self.config
        b, s, _ = x.shape
        qk = self.qk_proj(x).view(b, s, self.n_heads, self.head_dim)  # (B, S, H, D)
        v = self.v_proj(x).view(b, s, self.n_heads, self.head_dim)
        if self.rope is not None:
            qk = self.rope(qk)
        # one draw per forward, shared by the length groups below
        rotations = torch.randn_like(self.rotations) if self.training else self.rotations
        kw = dict(n_buckets=c.lsh_buckets, n_hashes=c.lsh_hashes, chunk_size=c.lsh_chunk_size, causal=self.causal,
                  rotations=rotations, layout="bshd")
        lengths = self._lengths(key_mask, seqlens_k, b, s, x.device)
        if lengths is None:
            out = lsh_attention(qk, v, **kw)
        else:
            out = v.new_zeros(v.shape)
            for n in lengths.unique().tolist():
                rows = (lengths == n).nonzero().squeeze(1)
                if n > 0:
                    out[rows, :n] = lsh_attention(qk[rows, :n], v[rows, :n], **kw)
        return self.out_proj(out.reshape(b, s, self.n_heads * self.head_dim))  # (B, S, d_model)


ATTENTION_MODULES["lsh"] = LSHAttention
