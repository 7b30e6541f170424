"""The attention options of context parallelism, one frozen object, and their rules, stated once.

Every entry point (attention.context_parallel_attention, the front door; ring.ring_attention and
ulysses.ulysses_attention, one mode each) takes the options as keywords and builds ONE
AttentionOptions from them with AttentionOptions.of, which refuses an unknown keyword with a
TypeError that names it and the keyword it likely meant. Each mode (allgather.py, ring.py,
ulysses.py) then reads the options, and applies them to its shards, through this object only:

- construction checks every value that needs no tensor: window_size (a (left, right) pair, each
  >= -1), dropout_p in [0, 1), layout ("bhsd" / "bshd"; a sharding given here names shard_layout);
- shards(q, k, v): the shards' checks (sharding.check_shards) and the per-head options against
  them: sinks (H,) on q's device, alibi_slopes (H,) or (B, H);
- sequence(q, group, shard_layout): the group's rank and size, the padded length S and the real
  one (seq_len, in [1, S]; with cu_seqlens their end);
- blocks(q, S): the block-sparse layout of the whole sequence, checked, on the host;
- documents(q, S): the packed documents' offsets (cu_seqlens, checked by sharding.check_cu_seqlens)
  as host ints, with B = 1;
- window: (left, right) on global positions, causal capping the right side at 0;
- result(out, lse): the output in the tensors' layout, with the LSE when return_lse.

So a bad value raises the same error whichever entry point and mode received it. Not options:
how the call is parallel (group, mode, shard_layout, which context.ContextParallel holds for a
model) and ring's private `stats`.
"""
import difflib
import inspect
from dataclasses import dataclass, fields
from typing import Callable, Dict, Optional, Sequence, Tuple, TypeVar, Union

import torch
import torch.distributed as dist
from torch import Tensor

from .._args import TENSOR_LAYOUT, as_int, not_a_tensor, renamed
from ..softmax.functional import window_size_pair
from ..softmax import ops as _ops
from .agree import agree, field, needed
from .sharding import _check_len, _check_tensor_layout, _documents_for, check_shards

__all__ = ["AttentionOptions", "takes_options"]

_FN = "context_parallel_attention"  # the name value errors carry, whichever entry point got the value


@dataclass(frozen=True, eq=False)
class AttentionOptions:
    """What context-parallel attention computes: the keywords of context_parallel_attention of
    the same names (documented there), shared by every mode. Frozen; two options are equal when
    every field is (tensors: the same object)."""

    causal: bool = False
    scale: Optional[float] = None
    window_size: Tuple[int, int] = (-1, -1)
    alibi_slopes: Optional[Tensor] = None
    softcap: float = 0.0
    sinks: Optional[Tensor] = None
    return_lse: bool = False
    layout: str = "bhsd"
    seq_len: Optional[int] = None
    dropout_p: float = 0.0
    seed: Union[int, Tensor, None] = None
    cu_seqlens: Union[Tensor, Sequence[int], None] = None
    block_layout: Optional[Tensor] = None
    block_size: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "window_size", window_size_pair(self.window_size, _FN))  # an (int, int) pair
        try:
            if isinstance(self.dropout_p, (bool, str)):
                raise TypeError
            object.__setattr__(self, "dropout_p", float(self.dropout_p))  # a Python, numpy or 0-d tensor number
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"dropout_p must be a float in [0, 1), got {self.dropout_p!r}") from None
        if self.seq_len is not None:
            if as_int(self.seq_len) is None:
                raise TypeError(f"seq_len must be an int (the real length, padding excluded) or None, got "
                                f"{self.seq_len!r}: a fractional length is refused, not rounded")
            object.__setattr__(self, "seq_len", as_int(self.seq_len))
        for name in ("alibi_slopes", "sinks"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), Tensor):
                raise not_a_tensor(name, getattr(self, name), _FN)
        if not 0.0 <= self.dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {self.dropout_p!r}")
        _check_tensor_layout(self.layout)

    @classmethod
    def of(cls, fn: str, keywords: Dict[str, object], takes: Sequence[str] = ()) -> "AttentionOptions":
        """The options given as `keywords` to entry point `fn` (e.g. "ring_attention()"), whose own
        keywords are `takes`. An unknown keyword raises a TypeError naming it; the old name
        qkv_layout raises one naming layout."""
        for name in keywords:
            if name not in _NAMES:
                if name in _RENAMED:
                    if keywords[name] is None:  # the old name left at its default: nothing to read
                        continue
                    raise renamed(fn, name, *_RENAMED[name])
                raise _unknown(fn, name, takes)
        return cls(**{n: val for n, val in keywords.items() if n in _NAMES})

    @classmethod
    def agreed(cls, fn: str, keywords: Dict[str, object], takes: Sequence[str], q: Tensor, k: Tensor, v: Tensor, *,
               group: Optional[dist.ProcessGroup], shard_layout: str, parallel: Dict[str, object],
               check_ranks: bool = True) -> "AttentionOptions":
        """`of`, then this rank's checks of its shards against the options (shards, sequence,
        blocks, and the kernel's own input rules, through softmax_fwd_route: every rank, whether
        or not its plan calls the kernel), then the group's agreement on them (agree.py: one small
        all-gather), so that a bad or mismatched argument on any rank raises on every rank before
        a collective. parallel: how the call is parallel (mode, shard_layout, overlap), which
        must agree too."""
        if not needed(group, check_ranks):  # nothing to exchange: the modes check, as without a group
            return cls.of(fn, keywords, takes)
        err, opts = None, None
        names = ["q", "k", "v", "grad mode", *parallel, *(f.name for f in fields(cls) if f.name != "return_lse")]
        values: Dict[str, object] = dict.fromkeys(names)  # every rank sends every name (agree's one length)
        try:
            opts = cls.of(fn, keywords, takes)
            q3, k3, v3 = opts.shards(q, k, v)
            _, _, s, _ = opts.sequence(q3, group, shard_layout)
            opts.blocks(q3, s)
            if _ops.has_kernel(q3.device, q3.dtype):  # the kernel's input rules, stated in C++
                _ops.fwd_route(*(t if t.stride(-1) == 1 else t.contiguous() for t in (q3, k3, v3)),
                               softcap=float(opts.softcap))
            values.update({"q": field(q), "k": field(k), "v": field(v), "grad mode": torch.is_grad_enabled(),
                           **{n: field(x) for n, x in parallel.items()}})
            # the options as built (numpy numbers, a window given as one int: their normal form);
            # return_lse is local
            values.update({f.name: field(getattr(opts, f.name)) for f in fields(cls) if f.name != "return_lse"})
        except Exception as e:  # noqa: BLE001  (any failure here must reach every rank, not leave them waiting)
            err = e
        agree(fn, group, values, err, check=check_ranks, kind="context-parallel softmax attention")
        return opts

    @property
    def window(self) -> Tuple[int, int]:
        """(left, right) key counts on global positions, -1 = unbounded; causal caps right at 0."""
        wl, wr = self.window_size
        return (wl, 0) if self.causal else (wl, wr)

    def shards(self, q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """The checks of this rank's shards and of the per-head options against them (before any
        collective, so that every rank fails alike): q, k, v as (B, H, n, D) / (B, H_k, n, D)
        views (bshd transposed, no copy)."""
        q, k, v = check_shards(q, k, v, layout=self.layout)
        b, h = q.shape[:2]
        if self.sinks is not None:
            if tuple(self.sinks.shape) != (h,):
                raise ValueError(f"sinks must be (H,) = ({h},), got {tuple(self.sinks.shape)}")
            if self.sinks.device != q.device:
                raise ValueError(f"sinks must be on {q.device}, got {self.sinks.device}")
        a = self.alibi_slopes
        if a is not None and (a.dim() not in (1, 2) or a.shape[-1] != h or (a.dim() == 2 and a.shape[0] != b)):
            raise ValueError(f"alibi_slopes must be (H,) = ({h},) or (B, H) = ({b}, {h}), got {tuple(a.shape)}")
        return q, k, v

    def sequence(self, q: Tensor, group: Optional[dist.ProcessGroup], shard_layout: str
                 ) -> Tuple[int, int, int, int]:
        """(rank, world size, padded length S, real length) of the sequence whose shard q
        ((B, H, n, D)) is: S = n P must be a multiple of the shard layout's multiple, and the
        real length (seq_len, default S) in [1, S]."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        s = q.shape[2] * world
        _check_len(s, world, shard_layout)
        seq_len = s if self.seq_len is None else self.seq_len
        docs = self.documents(q, s, shard_layout)
        if docs is not None:
            if self.seq_len is not None and self.seq_len != docs[-1]:
                raise ValueError(f"seq_len ({self.seq_len}) must equal cu_seqlens[-1] ({docs[-1]}), the packed "
                                 f"documents' end (or be left out)")
            seq_len = docs[-1]
        if not 0 < seq_len <= s:
            what = "cu_seqlens[-1] (the documents' end)" if docs is not None else "seq_len"
            raise ValueError(f"{what} must be in [1, {s}] (the padded length), got {seq_len}")
        return rank, world, s, seq_len

    def blocks(self, q: Tensor, s: int) -> Optional[Tuple[Tensor, int]]:
        """(the block layout as a host bool (H or 1, ceil(S / bs), ceil(S / bs)) tensor, bs), or
        None: the sparse family's layout of the WHOLE (padded) sequence of length s, blocks of
        block_size (a multiple of 16) on global positions."""
        lay, bs = self.block_layout, self.block_size
        if lay is None:
            return None
        if not isinstance(lay, Tensor) or lay.dtype != torch.bool:
            raise TypeError(f"block_layout must be a bool tensor, got {getattr(lay, 'dtype', type(lay).__name__)}")
        if not isinstance(bs, int) or bs < 16 or bs % 16:
            raise ValueError(f"block_size must be a positive multiple of 16, got {bs!r}")
        h, nb = q.shape[1], -(-s // bs)
        if lay.dim() == 2:
            lay = lay.unsqueeze(0)
        if lay.dim() != 3 or lay.shape[0] not in (1, h) or tuple(lay.shape[1:]) != (nb, nb):
            raise ValueError(f"block_layout must be the whole sequence's (H or 1, ceil(S / block_size), "
                             f"ceil(S / block_size)) = ({h} or 1, {nb}, {nb}) grid (S = {s}, the shards' length times "
                             f"the group size), got {tuple(lay.shape)}")
        return lay.cpu(), bs

    def documents(self, q: Tensor, s: int, shard_layout: str) -> Optional[Tuple[int, ...]]:
        """The packed documents' global offsets (cu_seqlens) as host ints, or None: checked
        (sharding.check_cu_seqlens) against the padded length s, with q ((B, H, n, D)) of B = 1;
        shard_layout="balanced" needs them."""
        if self.cu_seqlens is not None and q.shape[0] != 1:
            raise ValueError(f"cu_seqlens packs documents into ONE sequence: the shards' batch must be 1, got "
                             f"{q.shape[0]} (pack every batch row's documents into one sequence)")
        return _documents_for(shard_layout, self.cu_seqlens, s)

    def result(self, out: Tensor, lse: Optional[Tensor]) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        """A mode's (B, H, n, D) output in the tensors' layout, with its (B, H, n) LSE when
        return_lse."""
        if self.layout == "bshd":
            out = out.transpose(1, 2)
        return (out, lse) if self.return_lse else out

    def _key(self) -> tuple:
        return tuple(("tensor", id(x)) if isinstance(x, Tensor) else x
                     for x in (getattr(self, f.name) for f in fields(self)))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


_NAMES = frozenset(f.name for f in fields(AttentionOptions))
_RENAMED = {"qkv_layout": ("layout", TENSOR_LAYOUT)}  # old names, refused with the new one (None: not given)
_ALIASES = {"softmax_scale": "scale", "is_causal": "causal", "window": "window_size", "dropout": "dropout_p",
            "return_softmax_lse": "return_lse"}  # other APIs' spellings of these options


def _unknown(fn: str, name: str, takes: Sequence[str]) -> TypeError:
    known = [*takes, *(f.name for f in fields(AttentionOptions))]
    meant = _ALIASES.get(name) or next(iter(difflib.get_close_matches(name, known, n=1)), None)
    hint = f": did you mean {meant}=?" if meant else ""
    return TypeError(f"{fn} got an unexpected keyword argument {name!r}{hint} (its keywords: {', '.join(known)})")


_F = TypeVar("_F", bound=Callable)


def takes_options(fn: _F) -> _F:
    """Decorator for an entry point fn(q, k, v, *, ..., **options): its signature (inspect, help())
    lists the options' fields as keywords in place of **options, then the refused old names, then
    its private keywords."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    opts = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
            for f in fields(AttentionOptions)]
    old = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=None) for n in _RENAMED]
    params = [p for p in own if not p.name.startswith("_")] + opts + old + [p for p in own if p.name.startswith("_")]
    fn.__signature__ = sig.replace(parameters=params)
    return fn
