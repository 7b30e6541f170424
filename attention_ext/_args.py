"""Argument rules every family's public functions share, each stated once here:

- not_a_tensor(name, value): the error for a q / k / v / mask that is not a torch.Tensor, which
  says how to convert it (a numpy array: torch.from_numpy);
- key_padding_mask_renamed(fn): the error for `key_padding_mask` passed to a function that takes
  `key_mask`. Both name a (B, S_k) bool mask of the keys, with opposite polarities: key_mask
  True = a real key (flash-attn's and Hugging Face's sense), key_padding_mask True = padding
  (torch's nn.MultiheadAttention, which owns that name). A function never reads one as the other;
- renamed(fn, old, new, what): the error for an argument passed under its old name `old`, which
  names the new one. The old spelling is refused, never read under either meaning;
- misplaced(fn, arg, value, what, goes_in): the error for a value of another meaning given to
  `arg` (a block layout or a sequence sharding given as the tensor layout `layout`), which names
  the argument that takes it;
- LayoutMismatch / layout_mismatch(...): the error for q, k, v whose shapes fit the other tensor
  layout ("bhsd" vs "bshd") and not the one given, which names the layout argument.

One meaning per name: `layout` is always the tensors' layout ("bhsd" / "bshd"); a sparse block
layout is `block_layout`, context parallelism's sequence sharding `shard_layout`, and the sparse
layout builders' count of blocks `window_blocks` (`window` is always a (left, right) pair of keys).

The checks run on the error path only (or as one isinstance test): a good call pays nothing for
them.
"""
from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["not_a_tensor", "as_offsets", "key_padding_mask_renamed", "renamed", "misplaced",
           "LayoutMismatch", "layout_mismatch", "TENSOR_LAYOUT"]

_DIMS = {"bhsd": "(B, H, S, D)", "bshd": "(B, S, H, D)"}
TENSOR_LAYOUT = "the tensors' layout, 'bhsd' or 'bshd', as in attention()"  # what `layout` names everywhere


def not_a_tensor(name: str, value: object, fn: str = "") -> TypeError:
    """The TypeError for argument `name` given `value`, not a Tensor; `fn` prefixes the message.
    A numpy array converts without a copy (torch.from_numpy), a list or a number with
    torch.tensor."""
    t = type(value)
    what = f"{t.__module__}.{t.__qualname__}" if t.__module__ not in ("builtins", None) else t.__qualname__
    if t.__module__ == "numpy" and t.__name__ == "ndarray":
        fix = f": convert it with torch.from_numpy({name}) (no copy), then .to(device) if needed"
    elif isinstance(value, (list, tuple, int, float, bool)) or t.__module__ == "numpy":
        fix = f": convert it with torch.tensor({name})"
    else:
        fix = ""
    return TypeError(f"{fn}{': ' if fn else ''}{name} must be a torch.Tensor, got {what}{fix}")


def as_int(x: object) -> Optional[int]:
    """x as an int when it is an integer (a Python, numpy or 0-d tensor one; not a bool, not a
    float, which a caller refuses rather than truncates), else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def as_offsets(t: object, name: str, device, fn: str = "") -> Tensor:
    """An offsets tensor (cu_seqlens) as the ops read it: int32, contiguous, on `device`. Takes
    int32 or int64 (torch.tensor([0, 3, 10]) is int64); any other dtype is a TypeError, and an
    int64 value outside int32's range a ValueError (under torch.compile an in-graph assert)."""
    pre = f"{fn}: " if fn else ""
    if not isinstance(t, Tensor):
        raise not_a_tensor(name, t, fn)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{pre}{name} must be an int32 (or int64) tensor of offsets, got {t.dtype}")
    if t.dtype == torch.int64 and t.numel() > 0 and not t.is_meta:
        if torch.compiler.is_compiling():  # a graph cannot branch on the values: an in-graph assert
            torch._assert_async(((t >= -2 ** 31) & (t <= 2 ** 31 - 1)).all(),
                                f"{pre}{name} holds a value outside int32's range")
        else:
            lo, hi = int(t.min()), int(t.max())
            if lo < -2 ** 31 or hi > 2 ** 31 - 1:
                raise ValueError(f"{pre}{name} holds {hi if hi > 2 ** 31 - 1 else lo}, outside int32's range: "
                                 f"packs address at most 2^31 - 1 rows")
    return t.to(device=device, dtype=torch.int32).contiguous()


def key_padding_mask_renamed(fn: str, old: str = "key_padding_mask", new: str = "key_mask") -> TypeError:
    """The TypeError for `old` passed to `fn`, which takes `new` (True = a real key) instead."""
    return TypeError(f"{fn} takes {new} (B, S_k) bool, True = a real key (as flash-attn and Hugging Face mean a "
                     f"key mask); {old} is torch's name for the opposite (True = padding) and is not read here: "
                     f"pass {new}=~{old}")


def renamed(fn: str, old: str, new: str, what: str) -> TypeError:
    """The TypeError for `old` passed to `fn`, whose argument for `what` is `new`."""
    return TypeError(f"{fn} takes {new} ({what}); {old} is its old name and is not read: pass {new}= instead")


def misplaced(fn: str, arg: str, value: object, what: str, goes_in: str, exc: type = TypeError) -> Exception:
    """The error (`exc`) for `value`, of another meaning, given to `fn`'s argument `arg`, which takes
    `what`; `goes_in` names the argument that takes such a value."""
    got = repr(value) if isinstance(value, (str, int, float, tuple)) else f"a {type(value).__name__}"
    return exc(f"{fn}{': ' if fn else ''}{arg} is {what}, got {got}: {goes_in}")


class LayoutMismatch(ValueError):
    """q, k, v whose shapes fit the other layout and not the one given. The message names the
    layout argument (`arg`); a function that passes its own layout argument on under another
    name re-raises with `renamed(its_name)`."""

    def __init__(self, shapes: str, given: str, other: str, cause: str, arg: str = "layout", lengths: str = "",
                 rows: str = ""):
        self.shapes, self.given, self.other, self.cause = shapes, given, other, cause
        self.arg, self.lengths, self.rows = arg, lengths, rows
        if lengths:  # read as given, only the lengths disagree: either fix may be the one
            fix = (f"pass {arg}={other!r} if they are {_DIMS[other]}; if they are {_DIMS[given]}, give them one "
                   f"length ({lengths})")
        elif rows:  # read as given, only beta disagrees: it may be beta that is transposed
            fix = f"pass {arg}={other!r} if they are {_DIMS[other]}; if they are {_DIMS[given]}, {rows}"
        else:
            fix = f"pass {arg}={other!r}"
        super().__init__(f"{shapes} do not fit {arg}={given!r} {_DIMS[given]} but fit {arg}={other!r} "
                         f"{_DIMS[other]}: {fix} ({cause})")

    def renamed(self, arg: str) -> "LayoutMismatch":
        return LayoutMismatch(self.shapes, self.given, self.other, self.cause, arg, self.lengths, self.rows)


def _fits(q: Tensor, k: Tensor, v: Optional[Tensor], layout: str, same_len: bool,
          rows: Optional[Tensor] = None) -> bool:
    """Whether 4-D q, k (and v) read in `layout` agree: one batch, one head dim for q and k, k and
    v one (heads, length), query heads a multiple of kv heads (and one length with same_len).
    rows (the delta rule's beta, (B, H_v, S) in every layout): q and k one head count, v's a
    multiple of it, and rows (B, v's heads, S)."""
    hi, si = (1, 2) if layout == "bhsd" else (2, 1)
    h, hk = q.shape[hi], k.shape[hi]
    ok = q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and hk > 0 and h % hk == 0
    if rows is not None:
        hv = v.shape[hi]
        ok = (ok and h == hk and v.shape[0] == k.shape[0] and hv % hk == 0 and v.shape[si] == k.shape[si]
              and tuple(rows.shape) == (k.shape[0], hv, k.shape[si]))
    elif v is not None:
        ok = ok and v.shape[0] == k.shape[0] and v.shape[hi] == hk and v.shape[si] == k.shape[si]
    return ok and (not same_len or q.shape[si] == k.shape[si])


def _fits_without_rows(q: Tensor, k: Tensor, v: Tensor, layout: str, same_len: bool) -> bool:
    """Whether the delta rule's q, k, v (one head count for q and k, v's a multiple of it) fit
    `layout` by themselves, beta aside."""
    hi, si = (1, 2) if layout == "bhsd" else (2, 1)
    return (_fits(q, k, None, layout, same_len) and q.shape[hi] == k.shape[hi] and v.shape[0] == k.shape[0]
            and v.shape[hi] % k.shape[hi] == 0 and v.shape[si] == k.shape[si])


def layout_mismatch(q: Tensor, k: Tensor, v: Optional[Tensor], layout: str, cause: BaseException, *,
                    arg: str = "layout", same_len: bool = False,
                    names: Tuple[str, str, str] = ("q", "k", "v"), rows: Optional[Tensor] = None
                    ) -> Optional[LayoutMismatch]:
    """The LayoutMismatch to raise for `cause` (an error about q, k, v given in `layout`) when their
    shapes prove a layout mix-up: they do not fit `layout` and fit the other one. None otherwise
    (the error has another reason). v may be None (attention_weights); same_len: q and k must
    have one length (linear attention, context parallelism's shards); names: the arguments';
    rows: the delta rule's beta (_fits)."""
    ts = (q, k) if v is None else (q, k, v)
    if layout not in _DIMS or not all(isinstance(t, Tensor) and t.dim() == 4 for t in ts):
        return None
    if rows is not None and (v is None or not isinstance(rows, Tensor) or rows.dim() != 3):
        return None
    other = "bshd" if layout == "bhsd" else "bhsd"
    if _fits(q, k, v, layout, same_len, rows) or not _fits(q, k, v, other, same_len, rows):
        return None
    shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(names, ts))
    lengths = rows_fix = ""
    if same_len and _fits(q, k, v, layout, False, rows):
        si = 2 if layout == "bhsd" else 1
        lengths = f"{names[0]} has {q.shape[si]} positions, {names[1]} {k.shape[si]}"
    elif rows is not None and _fits_without_rows(q, k, v, layout, same_len):
        # q, k, v fit the layout given and only beta does not: a (B, S, H_v) beta is as likely as a
        # layout mix-up, and following the layout advice alone would then run the wrong math
        hi, si = (1, 2) if layout == "bhsd" else (2, 1)
        rows_fix = (f"beta must be (B, H_v, S) = {(k.shape[0], v.shape[hi], k.shape[si])} in every layout, "
                    f"got {tuple(rows.shape)}: pass beta.transpose(1, 2) if it is (B, S, H_v)")
    return LayoutMismatch(shapes, layout, other, str(cause).splitlines()[0] if str(cause) else type(cause).__name__,
                          arg, lengths, rows_fix)


def real_tokens(key_mask: object, seqlens_k: object, b: int, s: int, device, fn: str):
    """The (B, S) bool mask of a layer's real tokens from key_mask (B, S) bool (True = real) or
    seqlens_k (B,) integer lengths >= 0 (the first seqlens_k[b] tokens real; a length past S means
    all, as attention() reads it), checked by name; both: their intersection; None for neither.
    For the layers that turn the mask into per-token gates (the linear, delta, LSH and Linformer
    layers), where torch's own errors would name nothing. The length check reads the values on the
    host, or under torch.compile asserts in the graph (as as_offsets)."""
    if seqlens_k is not None:
        if not isinstance(seqlens_k, Tensor):
            raise not_a_tensor("seqlens_k", seqlens_k, fn)
        if seqlens_k.dtype.is_floating_point or seqlens_k.dtype == torch.bool or seqlens_k.is_complex():
            raise TypeError(f"{fn}: seqlens_k must be an integer (B,) tensor of lengths, got {seqlens_k.dtype}")
        if tuple(seqlens_k.shape) != (b,):
            raise ValueError(f"{fn}: seqlens_k must be ({b},) (a length per sequence), got {tuple(seqlens_k.shape)}")
        if torch.compiler.is_compiling():
            torch._assert_async((seqlens_k >= 0).all(), f"{fn}: seqlens_k must be >= 0")
        elif bool((seqlens_k < 0).any()):
            raise ValueError(f"{fn}: seqlens_k must be >= 0 (a length per sequence), got {seqlens_k.tolist()}")
        real = torch.arange(s, device=device).unsqueeze(0) < seqlens_k.to(device).view(-1, 1)
        return real if key_mask is None else real & real_tokens(key_mask, None, b, s, device, fn)
    if key_mask is None:
        return None
    if not isinstance(key_mask, Tensor):
        raise not_a_tensor("key_mask", key_mask, fn)
    if key_mask.dtype != torch.bool:
        raise TypeError(f"{fn}: key_mask must be bool (True = a real token), got {key_mask.dtype}")
    if tuple(key_mask.shape) != (b, s):
        raise ValueError(f"{fn}: key_mask must be (B, S) = {(b, s)} (True = a real token), got {tuple(key_mask.shape)}")
    if key_mask.device != device:
        raise ValueError(f"{fn}: key_mask must be on {device}, got {key_mask.device}")
    return key_mask
