"""What each rank runs for tests/distributed/test_cp_stack.py (imported by the spawned processes).

Stack cases: the LanguageModel with context_parallel on this rank's sequence shard against the
same model (same seed on every rank) on the full sequence in this process: logits, the global
mean loss and the parameter gradients (each rank backwards loss / P, then all_reduce SUM).
Packed cases: one pack of documents (cp.with_documents) against each document run alone. A
case's failure is recorded, not raised, so every rank runs the same collectives in the same order.

Training cases: examples/train_distributed.py's main() on this rank; its per-step losses come back.
"""
from __future__ import annotations

import importlib.util
import os
import traceback
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from attention_ext.distributed import ContextParallel, global_positions
from attention_ext.models import LanguageModel, LMConfig
from tests.helpers import rel_err

B, S = 2, 24            # S: a multiple of 2P for P = 2, 3
TOL = 1e-5              # fp32, relative (tests.helpers.rel_err)

# variant -> LMConfig options (every one causal: the decoder-only LM)
VARIANTS = {
    "rope-gqa": dict(positional="rope", n_kv_heads=2),
    "learned": dict(positional="learned"),
    "alibi-sinks": dict(positional="alibi", sinks=True),
    "rope-window": dict(positional="rope", window=(7, -1)),
}
LAYOUTS = ("contiguous", "zigzag")
STACK_CASES = [f"{shard_layout}-{v}" for shard_layout in LAYOUTS for v in VARIANTS]
# packed documents (B = 1): the pack against each document run alone
PACK = [0, 7, 8, 19, 24]
PACKED_CASES = [f"packed-{shard_layout}-{v}" for shard_layout in ("zigzag", "balanced")
                for v in ("rope-gqa", "learned", "alibi-sinks")]


def _config(variant: str) -> LMConfig:
    return LMConfig(vocab_size=37, block_size=S, n_layers=2, n_heads=4, d_model=32, dropout=0.0, **VARIANTS[variant])


def stack_case(rank: int, world: int, name: str) -> None:
    packed = name.startswith("packed-")
    shard_layout, variant = name.removeprefix("packed-").split("-", 1)
    torch.manual_seed((PACKED_CASES if packed else STACK_CASES).index(name))  # the same model, tokens on every rank
    model = LanguageModel(_config(variant))
    b = 1 if packed else B
    idx = torch.randint(0, 37, (b, S))
    tgt = torch.randint(0, 37, (b, S))

    # one process, the whole sequence (packed: each document alone, positions from 0)
    if packed:
        logits = torch.cat([model(idx[:, a:e]) for a, e in zip(PACK[:-1], PACK[1:])], 1)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    else:
        logits, loss = model(idx, tgt)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    # this rank's shard
    cp = ContextParallel(group=None, mode="allgather", shard_layout=shard_layout)
    if packed:
        cp = cp.with_documents(PACK)
    # the shard's global positions (cp.positions restarts them per document)
    pos = global_positions(S, rank=rank, world_size=world, shard_layout=shard_layout, cu_seqlens=cp.cu_seqlens)
    lg, ls = model(cp.shard(idx), cp.shard(tgt), context_parallel=cp)
    (ls / world).backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # the gradient of the summed loss / P = of the global mean loss
    gl = ls.detach().clone()
    dist.all_reduce(gl)
    gl /= world

    e = rel_err(lg, logits[:, pos])
    assert e <= TOL, f"logits: relative error {e:.3g}"
    lv = loss.item()
    assert abs(gl.item() - lv) <= TOL * max(1.0, abs(lv)), f"loss {gl.item()} != {lv}"
    off = 0
    for n, p in model.named_parameters():
        g = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
        e = rel_err(g, want[n])
        assert e <= TOL, f"grad {n}: relative error {e:.3g}"


def stack_suite(rank: int, world: int, names: List[str]) -> Dict[str, Optional[str]]:
    res: Dict[str, Optional[str]] = {}
    for name in names:
        try:
            stack_case(rank, world, name)
            res[name] = None
        except Exception:  # noqa: BLE001
            res[name] = traceback.format_exc()
    return res


def _example():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_distributed.py")
    spec = importlib.util.spec_from_file_location("train_distributed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_runs(rank: int, world: int, runs: List[List[str]]) -> List[object]:
    """examples/train_distributed.py main(argv) for each argv: its losses, or the error text."""
    main = _example().main
    out = []
    for argv in runs:
        try:
            out.append(main(argv))
        except Exception as e:  # noqa: BLE001
            out.append(f"{type(e).__name__}: {e}")
        dist.barrier()
    return out
