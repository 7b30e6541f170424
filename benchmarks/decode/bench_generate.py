"""Batched generation of ragged prompts: our paged path (LanguageModel.generate on a list of
prompts: PagedKVCache + attention_ext.decode.decode_fwd) against THE SAME MODEL on torch SDPA with a
contiguous preallocated cache, the way a torch user would write it: prompts left-padded into one
batch, a bool key-padding mask, enable_gqa (no repeated K/V), one batched prefill and 128 batched
decode steps. Greedy, fp32, CPU. Tokens/s counts new tokens only; contenders run interleaved.

    python benchmarks/decode/bench_generate.py [--reps 3] [--new 128] [--threads N]
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import interleaved  # noqa: E402

from attention_ext import _ext  # noqa: E402
from attention_ext.models.lm import LanguageModel, LMConfig  # noqa: E402
from attention_ext.nn import KVCache, register_attention_type  # noqa: E402


@register_attention_type("sdpa_padded")
def _sdpa_padded(q, k, v, *, key_mask=None, causal=False, **_):
    """torch SDPA with a bool mask: key padding, causal aligned bottom-right, and each query
    row may see its own key (so left-pad rows are not all -inf -> NaN)."""
    sq, sk = q.shape[1], k.shape[1]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    mask = key_mask[:, None, None, :]  # (B, 1, 1, S_k) True = attend
    if causal and sq > 1:
        i = torch.arange(sq)[:, None] + (sk - sq)
        j = torch.arange(sk)[None, :]
        mask = (mask & (j <= i)) | (j == i)  # (B, 1, S_q, S_k)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


@torch.no_grad()
def sdpa_generate(model: LanguageModel, prompts, new: int):
    """Left-padded batch on a contiguous KVCache per layer; RoPE is relative, so the left pad
    does not change the real tokens' scores."""
    b, tmax = len(prompts), max(p.numel() for p in prompts)
    total = tmax + new
    idx = torch.zeros(b, tmax, dtype=torch.long)
    kpm = torch.zeros(b, total, dtype=torch.bool)
    for i, p in enumerate(prompts):
        idx[i, tmax - p.numel():] = p
        kpm[i, tmax - p.numel():] = True
    kpm[:, tmax:] = True
    caches = model.allocate_caches(b, total)
    x, pos, outs = idx, 0, []
    for t in range(new):
        s = x.shape[1]
        h = model.wte(x)
        for blk, c in zip(model.blocks, caches):
            h = blk(h, key_mask=kpm[:, : pos + s], cache=c)
        x = model.lm_head(model.ln_f(h[:, -1:])).argmax(-1)  # (B, 1)
        pos += s
        outs.append(x)
    return torch.cat(outs, 1)  # (B, new)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = dict(vocab_size=512, block_size=512, n_layers=4, d_model=256, n_heads=8, n_kv_heads=2, positional="rope")
    torch.manual_seed(0)
    ours = LanguageModel(LMConfig(**cfg)).eval()
    base = LanguageModel(LMConfig(**cfg, attention_type="sdpa_padded")).eval()
    base.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(0)
    lens = [16, 40, 64, 88, 112, 136, 168, 200]
    prompts = [torch.randint(0, cfg["vocab_size"], (t,), generator=g) for t in lens]
    print(f"CPU: {platform.processor() or platform.machine()}, ISA {_ext.cpu_isa()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"model: {cfg}; prompts {lens}; {a.new} new tokens each, greedy, fp32")

    mine = ours.generate(prompts, a.new, greedy=True)
    theirs = sdpa_generate(base, prompts, a.new)
    same = sum(int(torch.equal(m[p.numel():], t)) for m, p, t in zip(mine, prompts, theirs))
    print(f"token agreement paged vs sdpa: {same}/{len(prompts)} sequences identical")

    fns = {"paged (ours)": lambda: ours.generate(prompts, a.new, greedy=True),
           "sdpa contiguous": lambda: sdpa_generate(base, prompts, a.new)}
    t = interleaved(fns, warmup=1, reps=a.reps)
    ntok = len(prompts) * a.new
    print(f"{'path':<18}{'s/generate':>12}{'tokens/s':>12}")
    for k, v in t.items():
        print(f"{k:<18}{v:>12.3f}{ntok / v:>12.1f}")
    print(f"speedup paged / sdpa: {t['sdpa contiguous'] / t['paged (ours)']:.2f}x (median of {a.reps} interleaved reps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
