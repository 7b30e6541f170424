"""Hugging Face transformers integration: attention_ext as an `attn_implementation`.

    import attention_ext.integrations.transformers as ae_hf
    ae_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attention_ext")
    model.set_attn_implementation("attention_ext")        # or switch an existing model

transformers is imported inside register() only, so this module imports without it.

Design: the masks are SDPA's (masking_utils.sdpa_mask, registered under our name), and the
attention function reads them with SDPA's semantics (integrations/sdpa_attention.py), so every
model that runs on "sdpa" gets the same attention pattern here:
- mask None, q_len > 1 and is_causal: causal, top-left aligned. sdpa_mask only drops the mask when
  q_len == kv_len, or the cache is empty (q_offset 0; the keys past q_len are a static cache's
  unwritten slots, which top-left causality hides), so top-left is exact where a mask is absent.
- mask None, q_len == 1 (decode with no padding; on a sliding layer only while the cache is
  shorter than the window): every key is visible.
- a mask: a 4-D bool (B, 1, Sq, Sk) (True = attend; or a caller's float mask, added to the
  scores), passed as attn_mask. It already holds causality, padding, the sliding window and
  packed sequences at HF's absolute positions (q_offset, kv_offset). The attention function does
  not receive those offsets, so `sliding_window` is not turned into the kernel's window: with a
  static cache (queries not ending at the last key slot) its bottom-right diagonal would differ
  from HF's. Recognizing a key-padding + causal mask to pass seqlens_k instead would read the
  mask's values (a host sync, and a graph break under torch.compile): not done. Nor is the
  kernel's causal flag added on top of a mask: or-overlays (bidirectional image-token blocks)
  let a query see later keys in a model whose attention is otherwise causal.
- softcap (Gemma 2) and s_aux (GPT-OSS sinks, (H,)) go to the kernel: HF applies the softcap to
  the scaled scores before the mask, and the sink as an extra softmax logit, as the kernel does.
- position_bias (T5 and its relatives, WavLM, LayoutLMv3: a learned additive score bias) is read
  as SDPA reads it (create_position_bias_mask): a float mask added to the scores, keeping the
  gradient that trains the bias; a bool mask's False entries become -inf in it, a float mask is
  added to it. Where no mask came, causality stays the kernel's causal flag (top-left, as above),
  which composes with the bias.
- GQA runs with no repeat of k / v (H % H_k == 0).
- A value head dim other than the query / key one (DeepSeek's MLA: 192 and 128) runs on zero
  columns appended to the narrower side (q . k and P v are unchanged by them, the scale stays
  the query head dim's) and the output cut back to the value's width: a copy, exact.
- Head dims above the kernels' 256 (Gemma 4's and DeepSeek-V4's 512-wide global layers) raise
  NotImplementedError: the kernel's own "head dim must be in [1, 256]" plus the layer and the
  implementation to load instead. No silent fallback to another implementation, which would hide
  that the model does not run on these kernels.
A fully masked query row (a left-padded position) gives 0 here; SDPA's value there is
implementation-defined, and HF ignores those positions.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["register", "attention_forward", "DEFAULT_NAME"]

DEFAULT_NAME = "attention_ext"


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs: Any,
) -> Tuple[Tensor, Optional[Tensor]]:
    """The attention function registered with transformers.AttentionInterface.

    Args:
        module: the calling attention module (its `is_causal` is the default for `is_causal`).
        query: (B, H, Sq, D); key: (B, H_k, Sk, D), value: (B, H_k, Sk, Dv), H % H_k == 0.
        attention_mask: None, or the (B, 1, Sq, Sk) mask built by sdpa_mask (bool, True =
            attend), or a caller's 4-D float mask (added to the scores).
        dropout: the probability's dropout rate (the model passes 0.0 outside training).
        scaling: the score scale, default 1 / sqrt(D).
        is_causal: overrides module.is_causal; used only where the mask is None (as SDPA).
        sliding_window: ignored: the mask holds the window (see the module docstring).
        softcap: logit soft-capping (Gemma 2), None or 0 = none.
        s_aux: (H,) attention-sink logits (GPT-OSS), in the model's dtype; attention() casts them
            to the kernel's float side dtype (float32; float64 for float64), keeping the gradient.

    kwargs: position_bias (T5 and its relatives: an additive score bias broadcastable to
        (B, H, Sq, Sk), gets a gradient; see the module docstring); output_attentions; the rest
        (the model's TransformersKwargs) is not read.

    Returns (out (B, Sq, H, Dv) contiguous, None), or with output_attentions=True the probabilities
    (B, H, Sq, Sk) in q's dtype in place of None, recomputed from the kernel's LSE (one more Q K^T):
    only without dropout and without autograd (the LSE carries no gradient), else
    NotImplementedError, as for head_mask.
    """
    from .. import attention, attention_weights  # deferred: attention_ext imports nothing from here

    want_weights = bool(kwargs.get("output_attentions"))
    if want_weights and (dropout > 0.0 or (torch.is_grad_enabled() and
                                           any(t.requires_grad for t in (query, key, value)))):
        raise NotImplementedError("attention_ext returns attention weights (output_attentions=True) only without "
                                  "dropout and gradients; use attn_implementation='eager' for them")
    if kwargs.get("head_mask") is not None:
        raise NotImplementedError("attention_ext does not support `head_mask` in the transformers integration; "
                                  "use attn_implementation='eager' for it")
    sq = query.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # SDPA's rule (sdpa_attention_forward): causal only with no mask and more than one query
    causal = bool(is_causal) and attention_mask is None and sq > 1
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:  # one additive float mask (module docstring); `causal` read the caller's mask
        if attention_mask is None:
            attention_mask = position_bias
        elif attention_mask.dtype == torch.bool:
            attention_mask = torch.where(attention_mask, position_bias, float("-inf"))
        else:
            attention_mask = position_bias + attention_mask
    softcap = float(softcap or 0.0)
    dv, dqk = value.shape[-1], query.shape[-1]
    if dv != dqk:  # zero columns to one width (module docstring); the scale stays q's
        scaling = scaling if scaling is not None else dqk ** -0.5
        width = max(dv, dqk)
        query, key, value = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
    try:
        out = attention(query, key, value, layout="bhsd", scale=scaling, causal=causal, bottom_right=False,
                        attn_mask=attention_mask, softcap=softcap, sinks=s_aux, dropout_p=float(dropout),
                        return_lse=want_weights)
    except ValueError as e:  # the kernels' head-dim rule (stated in C++) names no layer nor a way out
        if "head dim must be in" not in str(e):
            raise
        raise NotImplementedError(
            f"{e}; {type(module).__name__} has query / key head dim {dqk} and value head dim {dv}: load "
            "(or set_attn_implementation) this model with attn_implementation='sdpa' or 'eager'") from e
    weights = None
    if want_weights:  # the LSE holds the sink term, so exp(s - lse) is GPT-OSS's sink-less probability too
        out, lse = out
        weights = attention_weights(query, key, lse, scale=scaling, causal=causal, attn_mask=attention_mask,
                                    softcap=softcap, sinks=s_aux).to(query.dtype)
    return out[..., :dv].transpose(1, 2).contiguous(), weights  # (B, Sq, H, Dv), (B, H, Sq, Sk) or None


def _is_attention_forward(fn: Any) -> bool:
    """Whether `fn` is this module's attention_forward, also as a reloaded module's copy."""
    return getattr(fn, "__module__", None) == __name__ and getattr(fn, "__qualname__", None) == "attention_forward"


def register(name: str = DEFAULT_NAME) -> None:
    """Register attention_ext with transformers under `name`: the attention function in
    AttentionInterface and SDPA's mask builder (masking_utils.sdpa_mask: a 4-D bool mask, or None
    when causality alone describes it) in AttentionMaskInterface. Then
    `attn_implementation=name` selects it (from_pretrained / from_config / set_attn_implementation).
    Idempotent. Raises ImportError when transformers is missing or older than 4.53 (the first with
    masking_utils.AttentionMaskInterface; AttentionInterface alone is older).

    `name` must be a new one: transformers' registries are process-wide, so taking "eager", "sdpa",
    a flash / flex name or another library's name would swap that implementation (and its mask
    builder) under every model, the reference runs included, and code that still runs its own
    eager path (GPT-2's reorder_and_upcast_attn) would add our bool masks to its scores. A name
    with "/" is read by transformers as a Hub kernel repository and a "paged|" prefix is stripped,
    so neither would reach this function. Each raises ValueError (TypeError for a non-str).
    """
    if not isinstance(name, str):
        raise TypeError(f"register(name=...): name must be a str, got {type(name).__name__}; "
                        f"the default is {DEFAULT_NAME!r}")
    if not name or "/" in name or name.startswith("paged|"):
        raise ValueError(f"register(name=...): got {name!r}; transformers reads a name with '/' as a Hub kernel "
                         "repository and strips a 'paged|' prefix, and an empty name selects nothing: pass a plain "
                         f"name such as {DEFAULT_NAME!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError("attention_ext.integrations.transformers needs transformers >= 4.53 (AttentionInterface "
                          "and masking_utils.AttentionMaskInterface): pip install \"transformers>=4.53\"") from e
    fn, mask_fn = AttentionInterface().get(name), AttentionMaskInterface().get(name)
    if name == "eager" or (fn is not None and not _is_attention_forward(fn)) or (
            mask_fn is not None and mask_fn is not sdpa_mask):
        raise ValueError(f"register(name=...): {name!r} is already a transformers attention implementation "
                         "(its own, or another library's); registering over it would replace it for every model "
                         f"in this process. Pick a new name, e.g. register({DEFAULT_NAME!r})")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
