"""Drop-in for torch.nn.functional.scaled_dot_product_attention on the fused softmax kernel."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.nn.attention.bias import CausalBias, CausalVariant

from .._args import not_a_tensor
from ..softmax import ops
from ..softmax.functional import _plain_call, attention

__all__ = ["scaled_dot_product_attention"]

# torch's own SDPA for the shapes the fused kernel does not take, bound once: the builtin itself,
# not the F attribute, so that a caller who patches F.scaled_dot_product_attention with this
# drop-in (to run torch's own tests on it) does not send the fallback back here
_torch_sdpa = torch._C._nn.scaled_dot_product_attention


class SDPAInputError(RuntimeError, ValueError):
    """A bad input to the SDPA drop-in that the fused path finds (a mask that does not broadcast,
    a dropout_p out of range, ...): a RuntimeError, as torch's SDPA raises for it, and the
    ValueError attention_ext raises for the same input elsewhere."""


class SDPAInputTypeError(RuntimeError, TypeError):
    """SDPAInputError's kin for a wrong dtype (a mask of integers): RuntimeError and TypeError."""


def _causal_bias(mask: CausalBias, query: Tensor, key: Tensor, is_causal: bool) -> bool:
    """A torch.nn.attention.bias.CausalBias (causal_upper_left / causal_lower_right) read as
    what it stands for, never as a tensor: its storage is uninitialized, the object only carries
    the variant and the two lengths. Returns whether the diagonal is aligned bottom-right
    (lower-right with Sq != Sk); else the call is plain top-left causal."""
    if is_causal:  # torch's error and type
        raise ValueError("CausalBias should not be used with causal=True: attn_mask (causal_upper_left / "
                         "causal_lower_right) already makes the call causal; pass is_causal=False")
    sq, sk = query.size(-2), key.size(-2)
    if mask.seq_len_q != sq or mask.seq_len_kv != sk:
        raise RuntimeError(f"scaled_dot_product_attention: attn_mask is a causal bias for {mask.seq_len_q} queries "
                           f"and {mask.seq_len_kv} keys, but query has {sq} and key {sk}: build it with "
                           f"causal_upper_left({sq}, {sk}) or causal_lower_right({sq}, {sk})")
    return mask.variant == CausalVariant.LOWER_RIGHT and sq != sk


def _check_fallback_shapes(query: Tensor, key: Tensor, value: Tensor, gqa_heads: bool) -> None:
    """The shapes handed to torch's own SDPA, checked so that the error names the arguments:
    torch broadcasts the leading dims (each one size or 1), and its fused CPU kernel would read a
    value of another length than key's without a word. gqa_heads (enable_gqa): the heads dim
    (dim -3) is a GQA grouping, which torch checks."""
    if key.size(-2) != value.size(-2):
        raise SDPAInputError(f"scaled_dot_product_attention: key and value must have one length (dim -2), got key "
                             f"{tuple(key.shape)} and value {tuple(value.shape)}")
    shapes = [t.shape[:-2] for t in (query, key, value)]
    for i in range(2 if gqa_heads else 1, max(len(s) for s in shapes) + 1):
        want = 1
        for s in shapes:
            if len(s) >= i and s[-i] != 1:
                if want != 1 and s[-i] != want:
                    raise SDPAInputError(
                        f"scaled_dot_product_attention: the leading dims of query {tuple(query.shape)}, key "
                        f"{tuple(key.shape)} and value {tuple(value.shape)} do not broadcast (each dim before the "
                        f"last two must be one size or 1)")
                want = s[-i]


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, qk_quant: Optional[str] = None) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention: same arguments, conventions
    and error types.

    - A bool mask is True = attend, a float mask is added to the scores; is_causal is aligned
      top-left.
    - attn_mask may be torch's causal_upper_left / causal_lower_right object
      (torch.nn.attention.bias): causal aligned top-left / bottom-right, never read as a tensor.
      Its lengths must be query's and key's.
    - Size-1 dims broadcast as in torch: one key / value head serves every query head
      (multi-query attention) with or without enable_gqa.
    - (N, ..., L, E) inputs. 4-D inputs the kernel takes (one batch, query heads a multiple of
      key / value heads, q / k / v head dims equal and in [1, 256]) run the fused kernel; any
      other shape (broadcast leading dims, zero heads, Ev != E, ...) runs torch's own.
    - A bad input raises RuntimeError, as in torch; the errors of attention_ext's own checks are
      also ValueError / TypeError (SDPAInputError, SDPAInputTypeError). Beyond torch, a float
      mask of another float dtype than query's is taken, and key and value of different lengths
      are refused.
    - qk_quant="int8" (keyword, beyond torch): attention()'s int8 Q.K^T, for inference; only
      for inputs the fused kernel takes.
    """
    if (attn_mask is None and not dropout_p and qk_quant is None and type(query) is Tensor and type(key) is Tensor
            and (enable_gqa or key.dim() != 4 or key.size(1) in (1, query.size(1)))):
        # the plain call (no mask or dropout; GQA only when asked for): the op checks it, and
        # anything unusual (other shapes, a subclass, an error) takes the path below
        fast = _plain_call(query, key, value, "bhsd", scale, is_causal, False, (-1, -1), 0, False)
        if fast is not None:
            return fast[0]
    if not (isinstance(query, Tensor) and isinstance(key, Tensor) and isinstance(value, Tensor)):
        name, t = next((n, t) for n, t in (("query", query), ("key", key), ("value", value))
                       if not isinstance(t, Tensor))
        raise not_a_tensor(name, t, "scaled_dot_product_attention")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise RuntimeError(
            f"Expected query, key, and value to have the same dtype, but got query.dtype: {query.dtype} "
            f"key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if not query.is_floating_point():  # torch's own would fail deep inside a matmul, naming no argument
        raise RuntimeError(f"scaled_dot_product_attention: query, key and value must be floating point, got "
                           f"{query.dtype}")
    if query.device != key.device or query.device != value.device:
        raise RuntimeError(
            f"Expected query, key, and value to have the same device type, but got query.device: {query.device} "
            f"key.device: {key.device} and value.device: {value.device} instead.")
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise RuntimeError("scaled_dot_product_attention: query, key and value must have at least 2 dims")
    bottom_right = False
    if isinstance(attn_mask, CausalBias):  # before anything reads the object as a tensor
        bottom_right = _causal_bias(attn_mask, query, key, is_causal)
        attn_mask, is_causal = None, True
    elif is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
    if query.size(-1) != key.size(-1):
        raise RuntimeError(f"scaled_dot_product_attention: query and key head dims differ ({query.size(-1)} vs "
                           f"{key.size(-1)})")
    fused = False
    if query.dim() == 4 and key.dim() == 4 and value.dim() == 4:
        hq, hk = query.size(1), key.size(1)
        if hq != hk and hk != 1 and hq != 1:  # size-1 heads broadcast, as in torch
            if not enable_gqa:
                raise RuntimeError(f"scaled_dot_product_attention: number of heads in query ({hq}) and key ({hk}) "
                                   "differ; pass enable_gqa=True for grouped-query attention")
            if hk == 0 or hq % hk != 0:
                raise RuntimeError(f"scaled_dot_product_attention: number of heads in key/value ({hk}) must divide "
                                   f"the number of heads in query ({hq})")
        d = query.size(-1)
        # the kernel's shapes: q's heads a multiple of k's (MHA, GQA, MQA), one batch, k and v alike
        fused = (hq >= hk > 0 and hq % hk == 0 and 0 < d <= 256 and value.size(-1) == d
                 and query.size(0) == key.size(0) and key.shape[:3] == value.shape[:3]
                 and ops.has_kernel(query.device, query.dtype))
    if not fused:
        if qk_quant is not None:
            raise SDPAInputError(
                f"scaled_dot_product_attention: qk_quant={qk_quant!r} runs on the fused kernel only: 4-D query, key "
                f"and value with query heads a multiple of key heads and one head dim in [1, 256] (got query "
                f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)})")
        _check_fallback_shapes(query, key, value, enable_gqa)
        if bottom_right:  # torch's own takes the lower-right bias as its (Sq, Sk) bool mask
            sq, sk = query.size(-2), key.size(-2)
            attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril(sk - sq)
            is_causal = False
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    # dropout_p = 1 drops every weight: torch returns zeros (gradients zero); attention() takes
    # [0, 1), so the call runs undropped (checking every input) and is multiplied by the dropout
    drop_all = dropout_p == 1.0
    try:
        out = attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0 if drop_all else dropout_p,
                        causal=is_causal, bottom_right=bottom_right, scale=scale, qk_quant=qk_quant)
        return out * 0.0 if drop_all else out
    except (ValueError, TypeError) as e:  # torch's SDPA raises RuntimeError for every bad input
        if isinstance(e, RuntimeError):
            raise
        cls = SDPAInputTypeError if isinstance(e, TypeError) else SDPAInputError
        raise cls(*e.args).with_traceback(e.__traceback__) from None
