"""attn_implementation="attention_ext" in Hugging Face transformers, on tiny random models built
from configs (no downloads): logits, gradients, greedy generate() and torch.compile against the
model's own reference implementation on the same weights ("sdpa"; "eager" for Gemma 2 and GPT-OSS,
whose softcap / sinks SDPA does not serve).

transformers is a test dependency (dev.sh installs it); the skip only guards a bare environment.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attention_ext  # noqa: E402
import attention_ext.integrations.transformers as ae_hf  # noqa: E402
from tests.helpers import FLOOR, rel_err  # noqa: E402

AE = ae_hf.DEFAULT_NAME
ae_hf.register()

V, B, L, PAD = 128, 2, 12, 4  # vocab, batch, sequence, left padding of row 0
WINDOW = 4  # sliding window (keys a query sees, itself included), < L so that it bites

_COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, attention_dropout=0.0)


def _config(name: str):
    """(config, reference attn_implementation, Auto class) of a tiny model of family `name`."""
    t = transformers
    if name == "llama":
        return t.LlamaConfig(**_COMMON), "sdpa", t.AutoModelForCausalLM
    if name == "qwen2":  # every layer sliding (layers >= max_window_layers slide)
        return (t.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
                "sdpa", t.AutoModelForCausalLM)
    if name == "mistral":
        return t.MistralConfig(**_COMMON, sliding_window=WINDOW), "sdpa", t.AutoModelForCausalLM
    if name == "gemma2":  # sliding and full layers alternate; softcap 5 so that it bites at this scale
        return (t.Gemma2Config(**_COMMON, head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                               final_logit_softcapping=None, query_pre_attn_scalar=16),
                "eager", t.AutoModelForCausalLM)
    if name == "gpt_oss":  # sinks; sliding and full layers; a 4-expert MoE
        return (t.GptOssConfig(**_COMMON, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                               num_experts_per_tok=2),
                "eager", t.AutoModelForCausalLM)
    if name == "gpt2":  # MHA
        return (t.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2,
                             attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
                "sdpa", t.AutoModelForCausalLM)
    if name == "bert":  # bidirectional encoder
        return (t.BertConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                "sdpa", t.AutoModelForMaskedLM)
    raise KeyError(name)


def _available(name: str) -> bool:
    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig", "gemma2": "Gemma2Config",
           "gpt_oss": "GptOssConfig", "gpt2": "GPT2Config", "bert": "BertConfig"}[name]
    return hasattr(transformers, cls)


FAMILIES = [pytest.param(n, marks=pytest.mark.skipif(not _available(n), reason=f"{n} not in this transformers"))
            for n in ("llama", "qwen2", "mistral", "gemma2", "gpt_oss", "gpt2", "bert")]
DECODERS = [p for p in FAMILIES if p.values[0] != "bert"]
SLIDING = [p for p in FAMILIES if p.values[0] in ("qwen2", "mistral", "gemma2", "gpt_oss")]


def _pair(name: str, dtype=torch.float32, **overrides):
    """(reference model, our model) with the same weights, eval mode, in `dtype`."""
    cfg, ref_impl, auto = _config(name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    # GPT-OSS in float64: the plain experts loop (grouped mm has no float64; the loop has no fullgraph)
    extra = {"experts_implementation": "eager"} if name == "gpt_oss" and dtype == torch.float64 else {}
    torch.manual_seed(0)
    ref = auto.from_config(cfg, attn_implementation=ref_impl, **extra).to(dtype).eval()
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(AE)
    assert ours.config._attn_implementation == AE and ref.config._attn_implementation == ref_impl
    return ref, ours


def _inputs(name: str, padded: bool):
    """input_ids (B, L) and attention_mask (B, L): row 0 left-padded by PAD (right-padded for the
    encoder) when `padded`."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    if padded:
        if name == "bert":
            mask[0, L - PAD:] = 0
        else:
            mask[0, :PAD] = 0
        ids[mask == 0] = 0
    return ids, mask


class _DecodeCount:
    """Counts the decode kernel's op (attention_ext::decode_fwd) wherever attention()'s calls run
    it: the routed composites (softmax_fwd_routed, softmax_fwd_plain) call it in C++ for the calls
    their route sends there (route_fwd), so the count comes from the profiler, which records
    nested op calls."""

    def __init__(self, n):
        self.n = n
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def __enter__(self):
        self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        self.prof.__exit__(*exc)
        self.n[1] += sum(e.name == "attention_ext::decode_fwd" for e in self.prof.events())
        return False


@pytest.fixture
def calls(monkeypatch):
    """Counts calls into attention_ext.attention (the integration resolves it at call time), so
    a test cannot pass on a silent fallback to the reference implementation; n[1] counts the
    calls that run on the decode kernel, inside a `with _DecodeCount(n)` block."""
    n = [0, 0]
    real_attention = attention_ext.attention

    def counting(*a, **kw):
        n[0] += 1
        return real_attention(*a, **kw)

    monkeypatch.setattr(attention_ext, "attention", counting)
    return n


def _logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits.float()


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_fp32(name, padded, calls):
    ref, ours = _pair(name)
    ids, mask = _inputs(name, padded)
    with torch.no_grad():
        want, got = _logits(ref, ids, mask), _logits(ours, ids, mask)
    assert calls[0] == ours.config.num_hidden_layers
    real = mask.bool()  # fully padded query rows are implementation-defined
    assert torch.isfinite(got[real]).all()
    assert rel_err(got[real], want[real]) < 1e-5


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_bf16(name, calls):
    """The project rule: error vs a float64 run <= 2x the reference implementation's own bf16
    error + the bf16 floor."""
    ids, mask = _inputs(name, padded=True)
    real = mask.bool()
    ref64, _ = _pair(name, torch.float64)
    ref16, ours16 = _pair(name, torch.bfloat16)
    with torch.no_grad():
        exact = _logits(ref64, ids, mask)[real]
        e_ref = rel_err(_logits(ref16, ids, mask)[real], exact)
        e_ours = rel_err(_logits(ours16, ids, mask)[real], exact)
    assert calls[0] == ours16.config.num_hidden_layers
    assert e_ours <= 2 * e_ref + FLOOR[torch.bfloat16], f"error {e_ours:.3g} > 2 x reference {e_ref:.3g} + floor"


@pytest.mark.parametrize("name", FAMILIES)
def test_grads_fp32(name, calls):
    ref, ours = _pair(name)
    ids, mask = _inputs(name, padded=True)
    real = mask.bool()
    for m in (ref, ours):
        m.train()
        logits = _logits(m, ids, mask)[real]
        torch.nn.functional.cross_entropy(logits, ids[real]).backward()
    assert calls[0] == ours.config.num_hidden_layers
    grads = dict(ref.named_parameters())
    n = 0
    for pname, p in ours.named_parameters():
        want = grads[pname].grad
        if want is None:  # e.g. experts a tiny batch never routes to
            assert p.grad is None or not p.grad.any(), pname
            continue
        assert rel_err(p.grad, want) < 1e-4, pname
        n += 1
    assert n > 0


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", DECODERS)
def test_generate_greedy(name, padded, calls):
    """Prefill, then q_len 1 decode steps against the DynamicCache (sliding layers hold a cropped
    cache: the mask's kv_offset > 0)."""
    ref, ours = _pair(name)
    ids, mask = _inputs(name, padded)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = ours.generate(ids, **kw)
    assert calls[0] == ours.config.num_hidden_layers * 8
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unmasked_decode_steps_use_the_decode_kernel(dtype, calls):
    """Unpadded greedy decoding on the default cache: every q_len 1 step sees every key (HF drops
    the mask), so attention() hands it to the decode kernel; the tokens match sdpa's and every
    step's logits agree."""
    ref, ours = _pair("llama", dtype)
    ids, mask = _inputs("llama", padded=False)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        with _DecodeCount(calls):
            got = ours.generate(ids, **kw)
    layers = ours.config.num_hidden_layers
    assert calls[1] == layers * 5  # the 5 steps after the prefill (q_len > 1: attention())
    assert calls[0] == layers * 6
    if dtype == torch.float32:
        assert torch.equal(got.sequences, want.sequences)
    n0 = ids.shape[1]
    for i, (a, b) in enumerate(zip(got.scores, want.scores)):
        if not torch.equal(got.sequences[:, : n0 + i], want.sequences[:, : n0 + i]):
            break  # bf16 rounding picked a different token earlier: later logits answer other inputs
        assert rel_err(a.float(), b.float()) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("name", SLIDING)
def test_sliding_window_bites(name):
    """The window changes the result at this length, so the families above exercise it."""
    _, ours = _pair(name)
    _, wide = _pair(name, sliding_window=4 * L)
    ids, mask = _inputs(name, padded=False)
    with torch.no_grad():
        assert rel_err(_logits(ours, ids, mask), _logits(wide, ids, mask)) > 1e-3


def test_softcap_and_sinks_bite():
    """Gemma 2's softcap and GPT-OSS's sinks reach the kernel: changing them changes the output."""
    ids, mask = _inputs("gemma2", padded=False)
    with torch.no_grad():
        if _available("gemma2"):
            _, a = _pair("gemma2")
            _, b = _pair("gemma2", attn_logit_softcapping=None)
            assert rel_err(_logits(a, ids, mask), _logits(b, ids, mask)) > 1e-3
        if _available("gpt_oss"):
            _, a = _pair("gpt_oss")
            want = _logits(a, ids, mask)
            for layer in a.model.layers:
                layer.self_attn.sinks.add_(3.0)
            assert rel_err(_logits(a, ids, mask), want) > 1e-3


@pytest.mark.parametrize("name", [p for p in FAMILIES if p.values[0] in ("llama", "gemma2", "gpt_oss", "bert")])
def test_compile_fullgraph(name, calls):
    """torch.compile(fullgraph=True) traces the model with our op inside, no graph break; the
    compiled logits match eager's."""
    torch._dynamo.reset()
    _, ours = _pair(name)
    ids, mask = _inputs(name, padded=True)
    with torch.no_grad():
        want = _logits(ours, ids, mask)
        n_eager = calls[0]
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        got = compiled(input_ids=ids, attention_mask=mask).logits.float()
    assert calls[0] > n_eager  # traced through our op
    real = mask.bool()
    assert rel_err(got[real], want[real]) < 1e-5
    torch._dynamo.reset()


def test_from_config_and_set_attn_implementation(calls):
    cfg, _, auto = _config("llama")
    model = auto.from_config(cfg, attn_implementation=AE).eval()
    assert model.config._attn_implementation == AE
    ids, mask = _inputs("llama", padded=True)
    with torch.no_grad():
        a = _logits(model, ids, mask)
        assert calls[0] == cfg.num_hidden_layers
        model.set_attn_implementation("sdpa")
        b = _logits(model, ids, mask)
        assert calls[0] == cfg.num_hidden_layers  # sdpa: no more calls
        model.set_attn_implementation(AE)
        c = _logits(model, ids, mask)
    assert calls[0] == 2 * cfg.num_hidden_layers
    real = mask.bool()
    assert torch.equal(a, c) and rel_err(a[real], b[real]) < 1e-5
    assert transformers.masking_utils.AttentionMaskInterface._global_mapping[AE] is transformers.masking_utils.sdpa_mask


def test_custom_name_and_dropout():
    """register(name) under another name; dropout in training mode runs in the kernel (a fresh
    mask per call) and is off in eval mode."""
    ae_hf.register("attention_ext_test")
    ref, ours = _pair("llama", attention_dropout=0.5)
    ours.set_attn_implementation("attention_ext_test")
    ids, mask = _inputs("llama", padded=False)
    with torch.no_grad():
        assert torch.allclose(_logits(ours, ids, mask), _logits(ref, ids, mask), atol=1e-4)
        ours.train()
        a, b = _logits(ours, ids, mask), _logits(ours, ids, mask)
    assert torch.isfinite(a).all() and not torch.equal(a, b)


@pytest.mark.parametrize("name", [p for p in FAMILIES if p.values[0] in ("gemma2", "gpt_oss", "bert")])
def test_output_attentions(name, calls):
    """Inference: the probabilities, recomputed from the LSE, match eager's (softcap, sinks, window,
    padding); under autograd they raise rather than come back without a gradient."""
    ref, ours = _pair(name)
    ref.set_attn_implementation("eager")
    ids, mask = _inputs(name, padded=True)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
        got = ours(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert calls[0] == ours.config.num_hidden_layers and len(got) == len(want) > 0
    qreal = mask.bool()[:, None, :, None]  # fully padded query rows: 0 here, uniform in eager
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert rel_err(g * qreal, w * qreal) < 1e-5
    with pytest.raises(NotImplementedError, match="output_attentions"):
        ours(input_ids=ids, attention_mask=mask, output_attentions=True)


def test_unsupported_requests_raise():
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        ae_hf.attention_forward(torch.nn.Module(), q, k, v, None, output_attentions=True, dropout=0.1)
    with pytest.raises(NotImplementedError, match="head_mask.*eager"):
        ae_hf.attention_forward(torch.nn.Module(), q, k, v, None, head_mask=torch.ones(4))


def test_head_dim_over_the_kernels_limit_names_the_fix():
    """Head dims past 256 (Gemma 4's 512-wide global layers; a value dim past it too) raise
    NotImplementedError naming the layer and the implementation to use (it raised the kernel's bare
    "head dim must be in [1, 256]"); 256 itself runs."""
    mod = torch.nn.Module()
    for dqk, dv in ((512, 512), (128, 320)):
        q, k, v = torch.randn(1, 2, 3, dqk), torch.randn(1, 2, 3, dqk), torch.randn(1, 2, 3, dv)
        with pytest.raises(NotImplementedError, match=f"head dim {dqk} and value head dim {dv}.*'sdpa' or 'eager'"):
            ae_hf.attention_forward(mod, q, k, v, None)
    q = torch.randn(1, 2, 3, 256)
    assert ae_hf.attention_forward(mod, q, q, q, None)[0].shape == (1, 3, 2, 256)
    if not hasattr(transformers, "Gemma4TextConfig"):
        return
    cfg = transformers.Gemma4TextConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=512, sliding_window=WINDOW, max_position_embeddings=64,
        vocab_size_per_layer_input=V, hidden_size_per_layer_input=16,
        layer_types=["sliding_attention", "full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=AE).eval()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="Gemma4TextAttention.*head dim 512"):
        model(torch.randint(1, V, (1, 6)))


def test_attention_forward_semantics():
    """Direct calls: SDPA's reading of (mask, is_causal) with GQA, against torch's SDPA on repeated
    k / v. A bool or float mask wins over is_causal; q_len 1 with no mask sees every key."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mod = torch.nn.Module()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out, w = ae_hf.attention_forward(mod, q, k, v, None, is_causal=True)  # top-left, as SDPA's is_causal
    assert w is None and out.shape == (2, 5, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out, sdpa(q, kr, vr, is_causal=True).transpose(1, 2), atol=1e-5, rtol=1e-5)
    m = torch.rand(2, 1, 5, 7) > 0.3
    m[..., 0] = True
    out, _ = ae_hf.attention_forward(mod, q, k, v, m, is_causal=True, scaling=0.3)
    torch.testing.assert_close(out, sdpa(q, kr, vr, attn_mask=m, scale=0.3).transpose(1, 2), atol=1e-5, rtol=1e-5)
    fm = torch.randn(2, 1, 5, 7).masked_fill(~m, torch.finfo(torch.float32).min)  # a caller's float 4-D mask
    out, _ = ae_hf.attention_forward(mod, q, k, v, fm, is_causal=True)
    torch.testing.assert_close(out, sdpa(q, kr, vr, attn_mask=fm).transpose(1, 2), atol=1e-5, rtol=1e-5)
    out, _ = ae_hf.attention_forward(mod, q[:, :, :1], k, v, None, is_causal=True)
    torch.testing.assert_close(out, sdpa(q[:, :, :1], kr, vr).transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dv", [8, 24])
def test_attention_forward_value_head_dim(dv):
    """A value head dim other than q / k's (MLA: DeepSeek's 192 / 128) runs on zero columns and
    matches torch's SDPA, which takes it, with the default scale of q's head dim, a mask, causal,
    output_attentions and gradients."""
    torch.manual_seed(1)
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16)
    v = torch.randn(2, 2, 7, dv)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mod = torch.nn.Module()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    m = torch.rand(2, 1, 5, 7) > 0.3
    m[..., 0] = True
    for mask, causal in ((None, True), (m, False)):
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out, _ = ae_hf.attention_forward(mod, qg, kg, vg, mask, is_causal=causal)
        assert out.shape == (2, 5, 4, dv)
        want = sdpa(q, kr, vr, attn_mask=mask, is_causal=causal and mask is None).transpose(1, 2)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        qr, kr2, vr2 = (t.clone().requires_grad_() for t in (q, k, v))
        sdpa(qr, kr2.repeat_interleave(2, 1), vr2.repeat_interleave(2, 1), attn_mask=mask,
             is_causal=causal and mask is None).sum().backward()
        for a, b in ((qg, qr), (kg, kr2), (vg, vr2)):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        out, w = ae_hf.attention_forward(mod, q, k, v, m, output_attentions=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 5), atol=1e-5, rtol=0)


def test_mla_model_logits():
    """A tiny DeepSeek-V3 (MLA: q / k head dim 24, v head dim 16) gives SDPA's logits, padded or
    not (it used to raise: k and v must have one shape)."""
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers has no DeepSeek-V3")
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_k_dense_replace=1, max_position_embeddings=64)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(AE)
    x = torch.randint(0, V, (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[0, :PAD] = 0
    with torch.no_grad():
        for kw in (dict(), dict(attention_mask=mask)):
            want, got = ref(x, **kw).logits, ours(x, **kw).logits
            keep = slice(None) if not kw else (mask.bool()[..., None].expand_as(want))
            torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


def test_t5_position_bias(calls):
    """T5 passes its learned relative bias as `position_bias` (SDPA adds it to the scores; it used
    to raise here): logits with padded encoder and decoder rows, gradients (the relative bias's
    included), greedy generate() with the encoder-decoder cache, and output_attentions against eager."""
    cfg = transformers.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    ref = transformers.AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation="sdpa").eval()
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(AE)
    if ours.config._attn_implementation != AE:  # older transformers: T5 not on AttentionInterface
        pytest.skip("this transformers' T5 does not take registered attention implementations")
    g = torch.Generator().manual_seed(1)
    ids, dec = torch.randint(2, V, (B, L), generator=g), torch.randint(2, V, (B, 6), generator=g)
    mask, dmask = torch.ones(B, L, dtype=torch.long), torch.ones(B, 6, dtype=torch.long)
    mask[0, L - PAD:] = 0
    dmask[1, 4:] = 0
    kw = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dmask)
    keep = dmask.bool()
    with torch.no_grad():
        assert rel_err(ours(**kw).logits[keep], ref(**kw).logits[keep]) < 1e-5
        assert calls[0] == 3 * cfg.num_layers  # encoder self, decoder self and cross attention
        gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(ours.generate(ids, **gen), ref.generate(ids, **gen))
        eager = copy.deepcopy(ref)
        eager.set_attn_implementation("eager")
        want, got = eager(**kw, output_attentions=True), ours(**kw, output_attentions=True)
        rows = mask.bool()[:, None, :, None]  # the encoder's padded query rows: implementation-defined
        assert rel_err(got.encoder_attentions[0] * rows, want.encoder_attentions[0] * rows) < 1e-5
        assert rel_err(got.cross_attentions[1][1], want.cross_attentions[1][1]) < 1e-5
    for m in (ref, ours):
        m.train()
        torch.nn.functional.cross_entropy(m(**kw).logits[keep], dec[keep]).backward()
    grads = dict(ref.named_parameters())
    for pname, p in ours.named_parameters():
        assert rel_err(p.grad, grads[pname].grad) < 1e-4, pname
    assert ours.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad.any()


def test_import_does_not_import_transformers():
    """The module imports transformers only inside register()."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = "import sys, attention_ext.integrations.transformers as m; print('transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_register_rejects_taken_and_unusable_names():
    """register() over a transformers implementation would swap it for every model in the process
    (register("eager") left GPT-2's reorder_and_upcast_attn eager path adding our bool masks to its
    scores: wrong logits, no error); a name with '/' (a Hub kernel to transformers), a 'paged|'
    prefix, an empty name and a non-str raise too, and nothing is registered."""
    ifc, mifc = transformers.AttentionInterface, transformers.masking_utils.AttentionMaskInterface
    before = (dict(ifc._global_mapping), dict(mifc._global_mapping))
    for name in ("eager", "sdpa", "flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match=f"'{name}' is already a transformers attention implementation.*new name"):
            ae_hf.register(name)
    for name in ("org/kernel", "paged|attention_ext", ""):
        with pytest.raises(ValueError, match=r"register\(name=\.\.\.\).*plain name"):
            ae_hf.register(name)
    with pytest.raises(TypeError, match="name must be a str"):
        ae_hf.register(None)
    assert (dict(ifc._global_mapping), dict(mifc._global_mapping)) == before
    ae_hf.register(AE)  # idempotent
    assert ifc._global_mapping[AE] is ae_hf.attention_forward


def test_register_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r'pip install "transformers>=4.53"'):
        ae_hf.register()


@pytest.mark.parametrize("padded", [False, True], ids=["full", "padded"])
@pytest.mark.parametrize("name", [p for p in DECODERS if p.values[0] in ("llama", "mistral")])
def test_generate_static_cache(name, padded, calls):
    """A StaticCache: unpadded, the prefill gets kv_len (the cache size) > q_len and no mask, which
    SDPA's top-left is_causal serves (the unwritten slots lie past every query); bottom-right
    would be wrong there."""
    ref, ours = _pair(name)
    ids, mask = _inputs(name, padded)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = ours.generate(ids, **kw)
    assert calls[0] == ours.config.num_hidden_layers * 6
    assert torch.equal(got, want)
