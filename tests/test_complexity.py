"""`python -m attention_ext bench --complexity` (attention_ext.complexity): the slope fit on exact
powers, the sweep's stopping rules (budget, predicted time, predicted memory, an error) on stand-in
methods whose cost is known, and the whole CLI path on two tiny lengths: every method's row, the
markdown, CSV and plot files, the header naming the machine. The CLI run keeps each call to
milliseconds: a few seconds of the suite on 2 cores."""
import csv
import importlib.util
import math
import re
import time

import pytest
import torch

from attention_ext import bench, complexity
from attention_ext.complexity import Method, fit_exponent, summarize, sweep

SIZES = [1024 << i for i in range(7)]


@pytest.mark.parametrize("p", [0.5, 1.0, 1.5, 2.0, 2.5])
def test_fit_exponent_exact_powers(p):
    assert fit_exponent(SIZES, [3.7 * n ** p for n in SIZES]) == pytest.approx(p, abs=1e-9)
    # n log n is no power: its slope over 16k-64k is 1 + about 1 / ln(n)
    lg = fit_exponent(SIZES, [n * math.log2(n) for n in SIZES])
    assert 1.09 < lg < 1.10


def test_fit_uses_the_largest_points_only():
    # overhead that swamps the small lengths does not reach the fit over the largest 3
    ys = [n ** 2 + (1e12 if n < 16384 else 0) for n in SIZES]
    assert fit_exponent(SIZES, ys, last=3) == pytest.approx(2.0, abs=1e-9)
    assert fit_exponent(SIZES, ys, last=7) < 1.0
    # unordered input, missing and non-positive values left out
    ns = [4096, 1024, 2048, 8192, 16384]
    ys = [n ** 1.5 for n in ns[:3]] + [None, 0.0]
    assert fit_exponent(ns, ys) == pytest.approx(1.5, abs=1e-9)
    assert math.isnan(fit_exponent(ns, [float("nan")] * 4 + [1.0]))
    assert math.isnan(fit_exponent([1024], [1.0]))
    assert math.isnan(fit_exponent([1024, 1024], [1.0, 2.0]))


def _fake(name, per_n_s=0.0, power=1, alloc_mb=0, fail_from=None, cost=lambda n: n):
    """A stand-in method: its call sleeps per_n_s * n^power seconds and fills alloc_mb * n MiB;
    from n = fail_from its build raises."""
    def build(n, b, h, d):
        if fail_from is not None and n >= fail_from:
            raise RuntimeError("too long for this stand-in")

        def f(x):
            time.sleep(per_n_s * n ** power)
            big = torch.ones(alloc_mb * n * 2**18) if alloc_mb else torch.ones(1)
            return x * big[0]
        return f, [torch.ones(4)], (4,)
    return Method(name, "O(n)", "O(n)", cost, build)


def test_sweep_stops_at_the_predicted_budget():
    m = _fake("sleepy", per_n_s=0.02)
    rows, notes = sweep([m], (1, 2, 4, 8), budget=0.12, reps=1)
    # 20, 40, 80 ms measured; n = 8 predicted at about 160 ms > 120 ms: not run
    assert [r["n"] for r in rows] == [1, 2, 4]
    assert notes["sleepy"].startswith("stopped before n=8: a call is predicted")
    assert all(r["ms"] >= 20 * r["n"] for r in rows) and all(r["reps"] == 1 for r in rows)
    assert all(r["ms_q1"] <= r["ms"] <= r["ms_q3"] for r in rows)
    fit = summarize(rows, [m])["sleepy"]
    assert fit.sizes == (1, 2, 4) and fit.expected == pytest.approx(1.0)
    assert 0.8 < fit.time < 1.2


def test_sweep_stops_after_a_call_over_budget_and_at_an_error():
    # n = 2 is predicted from n = 1 alone, linearly (the theory's cost, at least linear): 20 ms,
    # within the budget; it runs and takes 80 ms (cubic)
    slow = _fake("slow", per_n_s=0.01, power=3, cost=lambda n: 1.0)
    broken = _fake("broken", fail_from=4)
    rows, notes = sweep([slow, broken], (1, 2, 4), budget=0.05, reps=1)
    assert [r["n"] for r in rows if r["method"] == "slow"] == [1, 2]
    assert notes["slow"].startswith("stopped after n=2: one call took")
    assert [r["n"] for r in rows if r["method"] == "broken"] == [1, 2]
    assert notes["broken"] == "stopped at n=4: RuntimeError: too long for this stand-in"


def test_sweep_times_short_calls_for_min_time_on_the_methods_threads():
    seen = []

    def build(n, b, h, d):
        def f(x):
            seen.append(torch.get_num_threads())
            return x * 2
        return f, [torch.ones(4)], (4,)
    old = torch.get_num_threads()
    m = Method("quick", "O(1)", "O(1)", lambda n: n, build, threads=1)
    rows, notes = sweep([m], (1,), reps=3, min_time=0.05)
    assert rows[0]["reps"] > 3 and not notes  # microsecond calls: many in 50 ms
    assert set(seen) == {1} and torch.get_num_threads() == old


def test_rounds_keep_each_points_fastest_median():
    calls = []
    per_round = 1 + complexity.WARM_CALLS + 3  # the peak call, the untimed ones, 3 timed

    def build(n, b, h, d):
        def f(x):
            calls.append(n)
            time.sleep(0.03 if len(calls) <= per_round else 0.0)  # the first round under "load"
            return x * 2
        return f, [torch.ones(4)], (4,)
    rows, _ = sweep([Method("bursty", "O(1)", "O(1)", lambda n: n, build)], (1,), reps=3, rounds=2)
    (r,) = rows
    assert len(calls) == 2 * per_round and len(r["ms_rounds"]) == 2
    assert r["ms_rounds"][0] >= 30 > r["ms_rounds"][1] == r["ms"]


@pytest.mark.skipif(bench._libc_trim() is None, reason="the CPU peak needs Linux with glibc (/proc clear_refs)")
def test_sweep_stops_at_the_memory_cap():
    m = _fake("hungry", alloc_mb=16)
    rows, notes = sweep([m], (1, 2, 4), budget=10.0, mem_cap_mb=48, reps=1)
    # 16, 32 MiB measured; n = 4 predicted at 64 MiB > 48: not run
    assert [r["n"] for r in rows] == [1, 2]
    assert [round(r["peak_mb"] / 16) for r in rows] == [1, 2]
    assert "peak memory is predicted" in notes["hungry"]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    import io
    from contextlib import redirect_stdout

    out = tmp_path_factory.mktemp("complexity")
    buf = io.StringIO()
    t0 = time.perf_counter()
    with redirect_stdout(buf):
        rc = bench.main(["--complexity", "--sizes", "128,256", "--budget", "1", "--reps", "1", "--threads", "1",
                         "--no-progress", "--out", str(out)])
    assert rc == 0
    return out, buf.getvalue(), time.perf_counter() - t0


def test_cli_every_method_has_its_row(cli_run):
    out, text, _ = cli_run
    md = (out / "complexity.md").read_text()
    assert md.strip() in text  # printed as written
    names = [m.name for m in complexity.methods()]
    assert len(names) == 12
    table_rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [r.split(" | ")[0][2:] for r in table_rows] == names
    for r in table_rows:
        cells = [c.strip() for c in r.strip("|").split("|")]
        assert len(cells) == 7 + 2 + 1  # 7 columns, ms at 128 and 256, the peak
        assert cells[6] == "128, 256"  # every method reached both lengths
        assert all(float(c) > 0 for c in cells[7:9])
        float(cells[2]), float(cells[3])  # slopes expected and measured: numbers
    assert "delta rule (DeltaNet)" in names and "not yet in the library" not in md


def test_cli_header_names_the_machine(cli_run):
    out, _, _ = cli_run
    head = (out / "complexity.md").read_text().splitlines()[0]
    from attention_ext import _ext

    assert f"torch {torch.__version__}" in head and ", 1 threads" in head  # --threads 1
    assert _ext.cpu_isa() in head and bench.cpu_model() in head
    assert re.search(r"\d{4}-\d\d-\d\d", head)


def test_cli_csv_and_plots(cli_run):
    out, _, _ = cli_run
    with open(out / "complexity.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == set(complexity.CSV_FIELDS)
    names = [m.name for m in complexity.methods()]
    assert sorted({r["method"] for r in rows}) == sorted(names)
    assert sorted(int(r["n"]) for r in rows) == sorted([128, 256] * len(names))
    assert all(float(r["ms"]) > 0 for r in rows)
    # two rounds (the default without --quick): each point keeps the faster median
    assert all(float(r["ms"]) == pytest.approx(min(map(float, r["ms_rounds"].split())), rel=1e-5) for r in rows)
    assert all(len(r["ms_rounds"].split()) == 2 for r in rows)
    pngs = sorted(p.name for p in out.glob("*.png"))
    if importlib.util.find_spec("matplotlib") is not None:
        assert pngs == ["complexity_cpu_float32.png", "complexity_cpu_float32_memory.png"]


def test_cli_threads_and_errors(tmp_path, capsys):
    old = torch.get_num_threads()
    with pytest.raises(SystemExit):
        bench.main(["--complexity", "--dtype", "bf16", "--out", str(tmp_path)])
    assert "--complexity: the CPU in fp32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--complexity", "--max-n", "0", "--out", str(tmp_path)])
    assert "--max-n: at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--complexity", "--rounds", "0", "--out", str(tmp_path)])
    assert "--rounds: at least 1" in capsys.readouterr().err
    # --max-n below every length: nothing to run, said so
    assert bench.main(["--complexity", "--sizes", "128", "--max-n", "64", "--no-progress", "--threads", "1",
                       "--out", str(tmp_path)]) == 2
    assert torch.get_num_threads() == old
