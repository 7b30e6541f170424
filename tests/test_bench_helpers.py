"""attention_ext.bench's timers: interleaved() calls every contender warmup + reps times, in a
fixed round-robin order by default and in a seeded, varying order with shuffle=True."""
from attention_ext.bench import interleaved


def _record(names):
    calls = []
    return calls, {n: (lambda n=n: calls.append(n)) for n in names}


def test_interleaved_fixed_order():
    calls, fns = _record("abcd")
    t = interleaved(fns, warmup=2, reps=5)
    assert set(t) == set("abcd") and all(v >= 0 for v in t.values())
    assert calls == list("aabbccdd") + list("abcd") * 5


def test_interleaved_shuffle_varies_order_and_is_seeded():
    calls, fns = _record("abcd")
    interleaved(fns, warmup=0, reps=12, shuffle=True)
    rounds = [tuple(calls[i:i + 4]) for i in range(0, len(calls), 4)]
    assert all(sorted(r) == list("abcd") for r in rounds)  # each contender once per round
    assert len(set(rounds)) > 1 and len({r[0] for r in rounds}) > 1  # not one fixed order
    calls2, fns2 = _record("abcd")
    interleaved(fns2, warmup=0, reps=12, shuffle=True)
    assert calls2 == calls  # the same seed, the same orders: runs stay comparable
