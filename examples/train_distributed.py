"""Train the decoder-only LanguageModel on a tiny character corpus over several processes.

    torchrun --nproc-per-node 2 examples/train_distributed.py                 # DDP, data parallel
    torchrun --nproc-per-node 2 examples/train_distributed.py --cp            # context parallel
    torchrun --nproc-per-node 2 examples/train_distributed.py --fsdp [--cp]   # FSDP2 (fully_shard)
    torchrun --nproc-per-node 2 examples/train_distributed.py --cp --packed   # packed documents
    python examples/train_distributed.py [--packed]                           # one process

Parallelism (all over the same ranks, P = world size):
- data parallel (default): the global batch of --batch sequences is split, rank r takes rows
  [r B/P, (r+1) B/P); --batch must be a multiple of P.
- --cp: context parallel: every rank takes the SAME global batch and its shard of every sequence
  (attention_ext.distributed.ContextParallel, --shard-layout / --mode); --seq must be a multiple of
  P (2P for zigzag). Attention gathers K/V from the other ranks over a group of its own, so its
  collectives never interleave with DDP's / FSDP's gradient collectives.
- --packed: each step trains on ONE pack of --seq tokens made of documents of random lengths
  (cut from the corpus at random places); no token attends, or predicts, across a document's end
  (its last token's target is ignored) and positions restart at each document. With --cp the
  ranks shard the pack (cp.with_documents(cu_seqlens); --shard-layout balanced splits it by
  attention work); in one process each document runs alone. The loss is the mean over the
  pack's predicted tokens, whichever rank holds them.
- gradients: DDP (torch.nn.parallel.DistributedDataParallel), or FSDP2
  (torch.distributed.fsdp.fully_shard, each block then the root) with --fsdp. Both AVERAGE the
  gradients over the ranks. Each rank's loss is the mean over its own tokens and every rank holds
  the same number of tokens, so the average of the ranks' gradients is the gradient of the global
  mean loss, in both the data- and the context-parallel case (with --cp a rank's gradient also
  holds what the other ranks' losses send back through its keys and values: the K/V gather's
  backward). The printed loss is that global mean: all_reduce(SUM) of the ranks' losses / P.

Backend: nccl with one GPU per rank (LOCAL_RANK) when CUDA is available, else gloo on the CPU. An
already initialized process group is used as it is (the tests spawn gloo ranks and call main()),
its backend choosing the device. Seeding is deterministic: the model from --seed on every rank,
batch i from a generator seeded with --seed + i, so a run over P ranks reproduces one process on
the global batch up to rounding.

FSDP2 on gloo / CPU: torch 2.14's fully_shard runs there (tests/distributed/test_cp_stack.py
trains with it, with and without --cp); where a torch build refuses it, main() raises with the
reason and the advice to use DDP.
"""
from __future__ import annotations

import argparse
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from attention_ext.distributed import ContextParallel
from attention_ext.models import LanguageModel, LMConfig

CORPUS = """\
It is a truth universally acknowledged, that a single man in possession of a good fortune, must be
in want of a wife. However little known the feelings or views of such a man may be on his first
entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families,
that he is considered the rightful property of some one or other of their daughters.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my
purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. It is a way I have of driving off the spleen and regulating the
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly
November in my soul; then, I account it high time to get to sea as soon as I can.
"""


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", action="store_true", help="context parallel: shard each sequence over the ranks")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--mode", default="allgather", help="context_parallel_attention mode (with --cp)")
    p.add_argument("--shard-layout", default="zigzag",
                   help="sequence sharding (with --cp): contiguous, zigzag, stripe; balanced with --packed")
    p.add_argument("--packed", action="store_true", help="one pack of documents per step (with --cp or alone)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--positional", default="rope", help="rope, alibi, learned or none")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="print nothing (the losses are returned)")
    return p.parse_args(argv)


def setup():
    """(rank, world, device, whether this call created the process group)."""
    created = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        created = True
    if not dist.is_initialized():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return 0, 1, device, created
    rank, world = dist.get_rank(), dist.get_world_size()
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return rank, world, device, created


def get_batch(data: torch.Tensor, step: int, args) -> tuple:
    """The global batch of `step`: (B, T) inputs and next-token targets, the same on every rank."""
    g = torch.Generator().manual_seed(args.seed + 1 + step)
    starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
    x = torch.stack([data[s: s + args.seq] for s in starts.tolist()])          # (B, T)
    y = torch.stack([data[s + 1: s + 1 + args.seq] for s in starts.tolist()])  # (B, T)
    return x, y


def get_pack(data: torch.Tensor, step: int, args) -> tuple:
    """The pack of `step`: (1, T) inputs, targets (a document's last token -100: ignored) and the
    documents' offsets, the same on every rank."""
    g = torch.Generator().manual_seed(args.seed + 1 + step)
    cu, xs, ys = [0], [], []
    while cu[-1] < args.seq:
        n = min(int(torch.randint(1, args.seq // 2 + 1, (1,), generator=g)), args.seq - cu[-1])
        s = int(torch.randint(0, data.numel() - n - 1, (1,), generator=g))
        xs.append(data[s: s + n])
        ys.append(torch.cat([data[s + 1: s + n], torch.tensor([-100])]))  # nothing after the document's end
        cu.append(cu[-1] + n)
    return torch.cat(xs)[None], torch.cat(ys)[None], cu


def packed_loss(net, model, x, y, cu, cp, world: int) -> tuple:
    """(this rank's loss to backward, its share of the global mean): the sum of its token losses
    over the pack's predicted tokens (times P: DDP / FSDP average the gradients)."""
    count = int((y != -100).sum()) if cp is None else int((cp.shard(y) != -100).sum())
    total = count
    if cp is None:  # one process: each document alone
        logits = torch.cat([model(x[:, a:e]) for a, e in zip(cu[:-1], cu[1:])], 1)
        target = y
    else:
        logits, target = net(cp.shard(x), context_parallel=cp), cp.shard(y)
        t = torch.tensor([count], dtype=torch.float64)
        dist.all_reduce(t)
        total = int(t.item())
    s = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                          target.reshape(-1).to(logits.device), reduction="sum")
    return s / total * world, s.detach() / total


def wrap(model: torch.nn.Module, args, world: int, device: torch.device) -> torch.nn.Module:
    """DDP or FSDP2 over the world (nothing for one process)."""
    if args.fsdp:
        if world == 1:
            return model
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError as e:
            raise RuntimeError(f"--fsdp needs torch.distributed.fsdp.fully_shard (FSDP2): {e}") from e
        try:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        except Exception as e:  # noqa: BLE001
            raise RuntimeError(f"FSDP2 (fully_shard) failed on backend {dist.get_backend()!r}, device "
                               f"{device.type}: {type(e).__name__}: {e}. Use DDP (drop --fsdp).") from e
        return model
    if world == 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def main(argv: Optional[List[str]] = None) -> List[float]:
    """Train; returns the per-step global mean losses (on every rank)."""
    args = parse_args(argv)
    rank, world, device, created = setup()
    cp = None
    try:
        chars = sorted(set(CORPUS))
        data = torch.tensor([chars.index(c) for c in CORPUS], dtype=torch.long)
        cfg = LMConfig(vocab_size=len(chars), block_size=args.seq, n_layers=args.layers, n_heads=args.heads,
                       d_model=args.d_model, positional=args.positional, dropout=0.0)
        torch.manual_seed(args.seed)  # the same initial model on every rank
        model = LanguageModel(cfg).to(device)
        if args.cp and world > 1:
            # a group of its own for the attention's K/V collectives (all ranks)
            cp = ContextParallel(group=dist.new_group(list(range(world))), mode=args.mode,
                                 shard_layout=args.shard_layout)
            if args.seq % cp.multiple():
                raise ValueError(f"--seq {args.seq} must be a multiple of {cp.multiple()} for --cp over {world} "
                                 f"ranks with shard_layout {args.shard_layout!r}")
        elif args.packed and world > 1:
            raise ValueError("--packed over several ranks needs --cp (one pack per step, sharded)")
        elif world > 1 and args.batch % world:
            raise ValueError(f"--batch {args.batch} must be a multiple of the world size {world} (data parallel)")
        net = wrap(model, args, world, device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

        losses = []
        for step in range(args.steps):
            if args.packed:
                x, y, cu = get_pack(data, step, args)
                pcp = cp.with_documents(cu) if cp is not None else None
                loss, share = packed_loss(net, model, x.to(device), y.to(device), cu, pcp, world)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if world > 1:
                    dist.all_reduce(share)  # the global mean over the pack's predicted tokens
                losses.append(share.item())
                if rank == 0 and not args.quiet:
                    print(f"step {step}  loss {losses[-1]:.6f}", flush=True)
                continue
            x, y = get_batch(data, step, args)
            if cp is not None:  # every rank the whole batch, its shard of each sequence
                x, y = cp.shard(x), cp.shard(y)  # (B, T / P)
            elif world > 1:     # data parallel: this rank's rows
                rows = slice(rank * args.batch // world, (rank + 1) * args.batch // world)
                x, y = x[rows], y[rows]  # (B / P, T)
            x, y = x.to(device), y.to(device)
            kw = {} if cp is None else {"context_parallel": cp}
            _, loss = net(x, y, **kw)  # mean over this rank's tokens
            opt.zero_grad(set_to_none=True)
            loss.backward()            # DDP / FSDP average the gradients over the ranks
            opt.step()
            g = loss.detach().clone()
            if world > 1:
                dist.all_reduce(g)
                g /= world             # the global mean loss (equal token counts per rank)
            losses.append(g.item())
            if rank == 0 and not args.quiet:
                print(f"step {step}  loss {losses[-1]:.6f}", flush=True)
        return losses
    finally:
        if cp is not None and dist.is_initialized():
            dist.destroy_process_group(cp.group)
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
