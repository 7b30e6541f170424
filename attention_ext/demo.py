"""`python -m attention_ext demo`: the package end to end, on a laptop CPU, with no downloads.

1. seq2seq: a small encoder-decoder Transformer learns to reverse random letter strings; reports
   held-out exact-sequence accuracy (greedy decoding with the KV cache), shows a few decodes and
   saves cross-attention heatmaps.
2. char LM: a small decoder-only Transformer trains on the Python standard library's own source
   files; reports validation bits per character against a unigram baseline and samples a few
   lines with KV-cache generation.
3. timings: forward+backward step time of the same model with our kernel and with torch SDPA
   (--variant linear / performer: our linear attention against SDPA's softmax attention, since
   SDPA has no linear form; --variant bigbird / topk / reformer: our sparse or LSH attention
   against SDPA's dense attention).

--variant linear / performer replace every softmax attention with linear attention (elu + 1 or
FAVOR+ features); generation then carries the recurrent state (nn.LinearCache) instead of a KV
cache. --variant gated_delta makes the char LM's layers Gated DeltaNet (nn.GatedDeltaNet: the
delta rule, a recurrent state in generation); it has no encoder or cross-attention form, so the
seq2seq part is skipped and says so. --variant bigbird makes every self-attention block-sparse (BigBird: a sliding window, a
global block and a random block per row, 16-position blocks; causal in the decoders) and
--variant topk keeps each query's best keys only (hard top-k attention); cross-attention stays
dense, and generation keeps the KV cache (a step reads its layout row as an element mask).
--variant reformer makes every self-attention Reformer's shared-QK LSH attention (causal in the
decoders; cross-attention stays softmax); it has no incremental form, so generation recomputes
the prefix each step. --variant linformer (keys and values projected to a fixed length) is
non-causal: it serves the seq2seq encoder only, the decoder keeps softmax attention, and the
causal char LM and its timings, which it cannot serve, are skipped and say so.

Training runs to a budget of steps, never of seconds: with the seed fixed, the run trains the same
steps on a quiet machine and on a loaded one and reports the same accuracy and bits per character
(bit for bit with the same --threads on the same CPU instruction set); only the time differs,
which the progress bars show. --max-seconds is a safety net per training part: a part it stops
is reported as stopped by the time cap (exit status 3), never as a model below its threshold.
Default under 3 minutes on a quiet 2-core CPU, `--quick` about a minute. Everything lands in
--out (default ./attention_ext_demo/): results.json, samples.txt, log.txt and the PNG heatmaps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor

from .models import LanguageModel, LMConfig, Transformer, TransformerConfig

VARIANTS = ("full", "gqa", "mqa", "window", "alibi", "rope", "sinks", "linear", "performer", "gated_delta", "bigbird",
            "topk", "reformer", "linformer")
LINEAR_VARIANTS = ("linear", "performer")  # attention_type="linear": no softmax, a recurrent state in generation
SPARSE_VARIANTS = ("bigbird", "topk")  # attention_type="sparse": a block layout or top-k keys per query
UNCACHED_VARIANTS = ("reformer",)  # attention_type="lsh": no incremental form, generation recomputes the prefix
ENCODER_VARIANTS = ("linformer",)  # non-causal: the seq2seq encoder only, no causal LM
LM_VARIANTS = ("gated_delta",)  # causal self-attention only (a recurrence): the char LM and timings, no seq2seq


@dataclass
class Size:
    s2s_d_model: int     # the seq2seq model (2 + 2 layers)
    d_model: int         # the LM
    n_heads: int
    n_layers: int
    block_size: int      # LM context
    batch: int           # LM batch


SIZES = {
    "tiny": Size(s2s_d_model=64, d_model=64, n_heads=4, n_layers=2, block_size=64, batch=32),
    "small": Size(s2s_d_model=64, d_model=96, n_heads=4, n_layers=3, block_size=128, batch=16),
    "base": Size(s2s_d_model=128, d_model=256, n_heads=8, n_layers=6, block_size=256, batch=32),
}


def variant_options(variant: str, n_heads: int, context: int) -> Dict:
    """The attention options a --variant stands for (model-config keyword arguments; an
    ENCODER_VARIANTS entry's are TransformerConfig's only)."""
    return {
        "full": {},
        "gqa": {"n_kv_heads": max(1, n_heads // 2)},
        "mqa": {"n_kv_heads": 1},
        "window": {"window": (max(4, context // 4),) * 2},  # causal layers drop the right side
        "alibi": {"positional": "alibi"},
        "rope": {"positional": "rope"},
        "sinks": {"sinks": True},
        "linear": {"attention_type": "linear", "feature_map": "elu"},  # Katharopoulos et al.: phi = elu + 1
        "performer": {"attention_type": "linear", "feature_map": "favor"},  # FAVOR+ random features
        # Gated DeltaNet (the delta rule with short convolutions and an output gate); the
        # recurrence orders positions, so no RoPE
        "gated_delta": {"attention_type": "gated_delta", "positional": "learned"},
        # BigBird with the paper's 3-block window, one global and one random block per row
        "bigbird": {"attention_type": "sparse", "sparse_pattern": "bigbird", "sparse_block_size": 16,
                    "sparse_kwargs": {"window_blocks": 1, "n_global": 1, "n_random": 1, "seed": 0}},
        "topk": {"attention_type": "sparse", "sparse_pattern": "topk", "topk": max(8, context // 8)},
        # Reformer: chunks of 32 and about context / 32 buckets (an even count), 2 hash rounds
        "reformer": {"attention_type": "lsh", "lsh_chunk_size": 32, "lsh_buckets": max(2, 2 * (context // 64)),
                     "lsh_hashes": 2},
        # Linformer in the encoder, keys and values projected to a quarter of the context; the
        # causal decoder keeps softmax attention
        "linformer": {"attention_type": "linformer", "decoder_attention_type": "softmax",
                      "linformer_k": max(4, context // 4)},
    }[variant]


def _cache_name(variant: str) -> str:
    """What generation carries between steps: a KV cache, linear attention's recurrent state, or
    nothing (LSH attention: each step recomputes the prefix)."""
    if variant in UNCACHED_VARIANTS:
        return "uncached"
    return "recurrent state" if variant in LINEAR_VARIANTS + LM_VARIANTS else "KV cache"


def _progress(total: int, desc: str, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=True, disable=quiet,
                file=sys.stderr, mininterval=0.5)


EXIT_BELOW_THRESHOLD = 1  # the seq2seq model trained its full budget and scored below --min-accuracy
EXIT_TIME_CAP = 3  # --max-seconds stopped a training part before its step budget


class TimeCap:
    """The --max-seconds safety net of one training part. The step budget alone decides what is
    trained; the cap only ends a run that would otherwise take far longer than documented, and
    says so, since its model then is not the model the budget stands for."""

    def __init__(self, seconds: float):
        self.seconds, self.t0 = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def hit(self) -> bool:
        return self.seconds > 0 and self.elapsed() > self.seconds

    def message(self, done: int, total: int) -> str:
        return f"stopped by the time cap ({self.seconds:g} s, --max-seconds) after {done} of {total} steps"


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t))))


# ----------------------------------------------------------------------------------------------
# 1. sequence to sequence: string reversal

PAD, BOS, EOS = 0, 1, 2
LETTERS = "abcdefghijklmnopqrstuvwxyz"
# the strings' lengths: S2S_MIN_LEN up to --s2s-max-len letters; the model's positions
# (TransformerConfig.max_len) hold a source with its EOS, so --s2s-max-len is at most S2S_POSITIONS - 1
S2S_MIN_LEN, S2S_POSITIONS = 4, 64
PARTS = ("seq2seq", "lm", "timings")


class ReverseTask:
    """Source: a random lowercase string of min_len..max_len letters; target: the string reversed.
    The held-out strings are drawn first and never appear in training."""

    def __init__(self, min_len: int, max_len: int, n_test: int, seed: int):
        self.min_len, self.max_len = min_len, max_len
        self.vocab = ["<pad>", "<s>", "</s>"] + list(LETTERS)
        self.rng = random.Random(seed)
        self.test = [self._draw() for _ in range(n_test)]
        self.held_out = set(self.test)

    def _draw(self) -> str:
        n = self.rng.randint(self.min_len, self.max_len)
        return "".join(self.rng.choice(LETTERS) for _ in range(n))

    def train_batch(self, n: int) -> List[str]:
        out = []
        while len(out) < n:
            s = self._draw()
            if s not in self.held_out:
                out.append(s)
        return out

    @staticmethod
    def target(s: str) -> str:
        return s[::-1]

    def encode(self, strings: List[str], device) -> tuple:
        """-> src (B, S) with EOS, src lengths (B,), decoder input (B, T) = BOS + target, decoder
        target (B, T) = target + EOS, PAD-filled."""
        ids = [[3 + LETTERS.index(c) for c in s] for s in strings]
        tgt = [[3 + LETTERS.index(c) for c in self.target(s)] for s in strings]
        s_len = max(len(x) for x in ids) + 1
        t_len = max(len(x) for x in tgt) + 1
        src = torch.full((len(ids), s_len), PAD, dtype=torch.long)
        dec_in = torch.full((len(ids), t_len), PAD, dtype=torch.long)
        dec_out = torch.full((len(ids), t_len), PAD, dtype=torch.long)
        for i, (a, b) in enumerate(zip(ids, tgt)):
            src[i, : len(a) + 1] = torch.tensor(a + [EOS])
            dec_in[i, : len(b) + 1] = torch.tensor([BOS] + b)
            dec_out[i, : len(b) + 1] = torch.tensor(b + [EOS])
        lengths = torch.tensor([len(a) + 1 for a in ids])
        return src.to(device), lengths.to(device), dec_in.to(device), dec_out.to(device)

    def decode(self, ids: List[int]) -> str:
        out = []
        for i in ids:
            if i == EOS:
                break
            out.append(self.vocab[i] if i >= 3 else "?")
        return "".join(out)


def run_seq2seq(args, size: Size, device, log) -> Dict:
    task = ReverseTask(min_len=S2S_MIN_LEN, max_len=args.s2s_max_len, n_test=args.s2s_test, seed=args.seed + 1)
    opts = variant_options(args.variant, size.n_heads, args.s2s_max_len + 2)
    cfg = TransformerConfig(src_vocab_size=len(task.vocab), d_model=size.s2s_d_model, n_heads=size.n_heads,
                            n_encoder_layers=2, n_decoder_layers=2, d_ff=args.s2s_ff_mult * size.s2s_d_model,
                            dropout=0.0, norm_first=True, max_len=S2S_POSITIONS, tie_embeddings=True, **opts)
    torch.manual_seed(args.seed)
    model = Transformer(cfg).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.s2s_lr, betas=(0.9, 0.98), weight_decay=0.01)
    log(f"\n[1/3] seq2seq: reverse strings of {task.min_len}-{task.max_len} letters  "
        f"({sum(p.numel() for p in model.parameters()) / 1e3:.0f}k params, 2+2 layers, variant={args.variant})")

    val = task.encode(task.train_batch(256), device)
    steps, batch = args.s2s_steps, args.s2s_batch
    bar = _progress(steps, "seq2seq", args.quiet)
    cap = TimeCap(args.max_seconds)
    tokens, step, val_acc, stopped_by = 0, 0, 0.0, "steps"
    model.train()
    for step in range(steps):
        for g in optim.param_groups:
            g["lr"] = _lr(step, steps, args.s2s_lr, warmup=min(100, steps // 10))
        src, lengths, dec_in, dec_out = task.encode(task.train_batch(batch), device)
        _, loss = model(src, dec_in, lengths, targets=dec_out)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        tokens += int((src != PAD).sum() + (dec_out != PAD).sum())
        bar.update(1)
        if (step + 1) % 50 == 0:  # teacher-forced sequence accuracy on a validation batch
            model.eval()
            with torch.no_grad():
                logits = model(val[0], val[2], val[1])
            val_acc = ((logits.argmax(-1) == val[3]) | (val[3] == PAD)).all(-1).float().mean().item()
            model.train()
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / cap.elapsed():,.0f}", val_acc=f"{val_acc:.1%}")
        # the early stop reads a validation score taken at fixed steps, so it too falls on the
        # same step on every machine
        if val_acc >= args.s2s_stop_at and step + 1 < steps:
            stopped_by = "early stop"
            break
        if cap.hit() and step + 1 < steps:
            stopped_by = "time cap"
            break
    bar.close()
    train_s = cap.elapsed()
    if stopped_by == "time cap":
        log(f"  {cap.message(step + 1, steps)}: the scores below are of a model short of its budget")

    # held-out exact-sequence accuracy with greedy decoding and the KV cache (where the decoder has one)
    model.eval()
    use_cache = args.variant not in UNCACHED_VARIANTS
    correct, shown = 0, []
    for i in range(0, len(task.test), 250):
        chunk = task.test[i: i + 250]
        src, lengths, _, _ = task.encode(chunk, device)
        out = model.greedy_decode(src, lengths, BOS, EOS, max_new_tokens=task.max_len + 1, use_cache=use_cache)
        for s, row in zip(chunk, out.tolist()):
            pred = task.decode(row)
            correct += pred == task.target(s)
            if len(shown) < 4:
                shown.append((s, pred))
    acc = correct / len(task.test)
    how = f", early stop at {val_acc:.1%} teacher-forced validation" if stopped_by == "early stop" else ""
    log(f"  trained {step + 1} of {steps} steps in {train_s:.1f}s{how}; held-out exact-sequence accuracy "
        f"{acc:.1%} on {len(task.test)} unseen strings (greedy, {_cache_name(args.variant)})")
    for s, pred in shown:
        log(f"    {s:>{task.max_len}} -> {pred:<{task.max_len}} {'ok' if pred == task.target(s) else 'WRONG'}")

    plots = []
    if not args.no_plots:
        plots = _plot_cross_attention(model, task, task.test[0], args.out, log, use_cache)
    # full-precision floats: two runs with the same seed compare equal (tests/test_demo.py)
    return {"task": "reverse", "steps": step + 1, "max_steps": steps, "stopped_by": stopped_by,
            "train_s": round(train_s, 1), "accuracy": acc, "val_acc": val_acc, "loss": loss.item(),
            "n_test": len(task.test), "examples": shown, "plots": plots}


def _plot_cross_attention(model, task, s: str, out_dir: str, log, use_cache: bool = True) -> List[str]:
    try:
        from . import viz
        import matplotlib  # noqa: F401
    except ImportError:
        log("  (matplotlib missing: no heatmaps; pip install matplotlib)")
        return []
    device = next(model.parameters()).device
    src, lengths, _, _ = task.encode([s], device)
    pred = model.greedy_decode(src, lengths, BOS, EOS, max_new_tokens=task.max_len + 1, use_cache=use_cache)
    dec_in = torch.cat([torch.tensor([[BOS]], device=device), pred[:, :-1]], 1)  # teacher-force the decode
    layers = [blk.cross_attn for blk in model.decoder.layers]
    for a in layers:
        a.keep_weights = True
    with torch.no_grad():
        model(src, dec_in, lengths)
    src_tok = list(s) + ["</s>"]
    out_tok = list(task.decode(pred[0].tolist())) + ["</s>"]
    paths = []
    for i, a in enumerate(layers):
        a.keep_weights = False
        w = a.last_weights[0, :, : len(out_tok), : len(src_tok)]  # (H, T, S)
        path = os.path.join(out_dir, f"seq2seq_cross_attention_layer{i}.png")
        viz.plot_attention_heads(w, path, x_tokens=src_tok, y_tokens=out_tok,
                                 title=f"decoder layer {i} cross-attention: reverse('{s}')")
        paths.append(path)
    log(f"  cross-attention heatmaps: {', '.join(paths)}")
    return paths


# ----------------------------------------------------------------------------------------------
# 2. character LM on the Python standard library


def stdlib_text(max_chars: int, seed: int = 0) -> tuple:
    """ASCII text of the stdlib's top-level .py files, taken in a seeded shuffle of the sorted names
    (the same files on every machine with the same Python) until max_chars; every 10th file goes
    to validation, so validation is unseen files. -> (train, val, list of files)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(root) if f.endswith(".py"))
    random.Random(seed).shuffle(files)
    train, val, used, n = [], [], [], 0
    for name in files:
        try:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        text = text.encode("ascii", "replace").decode("ascii").replace("\t", "    ")
        (val if len(used) % 10 == 9 else train).append(text)
        used.append(name)
        n += len(text)
        if n >= max_chars and len(val) >= 2:
            break
    return "\n".join(train), "\n".join(val), used


def run_char_lm(args, size: Size, device, log) -> Dict:
    train_text, val_text, files = stdlib_text(args.lm_chars)
    chars = sorted(set(train_text) | set(val_text))
    stoi = {c: i for i, c in enumerate(chars)}
    train = torch.tensor([stoi[c] for c in train_text], dtype=torch.long)
    val = torch.tensor([stoi[c] for c in val_text], dtype=torch.long)

    # unigram baseline: cross-entropy of val under train character frequencies (add-one smoothed)
    counts = torch.bincount(train, minlength=len(chars)).double() + 1.0
    logp = (counts / counts.sum()).log2()
    unigram_bpc = -logp[val].mean().item()

    opts = variant_options(args.variant, size.n_heads, size.block_size)
    opts.setdefault("positional", "learned")
    cfg = LMConfig(vocab_size=len(chars), block_size=size.block_size, n_layers=size.n_layers, n_heads=size.n_heads,
                   d_model=size.d_model, dropout=0.0, **opts)
    torch.manual_seed(args.seed)
    model = LanguageModel(cfg).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lm_lr, betas=(0.9, 0.95), weight_decay=0.1)
    log(f"\n[2/3] char LM on the Python stdlib: {len(files)} files, {len(train):,} train / {len(val):,} val chars, "
        f"vocab {len(chars)}  ({model.num_params() / 1e6:.2f}M params, {size.n_layers} layers, "
        f"context {size.block_size}, variant={args.variant})")

    gen = torch.Generator().manual_seed(args.seed)
    t_blk = size.block_size

    def batch(data, n, g=gen):
        ix = torch.randint(len(data) - t_blk - 1, (n,), generator=g)
        x = torch.stack([data[i: i + t_blk] for i in ix.tolist()])
        y = torch.stack([data[i + 1: i + 1 + t_blk] for i in ix.tolist()])
        return x.to(device), y.to(device)

    steps = args.lm_steps
    bar = _progress(steps, "char LM", args.quiet)
    cap = TimeCap(args.max_seconds)
    tokens, step, stopped_by = 0, 0, "steps"
    model.train()
    for step in range(steps):
        # the schedule follows the step only: one that also followed the clock would anneal a
        # slow machine's run early and train a different model
        for g in optim.param_groups:
            g["lr"] = _lr(step, steps, args.lm_lr, warmup=min(30, steps // 10))
        x, y = batch(train, size.batch)
        _, loss = model(x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        tokens += x.numel()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens / cap.elapsed():,.0f}")
        if cap.hit() and step + 1 < steps:
            stopped_by = "time cap"
            break
    bar.close()
    train_s = cap.elapsed()
    if stopped_by == "time cap":
        log(f"  {cap.message(step + 1, steps)}: the scores below are of a model short of its budget")

    model.eval()
    val_gen = torch.Generator().manual_seed(args.seed + 7)
    with torch.no_grad():
        losses = [model(*batch(val, size.batch, val_gen))[1].item() for _ in range(args.lm_eval_batches)]
    val_bpc = sum(losses) / len(losses) / math.log(2)
    log(f"  trained {step + 1} of {steps} steps in {train_s:.1f}s ({tokens / train_s:,.0f} tokens/s)")
    log(f"  validation: {val_bpc:.2f} bits/char   vs unigram baseline {unigram_bpc:.2f} bits/char "
        f"({_vs_baseline(val_bpc, unigram_bpc)})")

    cache_bpc = {}
    if cfg.attention_type == "softmax" and args.variant not in UNCACHED_VARIANTS:
        cache_bpc = _cache_bits(model, val, t_blk, device, args.seed)
        base = cache_bpc["bfloat16"]
        log("  validation through an 8-bit KV cache (teacher-forced, token by token, paged): bf16 "
            f"{base:.3f} bits/char; " + "; ".join(
                f"{n} {b:.3f} (perplexity {2 ** (b - base) - 1:+.2%})" for n, b in cache_bpc.items() if n != "bfloat16"))

    samples = []
    g = torch.Generator().manual_seed(args.seed)
    prompts = ["def ", "class ", "import "]
    idx = [torch.tensor([[stoi[c] for c in p]], device=device) for p in prompts]
    t1 = time.perf_counter()
    for p, x in zip(prompts, idx):
        n_new = min(args.lm_sample_chars, cfg.block_size - x.shape[1]) if cfg.positional == "learned" \
            else args.lm_sample_chars
        out = model.generate(x, n_new, temperature=0.8, top_k=20, generator=g,
                             use_cache=args.variant not in UNCACHED_VARIANTS)  # KV cache, or the prefix recomputed
        samples.append("".join(chars[i] for i in out[0].tolist()))
    gen_s = time.perf_counter() - t1
    log(f"  samples ({_cache_name(args.variant)} generation, temperature 0.8, top-k 20, {gen_s:.1f}s):")
    for s in samples:
        for line in s.splitlines()[:4]:
            log(f"    | {line}")
        log("    ---")
    # val_bpc is rounded for reading, val_loss and loss kept in full so that runs compare exactly
    return {"files": len(files), "train_chars": len(train), "val_chars": len(val), "steps": step + 1,
            "max_steps": steps, "stopped_by": stopped_by, "train_s": round(train_s, 1),
            "tokens_per_s": round(tokens / train_s), "val_bpc": round(val_bpc, 3), "val_loss": sum(losses) / len(losses),
            "loss": loss.item(), "unigram_bpc": round(unigram_bpc, 3), "samples": samples,
            "cache_bpc": {n: round(b, 4) for n, b in cache_bpc.items()}}


def _vs_baseline(bpc: float, base: float) -> str:
    """How the model's bits per character compare with the baseline's, in words that hold either
    way: fewer bits is better, by the ratio base / bpc."""
    if bpc < base:
        return f"{base / bpc:.2f}x better"
    if bpc == base:
        return "the same as the baseline"
    return f"worse than the baseline: {bpc / base:.2f}x its bits"


def _cache_bits(model, val: torch.Tensor, t_blk: int, device, seed: int, n_seq: int = 2) -> Dict[str, float]:
    """Validation bits/char of `model` stepping token by token through paged KV caches in bf16,
    int8 and fp8 e4m3 (a scale per row and kv head: the 8-bit caches of flash_attn_with_kvcache):
    n_seq sequences of t_blk characters, the same for each cache dtype, teacher-forced."""
    t_blk = min(t_blk, 128)  # a step per character: kept short, the check costs seconds
    g = torch.Generator().manual_seed(seed + 11)
    ix = torch.randint(len(val) - t_blk - 1, (n_seq,), generator=g).tolist()
    x = torch.stack([val[i: i + t_blk + 1] for i in ix]).to(device)  # (n_seq, t_blk + 1)
    out = {}
    for dtype in (torch.bfloat16, torch.int8, torch.float8_e4m3fn):
        caches = model.allocate_paged_caches(n_seq, num_pages=n_seq * (t_blk // 16 + 1), page_size=16,
                                             max_len=t_blk, device=device, dtype=dtype)
        with torch.no_grad():
            logits = [model(x[:, t:t + 1], caches=caches, offset=caches[0].positions()) for t in range(t_blk)]
        lg = torch.cat(logits, 1).float()  # (n_seq, t_blk, V): predicts x[:, 1:]
        nll = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1))
        out[str(dtype).replace("torch.", "")] = float(nll) / math.log(2)
    return out


# ----------------------------------------------------------------------------------------------
# 3. forward + backward step time: our kernel against torch SDPA in the same model


def _step_ms(model, x, y, reps: int) -> float:
    def step():
        _, loss = model(x, y)
        loss.backward()

    step()  # warmup
    if x.is_cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def run_timings(args, size: Size, device, log) -> List[Dict]:
    shapes = [(8, 128), (4, 512)] if args.quick else [(8, 128), (4, 512), (2, 1024)]
    variants = ["full", args.variant] if args.variant != "full" else ["full", "window"]
    rows = []
    from . import _ext

    on = (f"CPU ISA {_ext.cpu_isa() if _ext.HAS_EXT else '(extension not built)'}, "
          f"{torch.get_num_threads()} threads" if torch.device(device).type == "cpu" else device)
    log(f"\n[3/3] forward+backward step time of the LM ({size.n_layers} layers, d_model {size.d_model}): "
        f"our kernel vs torch SDPA (median of {args.bench_reps}; {on})")
    from .linear import ops as linear_ops
    from .softmax import ops

    if not (linear_ops if args.variant in LINEAR_VARIANTS else ops).has_kernel(torch.device(device)):
        log(f"  note: no compiled kernel for {device}; 'ours' is running the pure-PyTorch reference")
    log(f"  {'variant':<11} {'batch x seq':>11} {'ours ms':>9} {'sdpa ms':>9} {'sdpa/ours':>9}")
    if args.variant in LINEAR_VARIANTS + LM_VARIANTS:
        what = "Gated DeltaNet layer" if args.variant in LM_VARIANTS else "linear attention"
        log(f"  {args.variant}: 'ours' is our {what}, 'sdpa' torch SDPA's softmax attention (SDPA has no "
            f"linear form), in the same LM")
    if args.variant in SPARSE_VARIANTS:
        kind = "block-sparse" if args.variant == "bigbird" else "top-k"
        log(f"  {args.variant}: 'ours' is our sparse attention ({kind}), 'sdpa' torch SDPA's dense softmax attention, "
            f"in the same LM")
    if args.variant in UNCACHED_VARIANTS:
        log(f"  {args.variant}: 'ours' is our LSH attention (chunks of 32, 2 hash rounds), 'sdpa' torch SDPA's dense "
            f"softmax attention, in the same LM")
    for variant in variants:
        for b, s in shapes:
            opts = variant_options(variant, size.n_heads, s)
            if opts.get("sinks"):
                continue  # SDPA has no sinks
            ours_type = opts.pop("attention_type", "softmax")
            times = {}
            for kind in ("ours", "sdpa"):
                torch.manual_seed(0)
                kw = {"positional": "rope", **opts} if kind == "ours" or ours_type == "softmax" else \
                    {"positional": "rope"}
                cfg = LMConfig(vocab_size=96, block_size=s, n_layers=size.n_layers, n_heads=size.n_heads,
                               d_model=size.d_model, attention_type=ours_type if kind == "ours" else "sdpa", **kw)
                model = LanguageModel(cfg).to(device)
                x = torch.randint(0, 96, (b, s), device=device)
                times[kind] = _step_ms(model, x, x, args.bench_reps)
            row = {"variant": variant, "batch": b, "seq": s, "ours_ms": round(times["ours"], 2),
                   "sdpa_ms": round(times["sdpa"], 2), "ratio": round(times["sdpa"] / times["ours"], 2)}
            rows.append(row)
            log(f"  {variant:<11} {f'{b} x {s}':>11} {row['ours_ms']:>9.1f} {row['sdpa_ms']:>9.1f} {row['ratio']:>8.2f}x")
    return rows


# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attention_ext demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the CI version: about 1 minute")
    p.add_argument("--out", default="./attention_ext_demo", help="output directory (default: %(default)s)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--variant", default="full", choices=VARIANTS,
                   help="attention variant: full softmax, GQA, MQA, causal sliding window, ALiBi, RoPE, sinks; "
                        "linear (elu + 1 linear attention) or performer (FAVOR+) replace softmax attention; "
                        "gated_delta: Gated DeltaNet layers (the char LM and timings; seq2seq is skipped); "
                        "bigbird (block-sparse) or topk (top-k keys per query) make self-attention sparse; "
                        "reformer: LSH self-attention (generation without a cache); linformer: the seq2seq "
                        "encoder only (non-causal; the char LM and timings are skipped)")
    p.add_argument("--size", default=None, choices=sorted(SIZES), help="model size (default: small, tiny with --quick)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"the parts to run, a comma-separated subset of {','.join(PARTS)} (default: all three)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: %(default)s; 0: torch's choice). Results are the same bit "
                        "for bit only with the same thread count and CPU instruction set")
    p.add_argument("--no-plots", action="store_true", help="skip the seq2seq cross-attention heatmaps (PNG)")
    p.add_argument("--quiet", action="store_true", help="no progress bars (the log lines still print)")
    p.add_argument("--min-accuracy", type=float, default=0.95,
                   help="exit status 1 when the seq2seq held-out exact-sequence accuracy, in [0, 1], is below this "
                        "(default: %(default)s)")
    p.add_argument("--max-seconds", type=float,
                   help="safety net per training part: stop it after this many seconds even before its step "
                        "budget, and exit with status 3 (default: 600 with --quick, else 1800; 0: no cap)")
    g = p.add_argument_group("tuning (defaults depend on --quick)")
    g.add_argument("--s2s-steps", type=int, help="training step budget (at most; see --s2s-stop-at)")
    g.add_argument("--s2s-batch", type=int, default=64)
    g.add_argument("--s2s-lr", type=float, default=3e-3, help="peak learning rate, > 0 (default: %(default)s)")
    g.add_argument("--s2s-max-len", type=int,
                   help=f"longest string to reverse, {S2S_MIN_LEN}-{S2S_POSITIONS - 1} letters (the shortest is "
                        f"{S2S_MIN_LEN}; default: 7 with --quick, else 9)")
    g.add_argument("--s2s-test", type=int, default=1000)
    g.add_argument("--s2s-ff-mult", type=int, default=2)
    g.add_argument("--s2s-stop-at", type=float, default=0.98,
                   help="stop training once teacher-forced validation sequence accuracy (checked every 50 steps) "
                        "reaches this, in (0, 1]; above 1: train the whole budget (default: %(default)s)")
    g.add_argument("--lm-steps", type=int, help="training step budget")
    g.add_argument("--lm-lr", type=float, default=3e-3, help="peak learning rate, > 0 (default: %(default)s)")
    g.add_argument("--lm-chars", type=int)
    g.add_argument("--lm-eval-batches", type=int)
    g.add_argument("--lm-sample-chars", type=int, default=160)
    g.add_argument("--bench-reps", type=int)
    return p


def _defaults(args) -> None:
    q = args.quick
    for name, quick, full in [("s2s_steps", 400, 800), ("s2s_max_len", 7, 9), ("lm_steps", 300, 600),
                              ("lm_chars", 400_000, 1_500_000), ("lm_eval_batches", 8, 20), ("bench_reps", 3, 3),
                              ("max_seconds", 600.0, 1800.0)]:
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if args.size is None:
        args.size = "tiny" if q else "small"


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """The values argparse's types let through that the run cannot use: argparse's error (exit 2),
    before anything is made or trained."""
    from ._cli import check_out_dir

    if args.threads < 0:
        p.error(f"--threads must be >= 0 (0: torch's choice), got {args.threads}")
    for name in ("s2s_steps", "s2s_batch", "s2s_max_len", "s2s_test", "s2s_ff_mult", "lm_steps",
                 "lm_chars", "lm_eval_batches", "bench_reps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lm_sample_chars < 0:
        p.error(f"--lm-sample-chars must be >= 0, got {args.lm_sample_chars}")
    if not S2S_MIN_LEN <= args.s2s_max_len <= S2S_POSITIONS - 1:
        p.error(f"--s2s-max-len must be in [{S2S_MIN_LEN}, {S2S_POSITIONS - 1}] (the strings have at least "
                f"{S2S_MIN_LEN} letters, and the model {S2S_POSITIONS} positions for one and its end token), "
                f"got {args.s2s_max_len}")
    for name in ("s2s_lr", "lm_lr"):
        lr = getattr(args, name)
        if not (math.isfinite(lr) and lr > 0):
            p.error(f"--{name.replace('_', '-')} must be a finite learning rate > 0, got {lr}")
    if not args.max_seconds >= 0:  # NaN too
        p.error(f"--max-seconds must be >= 0 seconds (0: no cap), got {args.max_seconds}")
    if not args.s2s_stop_at > 0:
        p.error(f"--s2s-stop-at must be > 0: an accuracy in (0, 1] to stop at, or above 1 to train the whole "
                f"budget (0 would stop after the first step, before any validation), got {args.s2s_stop_at}")
    if not 0 <= args.min_accuracy <= 1:
        p.error(f"--min-accuracy must be an accuracy in [0, 1], got {args.min_accuracy}")
    parts = args.parts.split(",")
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        p.error(f"--parts: unknown {', '.join(repr(x) for x in unknown)} (comma-separated, from {', '.join(PARTS)})")
    if args.device != "auto":
        try:
            dev = torch.device(args.device)
        except RuntimeError:
            p.error(f"--device: cpu, cuda or cuda:N, got {args.device!r}")
        if dev.type == "cuda" and not torch.cuda.is_available():
            p.error(f"--device {args.device}: no CUDA device visible (leave --device out to use the CPU)")
        if dev.type not in ("cpu", "cuda"):
            p.error(f"--device: cpu, cuda or cuda:N, got {args.device!r}")
    check_out_dir(p, args.out)


def main(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _defaults(args)
    _check_args(p, args)
    # one thread by default: these models are too small to gain much from more, a fixed count
    # keeps the floating-point reductions, and so the metrics, the same on machines with other core
    # counts, and torch's threads spin at each op's barrier, so that on a loaded machine a step with
    # two threads took many times as long as with one (benchmarks/results/2026-11-29-figures-from-comments.md).
    # torch.use_deterministic_algorithms is not needed: our CPU kernels' tasks write
    # disjoint outputs (no atomics), so their dynamic scheduling does not change a bit, and the
    # torch CPU ops here are deterministic for a fixed thread count
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(args.out, exist_ok=True)
    parts = set(args.parts.split(","))
    size = SIZES[args.size]
    lines: List[str] = []

    def log(msg: str = "") -> None:
        lines.append(msg)
        print(msg, flush=True)

    from . import _ext

    t0 = time.perf_counter()
    log(f"attention_ext demo: device={device}, size={args.size}, variant={args.variant}, "
        f"{'quick' if args.quick else 'default'} run, {torch.get_num_threads()} threads, CPU ISA "
        f"{_ext.cpu_isa() if _ext.HAS_EXT else '(extension not built)'}, output in {args.out}")

    results: Dict = {"device": device, "size": args.size, "variant": args.variant, "quick": args.quick,
                     "seed": args.seed, "threads": torch.get_num_threads(),
                     "cpu_isa": _ext.cpu_isa() if _ext.HAS_EXT else None, "torch": torch.__version__}
    if args.variant in LM_VARIANTS and "seq2seq" in parts:  # no non-causal or cross-attention form
        why = f"--variant {args.variant} is causal self-attention only (a recurrence): no encoder or cross-attention"
        parts.discard("seq2seq")
        results.setdefault("skipped", {})["seq2seq"] = why
        log(f"\n[1/3] seq2seq: skipped: {why}")
    if "seq2seq" in parts:
        results["seq2seq"] = run_seq2seq(args, size, device, log)
    if args.variant in ENCODER_VARIANTS:  # the LM and its timings are causal: nothing to run them with
        why = f"--variant {args.variant} is non-causal (the seq2seq encoder only) and the char LM is causal"
        for part, name in (("lm", "[2/3] char LM"), ("timings", "[3/3] timings")):
            if part in parts:
                parts.discard(part)
                results.setdefault("skipped", {})[part] = why
                log(f"\n{name}: skipped: {why}")
    if "lm" in parts:
        results["char_lm"] = run_char_lm(args, size, device, log)
    if "timings" in parts:
        results["timings"] = run_timings(args, size, device, log)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    log(f"\ndone in {results['wall_s']:.0f}s; results in {os.path.join(args.out, 'results.json')}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.out, "log.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if "char_lm" in results:
        with open(os.path.join(args.out, "samples.txt"), "w") as f:
            f.write("\n\n----\n\n".join(results["char_lm"]["samples"]) + "\n")
    capped = [k for k in ("seq2seq", "char_lm") if results.get(k, {}).get("stopped_by") == "time cap"]
    if capped:
        # the budget was not trained, so the scores say nothing about the model: no threshold check
        for k in capped:
            r = results[k]
            print(f"{k}: stopped by the time cap ({args.max_seconds:g} s) after {r['steps']} of {r['max_steps']} "
                  f"steps; the machine was too slow or too busy to finish (raise --max-seconds, 0: no cap)",
                  file=sys.stderr)
        return EXIT_TIME_CAP
    if "seq2seq" in parts and results["seq2seq"]["accuracy"] < args.min_accuracy:
        print(f"seq2seq accuracy {results['seq2seq']['accuracy']:.1%} is below {args.min_accuracy:.0%} "
              f"({results['seq2seq']['steps']} steps trained, not stopped by the time cap)", file=sys.stderr)
        return EXIT_BELOW_THRESHOLD
    return 0


if __name__ == "__main__":
    sys.exit(main())
