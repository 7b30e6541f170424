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

The fingerprint has one length whatever the entry point and its arguments (the entry point's
code and a fixed number of field slots), so that ranks that called different entry points
disagree instead of aborting the transport. It runs on the CPU where the group has gloo, else
on the current CUDA device (NCCL), chosen from the group alone: a rank's bad argument cannot
send it elsewhere. The cost is that one all-gather and reading it on the host (a device sync
under NCCL only): an entry point's `check_ranks=False` skips it (the same on every rank: a rank
that skips it would pair its first collective with its peers' check), and a world of one rank,
a call without a process group or under torch.compile never runs it (`needed`).
"""
from __future__ import annotations

import hashlib
import numbers
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["agree", "field", "map_field", "needed", "shard_field", "state_field"]

_SLOTS = 40  # field slots of a fingerprint (the most an entry point has: context_parallel_attention's 22)
_REPR_BYTES = 1024  # of each rank's differing fields' reprs, on the mismatch path


def needed(group: Optional[dist.ProcessGroup], check: bool) -> bool:
    """Whether a call agrees with its group: checking, a process group, more than one rank, eager."""
    return (check and dist.is_available() and dist.is_initialized() and not torch.compiler.is_compiling()
            and dist.get_world_size(group) > 1)


def field(x: object, contents: bool = True, floats: bool = False) -> object:
    """What must agree of an argument: a tensor's shape, dtype, device type and requires_grad, and
    the contents of an integer or bool one (cu_seqlens, a block layout, a seed; a float one's too
    with floats: a feature map's projection), read on the host, as a digest; a sequence element by
    element; anything else its value (its repr)."""
    if isinstance(x, Tensor):
        meta = f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')} on {x.device.type}" + \
            (" requiring grad" if x.requires_grad else "")
        if not contents or ((x.is_floating_point() or x.is_complex()) and not floats):
            return meta
        data = x.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        return f"{meta}, contents {hashlib.blake2b(data, digest_size=8).hexdigest()}"
    if isinstance(x, (list, tuple)):
        return tuple(field(e, contents, floats) for e in x)
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)  # numpy ints: the int they hold
    if isinstance(x, numbers.Real):
        return float(x)
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
    """A feature map: its name; an nn.Module's type, settings (extra_repr: the fused map's name,
    a random map's widths) and tensors, their contents included (a random map's projection must
    be the same on every rank); a plain callable's qualified name (a repr may carry the object's
    address, which differs from process to process)."""
    if fm is None or isinstance(fm, str):
        return fm
    if isinstance(fm, torch.nn.Module):
        tensors = [*fm.parameters(), *fm.buffers()]
        return (type(fm).__qualname__, fm.extra_repr(), tuple(field(t, floats=True) for t in tensors))
    return getattr(fm, "__qualname__", type(fm).__qualname__)


def state_field(state: object) -> object:
    """An initial state: a tensor's `field`, or a state object's tensors' (S, z, log_scale)."""
    if state is None or isinstance(state, Tensor):
        return field(state)
    return (type(state).__name__,) + tuple(field(getattr(state, n, None)) for n in ("S", "z", "log_scale"))


def _code(value: object) -> int:
    """A 56-bit code of the field's repr (the same in every process, unlike hash())."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=7).digest(), "little")


def _device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where the exchange runs, from the group alone: the CPU where it has gloo, else (NCCL) the
    current CUDA device."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree(fn: str, group: Optional[dist.ProcessGroup], fields: Dict[str, object],
          error: Optional[BaseException], *, check: bool = True, kind: Optional[str] = None) -> None:
    """Raises, on every rank alike, `error` (this rank's checks failed), or an error naming the
    rank whose checks failed, or the fields (values of `field`) that differ across the group;
    returns when every rank passed its checks with the same fields. `fn` names the entry point in
    the messages; `kind` (default `fn`) is what the ranks must agree on: entry points that run the
    same collectives share one (softmax's three: ring_attention on one rank and
    context_parallel_attention(mode="ring") on another are the same call)."""
    if not needed(group, check):
        if error is not None:
            raise error
        return
    world = dist.get_world_size(group)
    names = list(fields)
    assert len(names) <= _SLOTS, "agree.py: raise _SLOTS"
    codes = [_code(fields[n]) for n in names] + [0] * (_SLOTS - len(names))
    device = _device(group)
    mine = torch.tensor([int(error is not None), _code(kind or fn)] + codes, dtype=torch.int64, device=device)
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
    if len({row[1] for row in table}) > 1:
        raise ValueError(f"{fn}: the ranks of the group called different context-parallel functions at once: every "
                         f"rank must make the same call")
    differ = [n for i, n in enumerate(names) if len({row[i + 2] for row in table}) > 1]
    if not differ:
        return
    # every rank's values of the differing fields, as text in one fixed-size byte row per rank
    text = "\x00".join(repr(fields[n]) for n in differ).encode()[:_REPR_BYTES]
    mine_b = torch.zeros(_REPR_BYTES, dtype=torch.uint8, device=device)
    mine_b[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else mine_b[:0]
    rows_b = [torch.empty_like(mine_b) for _ in range(world)]
    dist.all_gather(rows_b, mine_b, group=group)
    vals = [bytes(r.cpu().tolist()).rstrip(b"\x00").decode(errors="replace").split("\x00") for r in rows_b]
    lines = "; ".join(f"{n}: " + ", ".join(f"rank {r} {vals[r][i] if i < len(vals[r]) else '...'}"
                                          for r in range(world)) for i, n in enumerate(differ))
    raise ValueError(f"{fn}: the ranks of the group passed different {', '.join(differ)} ({lines}): every rank "
                     f"must call with the same arguments (only the shards' data differ), or the collectives "
                     f"would not match")
