"""ContextParallel: the option that turns a model's attention layers context-parallel.

A layer (nn.Attention) or a model (models.LanguageModel) given `context_parallel=ContextParallel(...)`
takes THIS rank's shard of the sequence, (B, n, d_model) with n = S / P, in the order of
shard_sequence(..., shard_layout=cp.shard_layout), and:
- computes its attention with context_parallel_attention(..., group, mode, shard_layout) (queries are
  the shard, keys the whole sequence); causal, window and ALiBi act on global positions there;
- applies RoPE / learned positions at the shard's GLOBAL positions (cp.positions(n)).
Everything else in a block (norms, MLP, projections) is per token and needs no communication.

Packed documents: cp.with_documents(cu_seqlens) is the same setup for one pack (B = 1) of
documents at those global offsets: attention keeps to each document (context_parallel_attention's
cu_seqlens), positions (RoPE, learned) restart at each document, and shard() / positions() follow
shard_layout="balanced" too.

`mode` is passed through untouched, so every mode of context_parallel_attention ("allgather",
"ring", "ulysses") serves the stack. The sequence must be a multiple of
sequence_multiple(P, shard_layout) (no padding through the stack: pad the tokens and drop the
padded targets from the loss instead).

Gradients: each rank's backward gives its parameters the gradient of its own loss through its
own computation, plus (through the K/V collectives' backward) the gradient other ranks' losses
send through its keys. Summing the parameter gradients over the group (all_reduce SUM, or DDP /
FSDP's average when every rank's loss is its shard's mean) gives the gradient of the summed loss.
"""
from __future__ import annotations

import sys
from dataclasses import InitVar, dataclass, replace
from typing import Any, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .attention import MODES
from .sharding import _check_layout, _no_layout, check_cu_seqlens, global_positions, sequence_multiple, shard_sequence

__all__ = ["ContextParallel"]


@dataclass(frozen=True)
class ContextParallel:
    group: Optional[Any] = None       # a torch.distributed ProcessGroup; None = the default (world) group
    mode: str = "allgather"           # context_parallel_attention's mode, passed through
    shard_layout: str = "zigzag"      # sharding.SHARD_LAYOUTS: "contiguous", "zigzag", "stripe", "balanced"
    layout: InitVar[None] = None      # not read: the sharding is shard_layout (a TypeError says so)
    cu_seqlens: Optional[Tuple[int, ...]] = None  # packed documents' global offsets (with_documents)
    check_ranks: bool = True          # context_parallel_attention's check_ranks: the group agrees on each call

    def __post_init__(self, layout: None):
        _no_layout("ContextParallel()", layout)
        _check_layout(self.shard_layout)
        if self.mode not in MODES:
            raise ValueError(f"ContextParallel: mode must be one of {MODES}, got {self.mode!r}")

    def with_documents(self, cu_seqlens: Union[Tensor, Sequence[int]]) -> "ContextParallel":
        """This setup for one pack of documents at global offsets cu_seqlens (B = 1; checked
        against the sequence at use, by sharding.check_cu_seqlens)."""
        return replace(self, cu_seqlens=check_cu_seqlens(cu_seqlens, sys.maxsize))  # the end: checked at use

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def seq_len(self, local_len: int) -> int:
        """The global length S of a sequence whose shards have local_len tokens."""
        return local_len * self.world_size

    def multiple(self) -> int:
        """The multiple the global sequence length must be of."""
        return sequence_multiple(self.world_size, self.shard_layout)

    def positions(self, local_len: int, device: Optional[torch.device] = None) -> Tensor:
        """(local_len,) int64 positions of this rank's shard: global, or with documents each
        token's position inside its document (padding's from cu_seqlens[-1])."""
        pos = global_positions(self.seq_len(local_len), rank=self.rank, world_size=self.world_size,
                               shard_layout=self.shard_layout, cu_seqlens=self.cu_seqlens)
        if self.cu_seqlens is not None:
            starts = torch.tensor(self.cu_seqlens, dtype=torch.int64)
            pos = pos - starts[torch.searchsorted(starts, pos, right=True) - 1]
        return pos.to(device) if device is not None else pos

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's shard of the full tensor x along `dim` (tokens (B, S) -> (B, n) by default)."""
        return shard_sequence(x, dim=dim, group=self.group, shard_layout=self.shard_layout,
                              cu_seqlens=self.cu_seqlens)
