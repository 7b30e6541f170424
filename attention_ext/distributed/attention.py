"""Context-parallel attention's front door: context_parallel_attention takes the shards, the
parallel setup (group, mode, shard_layout) and the attention options (options.AttentionOptions,
given as keywords), and hands them to the mode:

    mode="allgather"  allgather.py: K / V all-gathered, one collective forward, one backward
    mode="ring"       ring.py: K / V shards circulate rank to rank, overlapped with the compute
    mode="ulysses"    ulysses.py: all-to-all from sequence shards to head shards and back

Each mode returns this rank's (out, lse) as (B, H, n, D) / (B, H, n); the options turn them into
the result (layout, return_lse). ring.ring_attention and ulysses.ulysses_attention are the same
call with the mode fixed.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch.distributed as dist
from torch import Tensor

from . import allgather, ring, ulysses
from .options import AttentionOptions as _Options  # underscored: this module's public names are its API
from .options import takes_options as _takes_options

__all__ = ["context_parallel_attention", "MODES"]

MODES = ("allgather", "ring", "ulysses")
_TAKES = ("group", "mode", "shard_layout", "overlap", "check_ranks")


@_takes_options
def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Optional[dist.ProcessGroup] = None,
    mode: str = "allgather",
    shard_layout: str = "zigzag",
    overlap: bool = True,
    check_ranks: bool = True,
    _stats: Optional[dict] = None,
    **options: Any,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a sequence sharded across the ranks of `group` (context parallelism).

    Args:
        q: this rank's query shard, (B, H, n, D) for layout="bhsd" or (B, n, H, D) for
            "bshd"; n = S / P, as sharded by shard_sequence with the same `shard_layout`.
        k, v: this rank's key / value shards, (B, H_k, n, D) (or (B, n, H_k, D)), H % H_k == 0.
        group: the process group (default: the world).
        mode: "allgather" (K/V all-gathered, one collective forward, one backward); "ring" (K/V
            shards circulate rank to rank, P - 1 transfers overlapped with the compute; ring.py);
            "ulysses" (all-to-all from sequence to head shards and back, H % P == 0: ulysses.py).
        shard_layout: the sequence sharding, "contiguous", "zigzag", "stripe" or, for packed
            documents, "balanced" (attention_ext.distributed.sharding). A tensor layout given here
            raises a ValueError that names layout.
        overlap: mode="allgather" only: overlap the K / V gather (forward) and the dK / dV
            return (backward), one all-to-all each, with the compute on the rank's own shard (True,
            the default, eager); False, and any call under torch.compile, runs one all-gather then
            the kernel on the gathered keys and one reduce-scatter back, nothing overlapped
            (allgather.py). The other modes ignore it.
        check_ranks: before its first collective, every rank checks its arguments and the group
            agrees on them in one small all-gather (shapes, dtypes, options, mode, cu_seqlens and
            block_layout contents, grad mode): a bad value on any rank, or ranks that disagree,
            raise the same error on every rank instead of a hang, a transport abort or a wrong
            result (distributed/agree.py). False skips it (under NCCL it reads the all-gather on
            the host: a device sync per call); a call under torch.compile skips it.

    The attention options, keywords only, one AttentionOptions (options.py) for every mode:
        causal, window_size, alibi_slopes: as attention_ext.attention, on GLOBAL token
            positions (window_size is (left, right), -1 = unbounded; causal caps right at 0).
            alibi_slopes (H,) or (B, H).
        scale, softcap, sinks: as attention_ext.attention (sinks (H,) join every softmax).
        return_lse: also return this rank's (B, H, n) log-sum-exp shard.
        layout: the tensors' layout, "bhsd" or "bshd" (as in attention()). A sharding given
            here raises a ValueError that names shard_layout; the old name qkv_layout raises a
            TypeError that names layout.
        seq_len: the real length when the sequence was padded to a multiple (pad_to_multiple):
            no position >= seq_len is read, in any mode (queries, keys and values there may
            hold anything, NaN included); the out and lse of padded rows are unspecified (0, or
            -inf / the sink for lse) and must be dropped. Default: no padding (S = n * P).
        dropout_p, seed: dropout on the probabilities, drawn at GLOBAL coordinates (batch,
            head, query position, key position; sharding.dropout_coords): with the same seed
            the mask is the one attention_ext.attention(..., seed=seed) draws on the whole
            sequence in one process, in every mode, shard_layout and world size. seed=None: group
            rank 0 draws a seed from torch's generator and broadcasts it (one extra collective).
        cu_seqlens: packed documents: the GLOBAL document offsets of the one sequence (B = 1)
            the shards come from, int32 / int64 (or a list), the same on every rank; document i
            is positions [cu_seqlens[i], cu_seqlens[i + 1]) and positions from cu_seqlens[-1] on
            are padding (seq_len, if given, must equal cu_seqlens[-1]). No query attends a key of
            another document; causal, window, ALiBi, softcap, sinks, dropout and the LSE mean
            what they mean in flash_attn_varlen_func on the whole pack in one process (positions
            restart at each document; dropout is drawn at each document's own coordinates).
            Every mode and shard_layout; shard_layout="balanced" shards a pack by work.
        block_layout, block_size: a block-sparse layout of the WHOLE (padded) sequence, as the
            sparse family's (bool (H or 1, ceil(S / block_size), ceil(S / block_size)); blocks of
            block_size tokens, a multiple of 16, on global positions), with every other option and
            with cu_seqlens. A call whose queries and keys start on block boundaries takes its part
            of the grid (the kernel skips the off blocks), else the layout as an element mask; a
            ring step with no on block is skipped. B > 1 allowed without cu_seqlens.
    Any other keyword raises a TypeError that names it.

    _stats: mode="ring" only, private: a dict that receives the call's P2P op count and its
        seconds in wait() and in compute (ring.ring_attention's `stats`).

    Returns this rank's output shard in q's layout (and the LSE shard). The backward is
    autograd's: dq stays local, dK / dV are reduce-scattered to their owning ranks. A
    parameter every rank holds whole (sinks) gets this rank's queries' part of its gradient:
    sum it over the group (all_reduce) for the full one.
    """
    opts = _Options.agreed("context_parallel_attention()", options, _TAKES, q, k, v, group=group,
                           shard_layout=shard_layout, check_ranks=check_ranks,
                           parallel=dict(mode=mode, shard_layout=shard_layout,
                                         overlap=overlap if mode == "allgather" else True))
    if mode not in MODES:  # the same mode on every rank (agreed): every rank raises
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "ring":
        out, lse = ring.attend(q, k, v, opts, group=group, shard_layout=shard_layout, stats=_stats)
    elif mode == "ulysses":
        out, lse = ulysses.attend(q, k, v, opts, group=group, shard_layout=shard_layout)
    else:
        out, lse = allgather.attend(q, k, v, opts, group=group, shard_layout=shard_layout, overlap=overlap)
    return opts.result(out, lse)
