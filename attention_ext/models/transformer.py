"""The encoder-decoder Transformer ("Attention Is All You Need"), top to bottom.

    TransformerConfig -> TransformerEncoder (stack of EncoderBlock + final norm)
                      -> TransformerDecoder (stack of DecoderBlock + final norm)
                      -> Transformer (embeddings, positions, encoder, decoder, output head, decoding)

The defaults are the paper's base model: 6 + 6 layers, d_model 512, 8 heads, d_ff 2048, ReLU,
post-LN, dropout 0.1. Like torch.nn.Transformer, each stack ends with a LayerNorm, so with
weights copied (`load_torch_transformer`) the stacks compute what nn.Transformer computes.
Source padding comes in as lengths and reaches the kernel as `seqlens_k`, not as a mask tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._args import key_padding_mask_renamed
from ..nn.blocks import BlockConfig, DecoderBlock, EncoderBlock, make_norm
from ..nn.blocks import cross_config
from ..nn.layers import AttentionConfig, KVCache, allocate_cache
from ..nn.positional import Embeddings, LearnedPositionalEmbedding, SinusoidalPositionalEncoding


@dataclass
class TransformerConfig:
    src_vocab_size: int = 32000
    tgt_vocab_size: Optional[int] = None   # None: same as src_vocab_size
    d_model: int = 512
    n_heads: int = 8
    n_kv_heads: Optional[int] = None       # GQA/MQA in every attention layer
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    activation: str = "relu"
    norm: str = "layernorm"
    norm_first: bool = False               # post-LN as in the paper
    norm_eps: float = 1e-5
    positional: str = "sinusoidal"         # "sinusoidal" | "learned" | "rope" | "alibi" | "none"
    max_len: int = 512
    window: Tuple[int, int] = (-1, -1)     # sliding window of the self-attention layers
    sinks: bool = False
    attention_type: str = "softmax"
    decoder_attention_type: Optional[str] = None  # the decoder's (self and cross); None: attention_type
    feature_map: str = "elu"               # attention_type="linear"
    sparse_pattern: str = "local_global"   # attention_type="sparse" (self-attention; cross-attention stays dense)
    sparse_block_size: int = 64            # attention_type="sparse"
    sparse_kwargs: Optional[Dict[str, Any]] = None  # attention_type="sparse": the pattern's options
    topk: int = 0                          # attention_type="sparse", sparse_pattern="topk"
    linformer_k: int = 64                  # attention_type="linformer" (encoder only; max_len is its max length)
    linformer_share: str = "headwise"      # attention_type="linformer": "headwise", "kv" or "none"
    lsh_buckets: int = 8                   # attention_type="lsh" (cross-attention stays softmax)
    lsh_hashes: int = 1                    # attention_type="lsh"
    lsh_chunk_size: int = 64               # attention_type="lsh"
    bias: bool = True
    tie_embeddings: bool = False           # share the target embedding and the output projection
    pad_id: int = 0

    def attn(self, causal: bool) -> AttentionConfig:
        """The encoder's attention config (causal=False), or the decoder's (causal=True: its
        decoder_attention_type, so that a non-causal type such as "linformer" can serve the encoder
        alone)."""
        kind = self.attention_type if not causal or self.decoder_attention_type is None else self.decoder_attention_type
        return AttentionConfig(d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                               attention_type=kind, causal=causal, window=self.window,
                               feature_map=self.feature_map, positional=self.positional, sinks=self.sinks,
                               sparse_pattern=self.sparse_pattern, sparse_block_size=self.sparse_block_size,
                               sparse_kwargs=self.sparse_kwargs, topk=self.topk, linformer_k=self.linformer_k,
                               linformer_max_len=self.max_len, linformer_share=self.linformer_share,
                               lsh_buckets=self.lsh_buckets, lsh_hashes=self.lsh_hashes,
                               lsh_chunk_size=self.lsh_chunk_size, dropout=self.dropout, bias=self.bias)

    def block(self, causal: bool) -> BlockConfig:
        return BlockConfig(attn=self.attn(causal), d_ff=self.d_ff, activation=self.activation, norm=self.norm,
                           norm_first=self.norm_first, dropout=self.dropout, norm_eps=self.norm_eps)


class TransformerEncoder(nn.Module):
    """(B, S, d_model) embeddings -> (B, S, d_model) memory."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderBlock(config.block(causal=False)) for _ in range(config.n_encoder_layers))
        self.norm = make_norm(config.norm, config.d_model, config.norm_eps)

    def forward(self, x: Tensor, *, lengths: Optional[Tensor] = None, key_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None, key_padding_mask: None = None) -> Tensor:
        """lengths (B,) valid source lengths; key_mask (B, S) True = a real key (torch's
        key_padding_mask, True = padding, is refused: pass key_mask=~it); attn_mask True = attend."""
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("TransformerEncoder.forward()")
        for layer in self.layers:
            x = layer(x, seqlens_k=lengths, key_mask=key_mask, attn_mask=attn_mask)
        return self.norm(x)


class TransformerDecoder(nn.Module):
    """(B, T, d_model) target embeddings + (B, S, d_model) memory -> (B, T, d_model)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderBlock(config.block(causal=True)) for _ in range(config.n_decoder_layers))
        self.norm = make_norm(config.norm, config.d_model, config.norm_eps)

    def forward(self, x: Tensor, memory: Tensor, *, memory_lengths: Optional[Tensor] = None,
                memory_key_mask: Optional[Tensor] = None, key_mask: Optional[Tensor] = None,
                caches: Optional[List[Tuple[KVCache, KVCache]]] = None, key_padding_mask: None = None,
                memory_key_padding_mask: None = None) -> Tensor:
        """key_mask (B, T) / memory_key_mask (B, S): True = a real key (torch's key_padding_mask
        and memory_key_padding_mask, True = padding, are refused: pass the masks inverted)."""
        if key_padding_mask is not None:
            raise key_padding_mask_renamed("TransformerDecoder.forward()")
        if memory_key_padding_mask is not None:
            raise key_padding_mask_renamed("TransformerDecoder.forward()", "memory_key_padding_mask", "memory_key_mask")
        for i, layer in enumerate(self.layers):
            cache, cross_cache = caches[i] if caches is not None else (None, None)
            x = layer(x, memory, key_mask=key_mask, memory_seqlens=memory_lengths,
                      memory_key_mask=memory_key_mask, cache=cache, cross_cache=cross_cache)
        return self.norm(x)

    def allocate_caches(self, batch: int, max_len: int, memory_len: int, *, device=None,
                        dtype=torch.float32) -> List[Tuple[KVCache, KVCache]]:
        """One (self-attention, cross-attention) cache pair per layer, preallocated."""
        a = self.config.attn(causal=True)
        return [(allocate_cache(a, batch, max_len, device=device, dtype=dtype),
                 allocate_cache(cross_config(a), batch, memory_len, device=device, dtype=dtype, static=True))
                for _ in self.layers]


class Transformer(nn.Module):
    """Token-level encoder-decoder: forward(src, tgt_in) -> logits (B, T, tgt_vocab)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = c = config
        tgt_vocab = c.tgt_vocab_size or c.src_vocab_size
        self.src_embed = Embeddings(c.src_vocab_size, c.d_model)
        self.tgt_embed = Embeddings(tgt_vocab, c.d_model)
        if c.positional == "sinusoidal":
            self.pos = SinusoidalPositionalEncoding(c.d_model, c.max_len, c.dropout)
        elif c.positional == "learned":
            self.pos = LearnedPositionalEmbedding(c.d_model, c.max_len, c.dropout)
        else:  # rope / alibi live inside the attention layers
            self.pos = None
        self.encoder = TransformerEncoder(c)
        self.decoder = TransformerDecoder(c)
        self.lm_head = nn.Linear(c.d_model, tgt_vocab, bias=False)
        self._init_weights()
        if c.tie_embeddings:
            self.lm_head.weight = self.tgt_embed.lut.weight

    def _init_weights(self) -> None:
        # nn.Transformer's init: Xavier-uniform for every matrix; embeddings N(0, d^-1/2) so that
        # after the sqrt(d) scale they have unit variance. A stack of per-head matrices (Linformer's
        # (H_k, r, max_len) projections) keeps its module's per-matrix init
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.xavier_uniform_(p)
        for emb in (self.src_embed, self.tgt_embed):
            nn.init.normal_(emb.lut.weight, std=self.config.d_model ** -0.5)

    def _embed(self, embed: Embeddings, tokens: Tensor, offset: int = 0) -> Tensor:
        x = embed(tokens)  # (B, S, d_model)
        if self.pos is not None:
            x = self.pos(x, offset)
        return x

    def encode(self, src: Tensor, src_lengths: Optional[Tensor] = None) -> Tensor:
        return self.encoder(self._embed(self.src_embed, src), lengths=src_lengths)  # (B, S, d_model)

    def decode(self, tgt: Tensor, memory: Tensor, src_lengths: Optional[Tensor] = None, *, caches=None,
               offset: int = 0) -> Tensor:
        x = self._embed(self.tgt_embed, tgt, offset)
        return self.lm_head(self.decoder(x, memory, memory_lengths=src_lengths, caches=caches))  # (B, T, V)

    def forward(self, src: Tensor, tgt: Tensor, src_lengths: Optional[Tensor] = None,
                targets: Optional[Tensor] = None):
        """src (B, S), tgt (B, T) decoder inputs (BOS + shifted targets). Returns logits, or
        (logits, loss) when `targets` (B, T) is given; pad_id targets are ignored in the loss."""
        logits = self.decode(tgt, self.encode(src, src_lengths), src_lengths)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=self.config.pad_id)
        return logits, loss

    @torch.no_grad()
    def greedy_decode(self, src: Tensor, src_lengths: Optional[Tensor], bos_id: int, eos_id: int,
                      max_new_tokens: int, use_cache: bool = True,
                      kv_cache_dtype: Optional[torch.dtype] = None) -> Tensor:
        """Greedy decoding. Returns (B, <= max_new_tokens) tokens, eos included; after a
        sequence's EOS it is padded with eos_id. With `use_cache` each step feeds one token
        through preallocated self-attention caches, and the cross-attention K/V of the memory are
        computed once. kv_cache_dtype: torch.int8 or torch.float8_e4m3fn stores both caches in 8
        bits (a scale per row and kv head; the decode kernel reads them). Decoding runs in eval
        mode (no dropout), whatever the model's mode: each module's training flag is restored on
        return."""
        # a model left in train mode would decode through dropout: every module's own flag is kept
        # and put back, so a partly frozen model stays as it was
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            return self._greedy_decode(src, src_lengths, bos_id, eos_id, max_new_tokens, use_cache, kv_cache_dtype)
        finally:
            for m, training in modes:
                m.training = training

    def _greedy_decode(self, src: Tensor, src_lengths: Optional[Tensor], bos_id: int, eos_id: int,
                       max_new_tokens: int, use_cache: bool, kv_cache_dtype: Optional[torch.dtype]) -> Tensor:
        """greedy_decode() in eval mode."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"greedy_decode: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if kv_cache_dtype is not None and (kv_cache_dtype not in (torch.int8, torch.float8_e4m3fn) or not use_cache):
            raise ValueError(f"greedy_decode: kv_cache_dtype must be None, torch.int8 or torch.float8_e4m3fn (with "
                             f"use_cache=True), got {kv_cache_dtype}")
        b = src.shape[0]
        memory = self.encode(src, src_lengths)
        out = torch.full((b, 1), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(b, dtype=torch.bool, device=src.device)
        caches = (self.decoder.allocate_caches(b, max_new_tokens + 1, memory.shape[1], device=src.device,
                                               dtype=kv_cache_dtype or memory.dtype) if use_cache else None)
        for t in range(max_new_tokens):
            if use_cache:
                logits = self.decode(out[:, -1:], memory, src_lengths, caches=caches, offset=t)
            else:
                logits = self.decode(out, memory, src_lengths)
            nxt = logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            out = torch.cat([out, nxt.unsqueeze(1)], dim=1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
        return out[:, 1:]


def load_torch_transformer(encoder: TransformerEncoder, decoder: TransformerDecoder, ref: nn.Transformer) -> None:
    """Copies a torch.nn.Transformer's weights into our stacks (same d_model, heads, layers, d_ff;
    MHA attention, i.e. n_kv_heads = n_heads). torch packs W_q, W_k, W_v into in_proj_weight."""

    def attn(ours, theirs):
        wq, wk, wv = theirs.in_proj_weight.detach().chunk(3)
        ours.q_proj.weight.copy_(wq)
        ours.k_proj.weight.copy_(wk)
        ours.v_proj.weight.copy_(wv)
        if theirs.in_proj_bias is not None:
            bq, bk, bv = theirs.in_proj_bias.detach().chunk(3)
            ours.q_proj.bias.copy_(bq)
            ours.k_proj.bias.copy_(bk)
            ours.v_proj.bias.copy_(bv)
        ours.out_proj.load_state_dict(theirs.out_proj.state_dict())

    def ffn(ours, theirs):
        ours.w1.load_state_dict(theirs.linear1.state_dict())
        ours.w2.load_state_dict(theirs.linear2.state_dict())

    for name, mine, torchs in (("encoder", encoder.layers, ref.encoder.layers),
                               ("decoder", decoder.layers, ref.decoder.layers)):
        if len(mine) != len(torchs):  # zip(strict=True) would say neither which stack nor how (and is Python 3.10+)
            raise ValueError(f"load_torch_transformer: the {name} has {len(mine)} layers, the nn.Transformer's "
                             f"{name} {len(torchs)}: build the {name} with as many")
    with torch.no_grad():
        for ours, theirs in zip(encoder.layers, ref.encoder.layers):
            attn(ours.self_attn, theirs.self_attn)
            ffn(ours.ffn, theirs)
            ours.norm1.load_state_dict(theirs.norm1.state_dict())
            ours.norm2.load_state_dict(theirs.norm2.state_dict())
        for ours, theirs in zip(decoder.layers, ref.decoder.layers):
            attn(ours.self_attn, theirs.self_attn)
            attn(ours.cross_attn, theirs.multihead_attn)
            ffn(ours.ffn, theirs)
            for i in (1, 2, 3):
                getattr(ours, f"norm{i}").load_state_dict(getattr(theirs, f"norm{i}").state_dict())
        encoder.norm.load_state_dict(ref.encoder.norm.state_dict())
        decoder.norm.load_state_dict(ref.decoder.norm.state_dict())
