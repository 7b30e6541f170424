"""The attention options of context parallelism (attention_ext/distributed/options.py): the three
entry points (context_parallel_attention in each mode, ring_attention, ulysses_attention) build
one AttentionOptions from their keywords, refuse an unknown keyword with a TypeError that names
it, and raise one error per bad value, the same from every entry point and mode. One-rank gloo
groups on the CPU (tests.helpers.one_rank_group)."""
import dataclasses
import inspect

import pytest
import torch

from attention_ext import distributed as cp
from attention_ext.distributed import options as options_mod
from attention_ext.distributed.options import AttentionOptions
from attention_ext.distributed.ring import ring_attention
from attention_ext.distributed.ulysses import ulysses_attention
from tests.helpers import one_rank_group

Q = torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(0))

ENTRY_POINTS = {
    **{f"context_parallel_attention[{m}]": (lambda m: lambda *a, **kw: cp.context_parallel_attention(
        *a, mode=m, **kw))(m) for m in cp.MODES},
    "ring_attention": ring_attention,
    "ulysses_attention": ulysses_attention,
}
FN_NAME = {name: name.split("[")[0] + "()" for name in ENTRY_POINTS}


def _call(name, **kw):
    with one_rank_group():
        return ENTRY_POINTS[name](Q, Q, Q, **kw)


def _error(name, **kw):
    """(type, message) of the error the call raises."""
    with pytest.raises(Exception) as e:
        _call(name, **kw)
    return type(e.value), str(e.value)


# ------------------------------------------------------------------ unknown keywords
@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("given,meant", [("causl", "causal"), ("window_sizes", "window_size"),
                                          ("softmax_scale", "scale"), ("is_causal", "causal"),
                                          ("return_lse_", "return_lse"), ("shard_layot", "shard_layout")])
def test_unknown_keyword_is_named_with_the_one_meant(name, given, meant):
    typ, msg = _error(name, **{given: True})
    assert typ is TypeError
    assert f"{FN_NAME[name]} got an unexpected keyword argument {given!r}: did you mean {meant}=?" in msg, msg


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_unknown_keyword_without_a_near_name_lists_the_keywords(name):
    typ, msg = _error(name, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    assert typ is TypeError and "unexpected keyword argument 'attn_mask' (its keywords: " in msg, msg
    assert all(f.name in msg for f in dataclasses.fields(AttentionOptions)), msg


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_old_name_qkv_layout_names_layout(name):
    typ, msg = _error(name, qkv_layout="bshd")
    assert typ is TypeError and "takes layout" in msg and "pass layout= instead" in msg, msg
    assert _call(name, qkv_layout=None).shape == Q.shape  # left at its default: nothing to refuse


# ------------------------------------------------------------------ one rule per value
BAD_VALUES = {
    "window_int": dict(window_size=4),
    "window_negative": dict(window_size=(-2, 0)),
    "window_not_a_pair": dict(window_size=(1, 2, 3)),
    "dropout_p": dict(dropout_p=1.0),
    "dropout_p_negative": dict(dropout_p=-0.1),
    "layout_sharding": dict(layout="zigzag"),
    "layout": dict(layout="sbhd"),
    "seq_len_zero": dict(seq_len=0),
    "seq_len_too_long": dict(seq_len=9),
    "sinks_shape": dict(sinks=torch.zeros(3)),
    "sinks_device": dict(sinks=torch.zeros(2, device="meta")),
    "alibi_shape": dict(alibi_slopes=torch.ones(3)),
    "alibi_batch": dict(alibi_slopes=torch.ones(2, 2)),
    "seq_len_float": dict(seq_len=9.5),  # ran as 10 (allgather, ring) or crashed (ulysses) before
    "dropout_p_str": dict(dropout_p="0.1"),
    "sinks_list": dict(sinks=[0.0, 0.0]),
    "alibi_list": dict(alibi_slopes=[0.1, 0.2]),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_value_raises_one_error_from_every_entry_point(case):
    errors = {name: _error(name, **BAD_VALUES[case]) for name in ENTRY_POINTS}
    assert len(set(errors.values())) == 1, errors
    typ, msg = next(iter(errors.values()))
    assert issubclass(typ, (TypeError, ValueError)), errors
    what = {"window": "window_size", "dropout": "dropout_p", "layout": "layout", "seq": "seq_len", "sinks": "sinks",
            "alibi": "alibi_slopes"}[case.split("_")[0]]
    assert what in msg, msg


def test_bad_values_raise_at_construction():
    """The rules that need no tensor are the options' own: AttentionOptions(...) raises them."""
    for case in ("window_int", "window_negative", "dropout_p", "layout_sharding", "layout", "seq_len_float",
                 "dropout_p_str", "sinks_list", "alibi_list"):
        with pytest.raises((TypeError, ValueError)):
            AttentionOptions(**BAD_VALUES[case])


# ------------------------------------------------------------------ one options object
def _built(monkeypatch):
    """The AttentionOptions every entry point builds, recorded in call order."""
    seen, of = [], AttentionOptions.of.__func__

    def spy(cls, fn, keywords, takes=()):
        seen.append(of(cls, fn, keywords, takes))
        return seen[-1]
    monkeypatch.setattr(AttentionOptions, "of", classmethod(spy))
    return seen


def test_every_entry_point_builds_the_same_options(monkeypatch):
    seen = _built(monkeypatch)
    sinks = torch.zeros(2)
    kw = dict(causal=True, scale=0.1, window_size=[8, 0], softcap=5.0, sinks=sinks, return_lse=True, seq_len=7)
    results = {name: _call(name, **kw) for name in ENTRY_POINTS}
    assert len(seen) == len(ENTRY_POINTS)
    want = AttentionOptions(**kw)
    assert all(o == want for o in seen), seen
    assert want.window_size == (8, 0) and want.window == (8, 0)  # a pair of ints, whatever sequence was given
    assert len({hash(o) for o in seen}) == 1
    assert AttentionOptions(**{**kw, "sinks": sinks.clone()}) != want  # tensors: the same object
    out, lse = results["context_parallel_attention[allgather]"]
    for name, (o, l) in results.items():  # the same options: the same attention in every mode
        torch.testing.assert_close(o[:, :, :7], out[:, :, :7], msg=name)
        torch.testing.assert_close(l[:, :, :7], lse[:, :, :7], msg=name)


def test_options_are_frozen():
    o = AttentionOptions(causal=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.causal = False
    assert o.window == (-1, 0) and AttentionOptions().window == (-1, -1)


def test_keyword_calls_keep_working():
    """Every keyword of the documented signature, through every entry point, with group=."""
    with one_rank_group():
        g = torch.distributed.group.WORLD
        want = cp.context_parallel_attention(Q, Q, Q, group=g, mode="ring", causal=True, scale=0.1,
                                             window_size=(8, 0))
        for got in (ring_attention(Q, Q, Q, group=g, causal=True, scale=0.1, window_size=(8, 0)),
                    ulysses_attention(Q, Q, Q, group=g, causal=True, scale=0.1, window_size=(8, 0)),
                    cp.context_parallel_attention(Q, Q, Q, group=g, causal=True, scale=0.1, window_size=(8, 0))):
            torch.testing.assert_close(got, want)
        stats = {}
        ring_attention(Q, Q, Q, group=g, shard_layout="contiguous", stats=stats)
        assert stats["fwd_kv_sends"] == 0  # one rank: nothing to send


def test_signatures_list_the_options_once():
    """The three entry points document the same option keywords (the fields, in order), after
    their own and before their private ones."""
    fields = [f.name for f in dataclasses.fields(AttentionOptions)]
    for fn, own in ((cp.context_parallel_attention, ["group", "mode", "shard_layout", "overlap", "check_ranks"]),
                    (ring_attention, ["group", "shard_layout", "stats", "check_ranks"]),
                    (ulysses_attention, ["group", "shard_layout", "check_ranks"])):
        params = list(inspect.signature(fn).parameters)
        assert params[:3] == ["q", "k", "v"]
        rest = [p for p in params[3:] if not p.startswith("_")]
        assert rest == own + fields + ["qkv_layout"], (fn.__name__, params)
    assert list(inspect.signature(cp.context_parallel_attention).parameters)[-1] == "_stats"
    assert options_mod.__all__ == ["AttentionOptions", "takes_options"]


def test_numpy_and_tensor_numbers_are_taken():
    """seq_len and dropout_p of numpy or 0-d tensor kinds are the numbers they hold."""
    import numpy as np
    o = AttentionOptions(seq_len=np.int64(8), dropout_p=np.float32(0.25))
    assert o.seq_len == 8 and type(o.seq_len) is int and o.dropout_p == 0.25
    assert AttentionOptions(seq_len=torch.tensor(8), dropout_p=torch.tensor(0.5)).dropout_p == 0.5


def test_shard_sequence_names_a_bad_dim():
    """dim past x's dims is named before any process-group call (an IndexError before)."""
    from attention_ext.distributed import shard_sequence
    with pytest.raises(ValueError, match=r"dim must be an int in \[-4, 4\)"):
        shard_sequence(torch.zeros(1, 2, 8, 4), dim=5)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        shard_sequence([1, 2], dim=0)


def test_shards_of_two_lengths_name_both_fixes():
    """q and k shards that differ only in length as given: the message offers layout='bshd' and
    one length alike (it offered the layout alone, the wrong fix for shorter k / v shards)."""
    from attention_ext.distributed.sharding import check_shards
    with pytest.raises(ValueError, match=r"pass layout='bshd' if they are \(B, S, H, D\); if they are \(B, H, S, D\), "
                                         r"give them one length \(q has 16 positions, k 8\)"):
        check_shards(torch.randn(1, 2, 16, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8), layout="bhsd")
