"""`MultiheadAttention`: a drop-in for `torch.nn.MultiheadAttention` that runs our fused kernel.

Same constructor, forward, conventions and state_dict keys as torch's, so a torch module's
state_dict loads into it unchanged:
  - `key_padding_mask` (N, S): bool True = ignore that key, or float added to the scores;
  - `attn_mask` (L, S) or (N * num_heads, L, S): bool True = NOT allowed, or float added;
  - `is_causal`: a hint that attn_mask is the causal mask (top-left aligned), which lets the
    kernel skip the masked blocks instead of reading a mask. As in torch, the hint needs the mask:
    is_causal=True without attn_mask raises RuntimeError.
`need_weights=True` returns the real probabilities, recomputed from the kernel's log-sum-exp
(one extra q @ k^T), averaged over heads unless `average_attn_weights=False`. With dropout in
training they are the probabilities before dropout (torch returns them after). A query that
sees no key (every key padded or masked) gets output 0 and weights 0, the library's rule, where
torch gives NaN on its need_weights path (and 0 on its fused one). When is_causal=True comes with
an attn_mask, the mask is what is applied (torch's hint path may differ from its own mask path
then, e.g. with add_bias_kv).

Bad inputs raise a ValueError (shapes) or TypeError (dtypes) that names the argument, where
torch's module mostly asserts (AssertionError) or fails inside a reshape; a mask of another
dtype than bool or float is refused, as torch refuses it.

Inside torch's own layers (`nn.TransformerEncoderLayer`, `TransformerDecoderLayer`,
`TransformerEncoder`) it keeps running our kernel:
  - torch's encoder-layer fast path (eval, no grad) would call `torch._transformer_encoder_layer_fwd`
    with our weights and bypass our forward; torch skips that path when a submodule has forward
    hooks, so the module carries a no-op forward pre-hook (`_keep_our_forward`);
  - `TransformerEncoder(enable_nested_tensor=True)` turns a padded batch into a nested tensor
    before its layers: nested (N, *, E) inputs run here on their padded form with the lengths as
    the key padding mask, and come back nested.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import not_a_tensor
from ..softmax import attention, attention_weights


def _append_column(mask: Optional[Tensor]) -> Optional[Tensor]:
    """Adds one allowed key column (0 for float, False = not masked for bool), like torch's pad."""
    if mask is None:
        return None
    return torch.cat([mask, mask.new_zeros(mask.shape[:-1] + (1,))], dim=-1)


def _keep_our_forward(module: nn.Module, args) -> None:
    """A forward pre-hook that does nothing. torch's TransformerEncoderLayer takes its fused fast
    path only when no submodule has forward hooks (the fused kernel would skip them), so with it
    the layer calls our forward, hence our kernel."""
    return None


def _unnest(x: Tensor) -> Tuple[Tensor, Tensor]:
    """A nested (N, *, E) tensor -> its zero-padded (N, S, E) form and the (N,) lengths."""
    lengths = torch.tensor([t.shape[0] for t in x.unbind()], dtype=torch.long, device=x.device)
    return torch.nested.to_padded_tensor(x, 0.0), lengths


class MultiheadAttention(nn.Module):
    __constants__ = ["batch_first"]

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device=None, dtype=None):
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be > 0, got {embed_dim} and {num_heads}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        factory = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads

        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))  # [W_q; W_k; W_v]
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()
        self.register_forward_pre_hook(_keep_our_forward)

    def _reset_parameters(self) -> None:
        # torch's init, so that a seeded model starts from the same weights
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        e = self.embed_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.split(e)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.split(e)
        if self._qkv_same_embed_dim and query is key and key is value:
            return F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)  # self-attention: one GEMM
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def merge_masks(self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], query: Tensor):
        """torch's fast paths call this right before running torch's own fused attention on this
        module's weights. Our forward pre-hook keeps torch's TransformerEncoderLayer off that path;
        a torch whose fast path ignores hooks reaches this instead, and is told what to do rather
        than silently running another kernel."""
        raise RuntimeError("attention_ext.nn.MultiheadAttention: this torch's TransformerEncoderLayer fast path would "
                           "run torch's fused attention instead of attention_ext's kernel; call "
                           "torch.backends.mha.set_fastpath_enabled(False) (or upgrade torch)")

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
                need_weights: bool = True, attn_mask: Optional[Tensor] = None,
                average_attn_weights: bool = True, is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        if is_causal and attn_mask is None:  # torch's rule and error type: is_causal is a hint about attn_mask
            raise RuntimeError("attention_ext.nn.MultiheadAttention: is_causal=True is a hint that attn_mask is the "
                               "causal mask, and needs that mask: pass attn_mask=nn.Transformer."
                               "generate_square_subsequent_mask(L) with it")
        if not (isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)):
            self._check_inputs(query, key, value)  # names the argument that is not a Tensor
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights, attn_mask,
                                        average_attn_weights, is_causal)
        self._check_inputs(query, key, value)
        unbatched = query.dim() == 2
        if unbatched:  # (L, E) -> (1, L, E)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        out, weights = self._attend(query, key, value, key_padding_mask, need_weights, attn_mask,
                                    average_attn_weights, is_causal)
        if unbatched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (L, N, E)
        return out, weights

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """The shapes, dtypes and device the projections need, checked up front: past here a bad
        input fails inside a reshape or a matmul with a message that names no argument."""
        p = "attention_ext.nn.MultiheadAttention"
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise not_a_tensor(name, t, p)
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(f"{p}: query, key and value must all be 3-D (batched) or all 2-D (unbatched), got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        for name, t, e in (("query", query, self.embed_dim), ("key", key, self.kdim), ("value", value, self.vdim)):
            if t.shape[-1] != e:
                raise ValueError(f"{p}: {name} must have {e} features (the module's "
                                 f"{'embed_dim' if name == 'query' else name[0] + 'dim'}), got {tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"{p}: key and value must have the same batch and length, got {tuple(key.shape)} and "
                             f"{tuple(value.shape)}")
        bdim = 0 if self.batch_first else 1
        if query.dim() == 3 and query.shape[bdim] != key.shape[bdim]:
            raise ValueError(f"{p}: query and key must have the same batch size (dim {bdim}), got "
                             f"{tuple(query.shape)} and {tuple(key.shape)}")
        w = self.out_proj.weight
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.device != w.device:
                raise ValueError(f"{p}: {name} must be on the module's device {w.device}, got {t.device}")
            if not t.is_floating_point():  # a dtype other than the weights' stays legal: autocast
                raise TypeError(f"{p}: {name} must be floating point, got {t.dtype}")
            if t.dtype != query.dtype:
                raise TypeError(f"{p}: {name} must have query's dtype {query.dtype}, got {t.dtype}")

    def _check_masks(self, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], n: int, l: int,
                     s: int) -> None:
        """The masks' dtypes and shapes, by torch's rules (a 2-D attn_mask may also broadcast to
        (L, S)): past here a bad mask fails inside a view, or a mask of integers would be added to
        the scores as numbers."""
        p = "attention_ext.nn.MultiheadAttention"
        for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if m is not None and m.dtype != torch.bool and not m.is_floating_point():
                raise TypeError(f"{p}: {name} must be bool or floating point (bool True = masked out, float "
                                f"added to the scores), got {m.dtype}")
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (n, s):
            raise ValueError(f"{p}: key_padding_mask must be (N, S) = {(n, s)} (or (S,) unbatched), True = padding, "
                             f"got {tuple(key_padding_mask.shape)}")
        if attn_mask is not None:
            if attn_mask.dim() not in (2, 3) or (attn_mask.dim() == 3 and
                                                 tuple(attn_mask.shape) != (n * self.num_heads, l, s)):
                raise ValueError(f"{p}: attn_mask must be (L, S) = {(l, s)} or (N * num_heads, L, S) = "
                                 f"{(n * self.num_heads, l, s)}, got {tuple(attn_mask.shape)}")

    def _forward_nested(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                        need_weights: bool, attn_mask: Optional[Tensor], average_attn_weights: bool,
                        is_causal: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """Nested (N, *, E) inputs, batch first whatever batch_first says (as torch's nested
        tensors are): attention on the zero-padded batch, the key lengths as the padding mask.
        Returns out nested like query, and the weights padded (N, L, S) (zero past the lengths)."""
        if key_padding_mask is not None or attn_mask is not None:
            raise ValueError("attention_ext.nn.MultiheadAttention: nested inputs carry their own padding; pass no "
                             "key_padding_mask or attn_mask with them")
        if key.is_nested != value.is_nested or key.dim() != 3 or query.dim() != 3:
            raise ValueError("attention_ext.nn.MultiheadAttention: key and value must both be nested (N, *, E) "
                             "or both be padded (N, S, E) tensors")
        q_pad, q_len = _unnest(query) if query.is_nested else (query, None)
        if key is query:
            k_pad, k_len = q_pad, q_len
        else:
            k_pad, k_len = _unnest(key) if key.is_nested else (key, None)
        v_pad = k_pad if value is key else (_unnest(value)[0] if value.is_nested else value)
        if not self.batch_first and not key.is_nested:  # a padded key / value is (S, N, E) then
            k_pad, v_pad = k_pad.transpose(0, 1), v_pad.transpose(0, 1)
        if not self.batch_first and not query.is_nested:
            q_pad = q_pad.transpose(0, 1)
        kpm = None
        if k_len is not None:  # (N, S) True = padding, torch's convention
            kpm = torch.arange(k_pad.shape[1], device=k_pad.device).unsqueeze(0) >= k_len.unsqueeze(1)
        out, weights = self._attend(q_pad, k_pad, v_pad, kpm, need_weights, None, average_attn_weights, is_causal)
        if q_len is None:
            return (out if self.batch_first else out.transpose(0, 1)), weights
        rows = [out[i, :n] for i, n in enumerate(q_len.tolist())]
        return torch.nested.as_nested_tensor(rows, layout=query.layout), weights

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor],
                need_weights: bool, attn_mask: Optional[Tensor], average_attn_weights: bool,
                is_causal: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """(N, L, E) query, (N, S, E) key / value, torch's mask conventions -> out (N, L, E) and
        the weights (N, L, S) (or (N, H, L, S)) when asked."""
        n, l, _ = query.shape
        h, d = self.num_heads, self.head_dim
        self._check_masks(key_padding_mask, attn_mask, n, l, key.shape[1])
        q, k, v = self._project(query, key, value)  # (N, L, E), (N, S, E), (N, S, E)

        extra_key = self.bias_k is not None or self.add_zero_attn
        causal = bool(is_causal) and not extra_key  # the hint holds only without appended key columns
        if is_causal and extra_key and attn_mask is None:
            attn_mask = torch.triu(torch.ones(l, k.shape[1], dtype=torch.bool, device=q.device), diagonal=1)
        if causal:
            attn_mask = None  # the caller promises attn_mask is the causal mask
        if attn_mask is not None and attn_mask.dim() == 3:  # (N * H, L, S) -> (N, H, L, S)
            attn_mask = attn_mask.view(n, h, l, attn_mask.shape[-1])
        if self.bias_k is not None:
            # in k's dtype: under autocast the projections are 16-bit and the parameters float32
            k = torch.cat([k, self.bias_k.to(k.dtype).expand(n, 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.to(v.dtype).expand(n, 1, -1)], dim=1)
            attn_mask, key_padding_mask = _append_column(attn_mask), _append_column(key_padding_mask)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(n, 1, self.embed_dim)], dim=1)
            v = torch.cat([v, v.new_zeros(n, 1, self.embed_dim)], dim=1)
            attn_mask, key_padding_mask = _append_column(attn_mask), _append_column(key_padding_mask)
        s = k.shape[1]

        # torch's convention (True = masked out) -> ours (True = attend)
        kpm = None
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = ~attn_mask
        if key_padding_mask is not None:
            if key_padding_mask.dtype == torch.bool:
                kpm = ~key_padding_mask  # (N, S) True = valid
            else:  # a float key_padding_mask is additive: fold it into attn_mask
                add = key_padding_mask.to(q.dtype).view(n, 1, 1, s)
                if attn_mask is None:
                    attn_mask = add
                elif attn_mask.dtype == torch.bool:
                    attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                        ~attn_mask, float("-inf")) + add
                else:
                    attn_mask = attn_mask.to(q.dtype) + add

        q = q.view(n, l, h, d)  # (N, L, H, D)
        k = k.view(n, s, h, d)  # (N, S, H, D)
        v = v.view(n, s, h, d)
        opts = dict(layout="bshd", causal=causal, attn_mask=attn_mask, key_mask=kpm)
        p = self.dropout if self.training else 0.0
        # dropout 1 drops every weight, as in torch (attention() takes [0, 1)): the call runs
        # undropped and its output is zeroed, so its gradients are zero
        drop_all = p == 1.0
        weights = None
        if need_weights:
            out, lse = attention(q, k, v, dropout_p=0.0 if drop_all else p, return_lse=True, **opts)
            weights = attention_weights(q, k, lse, **opts)  # (N, H, L, S)
            if average_attn_weights:
                weights = weights.mean(dim=1)  # (N, L, S)
            weights = weights.to(q.dtype)  # torch's dtype: the inputs' (float32 sums before)
        else:
            out = attention(q, k, v, dropout_p=0.0 if drop_all else p, **opts)
        if drop_all:
            out = out * 0.0
        return self.out_proj(out.reshape(n, l, self.embed_dim)), weights  # (N, L, E)
