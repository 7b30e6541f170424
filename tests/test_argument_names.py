"""One meaning per argument name: every public function and method (found by signature, from the
public API that tests/test_api_docs.py walks) that takes one of the names below means by it what
the table says, and a value of another meaning raises an error that names the right argument.

    key_mask, memory_key_mask       (B, S_k) bool, True = a real key (flash-attn's and Hugging Face's sense)
    key_padding_mask, memory_...    torch's name: True = padding. Only nn.MultiheadAttention (torch's
                                    drop-in) reads it; every function that takes key_mask refuses it
                                    with a TypeError that says key_mask=~key_padding_mask
    attn_mask, memory_mask          bool True = attend (SDPA), float added to the scores;
                                    nn.MultiheadAttention keeps torch's bool True = NOT allowed
    window                          (left, right) keys around the diagonal, -1 = unbounded; an int is
                                    refused with the two pairs it may mean. Nothing else: the sparse
                                    layout builders' block count is window_blocks (test_window_has_one_meaning)
    window_blocks                   an int count of key blocks each side of the diagonal (the sparse layout
                                    builders); their old name `window` is refused, naming window_blocks
    window_size                     flash-attn's spelling of `window` (its drop-ins, context parallelism)
    scale, softmax_scale            multiplies q . k (default 1 / sqrt(D)); flash-attn's drop-ins spell it
                                    softmax_scale. Linear attention: multiplies phi(q) . phi(k) (default 1:
                                    the normalizer cancels it). Embeddings(scale=): a bool, scale by sqrt(d)
    layout                          the tensors' layout "bhsd" / "bshd", everywhere (test_layout_has_one_
                                    meaning); the old names layout_qkv (sparse) and qkv_layout (context
                                    parallelism) are refused, naming layout; a block layout or a sharding
                                    given as `layout` raises an error naming block_layout / shard_layout
    block_layout                    the sparse family's bool (H or 1, blocks_q, blocks_k) grid of computed blocks
    shard_layout                    context parallelism's sequence sharding "contiguous" / "zigzag" / "stripe";
                                    a tensor layout given to it raises an error naming layout. The
                                    sharding-only functions refuse their old name `layout`, naming shard_layout

Each table below maps (function, argument) to a check; test_every_use_is_checked fails when a
function gains one of these names without a row, so a new function cannot bring in another meaning
unseen.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

import attention_ext as ae
from tests.helpers import one_rank_group
from attention_ext import nn as aenn
from attention_ext.linear import reference as linear_ref
from attention_ext.softmax import reference as softmax_ref
from attention_ext.models.lm import LMConfig
from attention_ext.models.transformer import TransformerConfig, TransformerDecoder, TransformerEncoder
from attention_ext.sparse import layouts as L
from attention_ext.sparse.reference import block_sparse_attention_ref, topk_attention_ref
from tests.test_api_docs import API

F64 = torch.float64
NAMES = ("key_mask", "memory_key_mask", "key_padding_mask", "memory_key_padding_mask", "attn_mask", "memory_mask",
         "window", "window_size", "scale", "softmax_scale", "layout", "layout_qkv", "qkv_layout", "block_layout",
         "window_blocks", "shard_layout")


def _functions():
    """{"module.qualname": function} for every public function and public method (and __init__)
    of a public class of the API, each function once."""
    out = {}
    for obj in API.values():
        if inspect.isfunction(obj):
            fns = [obj]
        else:
            fns = [f for n, f in inspect.getmembers(obj, inspect.isfunction)
                   if not n.startswith("_") or n == "__init__"]
        for f in fns:
            if (f.__module__ or "").startswith("attention_ext"):
                out.setdefault(f"{f.__module__.removeprefix('attention_ext.')}.{f.__qualname__}", f)
    return out


FUNCTIONS = _functions()
USES = sorted((q, n) for q, f in FUNCTIONS.items() for n in inspect.signature(f).parameters if n in NAMES)


# ------------------------------------------------------------------ inputs
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _qkv(b=2, h=2, sq=5, sk=7, d=8, seed=0, layout="bhsd"):
    g = _gen(seed)
    shape = (lambda s: (b, h, s, d)) if layout == "bhsd" else (lambda s: (b, s, h, d))
    return tuple(torch.randn(shape(s), generator=g, dtype=F64) for s in (sq, sk, sk))


def _mask(*shape, seed=1):
    """A bool mask with a True and a False in every row (last dim), so that neither it nor its
    inverse hides a whole row."""
    m = torch.rand(*shape, generator=_gen(seed)) > 0.5
    m[..., 0], m[..., -1] = True, False
    return m


def _additive(m):
    """The float form of a bool True = attend mask: 0 where attended, -inf elsewhere."""
    return torch.zeros(m.shape, dtype=F64).masked_fill(~m, float("-inf"))


def _probs(q, k, allowed, scale=None):
    """softmax(scale q k^T) over the allowed keys, float64."""
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    return s.masked_fill(~allowed, float("-inf")).softmax(-1)


def _linear_ref(q, k, v, key_mask=None, eps=1e-6):
    """Non-causal normalized linear attention with phi = elu + 1, in float64: a padded key
    (key_mask False) adds nothing."""
    a = (F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)  # (B, H, S, S)
    if key_mask is not None:
        a = a * key_mask[:, None, None, :].to(a.dtype)
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


def _layer(attention_type="softmax", cross=True, causal=False):
    torch.manual_seed(0)
    cfg = aenn.AttentionConfig(d_model=16, n_heads=2, attention_type=attention_type, causal=causal)
    return aenn.make_attention(cfg, cross=cross).double().eval()


def _block(decoder=False):
    torch.manual_seed(0)
    cfg = aenn.BlockConfig(attn=aenn.AttentionConfig(d_model=16, n_heads=2, causal=decoder), d_ff=32, dropout=0.0)
    return (aenn.DecoderBlock if decoder else aenn.EncoderBlock)(cfg).double().eval()


def _transformer(decoder=False):
    torch.manual_seed(0)
    cfg = TransformerConfig(src_vocab_size=11, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
                            dropout=0.0)
    return (TransformerDecoder if decoder else TransformerEncoder)(cfg).double().eval()


def _x(b, s, seed):
    return torch.randn(b, s, 16, generator=_gen(seed), dtype=F64)


# ------------------------------------------------------------------ key_mask: True = a real key
# Each case returns (with the mask, the reference of that meaning, with the inverted mask).
def _km_softmax(call):
    def case():
        q, k, v = _qkv()
        m = _mask(2, 7)
        return call(q, k, v, m), F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None, None, :]), \
            call(q, k, v, ~m)
    return case


def _km_linear(call):
    def case():
        q, k, v = _qkv(sq=6, sk=6)
        m = _mask(2, 6)
        return call(q, k, v, m), _linear_ref(q, k, v, m), call(q, k, v, ~m)
    return case


def _km_weights():
    q, k, _ = _qkv()
    m = _mask(2, 7)
    run = lambda mm: ae.attention_weights(q, k, key_mask=mm)  # noqa: E731
    return run(m), _probs(q, k, m[:, None, None, :]), run(~m)


def _km_drop_keys(make, call):
    """A key mask on a module equals the module on the real keys alone (batch 1, no positions)."""
    def case():
        mod = make()
        x, mem, m = _x(1, 4, 2), _x(1, 7, 3), _mask(1, 7)
        with torch.no_grad():
            return call(mod, x, mem, m), call(mod, x, mem[:, m[0]], None), call(mod, x, mem, ~m)
    return case


def _km_self(make, call):
    """Self-attention with a key mask equals, at the real positions, the module on the real
    positions alone (per-position FFN and norms, no positions in the attention)."""
    def case():
        mod = make()
        x, m = _x(1, 7, 4), _mask(1, 7)
        with torch.no_grad():
            return call(mod, x, m)[:, m[0]], call(mod, x[:, m[0]], None), call(mod, x, ~m)[:, m[0]]
    return case


def _km_prefix(attention_type, refuses_inverse=False, causal=False):
    """Self-attention whose exact padding is right padding (Linformer projects the positions, LSH
    sorts them into chunks; Gated DeltaNet, causal, takes left padding too): a prefix key mask
    equals the module on the real positions alone. Linformer and LSH refuse a mask that is not a
    prefix (the inverse) with an error naming right padding; their polarity is then checked
    against the unmasked call."""
    def case():
        mod = _layer(attention_type, cross=False, causal=causal)
        x, m = _x(1, 7, 4), torch.arange(7).unsqueeze(0) < 5
        with torch.no_grad():
            got, want = mod(x, key_mask=m)[:, :5], mod(x[:, :5])
            if refuses_inverse:
                with pytest.raises(ValueError, match="right padding only"):
                    mod(x, key_mask=~m)
                return got, want, mod(x)[:, :5]
            return got, want, mod(x, key_mask=~m)[:, :5]
    return case


def _kw(name, m):
    return {} if m is None else {name: m}


_ONE_BLOCK = torch.ones(1, 1, 1, dtype=torch.bool)
KEY_MASK = {
    ("softmax.functional.attention", "key_mask"): _km_softmax(lambda q, k, v, m: ae.attention(q, k, v, key_mask=m)),
    ("softmax.functional.attention_weights", "key_mask"): _km_weights,
    ("sparse.functional.block_sparse_attention", "key_mask"): _km_softmax(
        lambda q, k, v, m: ae.block_sparse_attention(q, k, v, _ONE_BLOCK, block_size=16, key_mask=m)),
    ("sparse.functional.topk_attention", "key_mask"): _km_softmax(
        lambda q, k, v, m: ae.topk_attention(q, k, v, 7, key_mask=m)),
    ("sparse.reference.block_sparse_attention_ref", "key_mask"): _km_softmax(
        lambda q, k, v, m: block_sparse_attention_ref(q, k, v, _ONE_BLOCK, 16, key_mask=m)[0]),
    ("sparse.reference.topk_attention_ref", "key_mask"): _km_softmax(
        lambda q, k, v, m: topk_attention_ref(q, k, v, 7, key_mask=m)[0]),
    ("linear.functional.linear_attention", "key_mask"): _km_linear(
        lambda q, k, v, m: ae.linear_attention(q, k, v, key_mask=m)),
    ("linear.reference.linear_attention", "key_mask"): _km_linear(
        lambda q, k, v, m: linear_ref.linear_attention(q, k, v, feature_map=1, key_mask=m)[0]),
    ("distributed.linear.context_parallel_linear_attention", "key_mask"): _km_linear(
        lambda q, k, v, m: _cp(lambda: ae.distributed.context_parallel_linear_attention(q, k, v,
                                                                                          causal=False, key_mask=m))),
    ("nn.layers.Attention.forward", "key_mask"): _km_drop_keys(
        _layer, lambda mod, x, mem, m: mod(x, mem, **_kw("key_mask", m))),
    ("nn.linear.LinearAttention.forward", "key_mask"): _km_drop_keys(
        lambda: _layer("linear"), lambda mod, x, mem, m: mod(x, mem, **_kw("key_mask", m))),
    ("nn.linformer.LinformerAttention.forward", "key_mask"): _km_prefix("linformer", refuses_inverse=True),
    ("nn.lsh.LSHAttention.forward", "key_mask"): _km_prefix("lsh", refuses_inverse=True),
    ("nn.delta.GatedDeltaNet.forward", "key_mask"): _km_prefix("gated_delta", causal=True),
    ("nn.blocks.EncoderBlock.forward", "key_mask"): _km_self(_block, lambda mod, x, m: mod(x, **_kw("key_mask", m))),
    ("nn.blocks.DecoderBlock.forward", "key_mask"): _km_self(
        lambda: _block(decoder=True), lambda mod, x, m: mod(x, _x(1, 5, 5), **_kw("key_mask", m))),
    ("nn.blocks.DecoderBlock.forward", "memory_key_mask"): _km_drop_keys(
        lambda: _block(decoder=True), lambda mod, x, mem, m: mod(x, mem, **_kw("memory_key_mask", m))),
    ("models.transformer.TransformerEncoder.forward", "key_mask"): _km_self(
        _transformer, lambda mod, x, m: mod(x, **_kw("key_mask", m))),
    ("models.transformer.TransformerDecoder.forward", "key_mask"): _km_self(
        lambda: _transformer(decoder=True), lambda mod, x, m: mod(x, _x(1, 5, 5), **_kw("key_mask", m))),
    ("models.transformer.TransformerDecoder.forward", "memory_key_mask"): _km_drop_keys(
        lambda: _transformer(decoder=True), lambda mod, x, mem, m: mod(x, mem, **_kw("memory_key_mask", m))),
}


def _cp(call):
    with one_rank_group():
        return call()


def _mha_pair():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True).double().eval()
    ours = aenn.MultiheadAttention(16, 2, batch_first=True).double().eval()
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def _mha_key_padding_mask():
    """torch's meaning: True = padding, as torch.nn.MultiheadAttention reads it."""
    ours, ref = _mha_pair()
    x, p = _x(2, 7, 6), _mask(2, 7)
    with torch.no_grad():
        return ours(x, x, x, key_padding_mask=p)[0], ref(x, x, x, key_padding_mask=p)[0], \
            ours(x, x, x, key_padding_mask=~p)[0]


def _merge_masks_refuses():
    """torch's encoder fast path calls merge_masks to run torch's kernel on our weights: it
    raises instead, whatever the masks."""
    ours, _ = _mha_pair()
    x = _x(1, 3, 0)
    with pytest.raises(RuntimeError, match="fast path"):
        ours.merge_masks(None, torch.ones(1, 3, dtype=torch.bool), x)


# key_padding_mask with torch's meaning (True = padding): where it is read at all
TORCH_PADDING = {
    ("nn.multihead.MultiheadAttention.forward", "key_padding_mask"): _mha_key_padding_mask,
    ("nn.multihead.MultiheadAttention.merge_masks", "key_padding_mask"): _merge_masks_refuses,
}


def _check_meaning(got, want, inv):
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7)
    assert not torch.allclose(inv, want, atol=1e-6), "the inverted mask gave the same result: polarity untested"


@pytest.mark.parametrize("fn,name", sorted(KEY_MASK), ids=[f"{f}-{n}" for f, n in sorted(KEY_MASK)])
def test_key_mask_true_is_a_real_key(fn, name):
    _check_meaning(*KEY_MASK[(fn, name)]())


_OLD = [(f, n) for f, n in USES if n in ("key_padding_mask", "memory_key_padding_mask")]


@pytest.mark.parametrize("fn,name", _OLD, ids=[f"{f}-{n}" for f, n in _OLD])
def test_key_padding_mask_is_torchs_or_refused(fn, name):
    """Where key_padding_mask appears it means padding (torch's nn.MultiheadAttention) or is
    refused before anything else runs, with the new name and the flip in the message. The call
    below passes None for every other required argument: the refusal comes first."""
    if (fn, name) in TORCH_PADDING:
        r = TORCH_PADDING[(fn, name)]()
        if r is not None:
            _check_meaning(*r)
        return
    f = FUNCTIONS[fn]
    sig = inspect.signature(f)
    assert sig.parameters[name].default is None
    args = {p.name: None for p in sig.parameters.values()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    new = name.replace("_padding_mask", "_mask")
    with pytest.raises(TypeError, match=rf"takes {new} .*True = a real key.*pass {new}=~{name}"):
        f(**args, **{name: torch.ones(2, 3, dtype=torch.bool)})


def test_key_mask_is_refused_by_torchs_drop_in():
    """nn.MultiheadAttention keeps torch's signature: key_mask is not one of its arguments."""
    ours, _ = _mha_pair()
    x = _x(1, 3, 0)
    with pytest.raises(TypeError, match="key_mask"):
        ours(x, x, x, key_mask=torch.ones(1, 3, dtype=torch.bool))


# ------------------------------------------------------------------ attn_mask: bool True = attend
def _am_softmax(call):
    def case():
        q, k, v = _qkv()
        m = _mask(5, 7)
        return call(q, k, v, m), F.scaled_dot_product_attention(q, k, v, attn_mask=m), call(q, k, v, ~m)
    return case


def _am_weights():
    q, k, _ = _qkv()
    m = _mask(5, 7)
    return ae.attention_weights(q, k, attn_mask=m), _probs(q, k, m), ae.attention_weights(q, k, attn_mask=~m)


def _am_module(make, call, sq=4, sk=7):
    """A bool mask on a module against the same mask as 0 / -inf added to the scores."""
    def case():
        mod = make()
        m = _mask(sq, sk)
        with torch.no_grad():
            return call(mod, m), call(mod, _additive(m)), call(mod, ~m)
    return case


def _am_mha():
    """torch's meaning: bool True = NOT allowed, as torch.nn.MultiheadAttention reads it."""
    ours, ref = _mha_pair()
    x, m = _x(2, 7, 6), _mask(7, 7)
    with torch.no_grad():
        return ours(x, x, x, attn_mask=m)[0], ref(x, x, x, attn_mask=m)[0], ours(x, x, x, attn_mask=~m)[0]


def _am_linear_refuses():
    mod = _layer("linear")
    with pytest.raises(ValueError, match="attention_type='linear' takes no attn_mask"):
        mod(_x(1, 4, 0), _x(1, 7, 1), attn_mask=_mask(4, 7))


def _am_self_refuses(attention_type, causal=False):
    def case():
        mod = _layer(attention_type, cross=False, causal=causal)
        with pytest.raises(ValueError, match=f"attention_type='{attention_type}' takes no attn_mask"):
            mod(_x(1, 7, 0), attn_mask=_mask(7, 7))
    return case


_MEM = _x(1, 7, 3)
ATTN_MASK = {
    ("softmax.functional.attention", "attn_mask"): _am_softmax(lambda q, k, v, m: ae.attention(q, k, v, attn_mask=m)),
    ("softmax.functional.attention_weights", "attn_mask"): _am_weights,
    ("compat.sdpa.scaled_dot_product_attention", "attn_mask"): _am_softmax(
        lambda q, k, v, m: ae.scaled_dot_product_attention(q, k, v, attn_mask=m)),
    ("sparse.reference.block_sparse_attention_ref", "attn_mask"): _am_softmax(
        lambda q, k, v, m: block_sparse_attention_ref(q, k, v, _ONE_BLOCK, 16, attn_mask=m)[0]),
    ("nn.layers.Attention.forward", "attn_mask"): _am_module(
        _layer, lambda mod, m: mod(_x(1, 4, 2), _MEM, attn_mask=m)),
    ("nn.linear.LinearAttention.forward", "attn_mask"): _am_linear_refuses,
    ("nn.linformer.LinformerAttention.forward", "attn_mask"): _am_self_refuses("linformer"),
    ("nn.lsh.LSHAttention.forward", "attn_mask"): _am_self_refuses("lsh"),
    ("nn.delta.GatedDeltaNet.forward", "attn_mask"): _am_self_refuses("gated_delta", causal=True),
    ("nn.blocks.EncoderBlock.forward", "attn_mask"): _am_module(_block, lambda mod, m: mod(_x(1, 7, 2), attn_mask=m),
                                                                sq=7),
    ("nn.blocks.DecoderBlock.forward", "attn_mask"): _am_module(
        lambda: _block(decoder=True), lambda mod, m: mod(_x(1, 7, 2), _MEM, attn_mask=m), sq=7),
    ("nn.blocks.DecoderBlock.forward", "memory_mask"): _am_module(
        lambda: _block(decoder=True), lambda mod, m: mod(_x(1, 4, 2), _MEM, memory_mask=m)),
    ("models.transformer.TransformerEncoder.forward", "attn_mask"): _am_module(
        _transformer, lambda mod, m: mod(_x(1, 7, 2), attn_mask=m), sq=7),
    ("nn.multihead.MultiheadAttention.forward", "attn_mask"): _am_mha,
    ("nn.multihead.MultiheadAttention.merge_masks", "attn_mask"): _merge_masks_refuses,
}


@pytest.mark.parametrize("fn,name", sorted(ATTN_MASK), ids=[f"{f}-{n}" for f, n in sorted(ATTN_MASK)])
def test_attn_mask_bool_polarity(fn, name):
    r = ATTN_MASK[(fn, name)]()
    if r is not None:
        _check_meaning(*r)


# ------------------------------------------------------------------ window / window_size
_INT_WINDOW = r"{0} must be a \(left, right\) pair .*{0}=\(4, 0\) is a causal sliding window"


def _paged_attend(window):
    c = aenn.PagedKVCache(1, 4, 4, 2, 8)
    c.append(torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8))
    return c.attend(torch.randn(1, 1, 2, 8), scale=0.25, window=window)


def _kvcache_attend(window):
    c = aenn.KVCache(1, 8, 2, 8, dtype=torch.int8)
    c.append(torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8))
    return c.attend(torch.randn(1, 1, 2, 8), scale=0.25, window=window)


_Q, _K, _V = _qkv(b=1, sk=5)
_THD = (_Q[0].transpose(0, 1), _K[0].transpose(0, 1), _V[0].transpose(0, 1))  # (S, H, D) packs
_CU_Q, _CU_K = torch.tensor([0, 5], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
_BSHD = tuple(t.transpose(1, 2).contiguous() for t in (_Q, _K, _V))

# (left, right) pairs: the call with `window` set to the argument
WINDOW_PAIR = {
    "softmax.functional.attention": lambda w: ae.attention(_Q, _K, _V, window=w),
    "softmax.functional.attention_varlen": lambda w: ae.softmax.attention_varlen(*_THD, _CU_Q, _CU_K, 5, 5, window=w),
    "softmax.functional.attention_weights": lambda w: ae.attention_weights(_Q, _K, window=w),
    "nn.paged_cache.PagedKVCache.attend": _paged_attend,
    "nn.layers.KVCache.attend": _kvcache_attend,
    "nn.layers.AttentionConfig.__init__": lambda w: aenn.AttentionConfig(d_model=16, n_heads=2, window=w),
    "models.lm.LMConfig.__init__": lambda w: LMConfig(window=w).block(),
    "models.transformer.TransformerConfig.__init__": lambda w: TransformerConfig(window=w).attn(causal=True),
}
# a block count (an int): the sparse layout builders
WINDOW_BLOCKS = {
    "sparse.layouts.sliding_window": lambda w: L.sliding_window(w, seq_len=128, block_size=32),
    "sparse.layouts.longformer": lambda w: L.longformer(w, seq_len=128, block_size=32),
    "sparse.layouts.bigbird": lambda w: L.bigbird(w, n_global=0, n_random=0, seq_len=128, block_size=32),
}
# flash-attn's spelling of the pair
WINDOW_SIZE = {
    "compat.flash_attn.flash_attn_func": lambda w: ae.flash_attn_func(*_BSHD, window_size=w),
    "compat.flash_attn.flash_attn_qkvpacked_func": lambda w: ae.flash_attn_qkvpacked_func(
        torch.stack([_BSHD[0]] * 3, 2), window_size=w),
    "compat.flash_attn.flash_attn_kvpacked_func": lambda w: ae.flash_attn_kvpacked_func(
        _BSHD[0], torch.stack(_BSHD[1:], 2), window_size=w),
    "compat.flash_attn.flash_attn_varlen_func": lambda w: ae.flash_attn_varlen_func(*_THD, _CU_Q, _CU_K, 5, 5,
                                                                                    window_size=w),
    "compat.flash_attn.flash_attn_varlen_qkvpacked_func": lambda w: ae.flash_attn_varlen_qkvpacked_func(
        torch.stack([_THD[0]] * 3, 1), _CU_Q, 5, window_size=w),
    "compat.flash_attn.flash_attn_varlen_kvpacked_func": lambda w: ae.flash_attn_varlen_kvpacked_func(
        _THD[0], torch.stack(_THD[1:], 1), _CU_Q, _CU_K, 5, 5, window_size=w),
    "decode.kvcache.flash_attn_with_kvcache": lambda w: ae.flash_attn_with_kvcache(_BSHD[0], _BSHD[1], _BSHD[2],
                                                                                   window_size=w),
    "distributed.attention.context_parallel_attention": lambda w: _cp(
        lambda: ae.distributed.context_parallel_attention(*_LQ, window_size=w)),
}


@pytest.mark.parametrize("fn", sorted(WINDOW_PAIR))
def test_window_is_a_pair(fn):
    """`window` is (left, right): a pair is taken, an int raises a TypeError that names window
    and spells out the pairs it may mean."""
    WINDOW_PAIR[fn]((2, 1))
    with pytest.raises(TypeError, match=_INT_WINDOW.format("window")):
        WINDOW_PAIR[fn](4)


@pytest.mark.parametrize("fn", sorted(WINDOW_BLOCKS))
def test_sparse_layout_window_blocks_is_a_block_count(fn):
    """window_blocks counts key blocks on each side of the diagonal: 0 is the diagonal blocks, 1
    adds a block each side; a pair is refused."""
    assert WINDOW_BLOCKS[fn](0)[0, 2].tolist() == [False, False, True, False]
    assert WINDOW_BLOCKS[fn](1)[0, 2].tolist() == [False, True, True, True]
    with pytest.raises(TypeError, match="window_blocks must be an int"):
        WINDOW_BLOCKS[fn]((1, 0))


@pytest.mark.parametrize("fn", sorted(WINDOW_SIZE))
def test_window_size_is_a_pair(fn):
    WINDOW_SIZE[fn]((2, 0))
    with pytest.raises(TypeError, match=_INT_WINDOW.format("window_size")):
        WINDOW_SIZE[fn](4)


@pytest.mark.parametrize("how", ["attention", "attention_weights", "window_size"])
def test_window_pair_meaning(how):
    """window=(left, right): query i sees keys j with i - left <= j <= i + right (top-left);
    flash-attn's window_size means the same, aligned bottom-right as its causal."""
    q, k, v = _qkv(sq=7, sk=7)
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    band = (j >= i - 2) & (j <= i + 1)
    if how == "attention":
        torch.testing.assert_close(ae.attention(q, k, v, window=(2, 1)),
                                   F.scaled_dot_product_attention(q, k, v, attn_mask=band))
    elif how == "attention_weights":
        torch.testing.assert_close(ae.attention_weights(q, k, window=(2, 1)), _probs(q, k, band))
    else:
        got = ae.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), window_size=(2, 1))
        torch.testing.assert_close(got.transpose(1, 2), F.scaled_dot_product_attention(q, k, v, attn_mask=band))


# ------------------------------------------------------------------ scale / softmax_scale
def _sc_softmax(run):
    """run(scale, qf): the call with q multiplied by qf. scale multiplies q . k: scale s on q
    equals scale 1 on s q; None is 1 / sqrt(D) (D = 8)."""
    def check():
        torch.testing.assert_close(run(0.3, 1.0), run(1.0, 0.3))
        if run(None, 1.0) is not None:
            torch.testing.assert_close(run(None, 1.0), run(8 ** -0.5, 1.0))
    return check


def _sc_linear(run):
    """run(scale, normalize): linear attention's scale multiplies phi(q) . phi(k), default 1:
    normalized it cancels but for eps; unnormalized it scales the output."""
    def check():
        torch.testing.assert_close(run(None, True), run(1.0, True))
        torch.testing.assert_close(run(2.0, False), 2 * run(1.0, False))
    return check


def _sc_delta(run):
    """run(scale) -> out: the delta rule's scale multiplies q (o_t = h_t^T (scale q_t)), so the
    output is linear in it; None is K ** -0.5 (K = 8)."""
    def check():
        torch.testing.assert_close(run(2.0), 2 * run(1.0))
        torch.testing.assert_close(run(None), run(8 ** -0.5))
    return check


_BETA = torch.rand(2, 2, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _delta_qkv():
    q, k, v = _qkv(sq=6, sk=6)
    return q, linear_ref._l2n(k), v, _BETA


def _embeddings_scale():
    """Embeddings(scale=) is a flag of the token embedding ("Attention Is All You Need" 3.4):
    True multiplies by sqrt(d_model). Not an attention argument; a bool, never a factor."""
    torch.manual_seed(0)
    e = aenn.Embeddings(11, 16, scale=True)
    tok = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(e(tok), e.lut(tok) * math.sqrt(16))
    assert aenn.Embeddings(11, 16, scale=False).scale == 1.0


def _paged_scale(s, qf):
    c = aenn.PagedKVCache(1, 4, 4, 2, 8, dtype=F64)
    c.append(_BSHD[1], _BSHD[2])
    return c.attend(_BSHD[0][:, -1:] * qf, scale=s, causal=False) if s is not None else None


def _kvcache_scale(s, qf):
    c = aenn.KVCache(1, 8, 2, 8, dtype=F64)
    c.append(_BSHD[1], _BSHD[2])
    return c.attend(_BSHD[0][:, -1:] * qf, scale=s, causal=False) if s is not None else None


_PROJ = torch.randn(3, 5, dtype=F64)  # Linformer's (r, S_k) projection of _K, _V
_ROT = torch.randn(1, 8, 1, dtype=F64)  # LSH: one round, two buckets, D = 8


def _lin_qkv():
    return _qkv(sq=6, sk=6)


SCALE = {
    ("softmax.functional.attention", "scale"): _sc_softmax(lambda s, f: ae.attention(_Q * f, _K, _V, scale=s)),
    ("softmax.functional.attention_varlen", "scale"): _sc_softmax(
        lambda s, f: ae.softmax.attention_varlen(_THD[0] * f, *_THD[1:], _CU_Q, _CU_K, 5, 5, scale=s)),
    ("softmax.functional.attention_weights", "scale"): _sc_softmax(
        lambda s, f: ae.attention_weights(_Q * f, _K, scale=s)),
    ("compat.sdpa.scaled_dot_product_attention", "scale"): _sc_softmax(
        lambda s, f: ae.scaled_dot_product_attention(_Q * f, _K, _V, scale=s)),
    ("sparse.functional.block_sparse_attention", "scale"): _sc_softmax(
        lambda s, f: ae.block_sparse_attention(_Q * f, _K, _V, _ONE_BLOCK, block_size=16, scale=s)),
    ("sparse.functional.topk_attention", "scale"): _sc_softmax(
        lambda s, f: ae.topk_attention(_Q * f, _K, _V, 3, scale=s)),
    ("decode.ops.decode_fwd", "scale"): _sc_softmax(
        lambda s, f: ae.decode.decode_fwd(_BSHD[0] * f, _BSHD[1], _BSHD[2], scale=s)[0] if s is not None else None),
    ("nn.paged_cache.PagedKVCache.attend", "scale"): _sc_softmax(_paged_scale),
    ("nn.layers.KVCache.attend", "scale"): _sc_softmax(_kvcache_scale),
    ("distributed.attention.context_parallel_attention", "scale"): _sc_softmax(
        lambda s, f: _cp(lambda: ae.distributed.context_parallel_attention(_LQ[0] * f, *_LQ[1:], scale=s))),
    ("compat.flash_attn.flash_attn_func", "softmax_scale"): _sc_softmax(
        lambda s, f: ae.flash_attn_func(_BSHD[0] * f, *_BSHD[1:], softmax_scale=s)),
    ("compat.flash_attn.flash_attn_qkvpacked_func", "softmax_scale"): _sc_softmax(
        lambda s, f: ae.flash_attn_qkvpacked_func(torch.stack([_BSHD[1] * f, _BSHD[1], _BSHD[2]], 2), softmax_scale=s)),
    ("compat.flash_attn.flash_attn_kvpacked_func", "softmax_scale"): _sc_softmax(
        lambda s, f: ae.flash_attn_kvpacked_func(_BSHD[0] * f, torch.stack(_BSHD[1:], 2), softmax_scale=s)),
    ("compat.flash_attn.flash_attn_varlen_func", "softmax_scale"): _sc_softmax(
        lambda s, f: ae.flash_attn_varlen_func(_THD[0] * f, *_THD[1:], _CU_Q, _CU_K, 5, 5, softmax_scale=s)),
    ("compat.flash_attn.flash_attn_varlen_qkvpacked_func", "softmax_scale"): _sc_softmax(
        lambda s, f: ae.flash_attn_varlen_qkvpacked_func(torch.stack([_THD[1] * f, _THD[1], _THD[2]], 1), _CU_K, 5,
                                                         softmax_scale=s)),
    ("compat.flash_attn.flash_attn_varlen_kvpacked_func", "softmax_scale"): _sc_softmax(
        lambda s, f: ae.flash_attn_varlen_kvpacked_func(_THD[0] * f, torch.stack(_THD[1:], 1), _CU_Q, _CU_K, 5, 5,
                                                        softmax_scale=s)),
    ("decode.kvcache.flash_attn_with_kvcache", "softmax_scale"): _sc_softmax(
        lambda s, f: ae.flash_attn_with_kvcache(_BSHD[0] * f, _BSHD[1], _BSHD[2], softmax_scale=s)),
    ("linear.functional.linear_attention", "scale"): _sc_linear(
        lambda s, n: ae.linear_attention(*_lin_qkv(), scale=s, normalize=n)),
    ("linear.functional.linear_attention_step", "scale"): _sc_linear(
        lambda s, n: ae.linear_attention_step(*_lin_qkv(), None, scale=s, normalize=n)[0]),
    ("linear.reference.linear_attention", "scale"): _sc_linear(
        lambda s, n: linear_ref.linear_attention(*_lin_qkv(), **({} if s is None else {"scale": s}), normalize=n)[0]),
    ("distributed.linear.context_parallel_linear_attention", "scale"): _sc_linear(
        lambda s, n: _cp(lambda: ae.distributed.context_parallel_linear_attention(
            *_lin_qkv(), scale=s, normalize=n))),
    ("linear.delta.delta_rule_attention", "scale"): _sc_delta(
        lambda s: ae.delta_rule_attention(*_delta_qkv(), scale=s)),
    ("linear.delta.delta_rule_step", "scale"): _sc_delta(lambda s: ae.delta_rule_step(*_delta_qkv(), None, scale=s)[0]),
    ("distributed.delta.context_parallel_delta_rule_attention", "scale"): _sc_delta(
        lambda s: _cp(lambda: ae.distributed.context_parallel_delta_rule_attention(*_delta_qkv(), scale=s))),
    ("linear.reference.delta_rule", "scale"): _sc_delta(lambda s: linear_ref.delta_rule(*_delta_qkv(), scale=s)[0]),
    ("linear.reference.delta_rule_wy", "scale"): _sc_delta(
        lambda s: linear_ref.delta_rule_wy(*_delta_qkv(), scale=s, chunk=4)[0]),
    ("linear.reference.delta_rule_chunked", "scale"): _sc_delta(
        lambda s: linear_ref.delta_rule_chunked(*_delta_qkv(), scale=s, chunk=4)[0]),
    ("nn.positional.Embeddings.__init__", "scale"): _embeddings_scale,
    ("softmax.linformer.linformer_attention", "scale"): _sc_softmax(
        lambda s, f: ae.linformer_attention(_Q * f, _K, _V, _PROJ, scale=s)),
    ("softmax.reference.linformer_attention", "scale"): _sc_softmax(
        lambda s, f: softmax_ref.linformer_attention(_Q * f, _K, _V, _PROJ, scale=s)),
}


@pytest.mark.parametrize("fn,name", sorted(SCALE), ids=[f"{f}-{n}" for f, n in sorted(SCALE)])
def test_scale_multiplies_the_scores(fn, name):
    SCALE[(fn, name)]()


# ------------------------------------------------------------------ layouts
def _tensor_layout(run):
    """run(layout) -> output in (B, H, S, D): "bshd" inputs are the "bhsd" ones transposed, and
    the result is the same."""
    def check():
        torch.testing.assert_close(run("bshd"), run("bhsd"))
    check.tensor_layout = True  # test_layout_has_one_meaning
    return check


def _as(layout, *ts):
    return ts if layout == "bhsd" else tuple(t.transpose(1, 2) for t in ts)


def _back(layout, out):
    return out if layout == "bhsd" else out.transpose(1, 2)


_LQ = _qkv(sq=6, sk=6)
LAYOUT = {
    # the tensors' layout
    ("softmax.functional.attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.attention(*_as(lay, _Q, _K, _V), layout=lay))),
    ("softmax.functional.attention_weights", "layout"): _tensor_layout(
        lambda lay: ae.attention_weights(*_as(lay, _Q, _K), layout=lay)),
    ("linear.functional.linear_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.linear_attention(*_as(lay, *_LQ), layout=lay))),
    ("linear.functional.linear_attention_step", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.linear_attention_step(*_as(lay, *_LQ), None, layout=lay)[0])),
    ("linear.delta.delta_rule_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.delta_rule_attention(*_as(lay, *_delta_qkv()[:3]), _BETA, layout=lay))),
    ("linear.delta.delta_rule_step", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.delta_rule_step(*_as(lay, *_delta_qkv()[:3]), _BETA, None, layout=lay)[0])),
    ("sparse.functional.block_sparse_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.block_sparse_attention(*_as(lay, _Q, _K, _V), _ONE_BLOCK, block_size=16,
                                                         layout=lay))),
    ("sparse.functional.topk_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.topk_attention(*_as(lay, _Q, _K, _V), 3, layout=lay))),
    ("softmax.linformer.linformer_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.linformer_attention(*_as(lay, _Q, _K, _V), _PROJ, layout=lay))),
    ("sparse.lsh.lsh_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, ae.lsh_attention(*_as(lay, _LQ[0], _LQ[2]), n_buckets=2, chunk_size=2, rotations=_ROT,
                                                layout=lay))),
    ("sparse.lsh.lsh_buckets", "layout"): _tensor_layout(
        lambda lay: ae.sparse.lsh_buckets(*_as(lay, _LQ[0]), _ROT, 2, layout=lay)),
    ("distributed.attention.context_parallel_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, _cp(lambda: ae.distributed.context_parallel_attention(*_as(lay, *_LQ), layout=lay)))),
    ("distributed.linear.context_parallel_linear_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, _cp(lambda: ae.distributed.context_parallel_linear_attention(*_as(lay, *_LQ),
                                                                                            layout=lay)))),
    ("distributed.delta.context_parallel_delta_rule_attention", "layout"): _tensor_layout(
        lambda lay: _back(lay, _cp(lambda: ae.distributed.context_parallel_delta_rule_attention(
            *_as(lay, *_delta_qkv()[:3]), _BETA, layout=lay)))),
}


@pytest.mark.parametrize("fn,name", sorted(LAYOUT), ids=[f"{f}-{n}" for f, n in sorted(LAYOUT)])
def test_layout_names(fn, name):
    LAYOUT[(fn, name)]()


# ------------------------------------------------------------------ block_layout: the sparse block grid
def _block_layout(run, sq=20, sk=40, blocks=((True, False, True), (False, True, True))):
    """run(block_layout) -> out: keys in the off blocks are skipped, as the equivalent element mask
    does in dense attention; the inverted layout gives another result."""
    def check():
        q, k, v = _qkv(sq=sq, sk=sk)
        grid = torch.tensor([blocks])  # (1, ceil(sq / 16), ceil(sk / 16))
        allowed = ae.sparse.layout_to_mask(grid, 16, sq, sk)
        _check_meaning(run(q, k, v, grid), F.scaled_dot_product_attention(q, k, v, attn_mask=allowed),
                       run(q, k, v, ~grid))
    return check


BLOCK_LAYOUT = {
    ("sparse.functional.block_sparse_attention", "block_layout"): _block_layout(
        lambda q, k, v, b: ae.block_sparse_attention(q, k, v, b, block_size=16)),
    ("softmax.functional.attention", "block_layout"): _block_layout(
        lambda q, k, v, b: ae.attention(q, k, v, block_layout=b, block_size=16)),
    ("softmax.functional.attention_weights", "block_layout"): _block_layout(
        lambda q, k, v, b: ae.attention_weights(q, k, block_layout=b, block_size=16) @ v),
    # the whole sequence's grid, on a one-rank group (every row keeps a block either way)
    ("distributed.attention.context_parallel_attention", "block_layout"): _block_layout(
        lambda q, k, v, b: _cp(lambda: ae.distributed.context_parallel_attention(q, k, v, block_layout=b,
                                                                                 block_size=16)),
        sq=40, sk=40, blocks=((True, False, True), (False, True, True), (True, True, False))),
}


@pytest.mark.parametrize("fn,name", sorted(BLOCK_LAYOUT), ids=[f"{f}-{n}" for f, n in sorted(BLOCK_LAYOUT)])
def test_block_layout_is_the_block_grid(fn, name):
    BLOCK_LAYOUT[(fn, name)]()


# ------------------------------------------------------------------ shard_layout: context parallelism's sharding
# the call with `shard_layout` set to the argument, on a one-rank group: a sharding is taken, a
# tensor layout ("bshd") raises a ValueError that says it goes in `layout`
SHARD_LAYOUT = {
    "distributed.attention.context_parallel_attention": lambda s: _cp(
        lambda: ae.distributed.context_parallel_attention(*_LQ, shard_layout=s)),
    "distributed.linear.context_parallel_linear_attention": lambda s: _cp(
        lambda: ae.distributed.context_parallel_linear_attention(*_LQ, shard_layout=s)),
    "distributed.delta.context_parallel_delta_rule_attention": lambda s: _cp(
        lambda: ae.distributed.context_parallel_delta_rule_attention(*_delta_qkv(), shard_layout=s)),
    "distributed.context.ContextParallel.__init__": lambda s: ae.distributed.ContextParallel(shard_layout=s),
    "distributed.sharding.sequence_multiple": lambda s: ae.distributed.sequence_multiple(2, s),
    "distributed.sharding.global_positions": lambda s: ae.distributed.global_positions(8, rank=0, world_size=2,
                                                                                       shard_layout=s),
    "distributed.sharding.shard_sequence": lambda s: _cp(lambda: ae.distributed.shard_sequence(_Q, dim=2,
                                                                                                shard_layout=s)),
    "distributed.sharding.unshard_sequence": lambda s: _cp(lambda: ae.distributed.unshard_sequence(_Q, dim=2,
                                                                                                    shard_layout=s)),
    "distributed.sharding.all_gather_sequence": lambda s: _cp(lambda: ae.distributed.all_gather_sequence(
        _Q, dim=2, shard_layout=s)),
    "distributed.sharding.shard_work": lambda s: ae.distributed.shard_work(8, 2, s),
}


@pytest.mark.parametrize("fn", sorted(SHARD_LAYOUT))
def test_shard_layout_is_the_sharding(fn):
    SHARD_LAYOUT[fn]("contiguous")
    with pytest.raises(ValueError, match=r"shard_layout is the sequence sharding.*got 'bshd': the tensors' layout "
                                         r"goes in layout"):
        SHARD_LAYOUT[fn]("bshd")


# ------------------------------------------------------------------ renamed arguments
# (function, old name) -> (the call with the old name, the new name): the old spelling is refused
# with a TypeError that names the new one, never read under either meaning.
_SM = ae.sparse.SparseMask(block_layout=_ONE_BLOCK, block_size=16)
RENAMED = {
    ("sparse.functional.block_sparse_attention", "layout_qkv"): (
        lambda: ae.block_sparse_attention(*_BSHD, _ONE_BLOCK, block_size=16, layout_qkv="bshd"), "layout"),
    ("sparse.functional.topk_attention", "layout_qkv"): (
        lambda: ae.topk_attention(*_BSHD, 3, layout_qkv="bshd"), "layout"),
    ("sparse.layouts.sliding_window", "window"): (
        lambda: L.sliding_window(window=1, seq_len=128, block_size=32), "window_blocks"),
    ("sparse.layouts.longformer", "window"): (
        lambda: L.longformer(window=1, seq_len=128, block_size=32), "window_blocks"),
    ("sparse.layouts.bigbird", "window"): (lambda: L.bigbird(window=1, seq_len=128, block_size=32), "window_blocks"),
    ("distributed.attention.context_parallel_attention", "qkv_layout"): (
        lambda: _cp(lambda: ae.distributed.context_parallel_attention(*_LQ, qkv_layout="bshd")), "layout"),
    ("distributed.linear.context_parallel_linear_attention", "qkv_layout"): (
        lambda: _cp(lambda: ae.distributed.context_parallel_linear_attention(*_LQ, qkv_layout="bshd")), "layout"),
    ("distributed.context.ContextParallel.__init__", "layout"): (
        lambda: ae.distributed.ContextParallel(layout="zigzag"), "shard_layout"),
    ("distributed.sharding.sequence_multiple", "layout"): (
        lambda: ae.distributed.sequence_multiple(2, layout="zigzag"), "shard_layout"),
    ("distributed.sharding.global_positions", "layout"): (
        lambda: ae.distributed.global_positions(8, rank=0, world_size=2, layout="zigzag"), "shard_layout"),
    ("distributed.sharding.shard_sequence", "layout"): (
        lambda: _cp(lambda: ae.distributed.shard_sequence(_Q, dim=2, layout="zigzag")), "shard_layout"),
    ("distributed.sharding.unshard_sequence", "layout"): (
        lambda: _cp(lambda: ae.distributed.unshard_sequence(_Q, dim=2, layout="zigzag")), "shard_layout"),
    ("distributed.sharding.all_gather_sequence", "layout"): (
        lambda: _cp(lambda: ae.distributed.all_gather_sequence(_Q, dim=2, layout="zigzag")), "shard_layout"),
}


@pytest.mark.parametrize("fn,old", sorted(RENAMED), ids=[f"{f}-{n}" for f, n in sorted(RENAMED)])
def test_old_name_is_refused_with_the_new_one(fn, old):
    call, new = RENAMED[(fn, old)]
    with pytest.raises(TypeError, match=rf"takes {new} \(.*\); {old} is its old name and is not read: pass {new}="):
        call()


# (function, argument, what is given) -> (the call, exception, the argument the message names): a
# value of another meaning given to a shared name (a block layout or a sequence sharding given as
# the tensor layout `layout`) raises an error that names the argument taking it.
MISPLACED = {
    ("sparse.functional.block_sparse_attention", "layout", "a block layout"): (
        lambda: ae.block_sparse_attention(*_BSHD, layout=_ONE_BLOCK, block_size=16), TypeError, "block_layout"),
    ("sparse.functional.block_sparse_attention", "layout", "a SparseMask"): (
        lambda: ae.block_sparse_attention(*_BSHD, layout=_SM), TypeError, "block_layout"),
    ("sparse.functional.block_sparse_attention", "block_layout", "a tensor layout"): (
        lambda: ae.block_sparse_attention(*_BSHD, "bshd"), TypeError, "goes in layout"),
    ("sparse.functional.topk_attention", "layout", "a block layout"): (
        lambda: ae.topk_attention(*_BSHD, 3, layout=_ONE_BLOCK), TypeError, "block_layout"),
    **{("distributed.attention.context_parallel_attention", "layout", f"a sharding ({mode})"): (
        lambda mode=mode: _cp(lambda: ae.distributed.context_parallel_attention(*_LQ, mode=mode, layout="zigzag")),
        ValueError, "shard_layout") for mode in ae.distributed.MODES},
    ("distributed.linear.context_parallel_linear_attention", "layout", "a sharding"): (
        lambda: _cp(lambda: ae.distributed.context_parallel_linear_attention(*_LQ, layout="contiguous")), ValueError,
        "shard_layout"),
}


@pytest.mark.parametrize("fn,arg,given", sorted(MISPLACED), ids=["-".join(c) for c in sorted(MISPLACED)])
def test_value_of_another_meaning_names_its_argument(fn, arg, given):
    call, exc, right = MISPLACED[(fn, arg, given)]
    with pytest.raises(exc, match=rf"{arg} is .*got .*{right}"):
        call()


# Uses stated, not run: the references (the oracles the families' tests run, with the meaning of
# the function they define and no argument checks of their own), internal helpers that the walk
# finds through an import, and arguments that take a tensor of one kind only.
_BLOCK = "the sparse family's block layout: a bool (H or 1, blocks_q, blocks_k) tensor"
KINDS = {
    ("sparse.functional.layout_to_mask", "block_layout"): _BLOCK,
    ("sparse.layouts.SparseMask.__init__", "block_layout"): _BLOCK,
    ("sparse.layouts.draw", "block_layout"): _BLOCK,
    ("viz.plot_sparse_layout", "block_layout"): _BLOCK,
    ("sparse.reference.block_sparse_attention_ref", "block_layout"): _BLOCK,
    ("sparse.reference.block_sparse_attention_ref", "scale"): "block_sparse_attention's scale",
    ("sparse.reference.topk_attention_ref", "scale"): "topk_attention's scale",
    ("softmax.reference.attention", "scale"): "attention()'s scale",
    ("softmax.reference.attention", "window"): "attention()'s (left, right) window",
    ("softmax.reference.seen_keys", "window"): "attention()'s (left, right) window",
    ("softmax.reference.qk_int8_scores", "window"): "attention()'s (left, right) window",
    ("softmax.reference.qk_quant_scores", "window"): "attention()'s (left, right) window",
    ("softmax.reference.mask_structure", "window"): "attention()'s (left, right) window",
    ("softmax.functional.window_size_pair", "window_size"): "the one check of window_size (test_window_size_is_a_pair)",
    ("linear.reference.chunked", "scale"): "linear_attention's scale",
    ("linear.reference.linear_step", "scale"): "linear_attention_step's scale",
    ("decode.reference.decode_attention", "softmax_scale"): "flash_attn_with_kvcache's softmax_scale",
    ("decode.reference.decode_attention", "window_size"): "flash_attn_with_kvcache's window_size",
    ("distributed.sharding.check_shards", "layout"): "the tensors' layout: context parallelism's (test_layout_names)",
    ("distributed.sharding.shards_bhsd", "layout"): "the tensors' layout: context parallelism's (test_layout_names)",
    ("distributed.sharding.real_rows", "shard_layout"): "the sequence sharding, checked by its callers",
}


# ------------------------------------------------------------------ the tables cover the API
def test_every_use_is_checked():
    """Every (function, argument) of the API that uses one of the shared names has its row: a new
    function (or a new argument of one) fails here until its meaning is stated and tested."""
    rows = (set(KEY_MASK) | set(TORCH_PADDING) | set(ATTN_MASK) | set(SCALE) | set(LAYOUT) | set(BLOCK_LAYOUT)
            | set(KINDS)
            | {(f, "window") for f in WINDOW_PAIR} | {(f, "window_blocks") for f in WINDOW_BLOCKS}
            | {(f, "window_size") for f in WINDOW_SIZE} | {(f, "shard_layout") for f in SHARD_LAYOUT})
    refused = {(f, n) for f, n in _OLD if (f, n) not in TORCH_PADDING}  # test_key_padding_mask_is_torchs_or_refused
    refused |= set(RENAMED)  # test_old_name_is_refused_with_the_new_one
    assert {u for u in USES if u not in refused} == rows
    assert len(USES) > 60  # the walk found the API


def test_layout_has_one_meaning():
    """`layout` is the tensors' layout ("bhsd" / "bshd") wherever it is read: a block layout is
    `block_layout`, a sequence sharding `shard_layout`, and a function that took `layout` in
    another sense refuses it with an error naming the new argument."""
    uses = {f for f, n in USES if n == "layout"}
    tensor = {f for (f, n), check in LAYOUT.items() if n == "layout" and getattr(check, "tensor_layout", False)}
    tensor |= {f for (f, n), what in KINDS.items() if n == "layout" and what.startswith("the tensors' layout")}
    assert uses - {f for f, n in RENAMED if n == "layout"} == tensor
    assert set(LAYOUT) == {(f, "layout") for f in tensor if (f, "layout") in LAYOUT}


def test_window_has_one_meaning():
    """`window` is a (left, right) pair of keys wherever it is read: a count of blocks (the sparse
    builders) is `window_blocks`, and a function that took `window` in that sense refuses it."""
    uses = {f for f, n in USES if n == "window"}
    pair = set(WINDOW_PAIR) | {f for (f, n), what in KINDS.items() if n == "window" and "(left, right)" in what}
    assert uses - {f for f, n in RENAMED if n == "window"} == pair
