"""Config-driven attention layers: self and cross attention, MHA/MQA/GQA, causal, sliding window,
ALiBi, RoPE and attention sinks, with an optional preallocated KV cache.

The blocks and models build `make_attention(config)` and `allocate_cache(config, ...)`. Which kernel
computes the attention is `config.attention_type`, a key into `ATTENTION_TYPES`: "softmax" (our
fused kernel) and "sdpa" (torch's scaled_dot_product_attention, the peer the demo and benchmarks
compare against), both run by `Attention`. A type that brings its own module (its own
parameters, a recurrent state instead of a KV cache) registers the module class in
`ATTENTION_MODULES` instead: "linear" (nn/linear.py, LinearAttention), "gated_delta"
(nn/delta.py, GatedDeltaNet: the delta rule with a recurrent state in generation), "linformer"
(nn/linformer.py, LinformerAttention: learned projections along the sequence, non-causal) and
"lsh" (nn/lsh.py, LSHAttention: Reformer's shared-QK hashing, no KV cache). "sparse" does both:
its kernel here runs block-sparse or top-k attention on a layout it is given, and its module
(nn/sparse.py, SparseAttention) builds the layout from the config's pattern.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.types import Device

from .. import reference
from .._args import as_int, key_padding_mask_renamed, not_a_tensor
from ..decode import decode_fwd
from ..decode.quant import QMAX, check_cache_dtype, dequantize_kv, quantize_rows
from ..softmax import attention, attention_varlen, attention_weights
from ..softmax import ops as softmax_ops
from ..softmax.functional import window_pair
from ..sparse import block_sparse_attention, layout_to_mask, topk_attention
from .positional import RotaryEmbedding, alibi_slopes

if TYPE_CHECKING:  # nn does not import distributed at run time (it is imported on first use)
    from ..distributed import ContextParallel


@dataclass
class AttentionConfig:
    d_model: int
    n_heads: int
    n_kv_heads: Optional[int] = None   # None: = n_heads (MHA); 1: MQA; a divisor of n_heads: GQA
    attention_type: str = "softmax"    # key into ATTENTION_TYPES
    causal: bool = False
    window: Tuple[int, int] = (-1, -1)  # sliding window (left, right) around the diagonal; -1 unbounded
    positional: str = "none"           # "rope" or "alibi" act inside the layer; anything else is ignored here
    rope_base: float = 10000.0
    sinks: bool = False                # one learnable sink logit per head (an extra "attend to nothing" column)
    softcap: float = 0.0
    dropout: float = 0.0               # on the attention probabilities
    bias: bool = True
    kv_dim: Optional[int] = None       # width of the cross-attention memory; None = d_model
    feature_map: str = "elu"           # attention_type="linear": a registered feature map name
    decay_gate: Union[bool, str] = False  # attention_type="linear", causal: a gate projection gives log-decays, per
    #                                    head (True / "head") or per feature ("feature": GLA's gates)
    decay_gate_rank: int = 0           # decay_gate: 0 a full-rank projection; r > 0 a rank-r one, x -> r -> gates
    #                                    (GLA's: 16)
    decay_gate_temperature: float = 1.0  # decay_gate: the log-gates logsigmoid(W x + b) / temperature (GLA's: 16)
    delta_conv: int = 4                # attention_type="gated_delta": the short causal convolutions' kernel (0: none)
    sparse_pattern: str = "local_global"  # attention_type="sparse": a SparseAttention pattern name
    sparse_block_size: int = 64        # attention_type="sparse": the layout's block size
    sparse_kwargs: Optional[Dict[str, Any]] = None  # attention_type="sparse": the pattern's options (window_blocks..)
    topk: int = 0                      # attention_type="sparse", sparse_pattern="topk": keys kept per query
    linformer_k: int = 64              # attention_type="linformer": r, the projected length of keys and values
    linformer_max_len: int = 512       # attention_type="linformer": the longest sequence (the projections' width)
    linformer_share: str = "headwise"  # attention_type="linformer": "headwise", "kv" or "none" (LinformerAttention)
    lsh_buckets: int = 8               # attention_type="lsh": buckets per hash round, 1 or even (Reformer: ~ S / chunk)
    lsh_hashes: int = 1                # attention_type="lsh": hash rounds
    lsh_chunk_size: int = 64           # attention_type="lsh": the sorted positions' chunk length
    # attention_type="softmax": "int8" ("fp8") runs Q.K^T in int8 (fp8 e4m3; attention()'s
    # qk_quant) in forwards with no graph to build (torch.no_grad / inference_mode: evaluation, a
    # generation's prefill) on a device with a kernel for the format (int8: CPU, CUDA; fp8: sm_90
    # GPUs; ops.has_quant_kernel); a forward that records gradients, generation's cached steps,
    # keep_weights and other devices run unquantized
    qk_quant: Optional[str] = None

    def __post_init__(self):
        for name in ("d_model", "n_heads", "n_kv_heads"):
            x = getattr(self, name)
            if x is None and name == "n_kv_heads":
                continue
            n = as_int(x)  # numpy ints too, not bools or floats
            if n is None or n < 1:
                raise ValueError(f"{name} must be an int >= 1{' (None: n_heads)' if name == 'n_kv_heads' else ''}, "
                                 f"got {x!r}")
            setattr(self, name, n)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if not (isinstance(self.decay_gate, bool) or self.decay_gate in ("head", "feature")):
            raise ValueError(f"decay_gate must be False, True / 'head' (a log-decay per head) or 'feature' (one per "
                             f"feature, GLA), got {self.decay_gate!r}")
        rank = as_int(self.decay_gate_rank)
        if rank is None or rank < 0:
            raise ValueError(f"decay_gate_rank must be an int >= 0 (0: a full-rank gate projection), got "
                             f"{self.decay_gate_rank!r}")
        self.decay_gate_rank = rank
        tau = self.decay_gate_temperature
        if isinstance(tau, bool) or not isinstance(tau, numbers.Real) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"decay_gate_temperature must be a finite number > 0, got {tau!r}")
        self.decay_gate_temperature = float(tau)
        if not self.decay_gate and (rank != 0 or tau != 1.0):
            raise ValueError(f"decay_gate_rank / decay_gate_temperature shape the decay gate: pass decay_gate=True "
                             f"or 'feature' with them (got decay_gate={self.decay_gate!r})")
        if self.qk_quant is not None and self.attention_type != "softmax":
            raise ValueError(f"qk_quant serves attention_type='softmax', got {self.attention_type!r}")
        self.window = window_pair(self.window, causal=False)  # the functional API's check and error

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# ----------------------------------------------------------------------------------------------
# Kernels. Each takes (B, S, H, D) q and (B, S_k, H_k, D) k, v plus softmax.attention's keyword
# options, and returns out (B, S, H, D), or (out, lse) when return_lse.

ATTENTION_TYPES: Dict[str, Callable] = {}


def register_attention_type(name: str) -> Callable[[Callable], Callable]:
    """Decorator registering `fn(q, k, v, **options)` as the kernel of AttentionConfig(attention_type=name):
    (B, S, H, D) q and (B, S_k, H_k, D) k, v in, out (B, S, H, D) (or (out, lse) with return_lse) back."""
    def deco(fn):
        ATTENTION_TYPES[name] = fn
        return fn
    return deco


@register_attention_type("softmax")
def _softmax_attention(q, k, v, **kw):
    return attention(q, k, v, layout="bshd", **kw)


@register_attention_type("sdpa")
def _sdpa_attention(q, k, v, *, causal=False, bottom_right=False, window=(-1, -1), attn_mask=None,
                    key_mask=None, seqlens_k=None, alibi_slopes=None, softcap=0.0, sinks=None,
                    dropout_p=0.0, return_lse=False, scale=None, generator=None):
    """torch's SDPA on the same inputs: the peer for timings. Everything but plain causal becomes an
    explicit mask, which is how a torch user would have to write it."""
    if softcap or sinks is not None or return_lse:
        raise NotImplementedError("attention_type='sdpa' has no softcap, sinks or LSE")
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    plain = (attn_mask is None and key_mask is None and seqlens_k is None and alibi_slopes is None
             and tuple(window) == (-1, -1))
    mask = None
    is_causal = causal and plain and sq == sk
    if not plain or (causal and not is_causal):
        wl, wr = window
        ok = reference.mask_structure(sq, sk, window=(wl, 0 if causal else wr), bottom_right=bottom_right,
                                      len_k=seqlens_k, batch=b, device=q.device)  # (B, 1, S_q, S_k)
        if key_mask is not None:
            ok = ok & key_mask.view(b, 1, 1, sk)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            ok = ok & attn_mask
        mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill(~ok, float("-inf"))
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            mask = mask + attn_mask.to(q.dtype)
        if alibi_slopes is not None:
            mask = mask + reference.alibi_bias(alibi_slopes.to(q.dtype), sq, sk, bottom_right=bottom_right)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                         scale=scale, enable_gqa=k.shape[1] != h)
    return out.transpose(1, 2)  # (B, S, H, D)


@register_attention_type("sparse")
def _sparse_attention(q, k, v, *, block_layout=None, block_size=64, k_top=0, attn_mask=None, **kw):
    """Block-sparse attention over `block_layout` (H or 1, n_blocks, n_blocks), or top-k attention when
    k_top > 0; every other option is softmax.attention's. The layout is square over the keys: with
    fewer queries than keys (a KV-cache step, bottom_right) the queries are its last rows, and the
    layout's rows for them become the equivalent element mask through the fused op."""
    sq, sk = q.shape[1], k.shape[1]
    if k_top > 0:
        return topk_attention(q, k, v, k_top, layout="bshd", attn_mask=attn_mask, **kw)
    if block_layout is None:
        raise ValueError("attention_type='sparse' needs a block layout: build the layer with make_attention "
                         "(nn.SparseAttention), or call attention_ext.block_sparse_attention")
    if sq == sk:
        return block_sparse_attention(q, k, v, block_layout, block_size=block_size, layout="bshd",
                                      attn_mask=attn_mask, **kw)
    mask = sparse_rows_mask(block_layout, block_size, sq, sk).unsqueeze(0)  # (1, H or 1, S_q, S_k)
    if attn_mask is not None:
        mask = mask & attn_mask if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~mask, float("-inf"))
    return attention(q, k, v, layout="bshd", attn_mask=mask, **kw)


def sparse_rows_mask(block_layout: Tensor, block_size: int, sq: int, sk: int) -> Tensor:
    """The element mask of the last sq rows of a square (S_k, S_k) block layout: (H or 1, S_q, S_k)
    bool. Expands only the block rows those queries fall in."""
    r0 = (sk - sq) // block_size
    rows = layout_to_mask(block_layout[:, r0:].to(torch.bool), block_size,
                          block_layout.shape[1] * block_size - r0 * block_size, sk)  # rows r0 * bs ...
    first = sk - sq - r0 * block_size
    return rows[:, first: first + sq]


# ----------------------------------------------------------------------------------------------
# KV cache


def key_mask_run(key_mask: Tensor, s_k: int) -> Optional[Tuple[Tensor, Tensor]]:
    """(start, end), int32 (B,) each, when every row of key_mask (B, s_k) (True = a real key)
    holds its real keys as one run of positions [start, end) (a row without any: 0, 0); None when
    a row has holes, or for anything but a (B, s_k) bool tensor (the fused op, which the caller
    falls back to, states the rule). One device-to-host copy (the check)."""
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or key_mask.dim() != 2 or \
            key_mask.shape[1] != s_k:
        return None
    m = key_mask
    pos = torch.arange(s_k, device=m.device)
    real = m.any(1)
    start = torch.where(m, pos, s_k).amin(1)
    end = torch.where(m, pos + 1, 0).amax(1)
    if not bool(((end - start == m.sum(1)) | ~real).all()):
        return None
    return torch.where(real, start, 0).to(torch.int32), end.to(torch.int32)


class KVCache:
    """Preallocated keys and values of one attention layer: (B, max_len, H_k, D) each.

    `pos` rows are filled. A self-attention cache grows by the new rows each step; a `static` one
    (cross-attention over a fixed memory) is filled once and then only read.

    dtype=torch.int8 or torch.float8_e4m3fn stores the rows in 8 bits with a float32 scale per
    row and kv head (k_descale / v_descale, (B, max_len, H_k): amax / 127 or amax / 448 of each
    appended row, as flash_attn_with_kvcache quantizes); `attend` then reads them through the
    decode kernel: causal self-attention, or a `static` cross-attention memory (valid keys as a
    leading offset and a length per sequence); `dequantized` returns the rows as numbers for calls
    the decode kernel cannot express (Attention picks which, see Attention._read_8bit).
    """

    def __init__(self, batch: int, max_len: int, n_kv_heads: int, head_dim: int, *, device=None,
                 dtype=torch.float32, static: bool = False):
        check_cache_dtype(dtype, "KVCache")
        self.k = torch.empty(batch, max_len, n_kv_heads, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.pos = 0
        self.static = static
        self.quantized = dtype in QMAX
        self.k_descale = self.v_descale = None
        if self.quantized:
            self.k_descale = torch.zeros(batch, max_len, n_kv_heads, device=device, dtype=torch.float32)
            self.v_descale = torch.zeros_like(self.k_descale)

    def append(self, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
        """k, v (B, T, H_k, D): T new rows per sequence; returns every row so far (views)."""
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 4 or (x.shape[0],) + tuple(x.shape[2:]) != (
                    self.k.shape[0],) + tuple(self.k.shape[2:]):
                b, _, h, d = self.k.shape
                raise ValueError(f"KVCache.append: {name} must be (B, T, H_k, D) with (B, H_k, D) = {(b, h, d)} (the "
                                 f"cache's batch, kv heads and head dim), got "
                                 f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}: allocate the cache "
                                 "for this layer and batch (allocate_cache)")
        t = k.shape[1]
        if self.pos + t > self.k.shape[1]:
            raise ValueError(f"KV cache overflow: {self.pos} + {t} rows > max_len={self.k.shape[1]}")
        if self.quantized:  # a fresh scale per row and kv head
            for x, store, scales in ((k, self.k, self.k_descale), (v, self.v, self.v_descale)):
                s = x.float().abs().amax(-1) / QMAX[store.dtype]  # (B, t, H_k)
                scales[:, self.pos: self.pos + t] = s
                store[:, self.pos: self.pos + t] = quantize_rows(x, s[..., None], store.dtype)
        else:
            self.k[:, self.pos: self.pos + t] = k
            self.v[:, self.pos: self.pos + t] = v
        self.pos += t
        return self.k[:, : self.pos], self.v[:, : self.pos]  # (B, pos, H_k, D) views

    def attend(self, q: Tensor, *, scale: float, causal: bool = True, window: Tuple[int, int] = (-1, -1),
               alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
               softcap: float = 0.0, lengths: Optional[Tensor] = None, leftpad: Optional[Tensor] = None) -> Tensor:
        """q (B, S_q, H, D), the newest query rows (their keys already appended) -> out
        (B, S_q, H, D) over the `pos` cached rows (or each sequence's rows [leftpad, lengths), (B,)
        each: a memory's valid keys) by the decode kernel (attention_ext.decode; causal aligned
        bottom-right on each sequence's last valid row, GQA unrepeated), the 8-bit rows with their
        descales."""
        wl, wr = window_pair(window, causal)
        lens = torch.full((self.k.shape[0],), self.pos, dtype=torch.int32, device=self.k.device)
        if lengths is not None:
            lens = torch.minimum(lens, lengths.to(device=lens.device, dtype=torch.int32))
        if leftpad is not None:
            leftpad = torch.minimum(leftpad.to(device=lens.device, dtype=torch.int32), lens)
        out, _ = decode_fwd(q, self.k, self.v, cache_seqlens=lens, cache_leftpad=leftpad, alibi_slopes=alibi_slopes,
                            sinks=sinks, scale=scale, softcap=softcap, window_left=wl, window_right=wr,
                            k_descale=self.k_descale, v_descale=self.v_descale)
        return out

    def dequantized(self, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
        """The `pos` cached rows as numbers, (B, pos, H_k, D) each in `dtype`: stored value x
        descale for an 8-bit cache (a new tensor per call), the rows themselves otherwise."""
        k, v = self.k[:, : self.pos], self.v[:, : self.pos]
        if not self.quantized:
            return k.to(dtype), v.to(dtype)
        return (dequantize_kv(k, self.k_descale[:, : self.pos]).to(dtype),
                dequantize_kv(v, self.v_descale[:, : self.pos]).to(dtype))

    @property
    def lengths(self) -> Tensor:
        """(B,) int32 rows filled per sequence: the interface PagedKVCache shares."""
        return torch.full((self.k.shape[0],), self.pos, dtype=torch.int32, device=self.k.device)

    def reset(self) -> None:
        self.pos = 0


# ----------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head attention from an AttentionConfig. Self-attention when `cross=False`, else
    queries from x and keys/values from `context`.

    Masks use the functional API's convention: `key_mask` (B, S_k) True = a real key (torch's
    `key_padding_mask`, True = padding, is refused with a TypeError: pass key_mask=~it),
    `seqlens_k` (B,) valid key lengths, bool `attn_mask` True = attend, float = additive.

    Set `keep_weights = True` to store the (B, H, S_q, S_k) probabilities of each call in
    `last_weights` (recomputed from the LSE); the demo's heatmaps use this.
    """

    def __init__(self, config: AttentionConfig, cross: bool = False):
        super().__init__()
        if config.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"unknown attention_type {config.attention_type!r}; "
                             f"registered: {sorted(ATTENTION_TYPES)}")
        self.config = config
        self.cross = cross
        c = config
        init_projections(self, c, cross)
        if c.positional == "alibi" and not cross:
            self.register_buffer("alibi_slopes", alibi_slopes(c.n_heads), persistent=False)
        else:
            self.alibi_slopes = None
        self.sinks = nn.Parameter(torch.zeros(c.n_heads)) if c.sinks else None
        self.keep_weights = False
        self.last_weights: Optional[Tensor] = None

    def forward(self, x: Tensor, context: Optional[Tensor] = None, *, key_mask: Optional[Tensor] = None,
                seqlens_k: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, context_parallel: Optional["ContextParallel"] = None,
                key_padding_mask: None = None) -> Tensor:
        """x (B, S, d_model) -> (B, S, d_model). With `context_parallel`
        (attention_ext.distributed.ContextParallel) x is this rank's shard of the sequence and the
        attention runs across the group (see _context_parallel)."""
        if key_padding_mask is not None:
            raise key_padding_mask_renamed(f"{type(self).__name__}.forward()")
        c = self.config
        name = type(self).__name__
        if not isinstance(x, Tensor):
            raise not_a_tensor("x", x, f"{name}.forward")
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise ValueError(f"{name}.forward: x must be (B, S, d_model) with d_model = {c.d_model}, got shape "
                             f"{tuple(x.shape)}")
        if self.cross and context is None and not (cache is not None and cache.static and cache.pos > 0):
            raise ValueError(f"{name}.forward: a cross-attention layer (cross=True) needs `context`, the memory "
                             "(B, S_k, kv_dim), unless a static cache already holds it")
        if context is not None and not self.cross:
            raise ValueError(f"{name}.forward: `context` is the memory of a cross-attention layer; this layer "
                             "attends to x (build it with cross=True for cross-attention)")
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim)  # (B, S, H, D)
        if context_parallel is not None:
            if self.cross or context is not None or cache is not None or any(
                    m is not None for m in (key_mask, seqlens_k, attn_mask)):
                raise NotImplementedError("context_parallel serves self-attention without masks or caches "
                                          "(training / prefill of whole sequences)")
            out = self._context_parallel(q, x, context_parallel)  # (B, n, H, D)
            return self.out_proj(out.reshape(b, s, self.n_heads * self.head_dim))
        src = context if self.cross else x
        # the 8-bit Q.K^T: forwards without a graph, over a whole prompt (not a cached step)
        quant = c.qk_quant if (c.qk_quant and not torch.is_grad_enabled() and not self.keep_weights and
                               softmax_ops.has_quant_kernel(x.device, c.qk_quant) and
                               (cache is None or getattr(cache, "pos", None) == 0)) else None
        if getattr(cache, "paged", False) and not self.cross:
            return self.out_proj(self._paged(q, x, cache).reshape(b, s, self.n_heads * self.head_dim))
        if cache is not None and cache.static and cache.pos > 0:
            if getattr(cache, "quantized", False):  # an 8-bit memory: the decode kernel reads it
                out = self._read_8bit(q, cache, attn_mask, key_mask, seqlens_k)
                return self.out_proj(out.reshape(b, s, self.n_heads * self.head_dim))
            k, v = cache.k[:, : cache.pos], cache.v[:, : cache.pos]  # (B, S_k, H_k, D)
        else:
            sk = src.shape[1]
            k = self.k_proj(src).view(b, sk, self.n_kv_heads, self.head_dim)  # (B, S_k, H_k, D)
            v = self.v_proj(src).view(b, sk, self.n_kv_heads, self.head_dim)
            offset = cache.pos if (cache is not None and not self.cross) else 0
            if self.rope is not None:
                q, k = self.rope(q, offset), self.rope(k, offset)
            if getattr(cache, "quantized", False):
                if cache.static:  # a cross-attention memory, quantized once, then read like the steps
                    cache.append(k, v)
                    out = self._read_8bit(q, cache, attn_mask, key_mask, seqlens_k)
                else:
                    out = self._quantized_cache(q, k, v, cache, quant, attn_mask, key_mask, seqlens_k)
                return self.out_proj(out.reshape(b, s, self.n_heads * self.head_dim))
            if cache is not None:
                k, v = cache.append(k, v)
        # without a cache the queries are the sequence's own rows (top-left: with seqlens_k,
        # bottom-right would line the last query up with the last real key instead)
        kernel, opts = self._kernel(q, k, self._fused_opts(attn_mask, key_mask, seqlens_k,
                                                           bottom_right=cache is not None))
        if quant is not None:
            opts["qk_quant"] = quant
        p = c.dropout if self.training else 0.0
        if self.keep_weights:
            out, lse = kernel(q, k, v, dropout_p=p, return_lse=True, **opts)
            self.last_weights = self._weights(q, k, lse, opts).detach()
        else:
            out = kernel(q, k, v, dropout_p=p, **opts)
        return self.out_proj(out.reshape(b, s, self.n_heads * self.head_dim))  # (B, S, d_model)

    def _context_parallel(self, q: Tensor, x: Tensor, cp: "ContextParallel") -> Tensor:
        """Context-parallel self-attention of this rank's shard: q (B, n, H, D), x (B, n, d_model)
        -> (B, n, H, D). RoPE rotates at the shard's global positions; causal, window and ALiBi
        are applied on global positions by context_parallel_attention; K/V of the other shards
        arrive by cp.mode's collectives."""
        from ..distributed.attention import context_parallel_attention

        c = self.config
        if c.attention_type != "softmax":
            raise NotImplementedError(f"context_parallel needs attention_type='softmax', got {c.attention_type!r}")
        b, n = x.shape[:2]
        k = self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim)  # (B, n, H_k, D)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim)
        if self.rope is not None:
            pos = cp.positions(n, x.device).expand(b, n)  # (B, n) global positions
            q, k = self.rope(q, pos), self.rope(k, pos)
        p = c.dropout if self.training else 0.0
        return context_parallel_attention(q, k, v, group=cp.group, mode=cp.mode, shard_layout=cp.shard_layout,
                                          causal=c.causal, window_size=c.window, alibi_slopes=self.alibi_slopes,
                                          softcap=c.softcap, sinks=self.sinks, layout="bshd", dropout_p=p,
                                          cu_seqlens=cp.cu_seqlens, check_ranks=cp.check_ranks)

    def _quantized_cache(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache, quant: Optional[str],
                         attn_mask: Optional[Tensor], key_mask: Optional[Tensor],
                         seqlens_k: Optional[Tensor]) -> Tensor:
        """Self-attention through an 8-bit KVCache: the new rows k, v (B, S, H_k, D) are quantized
        into it; a prefill from empty attends over them with the fused kernel (unquantized, masks
        included), a step over the cached rows reads the 8-bit rows (_read_8bit). Returns
        (B, S, H, D)."""
        c = self.config
        if self.cross or self.keep_weights or c.dropout and self.training:
            raise NotImplementedError("an 8-bit KVCache serves self-attention without dropout or keep_weights "
                                      "(generation); use a float cache for those")
        fresh = cache.pos == 0
        cache.append(k, v)
        if fresh:
            kernel, opts = self._kernel(q, k, self._fused_opts(attn_mask, key_mask, seqlens_k))
            return kernel(q, k, v, **opts, **({"qk_quant": quant} if quant else {}))
        return self._read_8bit(q, cache, attn_mask, key_mask, seqlens_k)

    def _read_8bit(self, q: Tensor, cache: KVCache, attn_mask: Optional[Tensor], key_mask: Optional[Tensor],
                   seqlens_k: Optional[Tensor]) -> Tensor:
        """q (B, S, H, D) over the `pos` rows of an 8-bit KVCache (a memory, or a self-attention
        cache after its new rows were appended) -> (B, S, H, D), as the layer over a float cache
        holding the dequantized rows would compute it.

        The decode kernel reads the bytes when the keys each sequence sees are one run of rows:
        no mask, seqlens_k, or a key_mask whose real keys are contiguous per sequence (left or
        right padding: the run's start goes in as the kernel's leftpad). With causal, a window or
        ALiBi the run must end at the last row (left padding), where the kernel's bottom-right
        diagonal is the fused op's. Any other mask (attn_mask, a key_mask with holes) runs the
        fused kernel over the dequantized rows (a float copy of the cache per call)."""
        c = self.config
        if self.keep_weights or c.dropout and self.training:
            raise NotImplementedError("an 8-bit KVCache is read without dropout or keep_weights; use a float "
                                      "cache for those")
        causal = c.causal and not self.cross
        run = None
        if attn_mask is None and key_mask is not None:
            run = key_mask_run(key_mask, cache.pos)
            positional = causal or tuple(c.window) != (-1, -1) or self.alibi_slopes is not None
            if run is not None and positional and not bool(((run[1] == cache.pos) | (run[1] == 0)).all()):
                run = None
        if attn_mask is None and (key_mask is None or run is not None) and self._decode_kernel_ok():
            lengths, leftpad = seqlens_k, None
            if run is not None:
                leftpad, lengths = run[0], run[1] if seqlens_k is None else torch.minimum(
                    run[1], seqlens_k.to(device=run[1].device, dtype=torch.int32))
            return cache.attend(q, scale=self.head_dim ** -0.5, causal=causal, window=c.window,
                                alibi_slopes=self.alibi_slopes, sinks=self.sinks, softcap=c.softcap, lengths=lengths,
                                leftpad=leftpad)
        k, v = cache.dequantized(q.dtype)
        kernel, opts = self._kernel(q, k, self._fused_opts(attn_mask, key_mask, seqlens_k))
        return kernel(q, k, v, **opts)

    def _paged(self, q: Tensor, x: Tensor, cache) -> Tensor:
        """Self-attention through a PagedKVCache (nn/paged_cache.py) over its selected sequences:
        each at its own position. A prefill from empty attends over its own rows with the fused
        kernel; a step over cached rows is attention_ext.decode.decode_fwd (GQA unrepeated, causal
        aligned bottom-right). Returns (b, S, H, D)."""
        c = self.config
        if not self._decode_kernel_ok():
            raise NotImplementedError(f"attention_type={c.attention_type!r} does not step through a PagedKVCache (its "
                                      "steps and ragged prefills run dense attention kernels); generate with a "
                                      "contiguous KVCache")
        b, s = x.shape[:2]
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)  # (B, S, H_k, D)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        if self.rope is not None:
            pos = cache.positions()  # (B,) each sequence's own offset
            q, k = self.rope(q, pos), self.rope(k, pos)
        fresh = cache.empty()
        if cache.packed is not None and not fresh:  # refused before anything is written
            raise ValueError("a packed (ragged) call through a PagedKVCache is a prefill of sequences with no rows "
                             "yet; step sequences that hold rows unpacked (select(rows) without packed)")
        cache.append(k, v)
        if fresh and cache.packed is not None:  # a ragged prefill packed into one row: varlen attention
            cu = torch.tensor([0] + cache.packed, device=x.device).cumsum(0).to(torch.int32)
            n = max(cache.packed)
            return attention_varlen(q[0], k[0], v[0], cu, cu, n, n, causal=c.causal, bottom_right=True,
                                    window=c.window, alibi_slopes=self.alibi_slopes, softcap=c.softcap,
                                    sinks=self.sinks)[None]  # (1, total, H, D)
        if fresh:
            kernel, opts = self._kernel(q, k, self._fused_opts())
            return kernel(q, k, v, **opts)
        return cache.attend(q, scale=self.head_dim ** -0.5, causal=c.causal, window=c.window,
                            alibi_slopes=self.alibi_slopes, sinks=self.sinks, softcap=c.softcap)

    def _fused_opts(self, attn_mask: Optional[Tensor] = None, key_mask: Optional[Tensor] = None,
                    seqlens_k: Optional[Tensor] = None, bottom_right: bool = True) -> dict:
        """The fused op's options for this layer: causal / window / ALiBi aligned bottom-right
        (with a cache the new queries are the last rows; with seqlens_k the last real key of each
        sequence) or top-left (a whole padded sequence: query i is key i), the masks as given."""
        c = self.config
        return dict(causal=c.causal and not self.cross, bottom_right=bottom_right, window=c.window, attn_mask=attn_mask,
                    key_mask=key_mask, seqlens_k=seqlens_k, alibi_slopes=self.alibi_slopes, softcap=c.softcap,
                    sinks=self.sinks)

    def _kernel(self, q: Tensor, k: Tensor, opts: dict) -> Tuple[Callable, dict]:
        """The kernel for q (B, S_q, H, D), k (B, S_k, H_k, D) and its keyword options; a subclass
        adds its own (nn/sparse.py: the layout)."""
        return ATTENTION_TYPES[self.config.attention_type], opts

    def _decode_kernel_ok(self) -> bool:
        """Whether a step may read a cache with the decode kernel (cache.attend), which computes
        dense softmax attention: the "softmax" and "sdpa" types; a kernel registered under another
        name, or a layer with a rule of its own (nn/sparse.py), runs its kernel over the cache's
        rows instead (a PagedKVCache refuses it)."""
        return self.config.attention_type in ("softmax", "sdpa")

    def _weights(self, q: Tensor, k: Tensor, lse: Tensor, opts: dict) -> Tensor:
        """The (B, H, S_q, S_k) probabilities of the kernel's call, from its LSE (which holds the
        sinks: each row sums to 1 minus the sink's share)."""
        return attention_weights(q, k, lse, layout="bshd", **opts)


# ----------------------------------------------------------------------------------------------
# Attention types with a module of their own: name -> class(config, cross=False), with a
# classmethod allocate_cache(config, batch, max_len, *, device, dtype, static) for generation.
def init_projections(m: nn.Module, c: "AttentionConfig", cross: bool) -> None:
    """The q / k / v / out projections and RoPE every attention layer type shares: q from d_model
    to (n_heads * head_dim), k and v from the memory's width (kv_dim, cross-attention) or d_model
    to (n_kv_heads * head_dim), out back to d_model. RoPE and ALiBi encode positions within one
    sequence, so cross-attention gets neither."""
    m.n_heads, m.n_kv_heads, m.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
    kv_in = (c.kv_dim or c.d_model) if cross else c.d_model
    m.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=c.bias)
    m.k_proj = nn.Linear(kv_in, c.n_kv_heads * c.head_dim, bias=c.bias)
    m.v_proj = nn.Linear(kv_in, c.n_kv_heads * c.head_dim, bias=c.bias)
    m.out_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=c.bias)
    m.rope = RotaryEmbedding(c.head_dim, c.rope_base) if (c.positional == "rope" and not cross) else None


ATTENTION_MODULES: Dict[str, type] = {}


def make_attention(config: AttentionConfig, cross: bool = False) -> nn.Module:
    """The attention layer of `config.attention_type`: its registered module, else Attention."""
    return ATTENTION_MODULES.get(config.attention_type, Attention)(config, cross=cross)


def allocate_cache(config: AttentionConfig, batch: int, max_len: int, *, device: Device = None,
                   dtype: torch.dtype = torch.float32, static: bool = False) -> Any:
    """The generation cache of one layer: a preallocated KVCache, or what the type's module keeps
    (a recurrent state for "linear")."""
    cls = ATTENTION_MODULES.get(config.attention_type)
    if cls is not None:
        return cls.allocate_cache(config, batch, max_len, device=device, dtype=dtype, static=static)
    return KVCache(batch, max_len, config.n_kv_heads, config.head_dim, device=device, dtype=dtype, static=static)
