"""attention_ext.bench's timers and ceilings: interleaved() calls every contender warmup + reps
times, in a fixed round-robin order by default and in a seeded, varying order with shuffle=True;
interleaved_stats() times as many rounds as the spread needs; the FLOP ceiling is the highest of
the measures that apply to the device and dtype, and the peak loop's rate is physically possible."""
import math

import pytest
import torch

from attention_ext import _ext, bench
from attention_ext.bench import Timing, flop_ceiling, interleaved, interleaved_stats, timing


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


def test_interleaved_stats_before_runs_ahead_of_every_call_untimed(monkeypatch):
    """before (the decode rows' cache_evictor) runs ahead of each timed call, warmups excluded,
    and its time is not the contender's."""
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    t = interleaved_stats(fns, warmup=1, min_reps=3, budget=1e9,
                          before=lambda: (calls.append("flush"), setattr(clock, "now", clock.now + 1.0)))
    assert calls == ["a", "b"] + ["flush", "a", "flush", "b"] * 3
    assert all(v.median == 0.0 for v in t.values())


def test_cache_evictor_reads_twice_the_last_level_cache():
    ev = bench.cache_evictor("cpu")
    assert ev is not None and bench.cache_evictor("meta") is None
    assert bench.llc_bytes() >= 1 << 20
    ev()


def test_timing_quartiles_and_spread():
    t = timing([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median, t.q1, t.q3, t.best, t.n) == (3.0, 2.0, 4.0, 1.0, 5)
    assert t.spread == pytest.approx(2.0 / 3.0)
    assert t.rse == pytest.approx(1.2533 * (2.0 / 3.0) / 1.349 / math.sqrt(5))
    one = timing([0.5])
    assert (one.median, one.q1, one.q3, one.spread) == (0.5, 0.5, 0.5, 0.0)


class _Clock:
    """A fake perf_counter that only the contenders advance, each by its next duration."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def fn(self, durations):
        it = iter(durations)
        return lambda: setattr(self, "now", self.now + next(it))


def test_interleaved_stats_stops_when_the_medians_are_known(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    steady = [1e-3] * 1000
    t = interleaved_stats({"a": clock.fn(steady), "b": clock.fn([2e-3] * 1000)}, warmup=1, min_reps=5, budget=1e9)
    assert {k: v.n for k, v in t.items()} == {"a": 5, "b": 5}  # no spread: min_reps is enough
    assert t["a"].median == pytest.approx(1e-3) and t["b"].median == pytest.approx(2e-3)
    # min_time: short calls are sampled over that long however steady they are (3 ms a round)
    start = clock.now
    t = interleaved_stats({"a": clock.fn(steady), "b": clock.fn([2e-3] * 1000)}, warmup=0, min_reps=5, min_time=0.1)
    assert t["a"].n == 34 and 0.1 <= clock.now - start < 0.1 + 3e-3


def test_interleaved_stats_times_more_rounds_while_noisy_within_budget(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench, "time", clock)
    noisy = [1e-3, 3e-3] * 1000  # an IQR as large as the median: rse 0.93 / sqrt(n) never reaches 2%
    t = interleaved_stats({"a": clock.fn(noisy), "b": clock.fn([1e-3] * 2000)}, warmup=0, min_reps=5,
                          max_reps=10_000, budget=0.5, target=0.02)
    assert t["a"].n == t["b"].n > 5
    # no round starts once the budget (in the fake clock) is spent; a round takes at most 4 ms
    assert 0.5 <= clock.now < 0.5 + 4e-3
    capped = interleaved_stats({"a": clock.fn(noisy)}, warmup=0, min_reps=3, max_reps=7, budget=1e9)
    assert capped["a"].n == 7


def test_interleaved_stats_converges_on_real_time():
    t = interleaved_stats({"x": lambda: sum(range(2000))}, warmup=1, min_reps=3, budget=0.2)
    assert 3 <= t["x"].n and t["x"].q1 <= t["x"].median <= t["x"].q3 and t["x"].best <= t["x"].q1


def test_flop_ceiling_picks_the_measures_of_the_device_and_dtype():
    called = []

    def loop(kind, threads, seconds):
        called.append(kind)
        return {"fp32_fma": 100.0, "bf16_dot": 180.0, "bf16_amx": 0.0}[kind]  # no AMX: left out

    def matmul(dtype, n, device, reps):
        called.append(("matmul", dtype, n, device))
        return 120.0 if dtype == torch.float32 else 90.0

    peak, parts = flop_ceiling(torch.float32, "cpu", matmul=matmul, loop=loop)
    assert peak == 120.0 and parts == {"fp32 FMA loop": 100.0, "2048x2048 matmul": 120.0}
    peak, parts = flop_ceiling(torch.bfloat16, "cpu", matmul=matmul, loop=loop)
    assert peak == 180.0 and set(parts) == {"fp32 FMA loop", "bf16 dot loop", "2048x2048 matmul"}
    called.clear()
    peak, parts = flop_ceiling(torch.bfloat16, "cuda:0", matmul=matmul, loop=loop)  # no loop on CUDA
    assert peak == 90.0 and parts == {"4096x4096 matmul": 90.0}
    assert called == [("matmul", torch.bfloat16, 4096, "cuda:0")]
    # a measure that gave nothing (no bf16 dot on this CPU; no extension) is left out
    peak, parts = flop_ceiling(torch.bfloat16, "cpu", matmul=matmul,
                               loop=lambda k, t, s: 0.0 if k.startswith("bf16") else 100.0)
    assert peak == 100.0 and "bf16 dot loop" not in parts and "bf16 AMX loop" not in parts
    # AMX tiles: their loop is the bf16 ceiling
    peak, parts = flop_ceiling(torch.bfloat16, "cpu", matmul=matmul,
                               loop=lambda k, t, s: {"fp32_fma": 100.0, "bf16_dot": 50.0, "bf16_amx": 900.0}[k])
    assert peak == 900.0 and parts["bf16 AMX loop"] == 900.0


needs_ext = pytest.mark.skipif(not _ext.HAS_EXT, reason="the peak loop is part of the compiled extension")
# generous bounds on a core's clock: a rate outside them is a miscounted loop, not a fast machine
MAX_HZ, MIN_HZ = 6.5e9, 0.2e9


# the levels whose int8 Q.K^T runs vpdpbusd (cpu/q8dot.h), so whose "int8_dot" loop runs
_VNNI_LEVELS = ("avx2vnni", "avx512vnni", "avx512bf16", "avx512amx")


@needs_ext
def test_int8_dot_loop_runs_where_the_int8_product_does():
    """The avx2vnni / avx512vnni variants run the int8 Q.K^T on vpdpbusd (AVX-VNNI, AVX512-VNNI
    under a target attribute), so their ceiling is that loop's (it read 0 there: bench's int8 row
    fell back to the float32 FMA ceiling)."""
    old = _ext.cpu_isa()
    try:
        for level in _ext.cpu_isas():
            _ext.set_cpu_isa(level)
            got = bench.cpu_peak_flops("int8_dot", 1, 0.02)
            lanes = _ext._C.simd_width()
            if level in _VNNI_LEVELS:
                assert 0 < got < 2 * 4 * lanes * 2 * MAX_HZ, level
            else:
                assert got == 0.0, level
    finally:
        _ext.set_cpu_isa(old)


@needs_ext
def test_cpu_peak_flops_is_physically_possible():
    lanes = _ext._C.simd_width()  # float32 lanes of the active level
    one = bench.cpu_peak_flops("fp32_fma", 1, 0.05)
    # per thread: at most 2 FMA ports of `lanes` multiply-adds (2 FLOPs) per cycle; at least one
    # vector op every few cycles of a slow clock, even on a loaded machine
    assert lanes * 2 * MIN_HZ / 4 < one < 2 * lanes * 2 * MAX_HZ
    bf16 = bench.cpu_peak_flops("bf16_dot", 1, 0.05)
    if _ext.cpu_isa() in ("avx512bf16", "avx512amx", "native") and "avx512bf16" in _ext.cpu_isas():
        assert 0 < bf16 < 2 * 2 * lanes * 2 * MAX_HZ  # pairs: twice the multiply-adds of an FMA
    elif _ext.cpu_isa() != "native":
        assert bf16 == 0.0  # the level has no bf16 dot product
    int8 = bench.cpu_peak_flops("int8_dot", 1, 0.05)
    if _ext.cpu_isa() in _VNNI_LEVELS or (_ext.cpu_isa() == "native" and "avx512bf16" in _ext.cpu_isas()):
        assert 0 < int8 < 2 * 4 * lanes * 2 * MAX_HZ  # quads: four times the multiply-adds of an FMA
    elif _ext.cpu_isa() != "native":
        assert int8 == 0.0  # the level has no VNNI
    # AMX tiles (the avx512amx variant only): a (16, 16) tile product per instruction, at most one
    # per 16 cycles per core (1024 int8 / 512 bf16 multiply-adds per cycle), twice for slack
    for kind, macs in (("int8_amx", 1024), ("bf16_amx", 512)):
        amx = bench.cpu_peak_flops(kind, 1, 0.05)
        if _ext.cpu_isa() == "avx512amx":
            assert 0 < amx < 2 * macs * 2 * MAX_HZ, kind
        else:
            assert amx == 0.0, kind
    n = torch.get_num_threads()
    assert 0 < bench.cpu_peak_flops("fp32_fma", n, 0.05) < n * 2 * lanes * 2 * MAX_HZ


@needs_ext
def test_cpu_peak_flops_follows_the_active_isa_level():
    levels = _ext.cpu_isas()
    if len(levels) < 2:
        pytest.skip("one ISA level runs here")
    old = _ext.set_cpu_isa(levels[0])
    try:
        low = bench.cpu_peak_flops("fp32_fma", 1, 0.05)
        assert _ext._C.simd_width() * 2 * MIN_HZ / 4 < low < 2 * _ext._C.simd_width() * 2 * MAX_HZ
    finally:
        _ext.set_cpu_isa(old)


@needs_ext
def test_cpu_peak_flops_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kind must be 'fp32_fma', 'bf16_dot', 'int8_dot', 'int8_amx' or 'bf16_amx'"):
        _ext._C.cpu_peak_flops("fp64", 1, 0.01)
    n = torch.get_num_threads()
    with pytest.raises(ValueError, match=r"torch.set_num_threads"):
        _ext._C.cpu_peak_flops("fp32_fma", n + 1, 0.01)
    with pytest.raises(ValueError, match="seconds"):
        _ext._C.cpu_peak_flops("fp32_fma", 1, 0.0)


@needs_ext
def test_flop_ceiling_is_at_least_the_matmul_and_the_loop():
    peak, parts = flop_ceiling(torch.float32, "cpu", seconds=0.05, n=512, reps=2)
    assert set(parts) == {"fp32 FMA loop", "512x512 matmul"} and peak == max(parts.values())
    # torch's GEMM runs on the same FMAs: the loop is the higher of the two, with room for the noise
    # of a shared machine between the two measures
    assert parts["fp32 FMA loop"] > 0.7 * parts["512x512 matmul"]


def test_bandwidth_fns_move_the_bytes_they_count():
    fns = bench.bandwidth_fns(1 << 20)
    (copy, copied), (read, read_bytes) = fns[bench.CEIL_COPY], fns[bench.CEIL_READ]
    assert copied == read_bytes == 1 << 20  # half read + half written; all read
    assert copy().numel() * 4 * 2 == copied and read().item() == (1 << 20) // 4


# stand-in peak loops, one rate per kind, so that a row's ceiling names the loop it came from
FAKE_LOOPS = {"fp32_fma": 1e11, "bf16_dot": 2e11, "int8_dot": 4e11, "int8_amx": 6e12, "bf16_amx": 3e12}


@needs_ext
def test_int8_qk_row_is_read_against_the_int8_loop_of_the_active_level(monkeypatch):
    """The int8 Q.K^T row's ceiling is the int8 loop of the instruction the active ISA level runs
    (AMX tiles at avx512amx, VNNI at avx512bf16), in the case's rows and after the run's ceiling is
    final (final_ceilings, which once overwrote it with the fp32 one); the other rows keep the
    fp32 ceiling."""
    monkeypatch.setattr(bench, "cpu_peak_flops", lambda kind, threads=0, seconds=0.3: FAKE_LOOPS[kind])
    levels = [lv for lv in ("avx512bf16", "avx512amx") if lv in _ext.cpu_isas()] or [_ext.cpu_isa()]
    for level in bench.at_isa_levels(levels):
        kind = "int8_amx" if level == "avx512amx" else "int8_dot"
        assert bench.int8_qk_loop() == kind
        p = bench.Peers("cpu", flex=False, flex_reason="", flex_budget=60.0)
        notes = {}
        fp32 = FAKE_LOOPS["fp32_fma"]
        rows = bench.run_case(p, "softmax", (1, 2, 2, 16), 64, torch.float32, False,
                              dict(min_reps=1, budget=0.0, min_time=0.0, target=0.02), notes, fp32, "fp32_fma", [])
        by = {r["impl"]: r for r in rows}
        assert by["ours int8 qk"]["ceiling"] * 1e12 == pytest.approx(FAKE_LOOPS[kind])
        assert by["ours"]["ceiling"] * 1e12 == pytest.approx(fp32)
        assert kind in notes["ceiling ours int8 qk"]
        # the run's final ceiling, raised by a burst: the fp32 rows follow it, the int8 row keeps its loop
        peaks = {("cpu", torch.float32): (fp32, {bench.FP32_LOOP: fp32})}
        bench.final_ceilings({("softmax", "cpu", "float32"): rows}, peaks, {("cpu", torch.float32): [1.5 * fp32]},
                             {("softmax", "cpu", "float32"): {}})
        assert peaks["cpu", torch.float32] == (1.5 * fp32, {bench.FP32_LOOP: 1.5 * fp32})
        assert by["ours"]["ceiling"] * 1e12 == pytest.approx(1.5 * fp32)
        assert by["ours int8 qk"]["ceiling"] * 1e12 == pytest.approx(FAKE_LOOPS[kind])
        assert by["ours int8 qk"]["ceiling"] != by["ours"]["ceiling"]
        for r in rows:
            assert r["share"] == pytest.approx(r["tflops"] / r["ceiling"])


def test_final_ceilings_fold_the_bursts_into_the_loop_that_ran_them():
    """bf16 on AMX: the bursts beside every round ran the AMX tile loop (burst_loop), so they raise
    its entry and the header labels each rate by the loop that measured it (once, the AMX bursts
    were filed under the bf16 dot loop)."""
    parts = {bench.FP32_LOOP: 1.0, bench.BF16_LOOP: 2.0, bench.BF16_AMX_LOOP: 30.0, "2048x2048 matmul": 3.0}
    assert bench.burst_loop(parts) == bench.BF16_AMX_LOOP
    assert bench.burst_loop({bench.FP32_LOOP: 1.0, bench.BF16_LOOP: 2.0}) == bench.BF16_LOOP
    assert bench.burst_loop({"4096x4096 matmul": 1.0}) is None
    peaks = {("cpu", torch.bfloat16): (30.0, parts)}
    bench.final_ceilings({}, peaks, {("cpu", torch.bfloat16): [40.0, 35.0]}, {})
    assert peaks["cpu", torch.bfloat16][0] == 40.0
    assert parts == {bench.FP32_LOOP: 1.0, bench.BF16_LOOP: 2.0, bench.BF16_AMX_LOOP: 40.0, "2048x2048 matmul": 3.0}
