"""The ranks' agreement on a context-parallel call, before its first collective.

Every rank of a group must call with matching arguments: the same shapes (but for what a rank's
shard may vary in), dtypes and options. Where they differ, the ranks take different collectives,
or collectives of different sizes, and a transport does not report that: gloo aborts the process
("Received data size doesn't match") or hands back a partly unfilled buffer, NCCL waits until its
timeout. And a bad value on one rank only raises there, while its peers wait in the first
collective for it. So each entry point runs its checks on this rank, then `agree` exchanges one
small fingerprint (an error flag and a code per field) in one all-gather, and every rank raises
alike: the rank whose checks failed its own error, the others an error that points at that rank;
where the fields differ, an error that names them with every rank's value (an all-gather of
their reprs, on that path only). The group stays usable: every rank left before its transfers.

The cost is that one all-gather and reading it on the host (a device sync under NCCL): an entry
point's `check_ranks=False` skips it, and a world of one rank or a call under torch.compile never
runs it.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["agree", "field", "map_field", "shard_field", "state_field"]


def field(x: object, contents: bool = True) -> object:
    """What must agree of an argument: a tensor's shape, dtype, device type and requires_grad, and
    the contents of an integer or bool one (cu_seqlens, a block layout, a seed: read on the host,
    as a digest); a sequence element by element; anything else its value (its repr)."""
    if isinstance(x, Tensor):
        meta = f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')} on {x.device.type}" + \
            (" requiring grad" if x.requires_grad else "")
        if not contents or x.is_floating_point() or x.is_complex():
            return meta
        data = x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return f"{meta}, contents {hashlib.blake2b(data, digest_size=8).hexdigest()}"
    if isinstance(x, (list, tuple)):
        return tuple(field(e, contents) for e in x)
    return x


def shard_field(x: object, seq_dim: int) -> object:
    """`field` of a shard (its contents are the rank's own) whose length may differ per rank (linear
    attention's, the delta rule's): the sequence dim `seq_dim` reads "n"."""
    if isinstance(x, Tensor) and 0 <= seq_dim < x.dim():
        shape = list(x.shape)
        shape[seq_dim] = "n"
        return field(x, False).replace(str(tuple(x.shape)), "(" + ", ".join(map(str, shape)) + ")", 1)
    return field(x, False)


def map_field(fm: object) -> object:
    """A feature map: its name, or its type (an object's repr may carry its address, which differs
    from process to process)."""
    return fm if isinstance(fm, str) or fm is None else getattr(fm, "__qualname__", type(fm).__qualname__)


def state_field(state: object) -> object:
    """An initial state: a tensor's `field`, or a state object's tensors' (S, z, log_scale)."""
    if state is None or isinstance(state, Tensor):
        return field(state)
    return (type(state).__name__,) + tuple(field(getattr(state, n, None)) for n in ("S", "z", "log_scale"))


def _code(value: object) -> int:
    """A 56-bit code of the field's repr (the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def _device(group: Optional[dist.ProcessGroup], like: object) -> torch.device:
    """Where the group's collectives run: the tensor's CUDA device under NCCL, else the CPU."""
    if isinstance(like, Tensor) and like.is_cuda and "nccl" in str(dist.get_backend(group)).lower():
        return like.device
    return torch.device("cpu")


def agree(fn: str, group: Optional[dist.ProcessGroup], like: object, fields: Dict[str, object],
          error: Optional[BaseException], *, check: bool = True) -> None:
    """Raises, on every rank alike, `error` (this rank's checks failed), or an error naming the
    rank whose checks failed, or the fields (values of `field`) that differ across the group;
    returns when every rank passed its checks with the same fields. `like`: the call's q (its
    device runs the all-gather under NCCL; anything else: the CPU)."""
    # no group to agree with (the call fails on its own), one rank, or traced: nothing to exchange
    if not check or not dist.is_initialized() or dist.get_world_size(group) == 1 or torch.compiler.is_compiling():
        if error is not None:
            raise error
        return
    world = dist.get_world_size(group)
    names = list(fields)
    mine = torch.tensor([int(error is not None)] + [_code(fields[n]) for n in names], dtype=torch.int64,
                        device=_device(group, like))
    rows: List[Tensor] = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    table = [r.tolist() for r in rows]
    failed = [r for r in range(world) if table[r][0]]
    if failed:
        if error is not None:
            raise error
        raise ValueError(f"{fn}: rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of the group "
                         f"rejected {'their' if len(failed) > 1 else 'its'} arguments (the error there names the "
                         f"argument), so every rank stops before the collectives: call every rank with valid, "
                         f"matching arguments")
    differ = [n for i, n in enumerate(names) if len({row[i + 1] for row in table}) > 1]
    if not differ:
        return
    reprs: List[object] = [None] * world
    dist.all_gather_object(reprs, {n: repr(fields[n]) for n in differ}, group=group)
    lines = "; ".join(f"{n}: " + ", ".join(f"rank {r} {reprs[r][n]}" for r in range(world)) for n in differ)
    raise ValueError(f"{fn}: the ranks of the group passed different {', '.join(differ)} ({lines}): every rank "
                     f"must call with the same arguments (only the shards' data differ), or the collectives "
                     f"would not match")
