"""The delta rule (DeltaNet, Gated DeltaNet, Kimi Delta Attention) in the linear family: the
custom ops torch.ops.attention_ext.{delta_fwd, delta_bwd} with their autograd, and the public
functions delta_rule_attention / delta_rule_step.

    delta_fwd(q, k, v, beta, gate?, initial_state?, cu_seqlens?, scale, qk_l2norm, plain,
              checkpoints=False) -> (out, final_state, checkpoints)
    delta_bwd(dout, dfinal_state?, q, k, v, beta, gate?, initial_state?, cu_seqlens?, scale,
              qk_l2norm, plain, checkpoints?) -> (dq, dk, dv, dbeta, dgate, dinitial_state)
        plain: the write u = v (no delta correction, beta unread): linear attention with GLA's
        per-feature gates (linear.functional)
        checkpoints: the forward also returns the state entering every 64 tokens (CPU kernels),
        which the backward then reads instead of running a forward pass of its own
    delta_step(q, k, v, beta, state!, gate?, scale, qk_l2norm) -> out
        T tokens from state, advanced in place (no autograd: decode)

The math is reference.delta_rule's (common/delta_params.h in C++). The input rules, the Meta
kernels and the check-only op delta_check are C++ (csrc/torch/linear_delta_binding.*); this module adds
the layout handling, the defaults, `register_autograd`, and PyTorch where no kernel serves the
call (float64 on CUDA; CUDA calls that need gradients, except those the chunk-parallel backward
takes under linear.set_cuda_kernels(delta_chunked=...): cuda_chunked_grad): the chunked WY form,
reference.delta_rule_wy.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .._args import as_offsets, layout_mismatch, not_a_tensor
from .._ext import (HAS_EXT, call_autograd, call_below_autograd, delta_chunk_takes, eager_autograd,
                   refuse_double_backward, registered)
from . import reference
from .ops import cuda_kernels

HAS_OP = HAS_EXT and hasattr(torch.ops.attention_ext, "delta_fwd")
_KERNELS = {dev: HAS_OP and registered("attention_ext::delta_fwd", key) for dev, key in (("cpu", "CPU"),
                                                                                         ("cuda", "CUDA"))}
_BWD_KERNELS = {dev: HAS_OP and registered("attention_ext::delta_bwd", key) for dev, key in (("cpu", "CPU"),
                                                                                             ("cuda", "CUDA"))}
_STEP_KERNELS = {dev: HAS_OP and registered("attention_ext::delta_step", key) for dev, key in (("cpu", "CPU"),
                                                                                               ("cuda", "CUDA"))}
FWD_ARGS = tuple(a.name for a in torch.ops.attention_ext.delta_fwd.default._schema.arguments) if HAS_OP else ()
BWD_ARGS = tuple(a.name for a in torch.ops.attention_ext.delta_bwd.default._schema.arguments) if HAS_OP else ()
STEP_ARGS = tuple(a.name for a in torch.ops.attention_ext.delta_step.default._schema.arguments) if HAS_OP else ()
CHECK_ARGS = tuple(a.name for a in torch.ops.attention_ext.delta_check.default._schema.arguments) if HAS_OP else ()
_GRAD_INPUTS = ("q", "k", "v", "beta", "gate", "initial_state")


def has_kernel(device: torch.device, dtype: Optional[torch.dtype] = None, *, grad: bool = False) -> bool:
    """True when a compiled delta-rule forward serves every call on `device` (and of `dtype`,
    when given; with grad=True, its backward too). The CPU: every dtype, float64 included,
    forward and backward. CUDA: float32, float16 and bfloat16, the forward and the in-place step;
    its backward serves only the calls the chunk kernels take under the selection
    (cuda_chunked_grad), so grad=True says False there."""
    kernels = _BWD_KERNELS if grad else _KERNELS
    if not kernels.get(device.type, False) or (grad and device.type == "cuda"):
        return False
    return dtype is None or dtype != torch.float64 or device.type == "cpu"


def cuda_chunked_grad(a: dict) -> bool:
    """Whether a CUDA call of the delta_fwd arguments `a` that needs gradients runs the compiled
    kernels (the forward, then the chunk-parallel backward): the backward kernel is there, the
    selection (linear.set_cuda_kernels(delta_chunked=)) asks for the chunk kernels and they take
    the call's dtype and sizes (the C++ rule, delta_chunk_takes)."""
    q, v, gate = a["q"], a["v"], a["gate"]
    if not (_BWD_KERNELS.get("cuda", False) and isinstance(q, Tensor) and q.device.type == "cuda"
            and isinstance(v, Tensor) and q.dim() == 4 and v.dim() == 4):
        return False
    sel = cuda_kernels()["delta_chunked"]
    chunked = -1 if sel is None else int(bool(sel))
    per_key = isinstance(gate, Tensor) and gate.dim() == 4
    return delta_chunk_takes(chunked, q.dtype, q.shape[-1], v.shape[-1], per_key, bool(a["plain"]), q.shape[2],
                             backward=True)


def _needs_grad(a: dict) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(a.get(n), Tensor) and a[n].requires_grad for n in _GRAD_INPUTS)


def _args(op: str, names, a: dict) -> list:
    """The op's argument list from the arguments `a` by name; `checkpoints` (the forward's flag,
    the backward's tensor) defaults to none."""
    return [a.get(n, False if op == "delta_fwd" else None) if n == "checkpoints" else a[n] for n in names]


def _call(op: str, names, a: dict):
    """The op on the arguments `a` by name (_args)."""
    return getattr(torch.ops.attention_ext, op)(*_args(op, names, a))


def _fwd(a: dict, grad: bool):
    """delta_fwd on the arguments `a`, `grad` saying whether autograd records it (_needs_grad):
    eager differentiable calls through _EagerFwd (_ext.call_autograd)."""
    return call_autograd(torch.ops.attention_ext.delta_fwd.default, _args("delta_fwd", FWD_ARGS, a), _EagerFwd, grad)


if HAS_OP:

    def _setup_context(ctx, inputs, output):
        a = dict(zip(FWD_ARGS, inputs))
        ctx.set_materialize_grads(False)  # an unused final_state gives dfinal_state None
        ctx.need = {n: ctx.needs_input_grad[FWD_ARGS.index(n)] for n in _GRAD_INPUTS}
        if not any(ctx.need.values()):
            return
        ctx.scalars = {n: a[n] for n in ("scale", "qk_l2norm", "plain")}
        # the states the forward kept for this backward (checkpoints=True), else an empty tensor
        ckpt = output[2] if a.get("checkpoints") else None
        ctx.save_for_backward(a["q"], a["k"], a["v"], a["beta"], a["gate"], a["initial_state"], a["cu_seqlens"], ckpt)

    def _backward(ctx, dout, dfinal_state, _dcheckpoints):
        if not any(ctx.need.values()):
            return (None,) * len(FWD_ARGS)
        q, k, v, beta, gate, initial_state, cu_seqlens, ckpt = ctx.saved_tensors
        if dout is None:  # only the final state reached the loss
            dout = v.new_zeros(q.shape[0], v.shape[1], q.shape[2], v.shape[3])
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        if dfinal_state is not None:
            dfinal_state = dfinal_state.contiguous()
        a = dict(ctx.scalars, dout=dout, dfinal_state=dfinal_state, q=q, k=k, v=v, beta=beta, gate=gate,
                 initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoints=ckpt)
        args = _args("delta_bwd", BWD_ARGS, a)
        # create_graph=True records the call (delta_bwd's autograd refuses a second backward)
        op = torch.ops.attention_ext.delta_bwd.default
        dq, dk, dv, dbeta, dgate, dinit = op(*args) if torch.is_grad_enabled() else call_below_autograd(op, args)
        grads = dict(q=dq, k=dk, v=dv, beta=dbeta, gate=dgate if gate is not None else None,
                     initial_state=dinit if initial_state is not None else None)
        return tuple(grads[n] if n in grads and ctx.need[n] else None for n in FWD_ARGS)

    torch.library.register_autograd("attention_ext::delta_fwd", _backward, setup_context=_setup_context)
    _EagerFwd = eager_autograd("DeltaFwd", _setup_context, _backward)  # eager calls (_fwd)
    refuse_double_backward("attention_ext::delta_bwd", "delta rule", "reference.delta_rule")


def _side(name: str, t, caller: str = "delta_rule_attention()") -> Optional[Tensor]:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise not_a_tensor(name, t, caller)
    return t if t.is_contiguous() else t.contiguous()


def delta_rule_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    gate: Optional[Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[Tensor] = None,
    return_state: bool = False,
    cu_seqlens: Optional[Tensor] = None,
    layout: str = "bhsd",
    qk_l2norm: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The delta rule over a whole sequence: DeltaNet (no gate), Gated DeltaNet (gate (B, H_v, S))
    or Kimi Delta Attention (gate (B, H_v, S, K)). Per value head, with state h (K, V):

        h' = Diag(exp(g_t)) h_{t-1};  u_t = beta_t (v_t - h'^T k_t);  h_t = h' + k_t u_t^T
        o_t = h_t^T (scale q_t)

    Args:
        q, k: (B, H_k, S, K), or (B, S, H_k, K) with layout="bshd".
        v: (B, H_v, S, V) in the same layout; H_v a multiple of H_k (q and k are shared by
            H_v / H_k value heads, Gated DeltaNet's grouped values).
        beta: (B, H_v, S), the write strength (usually a sigmoid), always (B, H_v, S) whatever
            the layout; q's dtype or float32.
        gate: log-gates (<= 0 decays; -inf is an exact hard reset, e.g. at a document start):
            (B, H_v, S) per head, or (B, H_v, S, K) per key channel (KDA); q's dtype or float32.
        scale: multiplies q; None = K ** -0.5.
        initial_state: (N, H_v, K, V) float32 (float64 for float64 inputs), N = B, or the
            number of sequences with cu_seqlens.
        return_state: also return the final state, (N, H_v, K, V), float32 (float64).
        cu_seqlens: (N + 1) int32 offsets of sequences packed in one B = 1 batch; none sees
            another, each has its own initial and final state.
        qk_l2norm: L2-normalize q and k over K first (x / sqrt(sum x^2 + 1e-6)), with its
            gradient.

    Returns out (B, H_v, S, V) in q's layout and dtype (and the final state). Differentiable in
    q, k, v, beta, gate and initial_state. The CPU runs compiled kernels forward and backward;
    CUDA runs a compiled forward (float32 / float16 / bfloat16) and, for calls that need
    gradients, the chunk-parallel backward kernels where linear.set_cuda_kernels(delta_chunked=)
    selects them and they take the call (bf16 / fp16, K <= 128, K and V multiples of 8),
    else PyTorch's chunked WY form (reference.delta_rule_wy, exact for every gate; docs/api.md).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t, "delta_rule_attention()")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"delta_rule_attention(): layout must be 'bhsd' or 'bshd', got {layout!r}")
    q0, k0, v0 = q, k, v
    if layout == "bshd" and q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, S, D) views, no copy
    q, k, v = (t if t.dim() == 0 or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # rows read whole
    beta = _side("beta", beta)
    gate = _side("gate", gate)
    initial_state = _side("initial_state", initial_state)
    if cu_seqlens is not None:
        cu_seqlens = as_offsets(cu_seqlens, "cu_seqlens", q.device, "delta_rule_attention()")
    if scale is None:
        scale = q.shape[-1] ** -0.5 if q.dim() == 4 and q.shape[-1] > 0 else 1.0  # K = 0: the op says so
    a = dict(q=q, k=k, v=v, beta=beta, gate=gate, initial_state=initial_state, cu_seqlens=cu_seqlens,
             scale=float(scale), qk_l2norm=bool(qk_l2norm), plain=False)
    try:
        out, state = run(a)
    except ValueError as e:  # name `layout` where the shapes prove a bhsd / bshd mix-up
        mix = layout_mismatch(q0, k0, v0, layout, e, same_len=True, rows=beta)
        if mix is not None:
            raise mix from e
        raise
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, state) if return_state else out


def run(a: dict) -> Tuple[Tensor, Tensor]:
    """(out, final_state) of the delta_fwd op's arguments `a` (by name: FWD_ARGS, `plain`
    included): the compiled kernel where there is one (with autograd), else the op's input rules
    and PyTorch's chunked WY form (reference.delta_rule_wy, exact for every gate). For callers that
    prepared the arguments themselves (delta_rule_attention, linear_attention's per-key-channel
    gates with plain=True)."""
    q = a["q"]
    grad = _needs_grad(a)
    if isinstance(q, Tensor) and has_kernel(q.device, q.dtype, grad=grad):
        # a call that will have a backward keeps the states that backward would recompute
        out, state, _ = _fwd(dict(a, checkpoints=grad), grad)
        return out, state
    if grad and cuda_chunked_grad(a):  # the CUDA chunk backward recomputes its states itself
        out, state, _ = _fwd(dict(a, checkpoints=False), grad)
        return out, state
    if HAS_OP:
        _call("delta_check", CHECK_ARGS, a)
    # the chunked form: S / 64 (per-key gates: S / 32) steps of small matmuls, exact for every gate
    return reference.delta_rule_wy(a["q"], a["k"], a["v"], a["beta"], a["gate"], float(a["scale"]),
                                   a["initial_state"], a["cu_seqlens"], bool(a["qk_l2norm"]), plain=bool(a["plain"]))


def check_inputs(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, *, gate: Optional[Tensor] = None,
                 scale: Optional[float] = None, initial_state: Optional[Tensor] = None, layout: str = "bhsd",
                 qk_l2norm: bool = False, caller: str = "delta_rule_attention()") -> None:
    """delta_rule_attention's input rules on these tensors, for a caller that runs the kernels on
    tensors of its own making (context parallelism's widened values): the op's C++ check
    (delta_check), so an error names the caller's argument. Without the extension, nothing."""
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t, caller)
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"{caller}: layout must be 'bhsd' or 'bshd', got {layout!r}")
    if not HAS_OP:
        return
    q0, k0, v0 = q, k, v
    if layout == "bshd" and q.dim() == 4 and k.dim() == 4 and v.dim() == 4:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    a = dict(q=q, k=k, v=v, beta=_side("beta", beta, caller), gate=_side("gate", gate, caller),
             initial_state=_side("initial_state", initial_state, caller), cu_seqlens=None,
             scale=float(scale) if scale is not None else 1.0, qk_l2norm=bool(qk_l2norm), plain=False)
    try:
        _call("delta_check", CHECK_ARGS, a)
    except ValueError as e:
        mix = layout_mismatch(q0, k0, v0, layout, e, same_len=True, rows=beta)
        if mix is not None:
            raise mix from e
        raise


def delta_rule_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    state: Optional[Tensor],
    *,
    gate: Optional[Tensor] = None,
    scale: Optional[float] = None,
    qk_l2norm: bool = False,
    layout: str = "bhsd",
    inplace: bool = False,
) -> Tuple[Tensor, Tensor]:
    """T >= 1 new tokens from `state` (generation): q, k (B, H_k, T, K), v (B, H_v, T, V),
    beta (B, H_v, T), gate as delta_rule_attention's with T positions, state (B, H_v, K, V)
    float32 (float64 for float64 inputs; None = zeros). Returns (out (B, H_v, T, V), new_state).
    A prefill's final state followed by steps equals the whole sequence to rounding.

    inplace=False leaves `state` as it was and is differentiable; inplace=True advances `state`
    itself and returns it as new_state: one read and one write of the state per step, no new
    allocation (decode, where the state is the step's whole memory traffic). It records no
    autograd, so it refuses inputs that require grad while grad mode is on."""
    if not inplace:
        return delta_rule_attention(q, k, v, beta, gate=gate, scale=scale, initial_state=state, return_state=True,
                                    layout=layout, qk_l2norm=qk_l2norm)
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("state", state)):
        if not isinstance(t, Tensor):
            raise not_a_tensor(name, t, "delta_rule_step(inplace=True)")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, beta, gate, state)):
        raise ValueError("delta_rule_step(inplace=True) records no autograd: call it under torch.no_grad() (decode), "
                         "or pass inplace=False to differentiate")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"delta_rule_step(): layout must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd":
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k, v = (t if t.dim() == 0 or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    beta, gate = _side("beta", beta), _side("gate", gate)
    if scale is None:
        scale = q.shape[-1] ** -0.5 if q.dim() == 4 and q.shape[-1] > 0 else 1.0  # K = 0: the op says so
    a = dict(q=q, k=k, v=v, beta=beta, state=state, gate=gate, scale=float(scale), qk_l2norm=bool(qk_l2norm))
    if _STEP_KERNELS.get(q.device.type, False) and has_kernel(q.device, q.dtype):
        out = _call("delta_step", STEP_ARGS, a)
        # the op writes the state's memory from C++: tell autograd, so that a graph that saved the
        # state before this step raises at backward instead of reading the new values
        torch.autograd.graph.increment_version(state)
    else:
        if HAS_OP:  # the op's own input rules (delta_fwd's, with state as the initial state)
            _call("delta_check", CHECK_ARGS, dict(a, initial_state=state, cu_seqlens=None, plain=False))
        out, new = reference.delta_rule(q, k, v, beta, gate, float(scale), state, None, bool(qk_l2norm))
        state.copy_(new)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return out, state
