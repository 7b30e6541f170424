"""Context-parallel delta rule: each rank holds a contiguous shard of the sequence and computes its
queries' output of attention_ext.delta_rule_attention over the whole sequence.

The delta rule's step is affine in the state, h_t = A_t h_{t-1} + b_t v_t^T with
A_t = (I - beta_t k_t k_t^T) Diag(exp g_t) (K x K) and b_t = beta_t k_t. So a shard maps the
state entering it to the state leaving it as E = P E_in + U, with P (K x K) the product of its
A_t and U (K x V) its state from zero; and each row's state is h_t = P_{<=t} E_in + U_{<=t}, so

    o_t = h_t^T (scale q_t) = U_{<=t}^T (scale q_t) + E_in^T (P_{<=t}^T (scale q_t)).

Forward, per rank r:
1. two local calls of the delta-rule kernel, since the state's columns evolve independently:
   on v from a zero state (the outputs from zero and U_r), and on K zero value columns from the
   state I (P_{<=t}^T (scale q_t) per row, and P_r). Two calls rather than one on [v, 0] from
   [0, I]: each width stays within the kernel's limits as the user's V and K are. They run in
   float32 (float64 for float64 inputs); o_t is rounded to the output dtype once, at the end;
2. ONE all-gather of the (K, V + K) pairs [U_r, P_r] (sharding._AllGather: its backward is one
   reduce-scatter that sums every rank's gradient of them back to the owner), O(P K (V + K))
   floats per rank, independent of the sequence length;
3. E_in(r) = E_{r-1}, folded over the ranks before r: E_{-1} = initial_state (or 0),
   E_j = P_j E_{j-1} + U_j; and o_t as above (one matmul).
Backward is autograd's through the kernel's backward, the fold and the gather's reduce-scatter.
One collective per direction; the shard's work is the single-process kernel's on V + K columns
instead of V (2x at K = V).

Gates of -inf (a hard reset, such as a document start in a packed sequence) and -1e9 stay exact:
P is a product of the factors, never formed from sums of gates.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from ..linear.delta import check_inputs, delta_rule_attention
from .._args import not_a_tensor
from .agree import agree, field, needed, shard_field
from .linear import _Tie
from .sharding import _AllGather, _check_layout, shards_bhsd

__all__ = ["context_parallel_delta_rule_attention"]


def context_parallel_delta_rule_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    gate: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
    layout: str = "bhsd",
    qk_l2norm: bool = False,
    group: Optional[dist.ProcessGroup] = None,
    shard_layout: str = "contiguous",
    check_ranks: bool = True,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """delta_rule_attention over a sequence sharded contiguously across the ranks of `group`.

    Args:
        q, k: this rank's shards, (B, H_k, n, K) for layout="bhsd" or (B, n, H_k, K) for "bshd";
            rank r holds the r-th contiguous piece (n may differ per rank).
        v: this rank's value shard, (B, H_v, n, V) in the same layout, H_v a multiple of H_k.
        beta: this rank's (B, H_v, n) write strengths; gate: its (B, H_v, n) or (B, H_v, n, K)
            log-gates (-inf: an exact hard reset), both (B, H_v, n[, K]) whatever the layout.
        scale, qk_l2norm: as delta_rule_attention.
        initial_state: the (B, H_v, K, V) state the WHOLE sequence starts from, the same on every
            rank; it enters before rank 0's first token. Its gradient, like the keys', sums over
            ranks: each rank holds its part.
        return_state: also return the global final state (after the last rank's last token),
            (B, H_v, K, V) float32 (float64), the same on every rank.
        group: the process group (default: the world).
        shard_layout: the sequence sharding; must be "contiguous".
        check_ranks: as context_parallel_attention's: every rank checks its arguments and the
            group agrees on them (shapes but for the shards' lengths, dtypes, options) in one
            small all-gather before any collective, so a bad or mismatched argument raises the
            same error on every rank; False skips it.

    Returns this rank's output shard in q's layout and dtype (and the state). Communication: one
    all-gather of the (K, V + K) shard maps forward and one reduce-scatter backward, run by every
    rank's backward, so every rank of the group must call backward, with inputs that require grad
    on all ranks or on none. No varlen packing (cu_seqlens): a gate of -inf at each document start
    separates the documents of a packed sequence exactly.
    """
    fn = "context_parallel_delta_rule_attention()"
    check_ranks = needed(group, check_ranks)
    sd = 1 if layout == "bshd" else 2  # the shards' length may differ per rank: their sequence dim is left out
    fields = dict.fromkeys(("q", "k", "v", "beta", "gate", "initial_state", "grad mode", "scale", "layout",
                            "qk_l2norm", "shard_layout"))
    err = None
    try:  # this rank's checks, then the group's agreement (agree.py), before any collective
        if check_ranks:
            fields.update(q=shard_field(q, sd), k=shard_field(k, sd), v=shard_field(v, sd), beta=shard_field(beta, 2),
                          gate=shard_field(gate, 2), initial_state=field(initial_state), scale=field(scale),
                          layout=layout, qk_l2norm=field(qk_l2norm), shard_layout=shard_layout)
            fields["grad mode"] = torch.is_grad_enabled()
        for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
            if not isinstance(t, Tensor):
                raise not_a_tensor(name, t, fn)
        _check_layout(shard_layout)
        if shard_layout != "contiguous":
            raise ValueError(f"context_parallel_delta_rule_attention needs shard_layout='contiguous' (the shard "
                             f"maps compose in rank order, which must be sequence order), got {shard_layout!r}")
        # the input rules once, on this rank's shard as delta_rule_attention states them
        check_inputs(q, k, v, beta, gate=gate, scale=scale, initial_state=initial_state, layout=layout,
                     qk_l2norm=qk_l2norm, caller=fn)
    except Exception as e:  # noqa: BLE001  (any failure here must reach every rank, not leave them waiting)
        err = e
    agree(fn, group, fields, err, check=check_ranks)
    qb, kb, vb = shards_bhsd(q, k, v, layout=layout)  # (B, H, n, D) views
    b, hv, n, dv = vb.shape
    dk = qb.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32

    # 1. the shard's map [U_r, P_r] and its rows' two output parts: v from zero, 0 from I
    qa, ka, ba = qb.to(acc), kb.to(acc), beta.to(acc)
    gate = gate.to(acc) if gate is not None else None
    kw = dict(gate=gate, scale=scale, return_state=True, qk_l2norm=qk_l2norm)
    out_u, u_r = delta_rule_attention(qa, ka, vb.to(acc), ba, **kw)
    eye = torch.eye(dk, dtype=acc, device=q.device).expand(b, hv, dk, dk)
    out_p, p_r = delta_rule_attention(qa, ka, vb.new_zeros(b, hv, n, dk, dtype=acc), ba, initial_state=eye, **kw)
    # 2. every rank's [U_j, P_j]: (P, B, H_v, K, V + K)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gathered = _AllGather.apply(torch.cat([u_r, p_r], -1).unsqueeze(0), group)

    # 3. the state entering this shard (E_{r-1}) and, for return_state, the last one (E_{P-1})
    s0 = initial_state.to(acc) if initial_state is not None else None
    state_in = _fold(gathered, s0, rank, dv)
    final = _fold(gathered, s0, world, dv) if return_state else None
    out = out_u if state_in is None else out_u + out_p @ state_in
    out = out.to(q.dtype)
    if gathered.requires_grad:
        out = _Tie.apply(out, gathered)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, final) if return_state else out


def _fold(gathered: Tensor, s0: Optional[Tensor], upto: int, dv: int) -> Optional[Tensor]:
    """E_{upto - 1}, the state entering shard `upto`: E_{-1} = s0 (None: zero), E_j = P_j E_{j-1} + U_j
    with gathered[j] = [U_j, P_j] (B, H_v, K, V + K)."""
    e = s0
    for j in range(upto):
        u_j, p_j = gathered[j, ..., :dv], gathered[j, ..., dv:]
        e = u_j if e is None else p_j @ e + u_j
    return e
