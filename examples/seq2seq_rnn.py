"""An RNN encoder-decoder with Bahdanau or Luong attention, as in the original papers.

    python examples/seq2seq_rnn.py --attention bahdanau          # additive (Bahdanau et al. 2015)
    python examples/seq2seq_rnn.py --attention luong --score general   # Luong et al. 2015

Task: reverse random letter strings (the string's letters come back in the opposite order, so
a good alignment is the anti-diagonal). Encoder: a bidirectional GRU. Decoder: a GRU whose state
queries the encoder states at every step.
  - Bahdanau: the context is computed from the previous decoder state and fed into the GRU with
    the previous output token.
  - Luong: the GRU steps first; its new state queries the encoder ("dot", "general" or "concat"
    score), and the attentional state tanh(W_c [c; h]) feeds the output layer and the next step
    (input feeding).
Prints held-out exact-match accuracy and writes the alignment matrix of one example to a PNG.
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attention_ext.nn import AdditiveAttention, LuongAttention

PAD, BOS, EOS = 0, 1, 2
LETTERS = "abcdefghijklmnop"


def make_batch(strings, device):
    """-> src (B, S), src mask (B, S) True = valid, decoder input (B, T), decoder target (B, T)."""
    s_len = max(map(len, strings))
    t_len = s_len + 1
    b = len(strings)
    src = torch.full((b, s_len), PAD, dtype=torch.long)
    dec_in = torch.full((b, t_len), PAD, dtype=torch.long)
    dec_out = torch.full((b, t_len), PAD, dtype=torch.long)
    for i, s in enumerate(strings):
        ids = [3 + LETTERS.index(c) for c in s]
        rev = ids[::-1]
        src[i, : len(ids)] = torch.tensor(ids)
        dec_in[i, : len(ids) + 1] = torch.tensor([BOS] + rev)
        dec_out[i, : len(ids) + 1] = torch.tensor(rev + [EOS])
    return src.to(device), (src != PAD).to(device), dec_in.to(device), dec_out.to(device)


class Encoder(nn.Module):
    def __init__(self, vocab: int, emb: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb, padding_idx=PAD)
        self.rnn = nn.GRU(emb, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)

    def forward(self, src: Tensor, mask: Tensor):
        lengths = mask.sum(1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(src), lengths, batch_first=True, enforce_sorted=False)
        out, h = self.rnn(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])  # (B, S, 2H)
        h0 = torch.tanh(self.bridge(torch.cat([h[0], h[1]], dim=-1)))  # (B, H): both directions' last states
        return out, h0


class Decoder(nn.Module):
    def __init__(self, vocab: int, emb: int, hidden: int, attention: str, score: str):
        super().__init__()
        self.kind = attention
        self.embed = nn.Embedding(vocab, emb, padding_idx=PAD)
        if attention == "bahdanau":
            self.attn = AdditiveAttention(hidden, 2 * hidden, hidden)
            self.cell = nn.GRUCell(emb + 2 * hidden, hidden)
            self.out = nn.Linear(hidden + 2 * hidden + emb, vocab)
        else:
            self.enc_proj = nn.Linear(2 * hidden, hidden, bias=False)  # keys in the decoder's width ("dot" needs it)
            self.attn = LuongAttention(hidden, hidden, score=score)
            self.cell = nn.GRUCell(emb + hidden, hidden)  # input feeding: the previous attentional state
            self.w_c = nn.Linear(2 * hidden, hidden, bias=False)
            self.out = nn.Linear(hidden, vocab)
        self.hidden = hidden

    def step(self, token: Tensor, h: Tensor, feed: Tensor, enc: Tensor, keys: Tensor, mask: Tensor):
        """One decoder step -> logits (B, V), new state, new input feed, alignment (B, S)."""
        e = self.embed(token)  # (B, emb)
        if self.kind == "bahdanau":
            context, a = self.attn(h, enc, mask=mask)  # query: the previous state
            h = self.cell(torch.cat([e, context], -1), h)
            return self.out(torch.cat([h, context, e], -1)), h, feed, a
        h = self.cell(torch.cat([e, feed], -1), h)
        context, a = self.attn(h, keys, mask=mask)  # query: the new state
        att_state = torch.tanh(self.w_c(torch.cat([context, h], -1)))  # h~_t = tanh(W_c [c_t; h_t])
        return self.out(att_state), h, att_state, a

    def forward(self, dec_in: Tensor, h: Tensor, enc: Tensor, mask: Tensor):
        keys = self.enc_proj(enc) if self.kind == "luong" else enc
        feed = enc.new_zeros(enc.shape[0], self.hidden)
        logits, aligns = [], []
        for t in range(dec_in.shape[1]):
            lg, h, feed, a = self.step(dec_in[:, t], h, feed, enc, keys, mask)
            logits.append(lg)
            aligns.append(a)
        return torch.stack(logits, 1), torch.stack(aligns, 1)  # (B, T, V), (B, T, S)

    @torch.no_grad()
    def greedy(self, h: Tensor, enc: Tensor, mask: Tensor, max_len: int):
        keys = self.enc_proj(enc) if self.kind == "luong" else enc
        feed = enc.new_zeros(enc.shape[0], self.hidden)
        token = torch.full((enc.shape[0],), BOS, dtype=torch.long, device=enc.device)
        out, aligns = [], []
        for _ in range(max_len):
            lg, h, feed, a = self.step(token, h, feed, enc, keys, mask)
            token = lg.argmax(-1)
            out.append(token)
            aligns.append(a)
        return torch.stack(out, 1), torch.stack(aligns, 1)


def decode(ids) -> str:
    s = []
    for i in ids:
        if i == EOS:
            break
        s.append(LETTERS[i - 3] if i >= 3 else "?")
    return "".join(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attention", choices=["bahdanau", "luong"], default="bahdanau")
    p.add_argument("--score", choices=["dot", "general", "concat"], default="general", help="Luong's score")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--max-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="./attention_ext_demo")
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    def draw():
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, args.max_len)))

    test = [draw() for _ in range(500)]
    held_out = set(test)
    vocab = 3 + len(LETTERS)
    enc, dec = Encoder(vocab, 32, args.hidden), Decoder(vocab, 32, args.hidden, args.attention, args.score)
    params = list(enc.parameters()) + list(dec.parameters())
    optim = torch.optim.Adam(params, lr=3e-3)
    name = args.attention if args.attention == "bahdanau" else f"luong-{args.score}"
    print(f"RNN encoder-decoder with {name} attention, reversing strings of 3-{args.max_len} letters")
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = []
        while len(batch) < args.batch:
            s = draw()
            if s not in held_out:
                batch.append(s)
        src, mask, dec_in, dec_out = make_batch(batch, "cpu")
        memory, h0 = enc(src, mask)
        logits, _ = dec(dec_in, h0, memory, mask)
        loss = F.cross_entropy(logits.reshape(-1, vocab), dec_out.reshape(-1), ignore_index=PAD)
        optim.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        if (step + 1) % 250 == 0:
            print(f"  step {step + 1:5d}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.0f}s)")

    src, mask, _, _ = make_batch(test, "cpu")
    with torch.no_grad():
        memory, h0 = enc(src, mask)
        pred, aligns = dec.greedy(h0, memory, mask, args.max_len + 1)
    preds = [decode(r) for r in pred.tolist()]
    acc = sum(p == s[::-1] for p, s in zip(preds, test)) / len(test)
    print(f"held-out exact-match accuracy: {acc:.1%} on {len(test)} unseen strings")
    for s, p_ in list(zip(test, preds))[:3]:
        print(f"  {s:>{args.max_len}} -> {p_}")
    try:
        from attention_ext import viz

        s = test[0]
        t = len(preds[0]) + 1
        path = viz.plot_alignment(aligns[0, :t, : len(s)], os.path.join(args.out, f"rnn_alignment_{name}.png"),
                                  src_tokens=list(s), tgt_tokens=list(preds[0]) + ["</s>"],
                                  title=f"{name} alignment: reverse('{s}')")
        print(f"alignment heatmap: {path}")
    except ImportError:
        print("(matplotlib missing: no alignment plot)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
