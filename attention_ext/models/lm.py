"""A decoder-only language model (GPT-style, pre-LN), top to bottom: config, model, sampling.

Generation keeps one preallocated KV cache per layer: the prompt is fed once (prefill), then one
token per step, and the attention over the cache is the fused kernel with causal aligned
bottom-right (the new query rows are the last rows of the cache). Linear attention layers keep
their recurrent state instead (O(1) per token). Sparse attention layers keep the KV cache and
read their layout's rows for the new token. LSH attention layers (Reformer) have no incremental
form: generate(use_cache=False) recomputes the prefix each step. Linformer is non-causal and has
no place in this model.

Batched generation of prompts of different lengths (`generate([p0, p1, ...])`) keeps a
PagedKVCache per layer instead: the prompts are prefilled packed into one row (varlen attention,
each to its own length), then every
decode step feeds all active sequences at once (each at its own position, ragged cache lengths,
attention_ext.decode.decode_fwd over the pages); a sequence that emits eos_token_id or reaches its
token budget stops and its pages go back to the pool.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.blocks import BlockConfig, EncoderBlock, make_norm
from ..nn.layers import AttentionConfig, KVCache, allocate_cache
from ..nn.paged_cache import PagedKVCache
from ..nn.positional import LearnedPositionalEmbedding


@dataclass
class LMConfig:
    vocab_size: int = 256
    block_size: int = 256                 # training context length
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None      # GQA / MQA
    d_model: int = 128
    d_ff: Optional[int] = None            # None: 4 * d_model (relu/gelu), 8/3 * d_model (swiglu)
    dropout: float = 0.0
    activation: str = "gelu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    positional: str = "rope"              # "rope" | "alibi" | "learned" | "none"
    window: Tuple[int, int] = (-1, -1)    # (left, -1): a causal sliding window over `left` past tokens
    sinks: bool = False
    attention_type: str = "softmax"
    feature_map: str = "elu"              # attention_type="linear"
    decay_gate: Union[bool, str] = False  # attention_type="linear": learned log-decays, per head or "feature" (GLA)
    decay_gate_rank: int = 0              # decay_gate: the gate projection's rank (0: full; GLA's 16)
    decay_gate_temperature: float = 1.0   # decay_gate: the log-gates' divisor (GLA's 16)
    delta_conv: int = 4                   # attention_type="gated_delta": short convolutions' kernel (0: none)
    sparse_pattern: str = "local_global"  # attention_type="sparse": see nn.SparseAttention
    sparse_block_size: int = 64           # attention_type="sparse"
    sparse_kwargs: Optional[Dict[str, Any]] = None  # attention_type="sparse": the pattern's options
    topk: int = 0                         # attention_type="sparse", sparse_pattern="topk"
    lsh_buckets: int = 8                  # attention_type="lsh": see nn.LSHAttention (generate(use_cache=False))
    lsh_hashes: int = 1                   # attention_type="lsh"
    lsh_chunk_size: int = 64              # attention_type="lsh"
    bias: bool = True
    tie_weights: bool = True              # the output projection is the token embedding (Press & Wolf)
    qk_quant: Optional[str] = None        # "int8" / "fp8": the 8-bit Q.K^T in no-grad forwards (AttentionConfig)

    def block(self) -> BlockConfig:
        d_ff = self.d_ff or (int(8 * self.d_model / 3) if self.activation == "swiglu" else 4 * self.d_model)
        attn = AttentionConfig(d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                               attention_type=self.attention_type, causal=True, window=self.window,
                               feature_map=self.feature_map, decay_gate=self.decay_gate,
                               decay_gate_rank=self.decay_gate_rank,
                               decay_gate_temperature=self.decay_gate_temperature,
                               delta_conv=self.delta_conv, sparse_pattern=self.sparse_pattern, sparse_block_size=self.sparse_block_size,
                               sparse_kwargs=self.sparse_kwargs, topk=self.topk, lsh_buckets=self.lsh_buckets,
                               lsh_hashes=self.lsh_hashes, lsh_chunk_size=self.lsh_chunk_size,
                               positional=self.positional, sinks=self.sinks, dropout=self.dropout, bias=self.bias,
                               qk_quant=self.qk_quant)
        return BlockConfig(attn=attn, d_ff=d_ff, activation=self.activation, norm=self.norm, norm_first=True,
                           dropout=self.dropout, norm_eps=self.norm_eps)


class LanguageModel(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = c = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.wpe = LearnedPositionalEmbedding(c.d_model, c.block_size) if c.positional == "learned" else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(EncoderBlock(c.block()) for _ in range(c.n_layers))
        self.ln_f = make_norm(c.norm, c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self._init_weights()
        if c.tie_weights:
            self.lm_head.weight = self.wte.weight

    def _init_weights(self) -> None:
        # GPT-2: N(0, 0.02) everywhere, zero biases, and the projections that write into the residual
        # stream scaled by 1/sqrt(2 * n_layers) so the stream's variance does not grow with depth
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
        for block in self.blocks:
            for proj in (block.self_attn.out_proj, block.ffn.w2):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.config.n_layers))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Optional[Tensor] = None, *, caches: Optional[List[KVCache]] = None,
                offset=0, context_parallel=None):
        """idx (B, T) tokens -> logits (B, T, V); (logits, loss) when targets (B, T) is given.
        With `caches`, idx are the tokens at positions offset .. offset + T - 1 (offset an int,
        or a (B,) tensor of per-sequence offsets with paged caches).

        Context parallelism (training over a sequence sharded across ranks): with
        context_parallel=ContextParallel(group, mode, shard_layout) (attention_ext.distributed), idx and
        targets are this rank's shards, cp.shard(tokens) of the (B, S) global ones (S a multiple of
        cp.multiple()), and the logits are this rank's (B, S / P, V). Positions (learned, RoPE,
        ALiBi, causal) are the global ones. The loss is the mean over THIS rank's tokens; every
        shard has S / P of them, so
            global mean loss = all_reduce(loss, SUM) / P
            (in general: all_reduce(sum of token losses) / all_reduce(token count)),
        and backward of each rank's loss followed by an all_reduce AVG of the parameter gradients
        (what DDP and FSDP do over the group) gives the gradient of the global mean loss; with
        a SUM all_reduce, backward loss / P instead."""
        cp = context_parallel
        if cp is not None:
            if caches is not None or not (isinstance(offset, int) and offset == 0):
                raise NotImplementedError("context_parallel runs whole sequences (no caches or offsets)")
            if self.config.attention_type != "softmax":
                raise NotImplementedError(f"context_parallel needs attention_type='softmax', "
                                          f"got {self.config.attention_type!r}")
            # (B, T) global positions of this shard's tokens
            offset = cp.positions(idx.shape[1], idx.device).expand(idx.shape[0], -1)
        x = self.wte(idx)  # (B, T, d_model)
        if self.wpe is not None:
            x = self.wpe(x, offset)
        x = self.drop(x)
        kw = {} if cp is None else {"context_parallel": cp}
        for i, block in enumerate(self.blocks):
            x = block(x, cache=caches[i] if caches is not None else None, **kw)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def allocate_caches(self, batch: int, max_len: int, *, device=None, dtype=torch.float32) -> List[KVCache]:
        a = self.config.block().attn
        return [allocate_cache(a, batch, max_len, device=device, dtype=dtype) for _ in self.blocks]

    def allocate_paged_caches(self, batch: int, num_pages: int, page_size: int = 16, *, max_len: Optional[int] = None,
                              device=None, dtype=torch.float32) -> List[PagedKVCache]:
        a = self.config.block().attn
        return [PagedKVCache(batch, num_pages, page_size, a.n_kv_heads, a.head_dim, max_len=max_len, device=device,
                             dtype=dtype) for _ in self.blocks]

    @torch.no_grad()
    def generate(self, idx: Union[Tensor, Sequence[Tensor]], max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, greedy: bool = False,
                 use_cache: bool = True, generator: Optional[torch.Generator] = None,
                 eos_token_id: Optional[int] = None, page_size: int = 16,
                 num_pages: Optional[int] = None, kv_cache_dtype: Optional[torch.dtype] = None
                 ) -> Union[Tensor, List[Tensor]]:
        """Extends idx (B, T0) by max_new_tokens tokens -> (B, T0 + max_new_tokens).

        idx may instead be a list of 1-D prompts of different lengths: they run batched on a paged
        KV cache (see the module docstring) and the result is a list of 1-D tensors, prompt i
        followed by its new tokens: max_new_tokens of them, or fewer when it emitted eos_token_id
        (kept as its last token). page_size / num_pages size the page pool (default: enough for
        every sequence at full length); an exhausted pool raises RuntimeError.

        eos_token_id with a (B, T0) idx: a row that emitted it continues with eos_token_id, and
        generation stops once every row has, so the result is (B, T0 + n), n <= max_new_tokens
        (as Transformer.greedy_decode pads after its eos_id).

        kv_cache_dtype: torch.int8 or torch.float8_e4m3fn stores the caches in 8 bits (a scale
        per row and kv head, attention_ext.nn.PagedKVCache): the run goes through the paged
        caches (a (B, T0) idx as B prompts of one length, the result stacked back). None: the
        model's dtype. max_new_tokens 0 returns the prompts as given.

        Generation runs in eval mode (no dropout; LSH layers hash with their fixed rotations),
        whatever the model's mode: each module's training flag is restored on return."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"generate: page_size must be an int >= 1, got {page_size!r}")
        _check_sampling(temperature, top_k, top_p)
        if isinstance(idx, Tensor) and (idx.dim() != 2 or idx.shape[1] == 0):
            raise ValueError(f"generate: idx must be (B, T0) token ids with T0 >= 1 (or a list of 1-D prompts), got "
                             f"shape {tuple(idx.shape)}")
        self._check_tokens(idx)
        if max_new_tokens == 0:
            return idx.clone() if isinstance(idx, Tensor) else [p.clone() for p in idx]
        # a model left in train mode would sample through dropout (and LSH's fresh rotations):
        # every module's own flag is kept and put back, so a partly frozen model stays as it was
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            return self._generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  greedy=greedy, use_cache=use_cache, generator=generator,
                                  eos_token_id=eos_token_id, page_size=page_size, num_pages=num_pages,
                                  kv_cache_dtype=kv_cache_dtype)
        finally:
            for m, training in modes:
                m.training = training

    def _check_tokens(self, idx: Union[Tensor, Sequence[Tensor]]) -> None:
        """generate's prompts: integer token ids in [0, vocab_size) (the embedding's own error for
        others names no argument). One device-to-host copy per prompt tensor."""
        prompts = [idx] if isinstance(idx, Tensor) else list(idx) if isinstance(idx, (list, tuple)) else None
        if prompts is None or not all(isinstance(p, Tensor) for p in prompts):
            raise TypeError(f"generate: idx must be a (B, T0) tensor of token ids or a list of 1-D token tensors, "
                            f"got {type(idx).__name__}")
        v = self.config.vocab_size
        for p in prompts:
            if p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
                raise TypeError(f"generate: token ids must be an integer tensor (torch.long), got {p.dtype}: "
                                "convert them with .long()")
            if p.numel() and not (0 <= int(p.min()) and int(p.max()) < v):
                raise ValueError(f"generate: token ids must lie in [0, vocab_size={v}), got ids from {int(p.min())} "
                                 f"to {int(p.max())}")

    def _generate(self, idx: Union[Tensor, Sequence[Tensor]], max_new_tokens: int, *, temperature: float,
                  top_k: Optional[int], top_p: Optional[float], greedy: bool, use_cache: bool,
                  generator: Optional[torch.Generator], eos_token_id: Optional[int], page_size: int,
                  num_pages: Optional[int], kv_cache_dtype: Optional[torch.dtype]) -> Union[Tensor, List[Tensor]]:
        """generate() after its argument checks, in eval mode."""
        paged = not isinstance(idx, Tensor) or kv_cache_dtype is not None
        at = self.config.block().attn.attention_type
        if paged and at not in ("softmax", "sdpa"):  # the paged caches' readers (Attention._decode_kernel_ok)
            keeps = "a state" if at in ("linear", "gated_delta") else "kernels of its own"
            fix = ("with use_cache=False (LSH attention has no cache)" if at == "lsh" else "with kv_cache_dtype=None")
            raise NotImplementedError(
                f"generate: a list of prompts and kv_cache_dtype run on paged KV caches, which "
                f"attention_type={at!r} does not read (it keeps {keeps}); pass the prompts as one (B, T0) "
                f"tensor of equal lengths {fix}")
        if kv_cache_dtype is not None and kv_cache_dtype not in (torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"generate: kv_cache_dtype must be None, torch.int8 or torch.float8_e4m3fn, got "
                             f"{kv_cache_dtype}")
        if kv_cache_dtype is not None and isinstance(idx, Tensor):
            if not use_cache or eos_token_id is not None:
                raise ValueError("generate: kv_cache_dtype with a (B, T0) idx needs use_cache=True and no "
                                 "eos_token_id (pass a list of prompts to stop sequences early)")
            out = self._generate(list(idx), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                 greedy=greedy, use_cache=True, generator=generator, eos_token_id=None,
                                 page_size=page_size, num_pages=num_pages, kv_cache_dtype=kv_cache_dtype)
            return torch.stack(out)
        if not isinstance(idx, Tensor):
            return self._generate_ragged(list(idx), max_new_tokens, temperature=temperature, top_k=top_k,
                                         top_p=top_p, greedy=greedy, generator=generator,
                                         eos_token_id=eos_token_id, page_size=page_size, num_pages=num_pages,
                                         kv_cache_dtype=kv_cache_dtype)
        b, t0 = idx.shape
        total = t0 + max_new_tokens
        learned = self.wpe is not None
        # the last new token is sampled, never fed: the model sees positions 0 .. total - 2
        if use_cache and learned and total - 1 > self.config.block_size:
            raise ValueError(f"learned positions stop at block_size={self.config.block_size}; a {t0}-token prompt "
                             f"and {max_new_tokens} new tokens feed {total - 1} positions (generate(use_cache=False) "
                             "slides a block_size window instead)")
        if use_cache:
            caches = self.allocate_caches(b, total - 1, device=idx.device, dtype=self.wte.weight.dtype)
            logits = self(idx, caches=caches)  # prefill
        done = None if eos_token_id is None else torch.zeros(b, dtype=torch.bool, device=idx.device)
        for t in range(max_new_tokens):
            if not use_cache:
                ctx = idx[:, -self.config.block_size:] if learned else idx
                logits = self(ctx)
            nxt = sample_next(logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                              generator=generator)  # (B, 1)
            if done is not None:  # a finished row continues with eos; all finished: stop
                nxt = nxt.masked_fill(done[:, None], eos_token_id)
                done |= nxt[:, 0] == eos_token_id
            idx = torch.cat([idx, nxt], dim=1)
            if done is not None and bool(done.all()):
                break
            if use_cache and t + 1 < max_new_tokens:
                logits = self(nxt, caches=caches, offset=t0 + t)
        return idx

    def _generate_ragged(self, prompts: List[Tensor], max_new_tokens: int, *, eos_token_id: Optional[int],
                         page_size: int, num_pages: Optional[int], kv_cache_dtype: Optional[torch.dtype] = None,
                         **sample) -> List[Tensor]:
        n = len(prompts)
        if n == 0 or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
            raise ValueError("generate: a list of prompts must hold non-empty 1-D token tensors")
        device = prompts[0].device
        lens = [p.numel() for p in prompts]
        # the last new token is sampled, never fed: the longest prompt feeds max(lens) + max_new_tokens - 1
        if self.wpe is not None and max(lens) + max_new_tokens - 1 > self.config.block_size:
            raise ValueError(f"learned positions stop at block_size={self.config.block_size}; a {max(lens)}-token "
                             f"prompt and {max_new_tokens} new tokens feed {max(lens) + max_new_tokens - 1} positions")
        max_len = max(lens) + max_new_tokens
        if num_pages is None:
            num_pages = sum(-(-(t + max_new_tokens) // page_size) for t in lens)
        caches = self.allocate_paged_caches(n, num_pages, page_size, max_len=max_len, device=device,
                                            dtype=kv_cache_dtype or self.wte.weight.dtype)

        def run(tokens: Tensor, rows: List[int], packed: Optional[List[int]] = None) -> Tensor:
            for cache in caches:
                cache.select(rows, packed)
            return self(tokens, caches=caches, offset=caches[0].positions())  # (b, T, V)

        # prefill: the prompts packed into one row, each attending to its own rows only (varlen)
        ends = torch.tensor(lens, device=device).cumsum(0) - 1
        last = run(torch.cat(prompts).view(1, -1), list(range(n)), lens)[0, ends]  # (n, V)
        out: List[List[Tensor]] = [[p] for p in prompts]
        count = [0] * n
        active = list(range(n))
        while active:
            nxt = sample_next(last, **sample)  # (b, 1)
            still = []
            for j, i in enumerate(active):
                out[i].append(nxt[j])
                count[i] += 1
                if count[i] >= max_new_tokens or (eos_token_id is not None and int(nxt[j]) == eos_token_id):
                    for cache in caches:
                        cache.free(i)
                else:
                    still.append(j)
            if not still:
                break
            keep = torch.tensor(still, device=device)
            active = [active[j] for j in still]
            last = run(nxt[keep], active)[:, -1]
        return [torch.cat(o) for o in out]


def _check_sampling(temperature, top_k, top_p) -> None:
    """sample_next's argument rules (also checked by generate() before it runs the prompt)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be None or an int >= 0 (0 or None: no top-k filter), got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 <= top_p <= 1):
        raise ValueError(f"top_p must be None or a number in [0, 1], got {top_p!r}")


def sample_next(logits: Tensor, *, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, greedy: bool = False,
                generator: Optional[torch.Generator] = None) -> Tensor:
    """logits (B, V) -> next tokens (B, 1). Greedy (or temperature 0) takes the argmax; otherwise
    sample softmax(logits / temperature) restricted to the top_k tokens (0 or None: all) and to
    the smallest set whose probability reaches top_p (nucleus sampling, Holtzman et al.; the most
    likely token always stays, so top_p = 0 keeps it alone)."""
    _check_sampling(temperature, top_k, top_p)
    if greedy or temperature == 0.0:
        return logits.argmax(-1, keepdim=True)
    # shifted by the row's max before the division: a tiny temperature then sends the others to
    # -inf and keeps the max at 0, where logits / temperature would overflow to inf (inf - inf: NaN)
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)
