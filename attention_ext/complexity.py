"""`python -m attention_ext bench --complexity`: the complexity table, measured.

Every attention of the library (and torch's GRU as a recurrent reference point) is timed forward +
backward over sequence lengths n = 1k, 2k, 4k, ... 64k on the CPU in float32, its peak memory
measured, and its growth exponent fitted: the least-squares slope of log(time) against log(n) over
its largest FIT_POINTS measured lengths (small lengths are dominated by per-call overhead), and the
same for memory. The table sets the slopes beside each method's textbook complexity and the slope
that complexity predicts over the same lengths (n log n is not a power: its slope over 16k-64k is
about 1.1).

A method stops growing n when one call took longer than the budget (--budget), or when the next
length's call is predicted to (the last two lengths' local slope, at least 1, extrapolated), or its
predicted peak memory passes the cap (--mem-cap): the quadratic ones stop early, and their slopes
come from the lengths they reached.

    sweep()         the measurements: one row per (method, n)
    fit_exponent()  the slope of log y against log n over the largest points
    summarize()     each method's fitted slopes and the slope its theory predicts
    table(), plot() the markdown table and the log-log plots
    run()           bench.main's --complexity path: all of the above, then complexity.md / .csv / .png
"""
from __future__ import annotations

import gc
import math
import time
from typing import TYPE_CHECKING, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import bench as _bench

if TYPE_CHECKING:
    import argparse

SIZES = tuple(1024 << i for i in range(7))  # 1k ... 64k
QUICK_SIZES = (1024, 2048, 4096, 8192)
SHAPE = (1, 4, 64)  # B, H, D: small enough that the linear methods reach n = 64k within the budget
FIT_POINTS = 3  # the largest measured lengths each slope is fitted over
REPS = 3  # timed calls per length (their median) after the warm-up, at least
MIN_TIME_S, QUICK_MIN_TIME_S = 1.0, 0.25  # and calls for this long at least (a short call's median over many)
ROUNDS, QUICK_ROUNDS = 2, 1  # timing rounds over every point; each keeps its fastest round's median
SLOW_S = 3.0  # a length whose warm-up call took longer is timed once
# Calls after the peak measurement that are not timed: it hands freed memory back to the OS, and
# the next calls find a cold heap (fresh pages to fault in), where a training loop that repeats a
# shape finds a warm one.
WARM_CALLS = 2
MEM_CAP_GIB = 8.0
WINDOW = 256  # sliding window: keys i - 256 ... i
SPARSE_BLOCK = _bench.SPARSE_BLOCK  # 64
TOPK = 32
LSH_CHUNK, LSH_HASHES = 64, 2
LSH_FIXED_BUCKETS = 64
LINFORMER_R = 256
FAVOR_M = 128


class Method(NamedTuple):
    """One row of the table: its name, its complexity (time, memory) as text, the time cost
    function its theory predicts (n -> relative cost: the expected slope is fitted on it), and
    build(n, b, h, d) -> (f, inputs, output shape): the call f(*inputs) whose forward + backward
    is timed (bench.step: fresh leaves of the inputs, backward of ones, the gradient of out.sum());
    a note under the table; threads: the torch threads its calls run on, where not the run's."""
    name: str
    theory: str
    memory: str
    cost: Callable[[float], float]
    build: Callable[..., Tuple[Callable, list, tuple]]
    note: str = ""
    threads: Optional[int] = None


def _inputs(n: int, b: int, h: int, d: int, count: int = 3) -> list:
    """`count` (B, H, n, D) float32 standard normal tensors, the same for every method at n."""
    g = torch.Generator().manual_seed(n)
    return [torch.randn(b, h, n, d, generator=g) for _ in range(count)]


def _lsh_buckets(n: int) -> int:
    """Reformer's choice, about n / chunk buckets (even, at least 2)."""
    return max(2, n // LSH_CHUNK // 2 * 2)


def methods() -> List[Method]:
    """The rows, in the table's order."""
    import attention_ext as ae
    from attention_ext import sparse
    from attention_ext.linear.feature_maps import Favor

    def dense(n, b, h, d):
        return (lambda q, k, v: ae.attention(q, k, v, causal=True)), _inputs(n, b, h, d), (b, h, n, d)

    def window(n, b, h, d):
        return (lambda q, k, v: ae.attention(q, k, v, causal=True, window=(WINDOW, 0))), _inputs(n, b, h, d), \
            (b, h, n, d)

    def block_sparse(layout_fn):
        def build(n, b, h, d):
            lay = layout_fn(n, h)  # built once, outside the timed call (a model keeps its layout)
            return (lambda q, k, v: ae.block_sparse_attention(q, k, v, lay, block_size=SPARSE_BLOCK, causal=True)), \
                _inputs(n, b, h, d), (b, h, n, d)
        return build

    def topk(n, b, h, d):
        return (lambda q, k, v: ae.topk_attention(q, k, v, k_top=TOPK, causal=True)), _inputs(n, b, h, d), \
            (b, h, n, d)

    def lsh(n_buckets):
        def build(n, b, h, d):
            return _lsh(n, b, h, d, n_buckets(n))
        return build

    def _lsh(n, b, h, d, nb):
        rot = torch.randn(LSH_HASHES, d, nb // 2, generator=torch.Generator().manual_seed(0))
        f = lambda qk, v: ae.lsh_attention(qk, v, n_buckets=nb, n_hashes=LSH_HASHES,  # noqa: E731
                                           chunk_size=LSH_CHUNK, causal=True, rotations=rot)
        return f, _inputs(n, b, h, d, 2), (b, h, n, d)

    def linformer(n, b, h, d):
        r = min(LINFORMER_R, n)
        proj = torch.randn(r, n, generator=torch.Generator().manual_seed(1)) / math.sqrt(n)
        # the projection is a trained parameter: it is one of the inputs, and gets its gradient
        return (lambda q, k, v, p: ae.linformer_attention(q, k, v, p)), _inputs(n, b, h, d) + [proj], (b, h, n, d)

    def linear(n, b, h, d):
        return (lambda q, k, v: ae.linear_attention(q, k, v, causal=True)), _inputs(n, b, h, d), (b, h, n, d)

    def delta(n, b, h, d):
        beta = torch.rand(b, h, n, generator=torch.Generator().manual_seed(n))  # in (0, 1), as a sigmoid gives
        return (lambda q, k, v, bt: ae.delta_rule_attention(q, k, v, bt, qk_l2norm=True)), \
            _inputs(n, b, h, d) + [beta], (b, h, n, d)

    def favor(n, b, h, d):
        fm = Favor(d, nb_features=FAVOR_M, seed=0)
        return (lambda q, k, v: ae.linear_attention(q, k, v, causal=True, feature_map=fm)), _inputs(n, b, h, d), \
            (b, h, n, d)

    def gru(n, b, h, d):
        torch.manual_seed(0)
        rnn = torch.nn.GRU(h * d, h * d)  # its weights get their gradients too, as in training
        x = _inputs(n, b, h, d, 1)[0].permute(2, 0, 1, 3).reshape(n, b, h * d)  # (n, B, d_model)
        return (lambda x: rnn(x)[0]), [x], (n, b, h * d)

    def fixed_layout(n, h):
        return sparse.fixed(seq_len=n, block_size=SPARSE_BLOCK, heads=h, causal=True)  # stride round(sqrt(n / 64))

    def bigbird_layout(n, h):
        return _bench.sparse_layout(n, h, SPARSE_BLOCK, causal=True)  # the sparse family's benchmark layout

    lg = lambda n: n * math.log2(n)  # noqa: E731
    return [
        Method("dense softmax", "O(n^2 d)", "O(n d), fused: no n x n matrix", lambda n: n * n, dense),
        Method(f"sliding window w={WINDOW}", "O(n w d)", "O(n d)", lambda n: n, window),
        Method("Sparse Transformer fixed", "O(n^1.5 d): stride sqrt(n/64) blocks", "O(n d)", lambda n: n ** 1.5,
               block_sparse(fixed_layout),
               note=f"Sparse Transformer fixed: block {SPARSE_BLOCK}, stride round(sqrt(n / {SPARSE_BLOCK})) "
                    "blocks (the layout's default), c = 1: each row reads its window (about stride / 2 blocks, "
                    "causal) and one summary block per earlier window (about n_blocks / (2 stride)), "
                    "sqrt(n_blocks) blocks per row: O(n^1.5). A constant stride would make it O(n^2 / stride)."),
        Method("BigBird", "O(n d)", "O(n d)", lambda n: n, block_sparse(bigbird_layout),
               note=f"BigBird: block {SPARSE_BLOCK}, a window of 2 blocks on each side, 1 global block, 2 random "
                    "blocks per row (bench.sparse_layout), causal: at most 6 blocks per row whatever n."),
        Method(f"top-k k={TOPK}", "O(n^2 d): scores every key", "O(n d)", lambda n: n * n, topk),
        Method(f"LSH {LSH_HASHES} hashes, {LSH_FIXED_BUCKETS} buckets", "O(n log n)", f"O(n c), c = {LSH_CHUNK}", lg,
               lsh(lambda n: LSH_FIXED_BUCKETS),
               note=f"LSH (Reformer): shared QK, {LSH_HASHES} hash rounds, chunks of {LSH_CHUNK}; a fixed "
                    f"{LSH_FIXED_BUCKETS} buckets (as a layer that serves many lengths, nn's attention_type='lsh') "
                    f"or n / {LSH_CHUNK} (the paper's choice at one length). O(n log n) is the sort; the chunks "
                    f"are O(n c d) whatever the buckets. The hash projects every row on n_buckets / 2 directions: "
                    f"O(n d) for fixed buckets, but n^2 d / {2 * LSH_CHUNK} multiply-adds per round for n / "
                    f"{LSH_CHUNK}: a matmul, cheaper than the chunks' forward + backward below n of about 100k, "
                    f"but quadratic, so that row's slope sits above n log n's."),
        Method(f"LSH {LSH_HASHES} hashes, n/{LSH_CHUNK} buckets", "O(n log n) + hash O(n^2 d / c)",
               f"O(n c), c = {LSH_CHUNK}", lg, lsh(_lsh_buckets)),
        Method(f"Linformer r={LINFORMER_R}", "O(n r d)", "O(n (d + r))", lambda n: n, linformer,
               note=f"Linformer: one (r = {LINFORMER_R}, n) projection shared by k and v and every head, an input "
                    "that gets its gradient (a trained parameter); non-causal, as in the paper."),
        Method("linear (elu+1)", "O(n d^2)", "O(n d)", lambda n: n, linear),
        Method("delta rule (DeltaNet)", "O(n d^2)", "O(n d)", lambda n: n, delta,
               note="delta rule (DeltaNet): delta_rule_attention with qk_l2norm=True and beta in (0, 1) an input "
                    "with its gradient; the CPU kernel runs the recurrence (a (d, d) state per head, d^2 "
                    "multiply-adds per token, about 4 passes over it forward and 10 backward)."),
        Method(f"FAVOR+ m={FAVOR_M}", "O(n m d)", "O(n m)", lambda n: n, favor,
               note=f"FAVOR+: {FAVOR_M} random features (Favor), mapped by PyTorch ops ahead of the kernel. Page "
                    "faults: an intermediate of more than 32 MB (glibc's largest mmap threshold; FAVOR+'s (B, H, "
                    "n, m) features from n = 16k, LSH's sorted copies from n = 16k) is fresh memory on every call, "
                    "so the page faults per call step up there, and so does the time: the slopes of the rows built "
                    "of PyTorch ops read above their theory over 16k-64k. "
                    "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge pages for malloc, glibc >= 2.35) "
                    "removes most of the step."),
        Method("GRU (torch.nn.GRU, 1 thread)", "O(n d^2), sequential", "O(n d)", lambda n: n, gru,
               note="GRU: torch's own torch.nn.GRU over (n, B, H * D) = d_model 256 inputs, one layer, hidden "
                    "256, forward + backward (its weights' gradients included): a recurrent reference point, "
                    "not an attention of this library. n sequential steps of about 20 small ops each (a 1 x 256 "
                    "by 256 x 768 matmul), on 1 thread: 2 threads gain nothing there, and on a loaded machine "
                    "every op waited for both threads (a call many times slower).", threads=1),
    ]


def fit_exponent(ns: Sequence[float], ys: Sequence[Optional[float]], last: int = FIT_POINTS) -> float:
    """The least-squares slope of log(y) against log(n) over the `last` largest n whose y is a
    positive number (None, 0 and NaN are left out): the growth exponent, y ~ n^slope. NaN where
    fewer than 2 points (or 2 distinct n) remain."""
    pts = sorted((float(n), float(y)) for n, y in zip(ns, ys)
                 if y is not None and y == y and float(y) > 0 and float(n) > 0)[-last:]
    if len(pts) < 2:
        return float("nan")
    xs = [math.log(n) for n, _ in pts]
    ls = [math.log(y) for _, y in pts]
    mx, my = sum(xs) / len(xs), sum(ls) / len(ls)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ls)) / var


def _predict(ns: list, vals: list, n_next: int, cost: Callable[[float], float]) -> float:
    """The next length's value extrapolated from the last measured one: with the local slope of
    the last two (clamped to [1, 3]: noise neither hides growth nor blows it up), or with the
    theory's cost from one point alone."""
    if not ns or vals[-1] is None:
        return 0.0
    if len(ns) >= 2 and vals[-2] and vals[-1] > 0 and vals[-2] > 0:
        slope = math.log(vals[-1] / vals[-2]) / math.log(ns[-1] / ns[-2])
    else:
        slope = math.log(cost(n_next) / cost(ns[-1])) / math.log(n_next / ns[-1])
    return vals[-1] * (n_next / ns[-1]) ** min(3.0, max(1.0, slope))


def _free(trim: Optional[Callable[[], object]]) -> None:
    """Hands freed memory back to the OS (the extension's huge-page cache, glibc's free pages): the
    next case starts from the memory it needs. The inputs die by their reference counts."""
    from attention_ext import _ext

    _ext.empty_cpu_cache()
    if trim is not None:
        trim()


def _measure(m: Method, n: int, shape: tuple, reps: int, min_time: float, slow_s: float, trim) -> tuple:
    """One (method, n) on m.threads threads where given: (bench.Timing of the timed calls, seconds
    of the warm-up call, its peak MiB or None where it cannot be measured). Then WARM_CALLS more
    calls, not timed, and the timed calls: `reps`
    and min_time seconds at least (bench.interleaved_stats of the one call), a single one where the
    warm-up took longer than slow_s."""
    b, h, d = shape
    f, xs, out_shape = m.build(n, b, h, d)
    fn = _bench.step(f, xs, torch.ones(out_shape), "fwd_bwd")
    old = torch.get_num_threads()
    if m.threads is not None:
        torch.set_num_threads(m.threads)
    try:
        t0 = time.perf_counter()
        if trim is not None:
            peak = _bench._cpu_peak_mb(fn, trim)
        else:
            peak = None
            fn()
        first = time.perf_counter() - t0  # with _cpu_peak_mb's collection: cheap, the objects before it frozen
        slow = first > slow_s
        t = _bench.interleaved_stats({"call": fn}, warmup=0 if slow else WARM_CALLS, min_reps=1 if slow else reps,
                                     min_time=0.0 if slow else min_time, budget=0.0 if slow else min_time,
                                     max_reps=1 if slow else 1000)["call"]
    finally:
        torch.set_num_threads(old)
    return t, first, peak


def sweep(meths: Optional[Sequence[Method]] = None, sizes: Sequence[int] = SIZES, *, shape: tuple = SHAPE,
          budget: float = 10.0, mem_cap_mb: float = MEM_CAP_GIB * 1024, reps: int = REPS, min_time: float = 0.0,
          slow_s: float = SLOW_S, rounds: int = 1, progress: bool = False) -> Tuple[list, dict]:
    """Every method over the lengths in increasing order, each (method, n): the inputs built, one
    forward + backward call whose peak memory is measured (bench._cpu_peak_mb; it is the warm-up),
    then `reps` timed calls and min_time seconds of them at least (1 call where the warm-up took
    longer than slow_s), their median. A method stops growing n after a call over `budget`
    seconds, before a length whose call is predicted (_predict) to take longer than budget or to
    need more than mem_cap_mb, and at an error.
    rounds > 1: the (method, n) points the first round reached are timed again, as many more times,
    each after a warm-up call, minutes apart; a point keeps its fastest round's median (ms), so that
    a burst of another process's load has to hit the same point in every round to move it.
    Returns (rows, notes): rows {method, n, ms (the median), ms_q1, ms_q3, reps (of the round
    kept), ms_rounds (each round's median), first_ms, peak_mb (None where the peak cannot be
    measured)}, notes {method name: why it stopped}."""
    from tqdm import tqdm

    meths = list(methods() if meths is None else meths)
    sizes = sorted(set(int(n) for n in sizes))
    trim = _bench._libc_trim()
    rows, notes = [], {}
    bar = tqdm(total=len(meths) * len(sizes) * rounds, desc="complexity", unit="case", disable=not progress)
    # the garbage collection _cpu_peak_mb starts with walks every object of the process (0.2 s with
    # torch imported): the objects from before the sweep are frozen, out of its reach, until the end
    gc.collect()
    gc.freeze()
    try:
        _sweep(meths, sizes, shape, budget, mem_cap_mb, reps, min_time, slow_s, trim, rows, notes, bar)
        bar.total = bar.n + len(rows) * (rounds - 1)
        bar.refresh()
        by_name = {m.name: m for m in meths}
        for _ in range(rounds - 1):
            for r in rows:
                bar.set_postfix_str(f"{r['method']} n={r['n']} (again)")
                try:
                    tm, _, _ = _measure(by_name[r["method"]], r["n"], shape, reps, min_time, slow_s, None)
                except Exception:  # noqa: BLE001 - it ran in the first round: a failure now keeps that round's
                    tm = None
                finally:
                    _free(trim)
                if tm is not None:
                    r["ms_rounds"].append(tm.median * 1e3)
                    if tm.median * 1e3 < r["ms"]:
                        r.update(ms=tm.median * 1e3, ms_q1=tm.q1 * 1e3, ms_q3=tm.q3 * 1e3, reps=tm.n)
                bar.update(1)
    finally:
        gc.unfreeze()
        bar.close()
    return rows, notes


def _sweep(meths, sizes, shape, budget, mem_cap_mb, reps, min_time, slow_s, trim, rows, notes, bar) -> None:
    """sweep()'s loop, appending to rows and notes."""
    for m in meths:
        ns, times, mems = [], [], []
        for i, n in enumerate(sizes):
            bar.set_postfix_str(f"{m.name} n={n}")
            why = None
            if ns:
                t_pred = _predict(ns, times, n, m.cost)
                m_pred = _predict(ns, mems, n, lambda x: x) if mems and mems[-1] is not None else 0.0
                if times[-1] > budget:
                    why = f"stopped after n={ns[-1]}: one call took {times[-1]:.3g} s > the budget {budget:g} s"
                elif t_pred > budget:
                    why = (f"stopped before n={n}: a call is predicted to take {t_pred:.3g} s > the budget "
                           f"{budget:g} s")
                elif m_pred > mem_cap_mb:
                    why = (f"stopped before n={n}: its peak memory is predicted at {m_pred / 1024:.1f} GiB > the "
                           f"cap {mem_cap_mb / 1024:g} GiB")
            if why is not None:
                notes[m.name] = why
                bar.update(len(sizes) - i)
                break
            try:
                tm, first, peak = _measure(m, n, shape, reps, min_time, slow_s, trim)
            except Exception as e:  # noqa: BLE001 - out of memory, a rule the size breaks: a note, the method stops
                msg = str(e).splitlines()[0][:160] if str(e) else ""
                notes[m.name] = f"stopped at n={n}: {type(e).__name__}: {msg}"
                bar.update(len(sizes) - i)
                break
            finally:
                _free(trim)  # the inputs died with _measure's frame
            ns.append(n)
            times.append(tm.median)
            mems.append(peak)
            rows.append({"method": m.name, "n": n, "ms": tm.median * 1e3, "ms_q1": tm.q1 * 1e3, "ms_q3": tm.q3 * 1e3,
                         "reps": tm.n, "ms_rounds": [tm.median * 1e3], "first_ms": first * 1e3, "peak_mb": peak})
            bar.update(1)


class Fit(NamedTuple):
    """A method's fitted slopes (time, memory), the slope its theory predicts over the same
    lengths, and those lengths."""
    time: float
    memory: float
    expected: float
    sizes: tuple


def summarize(rows: list, meths: Sequence[Method], last: int = FIT_POINTS) -> dict:
    """{method name: Fit} for the methods with rows."""
    out = {}
    for m in meths:
        rs = sorted((r for r in rows if r["method"] == m.name), key=lambda r: r["n"])
        if not rs:
            continue
        ns = [r["n"] for r in rs]
        fit_ns = tuple(ns[-last:])
        out[m.name] = Fit(fit_exponent(ns, [r["ms"] for r in rs], last),
                          fit_exponent(ns, [r["peak_mb"] for r in rs], last),
                          fit_exponent(fit_ns, [m.cost(n) for n in fit_ns], last), fit_ns)
    return out


def _k(n: int) -> str:
    return f"{n >> 10}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _num(x: float, spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def table(rows: list, meths: Sequence[Method], fits: dict, notes: dict, header: str) -> str:
    """The markdown table: a row per method (its theory, the slope the theory predicts over the
    fitted lengths, the measured slopes of time and memory, the milliseconds at each n, the peak
    memory at its largest n), then the notes."""
    sizes = sorted({r["n"] for r in rows})
    cols = (["method", "time, theory", "slope expected", "time slope", "memory, theory", "memory slope",
             "fitted over n"] + [f"ms @ {_k(n)}" for n in sizes] + ["peak MB (at n)"])
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in meths:
        rs = {r["n"]: r for r in rows if r["method"] == m.name}
        fit = fits.get(m.name)
        if fit is None:
            cells = [m.name, m.theory, "-", "-", m.memory, "-", "-"] + ["-"] * len(sizes) + ["-"]
        else:
            top = rs[max(rs)]
            cells = [m.name, m.theory, _num(fit.expected), _num(fit.time), m.memory, _num(fit.memory),
                     ", ".join(_k(n) for n in fit.sizes)]
            cells += [_ms(rs[n]["ms"]) if n in rs else "-" for n in sizes]
            cells.append("-" if top["peak_mb"] is None else f"{top['peak_mb']:.0f} ({_k(max(rs))})")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {m.name}: {notes[m.name]}" for m in meths if m.name in notes]
    lines += [f"- {m.note}" for m in meths if m.note]
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("method", "theory", "n", "ms", "ms_q1", "ms_q3", "reps", "ms_rounds", "first_ms", "peak_mb",
              "time_slope", "memory_slope", "expected_slope")


def write_csv(path: str, rows: list, meths: Sequence[Method], fits: dict) -> None:
    """One line per (method, n), the method's slopes repeated on each."""
    import csv

    theory = {m.name: m.theory for m in meths}
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            fit = fits[r["method"]]
            w.writerow({**{k: (f"{v:.6g}" if isinstance(v, float) else "" if v is None else v) for k, v in r.items()},
                        "ms_rounds": " ".join(f"{x:.6g}" for x in r["ms_rounds"]), "theory": theory[r["method"]],
                        "time_slope": f"{fit.time:.4g}",
                        "memory_slope": f"{fit.memory:.4g}", "expected_slope": f"{fit.expected:.4g}"})


def plot(rows: list, meths: Sequence[Method], fits: dict, path_stem: str, title: str) -> list:
    """Log-log time against n (PATH_STEM.png) and peak memory against n (PATH_STEM_memory.png),
    one line per method, its fitted slope in the legend, and dashed guides of slope 1 and 2.
    Returns the paths written; [] without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    for field, ylabel, suffix, slope_of, guides in (
            ("ms", "forward + backward, ms (median)", "", lambda f: f.time, (1, 2)),
            ("peak_mb", "peak memory of one call, MiB", "_memory", lambda f: f.memory, (1,))):
        fig, ax = plt.subplots(figsize=(10, 5.5))
        firsts = []
        for m in meths:
            pts = sorted((r["n"], r[field]) for r in rows
                         if r["method"] == m.name and r[field] is not None and r[field] > 0)
            if not pts:
                continue
            firsts.append(pts[0])
            ax.plot(*zip(*pts), marker="os^vD<>ph*"[len(firsts) % 10], ms=4, lw=1.5,
                    ls="-" if len(firsts) <= 10 else "-.", label=f"{m.name} ({_num(slope_of(fits[m.name]))})")
        if not firsts:
            plt.close(fig)
            continue
        ns = sorted({r["n"] for r in rows})
        n0 = min(n for n, _ in firsts)
        y0 = sorted(y for _, y in firsts)[len(firsts) // 2]
        for s in guides:
            ax.plot([n0, ns[-1]], [y0, y0 * (ns[-1] / n0) ** s], ls="--", color="gray", lw=1,
                    label=f"slope {s} (guide)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [_k(n) for n in ns])
        ax.minorticks_off()
        legend = dict(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="method (fitted slope)",
                      title_fontsize=7)
        out.append(_bench.save_figure(fig, ax, f"{path_stem}{suffix}.png", "sequence length n", ylabel, title, 8,
                                      legend))
    return out


def _load() -> str:
    """The 1-minute load average, or "unknown"."""
    import os

    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (OSError, AttributeError):
        return "unknown"


def run(args: "argparse.Namespace", sizes: Optional[Sequence[int]], budget: float) -> int:
    """bench.main's --complexity: the sweep with the parsed arguments (--sizes or SIZES, QUICK_SIZES
    with --quick; --max-n, --budget, --mem-cap, --reps; --threads is set by main), the table printed
    and written to OUT/complexity.md, OUT/complexity.csv and the plots
    OUT/complexity_cpu_float32.png, ..._memory.png."""
    import datetime
    import os

    max_n = args.max_n if args.max_n is not None else max(SIZES)
    lengths = [n for n in (sizes or (QUICK_SIZES if args.quick else SIZES)) if n <= max_n]
    if not lengths:
        print(f"--complexity: no length <= --max-n {max_n}")
        return 2
    mem_cap = MEM_CAP_GIB if args.mem_cap is None else args.mem_cap
    reps = args.reps or REPS
    min_time = min(QUICK_MIN_TIME_S if args.quick else MIN_TIME_S, budget / 10)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    meths = methods()
    load0 = _load()
    t0 = time.perf_counter()
    rows, notes = sweep(meths, lengths, budget=budget, mem_cap_mb=mem_cap * 1024, reps=reps, min_time=min_time,
                        rounds=rounds, progress=not args.no_progress)
    took = time.perf_counter() - t0
    load1 = _load()
    fits = summarize(rows, meths)
    b, h, d = SHAPE
    threads = torch.get_num_threads()
    mem_how = ("the growth of the peak RSS over one call, output included, after freed memory is handed back"
               if _bench._libc_trim() is not None else "not measured here (needs Linux with glibc)")
    header = (f"### Complexity, measured: attention_ext bench --complexity, {datetime.date.today().isoformat()}, "
              f"{_bench.machine_line(threads)} ({_bench.cpu_model()}), float32, B{b} H{h} D{d}, causal "
              f"(Linformer: non-causal)\n\n"
              f"ms: forward + backward (the gradient of out.sum()), the median of {reps} calls and {min_time:g} s "
              f"of calls at least after {1 + WARM_CALLS} warm-up calls (1 call after 1 where the first took over "
              f"{SLOW_S:g} s)"
              + (f", the fastest of {rounds} such medians timed in rounds over every point" if rounds > 1 else "")
              + f"; peak MB: "
              f"{mem_how} (the warm-up call). Slopes: "
              f"least squares of log(time) or log(peak) against log(n) over each method's largest {FIT_POINTS} "
              f"lengths ('fitted over n'); 'slope expected': the theory's over the same lengths. A method stops "
              f"growing n at a call over {budget:g} s (--budget), one predicted to be, or a predicted peak over "
              f"{mem_cap:g} GiB (--mem-cap). Sweep: {took:.0f} s; load average (1 min) {load0} at its start, "
              f"{load1} at its end, on {os.cpu_count()} CPUs: other processes' load slows small calls most (each "
              f"op waits for every thread) and flattens the slopes."
              + (f" GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}." if os.environ.get("GLIBC_TUNABLES") else ""))
    text = table(rows, meths, fits, notes, header)
    print("\n" + text)
    os.makedirs(args.out, exist_ok=True)
    md = os.path.join(args.out, "complexity.md")
    with open(md, "w") as f:
        f.write(text)
    write_csv(os.path.join(args.out, "complexity.csv"), rows, meths, fits)
    title = (f"attention_ext bench --complexity: forward + backward, fp32, B{b} H{h} D{d}, "
             f"{datetime.date.today().isoformat()}\n{_bench.cpu_model()}: {_bench.machine_line(threads)}")
    pngs = plot(rows, meths, fits, os.path.join(args.out, "complexity_cpu_float32"), title)
    print(f"wrote {md}, complexity.csv" + (f" and {', '.join(os.path.basename(p) for p in pngs)}" if pngs else
                                           " (no plot: matplotlib is not installed)") + f" under {args.out}/")
    return 0
