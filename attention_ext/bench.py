"""`python -m attention_ext bench`: each family's kernels against the peers on this machine, over
a sweep of sequence lengths (tables, results.csv and plots: see main()); and the timing helpers
every benchmark shares (benchmarks/common.py re-exports them): one FLOP formula, interleaved
timing (medians, or medians with their spread over as many rounds as the noise needs), and the
machine's ceilings (the peak FLOP/s of a multiply-add loop or a matmul, copy and read bandwidth)."""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from typing import Callable, NamedTuple, Optional

import torch


def allowed_pairs(sq: int, sk: int, causal: bool = False, bottom_right: bool = False, window=(-1, -1)) -> int:
    """Number of (query, key) pairs a query may attend: the work a block-skipping kernel must do."""
    wl, wr = window
    if causal:
        wr = 0 if wr < 0 else min(wr, 0)
    diag = sk - sq if bottom_right else 0
    total = 0
    for i in range(sq):
        lo = 0 if wl < 0 else max(0, i + diag - wl)
        hi = sk - 1 if wr < 0 else min(sk - 1, i + diag + wr)
        total += max(0, hi - lo + 1)
    return total


def layout_pairs(layout, block_size: int, sq: int, sk: int, causal: bool = False) -> float:
    """Allowed (query, key) pairs of a block layout (H or 1, n_qb, n_kb), averaged over its heads:
    the useful work of block-sparse attention (the on blocks, clipped to the lengths and, with
    causal, to the lower triangle)."""
    lay = torch.as_tensor(layout).bool()
    if lay.dim() == 2:
        lay = lay[None]
    rows = torch.arange(sq)
    qb = rows // block_size
    if causal:  # keys j <= i in block c: clamp(i + 1 - c * bs, 0, block width)
        cols0 = torch.arange(lay.shape[2]) * block_size
        width = (torch.clamp(cols0 + block_size, max=sk) - cols0).clamp(min=0)
        per = torch.minimum((rows[:, None] + 1 - cols0[None, :]).clamp(min=0), width[None, :])  # (sq, n_kb)
    else:
        cols0 = torch.arange(lay.shape[2]) * block_size
        per = (torch.clamp(cols0 + block_size, max=sk) - cols0).clamp(min=0)[None, :].expand(sq, -1)
    total = (lay[:, qb, :].double() * per[None].double()).sum()
    return float(total) / lay.shape[0]


def flops(b: int, h: int, sq: int, sk: int, d: int, *, causal: bool = False, bottom_right: bool = False,
          window=(-1, -1), mode: str = "fwd", pairs: Optional[float] = None) -> float:
    """The one FLOP formula every benchmark reports: 2 matmuls (Q K^T, P V) of 2 * D FLOPs per
    allowed pair forward; the backward does 5 such matmuls (2.5x); fwd_bwd = 3.5x. pairs: the
    allowed pairs per (batch, head) when a mask decides them (layout_pairs for a block layout,
    S * k for top-k); else they follow from causal / window."""
    if pairs is None:
        pairs = allowed_pairs(sq, sk, causal, bottom_right, window)
    return flops_from_pairs(b * h * pairs, d, mode=mode)


def flops_from_pairs(pairs: float, d: int, *, mode: str = "fwd") -> float:
    """flops() for any mask (block-sparse layouts, top-k): `pairs` allowed (query, key) pairs in
    all, summed over batch and heads."""
    fwd = 4.0 * d * pairs
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def linear_flops(b: int, h: int, s: int, m: int, dv: int, *, normalize: bool = True, mode: str = "fwd") -> float:
    """The one FLOP formula of linear attention, causal or not, whatever the algorithm (chunked,
    recurrent, two matmuls): each key adds phi(k) v'^T to an M x Dv' state and each query reads
    phi(q)^T S, 2 * M * Dv' FLOPs each (Dv' = Dv + 1 with the normalizer) forward; the backward
    does twice that (dq, and dk / dv through the state's gradient); fwd_bwd = 3x."""
    fwd = 4.0 * b * h * s * m * (dv + 1 if normalize else dv)
    return {"fwd": fwd, "bwd": 2.0 * fwd, "fwd_bwd": 3.0 * fwd}[mode]


def step(f: Callable[..., torch.Tensor], xs, dout: torch.Tensor, mode: str = "fwd") -> Callable[[], None]:
    """A call to time: f(*xs) under no_grad ("fwd"), or f on fresh leaves of xs followed by
    backward(dout) ("fwd_bwd")."""
    def call() -> None:
        if mode == "fwd":
            with torch.no_grad():
                f(*xs)
        else:
            f(*[t.detach().requires_grad_() for t in xs]).backward(dout)
    return call


def bench(fn: Callable[[], object], *, warmup: int = 1, reps: int = 5, min_time: float = 0.0,
          sync: Optional[Callable[[], None]] = None) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Timing(NamedTuple):
    """Seconds per call of one contender over its timed calls: the median, the quartiles (q1, q3),
    the fastest call and the number of calls."""
    median: float
    q1: float
    q3: float
    best: float
    n: int

    @property
    def spread(self) -> float:
        """The interquartile range as a fraction of the median."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0

    @property
    def rse(self) -> float:
        """The median's relative standard error, estimated from the quartiles: a normal sample's
        median has standard error 1.2533 sigma / sqrt(n), and sigma = IQR / 1.349."""
        return 1.2533 * self.spread / 1.349 / math.sqrt(self.n)


def timing(times: list) -> Timing:
    """The Timing of a list of seconds (at least one)."""
    ts = sorted(times)
    q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else (ts[0],) * 3
    return Timing(statistics.median(ts), q1, q3, ts[0], len(ts))


def _round(fns: dict, times: dict, rng: Optional[random.Random], sync, before=None) -> None:
    """One call of every contender, in the given order or in rng's shuffle of it, each appended
    to its list of seconds; before() (untimed) ahead of each call when given."""
    order = list(fns.items())
    if rng is not None:
        rng.shuffle(order)
    for k, fn in order:
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times[k].append(time.perf_counter() - t0)


def interleaved(fns: dict, *, warmup: int = 1, reps: int = 5, sync=None, shuffle: bool = False) -> dict:
    """Median seconds per call of each fn, timed round-robin so noise on a shared machine hits
    every contender alike. shuffle: each round takes the contenders in a seeded random order, so
    none always runs right after the same neighbour. Where a call leaves the caches dirty or cold
    for the next (a bf16 SDPA call writes float32 copies of K / V), a fixed order charges that
    to whoever follows: the decode benchmark's page-16 row, always after SDPA, read 0.74-0.77 of
    contiguous there and 0.92-1.01 in a shuffled A/B (benchmarks/results/2026-11-28-decode-cpu-zen3.md).
    interleaved_stats: the same rounds, as many as the spread needs, with quartiles."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    rng = random.Random(0) if shuffle else None
    for _ in range(reps):
        _round(fns, times, rng, sync)
    return {k: statistics.median(v) for k, v in times.items()}


def interleaved_stats(fns: dict, *, warmup: int = 1, min_reps: int = 5, min_time: float = 0.0, max_reps: int = 1000,
                      budget: float = 10.0, target: float = 0.02, sync=None, shuffle: bool = False,
                      untracked=(), before=None) -> dict:
    """A Timing per fn from rounds as in interleaved(): at least min_reps of them and min_time
    seconds, then more until every contender's median is known to `target` (its relative standard
    error, Timing.rse), the rounds have taken `budget` seconds, or max_reps. A quiet machine stops
    early; a noisy one pays with time instead of with a median that the next run does not repeat.
    min_time spreads the samples of short calls over a while, so that one moment's state of the
    machine (another process, the clock) does not make their median. untracked: names timed in
    every round whose spread does not hold the rounds up (a ceiling read at its best). before: run
    untimed ahead of every call (cache_evictor: each call starts with cold caches)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    rng = random.Random(0) if shuffle else None
    t0 = time.perf_counter()
    while True:
        _round(fns, times, rng, sync, before)
        n = len(next(iter(times.values()))) if times else max_reps
        elapsed = time.perf_counter() - t0
        if n >= max_reps or (n >= min_reps and elapsed >= min_time and (elapsed >= budget or
                                                 all(timing(v).rse <= target for k, v in times.items()
                                                     if k not in untracked))):
            return {k: timing(v) for k, v in times.items()}


def interleaved_warm(fns: dict, *, block: int = 20, rounds: int = 10) -> dict:
    """Median seconds per call of each fn called back to back (`block` calls in a row, so its
    data stays in cache from one call to the next), the blocks taken round-robin over `rounds`
    so noise on a shared machine hits every contender alike. `interleaved` measures the other
    regime: every call after the other contenders have run, its data evicted."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            fn()  # the first call of a block brings the data in
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_ceiling(dtype=torch.float32, n: int = 2048, device="cpu", reps: int = 5) -> float:
    """Measured matmul FLOP/s (the median of reps): the ceiling some per-family scripts read
    attention FLOP/s against. The `bench` command reads them against flop_ceiling()."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device != "cpu" else None
    t = bench(lambda: a @ b, warmup=2, reps=reps, sync=sync)
    return 2.0 * n ** 3 / t


def matmul_best(dtype=torch.float32, n: int = 2048, device="cpu", reps: int = 3) -> float:
    """FLOP/s of the fastest of `reps` n x n matmuls (after one warm-up): the rate torch's own
    GEMM reaches on this machine when nothing disturbs it."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    cuda = str(device).startswith("cuda")
    times = []
    for i in range(reps + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / min(times)


def cpu_peak_flops(kind: str = "fp32_fma", threads: int = 0, seconds: float = 0.3) -> float:
    """FLOP/s of `threads` threads (0: torch.get_num_threads()) doing nothing but the multiply-adds
    the CPU kernels' products run on, at the active ISA level (attention_ext.set_cpu_isa):
    "fp32_fma", float32 FMAs as wide as the level's vectors, "bf16_dot", AVX512-BF16's bf16
    pair dot products (vdpbf16ps), "int8_dot", AVX512-VNNI's byte quad dot products (vpdpbusd,
    integer ops counted as FLOPs: the int8 Q.K^T's ceiling), "int8_amx" or "bf16_amx", AMX's tile
    products (tdpbsud, tdpbf16ps; the "avx512amx" level only: its int8 Q.K^T's and bf16
    products' ceiling). The best of the 1 ms bursts that fit in `seconds` (one at
    least; csrc/peak/cpu): a short burst often finds its cores free on a shared machine, where a
    long one would be sure to share them. 0.0 where the level has no such instruction or the
    extension is not built."""
    from attention_ext import _ext

    if not _ext.HAS_EXT or not hasattr(_ext._C, "cpu_peak_flops"):
        return 0.0
    return float(_ext._C.cpu_peak_flops(kind, int(threads), float(seconds)))


def at_isa_levels(levels):
    """Yields each CPU ISA level of `levels` made active in turn (attention_ext.set_cpu_isa), and
    restores the level active before, however the loop ends: the per-level benchmark scripts."""
    import attention_ext as ae

    old = ae.cpu_isa()
    try:
        for level in levels:
            ae.set_cpu_isa(level)
            yield level
    finally:
        ae.set_cpu_isa(old)


def emit(text: str, out: Optional[str]) -> None:
    """A benchmark's report: printed, and written to `out` when given."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)


FP32_LOOP, BF16_LOOP, BF16_AMX_LOOP = "fp32 FMA loop", "bf16 dot loop", "bf16 AMX loop"
LOOP_KINDS = {FP32_LOOP: "fp32_fma", BF16_LOOP: "bf16_dot", BF16_AMX_LOOP: "bf16_amx"}
INT8_LOOPS = {"int8_dot": "int8 VNNI loop", "int8_amx": "int8 AMX loop"}


def burst_loop(parts: dict) -> Optional[str]:
    """The loop of flop_ceiling's measures (its `parts`) that runs a burst beside every round of
    the `bench` cases, and whose entry those bursts raise: the fastest instruction the active ISA
    level runs for the dtype (AMX tiles, else bf16 dot products, else float32 FMAs); None where no
    loop was measured (CUDA, no extension)."""
    return next((k for k in (BF16_AMX_LOOP, BF16_LOOP, FP32_LOOP) if k in parts), None)


def int8_qk_loop() -> str:
    """The cpu_peak_flops kind of the instruction the int8 Q.K^T runs on at the active ISA level
    (csrc/cpu/q8dot.h): AMX's tdpbsud at "avx512amx", else VNNI's vpdpbusd. Where the level's
    loop lacks the instruction (it gives 0.0) the row is read against its case's ceiling."""
    from attention_ext import _ext

    return "int8_amx" if _ext.cpu_isa() == "avx512amx" else "int8_dot"


def flop_ceiling(dtype: torch.dtype, device="cpu", *, seconds: float = 0.3, n: Optional[int] = None, reps: int = 3,
                 matmul: Callable[..., float] = matmul_best, loop: Callable[..., float] = cpu_peak_flops) -> tuple:
    """The machine's peak FLOP/s for inputs of `dtype`: the highest of the measures that apply.
    CPU: the float32 FMA loop (cpu_peak_flops, on torch's thread count), the bf16 dot-product and
    AMX tile loops for bf16 where the CPU has them, and the best n x n matmul in dtype (n 2048), which is what is
    left without the extension. CUDA: the best n x n matmul in dtype (n 4096; a loop of
    tensor-core instructions is not measured there). A kernel runs on these same instructions, so
    no row can pass its ceiling (a 1024-square matmul, the ceiling once, ran slower than the
    attention kernels on AVX-512). Returns (ceiling, {measure: FLOP/s}), the measures that gave
    nothing (0) left out."""
    cuda = str(device).startswith("cuda")
    n = n or (4096 if cuda else 2048)
    parts = {}
    if not cuda:
        parts[FP32_LOOP] = loop("fp32_fma", torch.get_num_threads(), seconds)
        if dtype == torch.bfloat16:
            parts[BF16_LOOP] = loop("bf16_dot", torch.get_num_threads(), seconds)
            parts[BF16_AMX_LOOP] = loop("bf16_amx", torch.get_num_threads(), seconds)
    parts[f"{n}x{n} matmul"] = matmul(dtype, n, device, reps)
    parts = {k: v for k, v in parts.items() if v > 0}
    return max(parts.values()), parts


def cuda_time(fn: Callable[[], object], warmup: int = 3, reps: int = 10) -> float:
    """Median seconds per call on the current CUDA stream, from one event pair per call."""
    for _ in range(warmup):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return ts[len(ts) // 2] * 1e-3


def copy_bandwidth(nbytes: int = 1 << 28, device="cpu", reps: int = 5) -> float:
    """Measured copy bandwidth in bytes/s (bytes read + written) of one large tensor copy: the
    memory ceiling that the decode kernels' K / V read rate is read against."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    if str(device).startswith("cuda"):
        t = cuda_time(lambda: dst.copy_(src), warmup=3, reps=max(reps, 10))
    else:
        t = bench(lambda: dst.copy_(src), warmup=2, reps=reps)
    return 2.0 * nbytes / t


def decode_bytes(b: int, h_k: int, cache_len: int, d: int, dtype: torch.dtype) -> float:
    """Bytes of K and V one decode step reads: every cached key and value of every kv head once
    (q and out are negligible). cache_len: the keys each sequence attends."""
    return 2.0 * b * h_k * cache_len * d * torch.finfo(dtype).bits / 8


# ---------------------------------------------------------------------------------------------
# The `bench` command: a sequence-length sweep per family and device against the peers present on
# this machine, timed interleaved (every figure is a ratio against a peer of the same run), printed
# as tables and written to DIR/results.csv, DIR/results.md and one plot per (family, device, dtype).

FAMILIES = ("softmax", "linear", "sparse", "decode")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CSV_FIELDS = ("family", "device", "dtype", "impl", "batch", "heads", "kv_heads", "head_dim", "causal", "seq_len",
              "ms", "ms_q1", "ms_q3", "spread", "reps", "tflops", "gbps", "peak_mem_mb", "ratio", "share", "ceiling",
              "tokens_s", "cpu_isa", "threads")

# (B, H, H_k, D) per family and device kind
SHAPES = {
    "softmax": {"cpu": (1, 8, 8, 64), "cuda": (2, 16, 16, 128)},
    "linear": {"cpu": (1, 8, 8, 64), "cuda": (2, 16, 16, 128)},
    "sparse": {"cpu": (1, 8, 8, 64), "cuda": (2, 16, 16, 128)},
    "decode": {"cpu": (4, 32, 8, 128), "cuda": (8, 32, 8, 128)},
}
# sequence lengths (the KV-cache length for decode): (full, --quick) per family and device kind;
# --quick keeps the whole CPU run of the four families under a minute on 2 cores
LENGTHS = {
    "softmax": {"cpu": ((256, 512, 1024, 2048, 4096), (256, 1024)),
                "cuda": ((512, 1024, 2048, 4096, 8192, 16384), (1024, 4096))},
    "linear": {"cpu": ((1024, 2048, 4096, 8192, 16384), (1024, 4096)),
               "cuda": ((1024, 2048, 4096, 8192, 16384, 32768), (2048, 8192))},
    "sparse": {"cpu": ((1024, 2048, 4096, 8192), (1024, 2048)),
               "cuda": ((2048, 4096, 8192, 16384, 32768), (4096, 16384))},
    "decode": {"cpu": ((1024, 2048, 4096, 8192, 16384), (1024, 4096)),
               "cuda": ((4096, 8192, 16384, 32768, 65536), (4096, 32768))},
}
SPARSE_BLOCK = 64
LINEAR_CHUNK = 64  # the torch chunked peer's chunk (benchmarks/linear/bench_cpu.py's peer)
DECODE_PAGE = 16
MATH_MAX_BYTES = 4 << 30  # SDPA math materializes the (B, H, S, S) scores: left out beyond 4 GiB of them
# timing per case (interleaved_stats): at least MIN_REPS rounds and MIN_TIME seconds (QUICK_MIN_TIME
# with --quick), then more until every median's relative standard error is within TARGET_RSE or
# BUDGET seconds (QUICK_BUDGET) pass
MIN_REPS, TARGET_RSE = 5, 0.02
MIN_TIME, BUDGET, QUICK_MIN_TIME, QUICK_BUDGET = 2.5, 10.0, 2.5, 5.0


def sparse_layout(s: int, heads: int, block_size: int = SPARSE_BLOCK, causal: bool = False) -> torch.Tensor:
    """The sparse family's benchmark layout (heads, S / bs, S / bs): BigBird with a 2-block window
    on each side, 1 global block and 2 random blocks per row, so that each query attends a fixed
    number of keys (about 8 blocks) whatever S: the work grows linearly, dense attention's
    quadratically."""
    from attention_ext import sparse

    return sparse.bigbird(window_blocks=2, n_global=1, n_random=2, seed=0, seq_len=s, block_size=block_size,
                          heads=heads, causal=causal)


class Contenders(NamedTuple):
    """One case's contenders: fns (name -> zero-argument call), the Flex ones among them (their
    first call compiles), the work of one call (FLOPs, or bytes for decode) in `unit` ("tflops" /
    "gbps"), and how to bring each output to ours' layout for the agreement check (name -> function;
    None: not expected to agree, e.g. dense attention against a sparse layout; absent: as is).
    work_of: the work of the contenders whose call does a different amount (name -> work; the
    8-bit caches read fewer bytes). peak_of: the contenders that run on another instruction than
    the case's ceiling counts (name -> a cpu_peak_flops kind: the int8 Q.K^T's int8_qk_loop()),
    whose ceiling is the higher of the two."""
    fns: dict
    flex: list
    work: float
    unit: str
    convert: dict
    work_of: Optional[dict] = None
    peak_of: Optional[dict] = None


def _bshd(o):
    """A (B, S, H, D) output (flash-attn's layout) as (B, H, S, D), a view."""
    return o.transpose(1, 2)


class Peers:
    """What one device offers besides our kernels, probed once: the SDPA backends, compiled
    FlexAttention (given up for the rest of the run when it fails or its first compile takes
    longer than `flex_budget` seconds), flash-attn and fla."""

    def __init__(self, device: str, *, flex: bool, flex_reason: str, flex_budget: float):
        import importlib.util

        self.device = device
        self.cuda = device.startswith("cuda")
        self.flex_on, self.flex_reason, self.flex_budget = flex, flex_reason, flex_budget
        self._flex = {}
        self.flash_attn = self.cuda and importlib.util.find_spec("flash_attn") is not None
        self.fla = self.cuda and importlib.util.find_spec("fla") is not None

    def flex(self, family: str):
        """torch.compile(flex_attention), one per family, with static shapes: a dynamic-shape
        recompile fails to build on the CPU for block masks."""
        if family not in self._flex:
            from torch.nn.attention.flex_attention import flex_attention

            self._flex[family] = torch.compile(flex_attention, dynamic=False)
        return self._flex[family]

    def sdpa_backends(self) -> dict:
        """SDPA as a user would call it: the default dispatch on the CPU (plus the math backend,
        the unfused reference); on CUDA each backend pinned with sdpa_kernel."""
        from torch.nn.attention import SDPBackend

        if not self.cuda:
            return {"sdpa": None, "sdpa math": SDPBackend.MATH}
        out = {"sdpa flash": SDPBackend.FLASH_ATTENTION, "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa math": SDPBackend.MATH}
        if hasattr(SDPBackend, "CUDNN_ATTENTION"):
            out["sdpa cudnn"] = SDPBackend.CUDNN_ATTENTION
        return out


def _sdpa(q, k, v, backend, **kw):
    """F.scaled_dot_product_attention, pinned to `backend` when one is given."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if backend is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return run


def _try(setup: Callable[[], Callable[[], object]]) -> Callable[[], object]:
    """An optional peer's call from setup(); when its setup fails (an import, a mask), a call that
    raises the same error, so that the first-call screening drops it with a note and the case
    keeps its other contenders."""
    try:
        return setup()
    except Exception as e:  # noqa: BLE001 - reported by the screening
        def fail(e=e):
            raise e
        return fail


def _softmax_case(p: Peers, b, h, hk, s, d, dtype, causal):
    """ae.attention against SDPA (each backend), FlexAttention and flash-attn; q, k, v (B, H, S, D)
    contiguous, the layout SDPA and Flex read best (flash-attn gets its own (B, S, H, D) copies)."""
    import attention_ext as ae

    dev = p.device
    q = torch.randn(b, h, s, d, dtype=dtype, device=dev)
    k, v = (torch.randn(b, hk, s, d, dtype=dtype, device=dev) for _ in range(2))
    gqa = hk != h
    fns = {"ours": lambda: ae.attention(q, k, v, causal=causal)}
    # the 8-bit Q.K^T: int8 on every device, fp8 on sm_90 (its only kernel). Where the device's
    # kernel refuses the call (its NotImplementedError) the row is screened out with that note:
    # the reference attention() would fall back to is not a contender
    quant = ["int8"] + (["fp8"] if p.cuda and torch.cuda.get_device_capability(dev)[0] == 9 else [])
    for fmt in quant:
        def quant_setup(fmt=fmt):
            from .softmax import ops as softmax_ops

            softmax_ops.fwd_quant(q[:, :, :1], k, v, qk_quant=fmt)  # raises where no kernel takes it
            return lambda: ae.attention(q, k, v, causal=causal, qk_quant=fmt)
        fns[f"ours {fmt} qk"] = _try(quant_setup)
    for name, backend in p.sdpa_backends().items():
        if name == "sdpa math" and b * h * s * s * 4 > MATH_MAX_BYTES:
            continue  # noted by the caller
        fns[name] = _sdpa(q, k, v, backend, is_causal=causal, enable_gqa=gqa)
    flex = []
    if p.flex_on:
        def flex_setup():
            bm = None
            if causal:
                from torch.nn.attention.flex_attention import create_block_mask

                bm = create_block_mask(lambda b_, h_, i, j: j <= i, None, None, s, s, device=dev)
            return lambda: p.flex("softmax")(q, k, v, block_mask=bm, enable_gqa=gqa)
        fns["flex"] = _try(flex_setup)
        flex.append("flex")
    if p.flash_attn:
        def fa_setup():
            from flash_attn import flash_attn_func

            qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            return lambda: flash_attn_func(qb, kb, vb, causal=causal)
        fns["flash-attn"] = _try(fa_setup)
    # the 8-bit rows agree with ours to their quantization, not to the tolerance
    return Contenders(fns, flex, flops(b, h, s, s, d, causal=causal), "tflops",
                      {"flash-attn": _bshd, "ours int8 qk": None, "ours fp8 qk": None},
                      peak_of={"ours int8 qk": int8_qk_loop()})


def _linear_case(p: Peers, b, h, hk, s, d, dtype, causal):
    """Causal linear attention (elu + 1 features, normalized) against the chunked PyTorch form
    (attention_ext.linear.reference.chunked, chunk 64: one batched matmul per chunk and an
    exclusive cumsum of the chunk states) and fla's chunk_linear_attn on CUDA."""
    import attention_ext as ae
    from attention_ext.linear import reference

    dev = p.device
    q = torch.randn(b, h, s, d, dtype=dtype, device=dev)
    k, v = (torch.randn(b, hk, s, d, dtype=dtype, device=dev) for _ in range(2))
    fns = {"ours": lambda: ae.linear_attention(q, k, v, causal=True, feature_map="elu"),
           "torch chunked": lambda: reference.chunked(q, k, v, causal=True, feature_map=1, chunk=LINEAR_CHUNK)}
    if p.fla:
        def fla_setup():
            import torch.nn.functional as F
            from fla.ops.linear_attn import chunk_linear_attn

            # fla takes featurized (B, S, H, D) inputs; the feature map is the user's, outside the timing
            qf, kf = ((F.elu(t) + 1).transpose(1, 2).contiguous() for t in (q, k.repeat_interleave(h // hk, 1)))
            vf = v.repeat_interleave(h // hk, 1).transpose(1, 2).contiguous()
            return lambda: chunk_linear_attn(qf, kf, vf, scale=1.0, normalize=True)
        fns["fla"] = _try(fla_setup)
    return Contenders(fns, [], linear_flops(b, h, s, d, d), "tflops", {"fla": _bshd})


def _sparse_case(p: Peers, b, h, hk, s, d, dtype, causal):
    """Block-sparse attention on sparse_layout() against dense SDPA (all pairs: what the layout
    saves) and FlexAttention with the equivalent BlockMask (Flex's default 128 blocks). TFLOP/s of
    every row count the layout's useful pairs (layout_pairs), so they read as time ratios."""
    import attention_ext as ae

    dev = p.device
    bs = SPARSE_BLOCK
    lay = sparse_layout(s, h, bs, causal).to(dev)
    q = torch.randn(b, h, s, d, dtype=dtype, device=dev)
    k, v = (torch.randn(b, hk, s, d, dtype=dtype, device=dev) for _ in range(2))
    gqa = hk != h
    fns = {"ours": lambda: ae.block_sparse_attention(q, k, v, lay, block_size=bs, causal=causal)}
    fns["sdpa dense"] = _sdpa(q, k, v, None, is_causal=causal, enable_gqa=gqa)  # the dispatcher's pick
    flex = []
    if p.flex_on:
        def flex_setup():
            from torch.nn.attention.flex_attention import create_block_mask

            def mask_mod(b_, hh, i, j):
                on = lay[hh, i // bs, j // bs]
                return (on & (j <= i)) if causal else on

            bm = create_block_mask(mask_mod, None, h, s, s, device=dev)
            return lambda: p.flex("sparse")(q, k, v, block_mask=bm, enable_gqa=gqa)
        fns["flex block mask"] = _try(flex_setup)
        flex.append("flex block mask")
    pairs = layout_pairs(lay.cpu(), bs, s, s, causal)
    return Contenders(fns, flex, flops(b, h, s, s, d, pairs=pairs), "tflops", {"sdpa dense": None})


def _decode_case(p: Peers, b, h, hk, s, d, dtype, causal):
    """One decode step (q_len 1) over a cache of S keys: decode_fwd on a contiguous (B, S, H_k, D)
    cache and on a paged one (16-token pages in shuffled order), on the CPU also over int8 and
    fp8 e4m3 caches (per-row descales, quantize_kv's "token"), against SDPA with enable_gqa on a
    contiguous (B, H_k, S, D) cache (its best layout) and flash-attn's flash_attn_with_kvcache on
    CUDA. GB/s of K / V read (decode_bytes; the 8-bit rows: their bytes and descales)."""
    import torch.nn.functional as F

    from attention_ext.decode import decode_fwd, quantize_kv

    dev = p.device
    q = torch.randn(b, 1, h, d, dtype=dtype, device=dev)
    kc, vc = (torch.randn(b, s, hk, d, dtype=dtype, device=dev) for _ in range(2))
    lens = torch.full((b,), s, dtype=torch.int32, device=dev)
    n = -(-s // DECODE_PAGE)  # pages per sequence, the last one filled to S only (cache_seqlens)
    bt = torch.randperm(b * n, device=dev).view(b, n).int()
    kp, vp = (torch.zeros(b * n, DECODE_PAGE, hk, d, dtype=dtype, device=dev) for _ in range(2))
    tail = (0, 0, 0, 0, 0, n * DECODE_PAGE - s)  # F.pad's (D, H_k, S) pairs: S padded to whole pages
    kp[bt.flatten().long()] = F.pad(kc, tail).reshape(b * n, DECODE_PAGE, hk, d)
    vp[bt.flatten().long()] = F.pad(vc, tail).reshape(b * n, DECODE_PAGE, hk, d)
    qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
    scale = d ** -0.5
    fns = {"ours": lambda: decode_fwd(q, kc, vc, cache_seqlens=lens, scale=scale),
           f"ours paged {DECODE_PAGE}": lambda: decode_fwd(q, kp, vp, cache_seqlens=lens, block_table=bt,
                                                           scale=scale),
           "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, scale=scale, enable_gqa=hk != h)}
    work_of, convert = {}, {"sdpa": _bshd}
    if not p.cuda:  # CUDA runs 8-bit caches through the dequantized reference: not a contender yet
        for qdt, name in ((torch.int8, "ours int8 cache"), (torch.float8_e4m3fn, "ours fp8 cache")):
            (k8, kd), (v8, vd) = quantize_kv(kc, qdt, "token"), quantize_kv(vc, qdt, "token")
            fns[name] = (lambda k8=k8, v8=v8, kd=kd, vd=vd:
                         decode_fwd(q, k8, v8, cache_seqlens=lens, scale=scale, k_descale=kd, v_descale=vd))
            work_of[name] = sum(t.numel() * t.element_size() for t in (k8, v8, kd, vd))
            convert[name] = None  # agrees with ours to its quantization, not to the tolerance
    if p.flash_attn:
        def fa_setup():
            from flash_attn import flash_attn_with_kvcache

            return lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, softmax_scale=scale)
        fns["flash-attn"] = _try(fa_setup)
    # ours and flash-attn give (B, 1, H, D) (decode_fwd with its LSE), SDPA (B, H, 1, D)
    return Contenders(fns, [], decode_bytes(b, hk, s, d, dtype), "gbps", convert, work_of)


CASES = {"softmax": _softmax_case, "linear": _linear_case, "sparse": _sparse_case, "decode": _decode_case}


def _rss_mb(key: str) -> float:
    """A line of /proc/self/status (VmRSS:, VmHWM:) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024.0
    raise KeyError(key)


def _libc_trim() -> Optional[Callable[[], object]]:
    """glibc's malloc_trim(0) where the CPU peak can be measured (Linux, a writable
    /proc/self/clear_refs), else None."""
    import ctypes

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    return lambda: trim(0)


def _cpu_peak_mb(fn: Callable[[], object], trim: Callable[[], object]) -> float:
    """Peak resident memory one CPU call adds, output included: the peak-RSS mark (VmHWM) reset
    to the current RSS (/proc/self/clear_refs 5) and read after the call. Freed memory that the
    process still holds would be reused unseen, so the extension's huge-page cache is emptied and
    glibc's free pages are handed back (malloc_trim) first: what remains resident is what is live.
    Repeats within 1 MiB (SDPA math at S=4096, B1 H8: 1168 MiB, its two S x S matrices)."""
    import gc

    from attention_ext import _ext

    gc.collect()
    _ext.empty_cpu_cache()
    trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_mb("VmRSS:")
    fn()
    return max(0.0, _rss_mb("VmHWM:") - base)


def _peak_mb(fn: Callable[[], object], device: str) -> float:
    """Peak CUDA memory one call allocates beyond what was allocated before it, output included."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _same(o):
    return o


def _is_ours(impl: str) -> bool:
    return impl == "ours" or impl.startswith("ours ")


CEIL_COPY, CEIL_READ, CEIL_PEAK = "(copy)", "(read)", "(peak loop)"


def llc_bytes() -> int:
    """The CPU's last-level cache per core complex in bytes (sysfs), or 32 MiB where unknown."""
    best = 0
    for idx in range(8):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{idx}/size") as f:
                txt = f.read().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
        try:
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best or 32 << 20


def cache_evictor(device="cpu") -> Optional[Callable[[], object]]:
    """A call that reads twice the last-level cache's bytes (CPU; None elsewhere), so that the next
    call finds none of its data cached. A decode step reads K / V that other layers' weights and
    caches evicted since the last step; and where K / V is about the size of the cache (B4 H_k 8
    D128 at S 1024: 34 MB against Zen 5's 32 MB L3), which part of it the previous contender left
    cached made the timings bimodal (IQR 16-26%) and the medians of two runs 16-25% apart."""
    if torch.device(device).type != "cpu":
        return None
    buf = torch.ones(2 * llc_bytes() // 4, dtype=torch.float32)
    return lambda: buf.sum()


def bandwidth_fns(nbytes: float, device="cpu") -> dict:
    """The memory ceiling of a case that reads `nbytes` (a decode step's K / V), as two more
    contenders of its interleaved timing, so that noise moves it with the others, on a buffer of
    as many bytes, so that it sits in the same level of the cache hierarchy as K / V: a copy of the
    buffer's first half into another (bytes read + written, copy_bandwidth's measure) and a read
    of the whole buffer (torch's sum). A decode step only reads, and a read streams faster than a
    copy, whose writes cost a read for ownership too, so the ceiling is the faster of the two,
    each at its best call. Returns {name: (fn, bytes one call moves)}."""
    n = max(2, int(nbytes) // 4)
    buf = torch.ones(n, dtype=torch.float32, device=device)
    half = buf[: n // 2]
    dst = torch.empty_like(half)
    return {CEIL_COPY: ((lambda: dst.copy_(half)), 8.0 * (n // 2)), CEIL_READ: ((lambda: buf.sum()), 4.0 * n)}


def run_case(p: Peers, family: str, shape: tuple, s: int, dtype: torch.dtype, causal: bool, timing_kw: dict,
             notes: dict, flop_peak: Optional[float] = None, peak_kind: Optional[str] = None,
             peak_rates: Optional[list] = None) -> list:
    """Times every contender of one case interleaved (interleaved_stats with timing_kw); returns one
    CSV row (dict) per contender. A contender whose first call fails is dropped with a note; so is
    Flex for the rest of the run when its first compile exceeds the budget. The ceiling: flop_peak
    (flop_ceiling) for FLOP/s, the best copy or read of the case's bytes (bandwidth_fns) for GB/s.
    peak_kind: a CPU peak loop (cpu_peak_flops) that also runs one burst per round, its rates
    appended to peak_rates: the caller's ceiling is then the best of the whole run's bursts, which
    a moment of load on a shared machine cannot pull down."""
    b, h, hk, d = shape
    dev = p.device
    sync = (lambda: torch.cuda.synchronize(dev)) if p.cuda else None
    with torch.no_grad():
        if p.flex_on and family in ("softmax", "sparse"):
            # every length compiles Flex anew (static shapes); torch caps the compiles per function
            # (recompile_limit, 8) and runs the eager, unfused Flex beyond it: start each case afresh
            torch._dynamo.reset()
        fns, flex_names, work, unit, convert, work_of, peak_of = CASES[family](p, b, h, hk, s, d, dtype, causal)
        work_of, peak_of = work_of or {}, peak_of or {}
        outs = {}
        for name in list(fns):  # the first call: compiles Flex, and screens out what cannot run here
            t0 = time.perf_counter()
            try:
                out = fns[name]()
                if sync is not None:
                    sync()
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is skipped, not fatal
                notes[name] = f"{name}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
                del fns[name]
                if name in flex_names:
                    p.flex_on, p.flex_reason = False, notes[name]
                continue
            took = time.perf_counter() - t0
            if name in flex_names and took > p.flex_budget:
                p.flex_on = False
                p.flex_reason = f"flex: compile took {took:.0f} s (> --flex-budget {p.flex_budget:.0f} s); skipped after S={s}"
            if convert.get(name, _same) is not None:
                out = out[0] if isinstance(out, tuple) else out
                outs[name] = convert.get(name, _same)(out).float()
            del out
        # the contenders compute the same thing: a peer set up wrong would make every ratio a lie
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        ref = outs.get("ours")
        for name, o in outs.items():
            err = (o - ref).abs().max().item() if ref is not None and o.shape == ref.shape else float("inf")
            if ref is not None and not err <= tol:
                notes[f"{name} differs"] = (f"{name}: output differs from ours (max abs diff {err:.3g} at S={s}, "
                                            f"tolerance {tol:g}); its row is not a like-for-like comparison")
        del outs, ref
        if p.cuda:
            peak = {n: _peak_mb(fn, dev) for n, fn in fns.items()}
        else:
            trim = _libc_trim()
            peak = {n: _cpu_peak_mb(fn, trim) for n, fn in fns.items()} if trim is not None else {}
        extra = bandwidth_fns(work, dev) if unit == "gbps" else {}
        if peak_kind is not None:
            threads = torch.get_num_threads()
            extra[CEIL_PEAK] = (lambda: peak_rates.append(cpu_peak_flops(peak_kind, threads, 1e-3))), 0.0
        # decode: a seeded random order per round, as a fixed one charges SDPA's cache traffic to the
        # contender after it (interleaved's docstring), and every call from cold caches
        # (cache_evictor), as in a model's decode step
        t = interleaved_stats({**fns, **{k: f for k, (f, _) in extra.items()}}, sync=sync, untracked=set(extra),
                              shuffle=family == "decode", before=cache_evictor(dev) if family == "decode" else None,
                              **timing_kw)
        t.pop(CEIL_PEAK, None)
        ceiling = max(nb / t.pop(k).best for k, (_, nb) in extra.items() if k != CEIL_PEAK) if unit == "gbps" else \
            max([flop_peak, *(peak_rates or [])])
    # a row on another instruction (the int8 dot products): the higher of its loop and the case's
    # ceiling; the note names the loop, which the table's header (the dtype's measures) does not
    row_ceiling = {}
    for n, kind in peak_of.items():
        if n in t and not p.cuda:
            rate = cpu_peak_flops(kind, torch.get_num_threads(), 0.2)
            row_ceiling[n] = max(ceiling, rate)
            if rate > 0:
                notes[f"ceiling {n}"] = (f"{n}: 'of ceiling' is of the {INT8_LOOPS.get(kind, kind)} ({kind}: its "
                                         f"instruction at this ISA level), the higher of it and the header's peak "
                                         f"(results.csv's ceiling column)")
    peers = [x.median for n, x in t.items() if not _is_ours(n)]
    best = min(peers) if peers else float("nan")
    rows = []
    for name, tm in t.items():
        rate = work_of.get(name, work) / tm.median
        rows.append({
            "family": family, "device": dev, "dtype": str(dtype).replace("torch.", ""), "impl": name,
            "batch": b, "heads": h, "kv_heads": hk, "head_dim": d, "causal": causal if family != "decode" else "",
            "seq_len": s, "ms": tm.median * 1e3, "ms_q1": tm.q1 * 1e3, "ms_q3": tm.q3 * 1e3, "spread": tm.spread,
            "reps": tm.n, "tflops": rate / 1e12 if unit == "tflops" else "",
            "gbps": rate / 1e9 if unit == "gbps" else "",
            "peak_mem_mb": peak.get(name, ""), "ratio": best / tm.median,
            "share": rate / row_ceiling.get(name, ceiling),
            "ceiling": row_ceiling.get(name, ceiling) / (1e12 if unit == "tflops" else 1e9),
            "tokens_s": b / tm.median if family == "decode" else "",  # one new token per sequence a call
            # the CPU rows' ISA level and threads (a CUDA row's ceiling and time do not depend on them)
            "cpu_isa": "" if p.cuda else cpu_isa_name(), "threads": "" if p.cuda else torch.get_num_threads(),
        })
    return rows


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, float) else str(x)


def table(rows: list, header: str, notes: list) -> str:
    """One markdown table of a (family, device, dtype) group, S by S: the median time of each
    contender, its spread (interquartile range over median), its rate and share of the ceiling."""
    decode = rows[0]["family"] == "decode"
    mem = any(r["peak_mem_mb"] != "" for r in rows)
    rate = "GB/s" if decode else "TFLOP/s"
    cols = ["S", "impl", "ms", "IQR", rate, "of ceiling"] + (["tokens/s"] if decode else []) + \
        (["peak MB"] if mem else []) + ["vs fastest peer"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [str(r["seq_len"]), r["impl"], _fmt(r["ms"], ".3f"), _fmt(r["spread"], ".0%"),
                 _fmt(r["gbps"], ".1f") if decode else _fmt(r["tflops"], ".4f"), _fmt(r["share"], ".0%")]
        cells += [_fmt(r["tokens_s"], ".0f")] if decode else []
        cells += [_fmt(r["peak_mem_mb"], ".1f")] if mem else []
        cells.append("-" if r["ratio"] != r["ratio"] else f"{r['ratio']:.2f}x")  # NaN: no peer ran
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    return "\n".join(lines)


def plot(rows: list, path_stem: str) -> list:
    """Throughput (TFLOP/s, GB/s for decode) against S, one line per contender, the median with a
    bar over the interquartile range, under the ceiling; and peak memory against S where it was
    measured. Returns the PNG paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    r0 = rows[0]
    decode = r0["family"] == "decode"
    key, label = (("gbps", "GB/s of K / V read") if decode else
                  ("tflops", "TFLOP/s (useful pairs)" if r0["family"] == "sparse" else "TFLOP/s"))
    title = (f"{r0['family']} · {r0['device']} · {r0['dtype']} · B{r0['batch']} H{r0['heads']}"
             f"{'' if r0['kv_heads'] == r0['heads'] else ' Hkv' + str(r0['kv_heads'])} D{r0['head_dim']}")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    out = []
    panels = [(key, label, "")] + ([("peak_mem_mb", "peak memory of one call, output included (MiB)", "_memory")]
                                   if any(r["peak_mem_mb"] != "" for r in rows) else [])
    for field, ylabel, suffix in panels:
        fig, ax = plt.subplots(figsize=(6, 4))
        for impl in impls:
            pts = [r for r in rows if r["impl"] == impl and r[field] != ""]
            if not pts:
                continue
            xs, ys = [r["seq_len"] for r in pts], [r[field] for r in pts]
            if suffix:
                ax.plot(xs, ys, marker="o", lw=2.5 if _is_ours(impl) else 1.5, label=impl)
                continue
            # the rate at the time quartiles: a bar from the slower quarter's rate to the faster's
            lo = [max(0.0, y - y * r["ms"] / r["ms_q3"]) for y, r in zip(ys, pts)]
            hi = [max(0.0, y * r["ms"] / r["ms_q1"] - y) for y, r in zip(ys, pts)]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, lw=2.5 if _is_ours(impl) else 1.5, label=impl)
        if not suffix:  # the ceiling, dashed: the machine's peak, or the copy / read beside each case
            pts = sorted({r["seq_len"]: r["ceiling"] for r in rows}.items())
            ax.plot(*zip(*pts), ls="--", color="gray",
                    label="best copy / read (ceiling)" if decode else "peak (ceiling)")
        ax.set_xscale("log", base=2)
        lengths = sorted({r["seq_len"] for r in rows})
        ax.set_xticks(lengths, [str(x) for x in lengths])
        ax.minorticks_off()
        if suffix:
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        xlabel = "KV-cache length" if decode else "sequence length S"
        out.append(save_figure(fig, ax, f"{path_stem}{suffix}.png", xlabel, ylabel, title, 10, dict(fontsize=8)))
    return out


def save_figure(fig, ax, path: str, xlabel: str, ylabel: str, title: str, title_size: int, legend: dict) -> str:
    """The benchmark plots' common finish: labels, title, grid and legend (`legend`: matplotlib's
    legend keywords), then the PNG at `path`, the figure closed. Returns path."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first "model name"), else platform.processor(), else
    "unknown"."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_isa_name() -> str:
    """The ISA level the CPU kernels run (attention_ext.cpu_isa()), or "(extension not built)"."""
    from attention_ext import _ext

    return _ext.cpu_isa() if _ext.HAS_EXT else "(extension not built)"


def machine_line(threads: int, gpu: bool = False) -> str:
    """"torch V, CPU <arch> <ISA level>, N threads[, GPU <name>]": the machine every table's header
    names (the ISA level the CPU kernels run, attention_ext.cpu_isa())."""
    import platform

    return (f"torch {torch.__version__}, CPU {platform.machine()} {cpu_isa_name()}, {threads} threads"
            + (f", GPU {torch.cuda.get_device_name()}" if gpu else ""))


def main(argv=None) -> int:
    """`python -m attention_ext bench`: see the parser's help."""
    from attention_ext._cli import check_out_dir

    cuda_ok = torch.cuda.is_available()
    ap = argparse.ArgumentParser(
        prog="python -m attention_ext bench",
        description="Sequence-length sweeps of each kernel family against the peers on this machine (torch "
                    "SDPA, FlexAttention, flash-attn, fla), timed interleaved in the same run: a table per "
                    "(family, device, dtype), DIR/results.csv, DIR/results.md and PNG plots. Peak memory of one "
                    "call, output included: torch.cuda.max_memory_allocated on CUDA; on the CPU the growth "
                    "of the peak RSS after freed memory is handed back (Linux with glibc; elsewhere the "
                    "CPU rows leave it empty).",
        epilog="Peers: softmax: SDPA (CPU: default and math; CUDA: flash, efficient, math, cuDNN, each pinned), "
               "compiled Flex, flash-attn; linear (causal, elu features): the chunked PyTorch form "
               "(attention_ext.linear.reference.chunked), fla; sparse (BigBird layout, block 64): dense SDPA, "
               "Flex with the equivalent BlockMask; decode (q_len 1): SDPA with enable_gqa on a contiguous "
               "(B, H_k, S, D) cache, flash-attn's flash_attn_with_kvcache. A peer that is missing, fails, or "
               "disagrees with ours is named in a note under its table.")
    ap.add_argument("--family", default="all", choices=FAMILIES + ("all",))
    ap.add_argument("--device", default="all", choices=("cpu", "cuda", "all"),
                    help="all: the CPU and, when present, CUDA")
    ap.add_argument("--dtype", default=None,
                    help="comma list of fp32, bf16, fp16 (default: fp32 on the CPU, bf16 on CUDA)")
    ap.add_argument("--quick", action="store_true",
                    help=f"two lengths per family, {QUICK_MIN_TIME:g}-{QUICK_BUDGET:g} s of timing per case, no Flex "
                         f"on the CPU")
    ap.add_argument("--sizes", default=None, help="comma list of lengths replacing every family's sweep")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads of the run (torch.set_num_threads: the kernels, the peers and the ceiling's "
                         "FMA loop all use it; default: torch's)")
    ap.add_argument("--reps", type=int, default=None,
                    help=f"interleaved rounds per case at least (default {MIN_REPS}); more follow while a median is "
                         f"known only to worse than {TARGET_RSE * 100:g}%% and the case's --budget lasts")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds of timing per case after which no more rounds start (default {BUDGET:g}, "
                         f"--quick {QUICK_BUDGET:g}); rounds go on for {MIN_TIME:g} s at least ({QUICK_MIN_TIME:g} "
                         f"s with --quick), or the budget where it is shorter")
    ap.add_argument("--causal", action="store_true",
                    help="causal softmax and sparse (linear is always causal; decode has no mask)")
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention out of every family")
    ap.add_argument("--flex-budget", type=float, default=60.0,
                    help="seconds a FlexAttention compile may take before Flex is left out of the rest of the run "
                         "(default %(default)g)")
    ap.add_argument("--out", default="bench_out", help="directory of results.csv, results.md and the PNGs")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (tqdm) over the cases")
    ap.add_argument("--decode", action="store_true", help="alias of --family decode")
    ap.add_argument("--complexity", action="store_true",
                    help="the complexity table, measured (attention_ext.complexity): forward + backward time and "
                         "peak memory of every attention (and torch's GRU) for n = 1k ... 64k on the CPU in fp32, "
                         "each one's growth exponents fitted over its largest 3 lengths beside its theory: "
                         "DIR/complexity.md, complexity.csv, complexity_cpu_float32.png. --sizes, --quick (1k-8k), "
                         "--max-n, --reps (calls per length, default 3, and 1 s of calls at least: 0.25 with --quick, "
                         "at most a tenth of --budget), --budget (the seconds one call may take before a method "
                         f"stops growing n, default {BUDGET:g}, {QUICK_BUDGET:g} with --quick), --mem-cap, --threads, "
                         "--out apply")
    ap.add_argument("--max-n", type=int, default=None, help="--complexity: the longest length (default 65536)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="--complexity: timing rounds over every (method, n), each length keeping its fastest "
                         "round's median, so that a burst of load has to hit it in every round (default 2, 1 with "
                         "--quick)")
    ap.add_argument("--mem-cap", type=float, default=None,
                    help="--complexity: GiB of predicted peak memory past which a method stops growing n (default 8)")
    args = ap.parse_args(argv)

    if args.decode and args.family not in ("all", "decode"):
        ap.error(f"--decode is --family decode: it does not combine with --family {args.family}")
    families = ("decode",) if args.decode else FAMILIES if args.family == "all" else (args.family,)
    if args.device == "cuda" and not cuda_ok:
        ap.error("--device cuda: no CUDA device visible")
    devices = ["cpu", "cuda"] if args.device == "all" and cuda_ok else ["cpu"] if args.device == "all" else [args.device]
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads: at least 1, got {args.threads}")
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps: at least 1, got {args.reps}")
    if args.budget is not None and args.budget < 0:
        ap.error(f"--budget: seconds >= 0, got {args.budget}")
    budget = args.budget if args.budget is not None else QUICK_BUDGET if args.quick else BUDGET
    timing_kw = dict(min_reps=args.reps or MIN_REPS, target=TARGET_RSE, budget=budget,
                     min_time=min(budget, QUICK_MIN_TIME if args.quick else MIN_TIME))
    try:
        sizes = tuple(int(x) for x in args.sizes.split(",")) if args.sizes is not None else None
    except ValueError:
        ap.error(f"--sizes takes comma-separated lengths, e.g. 1024,4096, got {args.sizes!r}")
    if sizes is not None and (not sizes or min(sizes) < 1):
        ap.error(f"--sizes: lengths >= 1, got {args.sizes!r}")
    names = (args.dtype or "").split(",")
    bad = [x for x in names if x not in DTYPES] if args.dtype is not None else []
    if bad:
        ap.error(f"--dtype: unknown {', '.join(repr(x) for x in bad)} (comma-separated, from {', '.join(DTYPES)})")
    alone = [f for f, v in (("--max-n", args.max_n), ("--rounds", args.rounds), ("--mem-cap", args.mem_cap))
             if v is not None]
    if alone and not args.complexity:
        ap.error(f"{', '.join(alone)}: {'options' if len(alone) > 1 else 'an option'} of --complexity only; add "
                 f"--complexity or leave {'them' if len(alone) > 1 else 'it'} out")
    if args.complexity:
        if args.family != "all" or args.decode or args.device == "cuda" or (args.dtype or "fp32") != "fp32":
            ap.error("--complexity: the CPU in fp32, every method; --family, --decode, --device cuda and --dtype "
                     "do not apply")
        if args.max_n is not None and args.max_n < 1:
            ap.error(f"--max-n: at least 1, got {args.max_n}")
        if args.rounds is not None and args.rounds < 1:
            ap.error(f"--rounds: at least 1, got {args.rounds}")
        if args.mem_cap is not None and args.mem_cap <= 0:
            ap.error(f"--mem-cap: GiB > 0, got {args.mem_cap}")
    check_out_dir(ap, args.out)
    old_threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        if args.complexity:
            from attention_ext import complexity

            return complexity.run(args, sizes, budget)
        return _run(args, families, devices, sizes, timing_kw)
    finally:
        torch.set_num_threads(old_threads)


def final_ceilings(groups: dict, peaks: dict, bursts: dict, notes: dict) -> None:
    """The run's FLOP ceilings, in place: each (device, dtype)'s measures (peaks: flop_ceiling's
    (ceiling, parts)) with the bursts of its loop beside every round (bursts: FLOP/s) folded into
    that loop's entry (burst_loop), then every FLOP/s row of `groups` ((family, device, dtype) ->
    rows) read against the result: its ceiling raised to it, never lowered (a row on its own
    instruction, the int8 Q.K^T, keeps its loop's ceiling where that is higher), its share anew,
    and a note in `notes` for a row above its ceiling."""
    for (dev, dtype), rates in bursts.items():
        _, parts = peaks[dev, dtype]
        loop = burst_loop(parts)
        if rates and loop is not None:
            parts[loop] = max(parts[loop], *rates)
            peaks[dev, dtype] = max(parts.values()), parts
    for (fam, dev, dt), rows in groups.items():
        for r in rows:
            if fam != "decode":
                ceiling = max(r["ceiling"] * 1e12, peaks[dev, getattr(torch, dt)][0])
                r["ceiling"], r["share"] = ceiling / 1e12, r["tflops"] * 1e12 / ceiling
            if r["share"] > 1:  # never clipped: a ceiling below a row is a wrong ceiling, and says so
                notes[fam, dev, dt][f"above{r['seq_len']}{r['impl']}"] = (
                    f"{r['impl']} at S={r['seq_len']}: {r['share']:.0%} of its ceiling (the ceiling was measured "
                    f"too low)")


def _sweep(args, bar, peers: dict, groups: dict, notes: dict, peaks: dict, bursts: dict, timing_kw: dict,
           finished: list) -> None:
    """_run's cases, in the order of `bar` (tqdm over (device, family, dtype, S)): each case's
    rows into groups[(family, device, dtype)] and its notes into notes[...], the FLOP ceilings
    measured once per (device, dtype) into peaks and the loop's bursts beside them into bursts,
    and the case into `finished` once it is done: what an interrupted sweep has to write."""
    for dev, fam, dtype, s in bar:
        bar.set_postfix_str(f"{fam} {dev} {str(dtype)[6:]} S={s}")
        p = peers[dev]
        key = (fam, dev, str(dtype).replace("torch.", ""))
        gnotes = notes.setdefault(key, {})
        shape = SHAPES[fam]["cuda" if p.cuda else "cpu"]
        peak_kind = None
        if fam != "decode":
            if (dev, dtype) not in peaks:
                peaks[dev, dtype] = flop_ceiling(dtype, dev, seconds=0.2 if args.quick else 0.5)
                bursts[dev, dtype] = []
            loop = burst_loop(peaks[dev, dtype][1])
            peak_kind = LOOP_KINDS[loop] if loop is not None and not p.cuda else None
        try:
            rows = run_case(p, fam, shape, s, dtype, args.causal, timing_kw, gnotes,
                            peaks[dev, dtype][0] if fam != "decode" else None, peak_kind, bursts.get((dev, dtype)))
        except Exception as e:  # noqa: BLE001 - one case that cannot be built (e.g. out of memory) is a note
            gnotes[f"case{s}"] = f"S={s}: skipped ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
            rows = []
        if not p.flex_on and p.flex_reason and fam in ("softmax", "sparse") and p.flex_reason not in gnotes.values():
            gnotes.setdefault("flex", p.flex_reason)
        if fam == "softmax" and shape[0] * shape[1] * s * s * 4 > MATH_MAX_BYTES:
            gnotes.setdefault("math", f"sdpa math: left out from S={s} (its (B, H, S, S) scores exceed "
                                      f"{MATH_MAX_BYTES >> 30} GiB)")
        if p.cuda and not p.flash_attn and fam in ("softmax", "decode"):
            gnotes.setdefault("flash-attn", "flash-attn: not installed")
        if p.cuda and not p.fla and fam == "linear":
            gnotes.setdefault("fla", "fla (flash-linear-attention): not installed")
        groups.setdefault(key, []).extend(rows)
        finished.append((dev, fam, dtype, s))
        if p.cuda:
            torch.cuda.empty_cache()


def _run(args, families, devices, sizes, timing_kw) -> int:
    """main() after the arguments: every case, then the tables, CSV and plots."""
    import csv
    import os

    from tqdm import tqdm

    cases = []  # (device, family, dtype, S)
    for dev in devices:
        kind = "cuda" if dev.startswith("cuda") else "cpu"
        names = args.dtype.split(",") if args.dtype else ["bf16" if kind == "cuda" else "fp32"]
        for fam in families:
            for name in names:
                for s in sizes or LENGTHS[fam][kind][1 if args.quick else 0]:
                    cases.append((dev, fam, DTYPES[name], s))

    peers, groups, notes, peaks, bursts = {}, {}, {}, {}, {}
    for dev in devices:
        cuda = dev.startswith("cuda")
        flex, why = True, ""
        if args.no_flex:
            flex, why = False, "flex: left out (--no-flex)"
        elif not cuda and args.quick:
            # a CPU Flex compile takes ~15 s, ~3 s more per new length on 2 cores: more than --quick's minute
            flex, why = False, "flex: skipped on the CPU with --quick (its compile alone exceeds the minute)"
        peers[dev] = Peers(dev, flex=flex, flex_reason=why, flex_budget=args.flex_budget)
    bar = tqdm(cases, desc="bench", unit="case", disable=args.no_progress)
    finished, interrupted = [], False
    try:
        _sweep(args, bar, peers, groups, notes, peaks, bursts, timing_kw, finished)
    except KeyboardInterrupt:  # Ctrl-C: the finished cases are written as a whole run's, and say so
        interrupted = True
    bar.close()
    final_ceilings(groups, peaks, bursts, notes)

    os.makedirs(args.out, exist_ok=True)
    threads = torch.get_num_threads()
    all_rows = [r for rows in groups.values() for r in rows]
    reps = sorted({r["reps"] for r in all_rows})
    head = (f"attention_ext bench: {machine_line(threads, gpu='cuda' in devices)}"
            + (f"; ms: the median of {reps[0]}{'-' + str(reps[-1]) if reps[-1] != reps[0] else ''} interleaved "
               f"rounds per case, IQR: their interquartile range over the median; 'vs fastest peer' = the fastest "
               f"peer's time / this row's time" if reps else "; no case ran (the notes below say why)"))
    md, pngs = [head, ""], []
    print(head)
    for key, rows in groups.items():
        fam, dev, dt = key
        if not rows:
            print(f"\n{fam} {dev} {dt}: no rows ({'; '.join(notes[key].values())})")
            continue
        r0 = rows[0]
        if fam == "decode":
            ceil = statistics.median({r["seq_len"]: r["ceiling"] for r in rows}.values())
            extra = (f"'of ceiling': of the faster of a copy (bytes read + written) and a read (torch sum) of as "
                     f"many bytes as K / V, the best call of each, timed beside each case (median {ceil:.1f} GB/s)")
        else:
            peak, parts = peaks[dev, getattr(torch, dt)]
            extra = (f"'of ceiling': of this machine's peak for {dt} on {threads if dev == 'cpu' else 'the'} "
                     f"{'threads' if dev == 'cpu' else 'GPU'}, {peak / 1e12:.3f} TFLOP/s, the highest of: "
                     + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in parts.items())
                     + (" (a loop: its best 1 ms burst of the run, one beside every round)" if dev == "cpu" else "")
                     + " (matmul: its fastest of 3)")
        causal = "" if fam == "decode" else (" causal" if fam == "linear" or args.causal else " non-causal")
        header = (f"### {fam}, {dev}, {dt}: B{r0['batch']} H{r0['heads']} Hkv{r0['kv_heads']} D{r0['head_dim']}"
                  f"{causal}{', block ' + str(SPARSE_BLOCK) if fam == 'sparse' else ''}; {extra}")
        text = table(rows, header, list(notes[key].values()))
        print("\n" + text)
        md += [text, ""]
        pngs += plot(rows, os.path.join(args.out, f"{fam}_{dev.replace(':', '')}_{dt}"))
    with open(os.path.join(args.out, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in all_rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md))
    print(f"\nwrote {os.path.join(args.out, 'results.csv')}, results.md and "
          f"{f'{len(pngs)} plot(s)' if pngs else 'no plot (no case ran)'} under {args.out}/")
    if interrupted:
        print(f"python -m attention_ext bench: interrupted (Ctrl-C) after {len(finished)} of {len(cases)} cases; "
              f"what was written is theirs", file=sys.stderr)
        return 130
    return 0


def decode_main(dev: str, reps: int) -> int:
    """One decode step (q_len 1) over contiguous and paged caches, B4, Hq32, Hkv8, D128: K / V
    read rate as a share of the measured copy bandwidth, and the speedup over torch SDPA with
    enable_gqa on a contiguous (B, H_k, S, D) cache (its best layout), timed interleaved."""
    import torch.nn.functional as F

    from attention_ext.decode import decode_fwd

    cuda = dev.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else None
    copy_bw = copy_bandwidth(1 << 28, device=dev)
    b, h, hk, d = (8, 32, 8, 128) if cuda else (4, 32, 8, 128)
    lengths = (4096, 16384, 65536) if cuda else (4096, 16384)
    dtypes = (torch.bfloat16,) if cuda else (torch.float32, torch.bfloat16)
    print(f"device {dev}; copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write); B{b} Hq{h} Hkv{hk} D{d}, q_len 1")
    print("| cache | dtype | ours GB/s | share of copy | paged-16 / contiguous | SDPA GB/s | ours / SDPA |")
    print("|---|---|---|---|---|---|---|")
    for s in lengths:
        for dtype in dtypes:
            q = torch.randn(b, 1, h, d, dtype=dtype, device=dev)
            kc, vc = (torch.randn(b, s, hk, d, dtype=dtype, device=dev) for _ in range(2))
            lens = torch.full((b,), s, dtype=torch.int32, device=dev)
            page, n = 16, s // 16
            bt = torch.randperm(b * n, device=dev).view(b, n).int()
            kp, vp = (torch.empty(b * n, page, hk, d, dtype=dtype, device=dev) for _ in range(2))
            kp[bt.flatten().long()] = kc.reshape(b * n, page, hk, d)
            vp[bt.flatten().long()] = vc.reshape(b * n, page, hk, d)
            qs, ks, vs = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
            with torch.no_grad():
                t = interleaved({
                    "ours": lambda: decode_fwd(q, kc, vc, cache_seqlens=lens, scale=d ** -0.5),
                    "paged": lambda: decode_fwd(q, kp, vp, cache_seqlens=lens, block_table=bt, scale=d ** -0.5),
                    "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True),
                }, reps=reps, sync=sync, shuffle=True)
            nb = decode_bytes(b, hk, s, d, dtype)
            print(f"| {s} | {str(dtype)[6:]} | {nb / t['ours'] / 1e9:.1f} | {nb / t['ours'] / copy_bw:.0%} | "
                  f"{t['ours'] / t['paged']:.2f} | {nb / t['sdpa'] / 1e9:.1f} | {t['sdpa'] / t['ours']:.2f}x |")
            del q, kc, vc, kp, vp, qs, ks, vs
    return 0
