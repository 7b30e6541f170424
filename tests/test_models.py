"""attention_ext.models: nn.Transformer parity with copied weights, KV-cache generation equal to
generation without a cache, sampling, weight tying."""
import pytest
import torch

from attention_ext.models import (LanguageModel, LMConfig, Transformer, TransformerConfig, TransformerDecoder,
                                  TransformerEncoder, load_torch_transformer, sample_next)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True:UserWarning")
@pytest.mark.parametrize("norm_first", [False, True])
def test_nn_transformer_parity(norm_first):
    torch.manual_seed(0)
    d, h, ff = 32, 4, 64
    ref = torch.nn.Transformer(d_model=d, nhead=h, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=ff,
                               dropout=0.0, activation="relu", batch_first=True, norm_first=norm_first)
    cfg = TransformerConfig(d_model=d, n_heads=h, n_encoder_layers=2, n_decoder_layers=2, d_ff=ff, dropout=0.0,
                            norm_first=norm_first)
    enc, dec = TransformerEncoder(cfg), TransformerDecoder(cfg)
    load_torch_transformer(enc, dec, ref)
    b, s, t = 3, 9, 7
    src, tgt = torch.randn(b, s, d), torch.randn(b, t, d)
    lengths = torch.tensor([9, 5, 2])
    src_pad = torch.arange(s).unsqueeze(0) >= lengths.unsqueeze(1)  # torch: True = ignore
    tgt_mask = torch.nn.Transformer.generate_square_subsequent_mask(t)
    out_ref = ref(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
                  tgt_is_causal=True)
    mem_ref = ref.encoder(src, src_key_padding_mask=src_pad)
    mem = enc(src, lengths=lengths)
    out = dec(tgt, mem, memory_lengths=lengths)
    valid = ~src_pad
    torch.testing.assert_close(mem[valid], mem_ref[valid], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-4)
    # gradients agree too
    out.square().sum().backward()
    out_ref.square().sum().backward()
    g, g_ref = dec.layers[0].ffn.w1.weight.grad, ref.decoder.layers[0].linear1.weight.grad
    torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)
    g, g_ref = enc.layers[0].self_attn.q_proj.weight.grad, ref.encoder.layers[0].self_attn.in_proj_weight.grad[:d]
    torch.testing.assert_close(g, g_ref, atol=1e-4, rtol=1e-4)


def test_transformer_default_is_the_base_model():
    c = TransformerConfig()
    assert (c.n_encoder_layers, c.n_decoder_layers, c.d_model, c.n_heads, c.d_ff) == (6, 6, 512, 8, 2048)
    assert not c.norm_first and c.activation == "relu"


def _small_seq2seq(**kw):
    torch.manual_seed(0)
    cfg = dict(src_vocab_size=13, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64,
               dropout=0.0)
    cfg.update(kw)
    return Transformer(TransformerConfig(**cfg)).eval()


@pytest.mark.parametrize("kw", [dict(), dict(positional="rope", n_kv_heads=2, norm_first=True),
                                dict(positional="alibi", tie_embeddings=True), dict(positional="learned")])
def test_seq2seq_forward_and_cached_greedy(kw):
    model = _small_seq2seq(**kw)
    src = torch.randint(3, 13, (4, 8))
    lengths = torch.tensor([8, 6, 3, 1])
    tgt = torch.randint(3, 13, (4, 5))
    logits, loss = model(src, tgt, lengths, targets=tgt)
    assert logits.shape == (4, 5, 13) and loss.ndim == 0
    loss.backward()
    # padded source positions do not change anything
    src2 = src.clone()
    src2[2, 3:] = 5
    torch.testing.assert_close(model(src2, tgt, lengths), logits, atol=1e-5, rtol=1e-5)
    a = model.greedy_decode(src, lengths, bos_id=1, eos_id=2, max_new_tokens=10)
    b = model.greedy_decode(src, lengths, bos_id=1, eos_id=2, max_new_tokens=10, use_cache=False)
    assert torch.equal(a, b)


def _small_lm(**kw):
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, block_size=48, n_layers=2, n_heads=4, d_model=32)
    cfg.update(kw)
    return LanguageModel(LMConfig(**cfg)).eval()


LM_CASES = [dict(), dict(positional="learned"), dict(positional="alibi", n_kv_heads=1),
            dict(positional="rope", n_kv_heads=2, window=(6, -1), activation="swiglu", norm="rmsnorm"),
            dict(sinks=True)]


@pytest.mark.parametrize("kw", LM_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_generate_with_cache_equals_without(kw):
    model = _small_lm(**kw)
    if model.blocks[0].self_attn.sinks is not None:
        for blk in model.blocks:
            torch.nn.init.normal_(blk.self_attn.sinks)
    prompt = torch.randint(0, 40, (3, 5))
    a = model.generate(prompt, 20, greedy=True)
    b = model.generate(prompt, 20, greedy=True, use_cache=False)
    assert a.shape == (3, 25) and torch.equal(a[:, :5], prompt)
    assert torch.equal(a, b)
    for opts in (dict(temperature=0.8, top_k=10), dict(temperature=1.2, top_p=0.9)):
        a = model.generate(prompt, 20, generator=torch.Generator().manual_seed(7), **opts)
        b = model.generate(prompt, 20, use_cache=False, generator=torch.Generator().manual_seed(7), **opts)
        assert torch.equal(a, b)


def test_lm_weight_tying_and_loss():
    model = _small_lm()
    assert model.lm_head.weight is model.wte.weight
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, 40, (2, 16))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert logits.shape == (2, 15, 40)
    assert abs(loss.item() - torch.log(torch.tensor(40.0)).item()) < 0.5  # near-uniform at init
    loss.backward()
    assert model.wte.weight.grad is not None
    untied = _small_lm(tie_weights=False)
    assert untied.lm_head.weight is not untied.wte.weight
    with pytest.raises(ValueError, match="block_size"):
        _small_lm(positional="learned").generate(idx, 40)


def test_sample_next():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert sample_next(logits, greedy=True).tolist() == [[1], [0]]
    assert sample_next(logits, temperature=0.0).tolist() == [[1], [0]]
    assert sample_next(logits, top_k=1, generator=gen).tolist() == [[1], [0]]
    assert sample_next(logits, top_p=1e-3, generator=gen).tolist() == [[1], [0]]
    draws = torch.cat([sample_next(logits, top_k=2, generator=gen) for _ in range(200)], 1)
    assert set(draws[0].tolist()) == {1, 3}
    # top_p = 0.85 on probs (0.7, 0.2, 0.1): the smallest set reaching 0.85 is the first two
    lp = torch.tensor([[0.7, 0.2, 0.1]]).log()
    draws = torch.cat([sample_next(lp, top_p=0.85, generator=gen) for _ in range(300)], 1)
    assert set(draws[0].tolist()) == {0, 1}


def test_generate_runs_in_eval_mode_and_restores_the_flags():
    """A model left in train mode generates as in eval mode (no dropout), and every module's own
    training flag is back afterwards, a frozen (eval) submodule included."""
    model = _small_lm(dropout=0.5, positional="learned")
    prompt = torch.randint(0, 40, (2, 5))
    want = model.generate(prompt, 8, greedy=True)  # _small_lm returns the model in eval mode
    want_ragged = model.generate(list(prompt), 8, greedy=True)
    model.train()
    model.blocks[0].eval()
    for kw in (dict(), dict(use_cache=False)):
        assert torch.equal(model.generate(prompt, 8, greedy=True, **kw), want)
    for a, b in zip(model.generate(list(prompt), 8, greedy=True), want_ragged):
        assert torch.equal(a, b)
    assert model.training and model.blocks[1].self_attn.training
    assert not any(m.training for m in model.blocks[0].modules())
    seq2seq = _small_seq2seq(dropout=0.5)
    src = torch.randint(3, 13, (3, 8))
    want = seq2seq.greedy_decode(src, None, bos_id=1, eos_id=2, max_new_tokens=6)
    seq2seq.train()
    assert torch.equal(seq2seq.greedy_decode(src, None, bos_id=1, eos_id=2, max_new_tokens=6), want)
    assert seq2seq.training and seq2seq.decoder.layers[0].dropout1.training


def test_generate_from_a_prompt_at_block_size():
    """The last new token is sampled, never fed: a block_size-token prompt with learned positions
    takes one new token (the positions it feeds: block_size), as it does without a cache."""
    model = _small_lm(positional="learned")  # block_size 48
    prompt = torch.randint(0, 40, (2, 48))
    a = model.generate(prompt, 1, greedy=True)
    assert a.shape == (2, 49) and torch.equal(a, model.generate(prompt, 1, greedy=True, use_cache=False))
    outs = model.generate([prompt[0], prompt[1, :20]], 1, greedy=True)
    assert torch.equal(outs[0], a[0])
    a = model.generate(prompt[:, :40], 9, greedy=True)
    assert torch.equal(a, model.generate(prompt[:, :40], 9, greedy=True, use_cache=False))
    for idx in (prompt, [prompt[0], prompt[1, :3]]):
        with pytest.raises(ValueError, match="block_size=48.*feed 49 positions"):
            model.generate(idx, 2)


def test_generate_eos_with_a_tensor_prompt():
    """eos_token_id with a (B, T0) idx: a row that emitted it continues with it, and generation
    stops once every row has."""
    model = _small_lm()
    prompt = torch.randint(0, 40, (3, 5))

    def run(**kw):  # sampled (greedy repeats one token at init); one draw per step either way
        return model.generate(prompt, 12, generator=torch.Generator().manual_seed(3), **kw)
    full = run()
    eos = int(full[1, 7])  # row 1's third new token
    stops = [row[5:].tolist().index(eos) + 1 if eos in row[5:].tolist() else 12 for row in full]
    assert sorted(stops)[0] < 12 and len(set(stops)) > 1
    for kw in (dict(), dict(use_cache=False)):
        out = run(eos_token_id=eos, **kw)
        assert out.shape == (3, 5 + max(stops))
        for row, f, stop in zip(out, full, stops):
            assert row[: 5 + stop].tolist() == f[: 5 + stop].tolist()
            assert (row[5 + stop:] == eos).all()


def test_generate_checks_token_ids():
    model = _small_lm()
    with pytest.raises(TypeError, match=r"integer tensor.*\.long\(\)"):
        model.generate(torch.zeros(1, 3), 2)
    for idx in (torch.tensor([[1, 40]]), [torch.tensor([3]), torch.tensor([-1, 2])]):
        with pytest.raises(ValueError, match=r"token ids must lie in \[0, vocab_size=40\)"):
            model.generate(idx, 2)
    assert model.generate(torch.tensor([[0, 39]], dtype=torch.int32), 1).shape == (1, 3)


def test_sample_next_tiny_temperature_is_greedy():
    """logits / 1e-45 overflow to inf (and inf - inf to NaN in the softmax): the row's max is
    taken off first, so a tiny temperature samples the argmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, -1.0, float("-inf")]])
    gen = torch.Generator().manual_seed(0)
    for t in (1e-45, 1e-30):
        for kw in (dict(), dict(top_k=2), dict(top_p=0.9)):
            assert sample_next(logits, temperature=t, generator=gen, **kw).tolist() == [[1], [0]]


def test_load_torch_transformer_names_a_layer_count_mismatch():
    """A stack with another layer count than the nn.Transformer's is refused by name (before, a
    bare zip() error on Python 3.10+, and a TypeError on 3.9, which the package supports)."""
    ref = torch.nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=64,
                               batch_first=True)
    cfg = TransformerConfig(d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=64)
    with pytest.raises(ValueError, match=r"the decoder has 2 layers, the nn.Transformer's decoder 1"):
        load_torch_transformer(TransformerEncoder(cfg), TransformerDecoder(cfg), ref)
