"""`python -m attention_ext bench` and `profile`, run in-process on the CPU on tiny sizes: the CSV,
the plots, the tables' peer rows and spread, --threads, a peer that fails, and the ncu / nsys command
lines. --budget 0: the minimum rounds (--reps) and no more, so that a loaded machine does not make the
tests slow."""
import csv
import platform
import shlex

import pytest
import torch

from attention_ext import _ext, bench, profile
from attention_ext.__main__ import main as cli

EXPECTED = {"family", "device", "dtype", "impl", "batch", "heads", "kv_heads", "head_dim", "seq_len", "ms", "ms_q1",
            "ms_q3", "spread", "reps", "tflops", "gbps", "peak_mem_mb", "ratio", "share", "ceiling", "tokens_s",
            "cpu_isa", "threads"}
PEERS = {"softmax": "sdpa", "linear": "torch chunked", "sparse": "sdpa dense", "decode": "sdpa"}


@pytest.fixture(scope="module")
def run_all(tmp_path_factory):
    """Every family, two tiny lengths, three rounds: the whole CLI path in a few seconds."""
    import io
    from contextlib import redirect_stdout

    out = tmp_path_factory.mktemp("bench")
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = bench.main(["--quick", "--device", "cpu", "--sizes", "128,256", "--reps", "3", "--budget", "0",
                         "--no-progress", "--out", str(out)])
    assert rc == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    return out, rows, buf.getvalue()


def test_bench_csv_columns_and_rows(run_all):
    out, rows, _ = run_all
    assert EXPECTED <= set(rows[0])
    for fam, peer in PEERS.items():
        got = [r for r in rows if r["family"] == fam]
        impls = {r["impl"] for r in got}
        assert {"ours", peer} <= impls, (fam, impls)
        assert {int(r["seq_len"]) for r in got} == {128, 256}
        unit = "gbps" if fam == "decode" else "tflops"
        assert all(float(r[unit]) > 0 and float(r["ms"]) > 0 for r in got)
        # the median between its quartiles, three rounds each, the spread their range over the median
        for r in got:
            q1, ms, q3 = float(r["ms_q1"]), float(r["ms"]), float(r["ms_q3"])
            assert 0 < q1 <= ms <= q3 and int(r["reps"]) == 3
            assert float(r["spread"]) == pytest.approx((q3 - q1) / ms, rel=1e-3, abs=1e-4)  # CSV: 6 digits
            assert float(r["share"]) == pytest.approx(float(r[unit]) / float(r["ceiling"]), rel=1e-4)
        if bench._libc_trim() is not None:
            assert all(float(r["peak_mem_mb"]) >= 0 for r in got)
        # the CPU figures carry the ISA level the kernels ran and the threads
        assert {(r["cpu_isa"], r["threads"]) for r in got} == {(_ext.cpu_isa(), str(torch.get_num_threads()))}
        # the fastest peer reads 1.00x against itself
        assert max(float(r["ratio"]) for r in got if not r["impl"].startswith("ours")) == pytest.approx(1.0)
    # the quantized rows: the int8 Q.K^T; the 8-bit caches, their rate counted in their own bytes
    assert "ours int8 qk" in {r["impl"] for r in rows if r["family"] == "softmax"}
    dec = [r for r in rows if r["family"] == "decode"]
    assert {"ours int8 cache", "ours fp8 cache"} <= {r["impl"] for r in dec}
    for r in dec:
        assert float(r["tokens_s"]) == pytest.approx(int(r["batch"]) / (float(r["ms"]) * 1e-3), rel=1e-4)
        if r["impl"] in ("ours int8 cache", "ours fp8 cache"):  # bytes: a quarter of fp32 K / V, + descales
            s, hk, d = int(r["seq_len"]), int(r["kv_heads"]), int(r["head_dim"])
            nbytes = 2 * int(r["batch"]) * s * hk * (d + 4)
            assert float(r["gbps"]) == pytest.approx(nbytes / (float(r["ms"]) * 1e-3) / 1e9, rel=1e-4)


def test_bench_plots_and_tables(run_all):
    out, _, text = run_all
    for fam in PEERS:
        png = out / f"{fam}_cpu_float32.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # peak memory: measured on the CPU where the peak RSS can be reset (Linux, glibc)
    mem = list(out.glob("*_cpu_float32_memory.png"))
    assert len(mem) == (4 if bench._libc_trim() is not None else 0)
    assert "| 256 | sdpa |" in text and "| 256 | ours |" in text and "vs fastest peer" in text
    for rate in ("TFLOP/s", "GB/s"):
        assert f"| S | impl | ms | IQR | {rate} | of ceiling |" in text
    assert "the highest of: fp32 FMA loop" in text and "2048x2048 matmul" in text  # the ceiling, and what made it
    assert "interleaved rounds per case" in text
    assert "differs from ours" not in text
    assert "flex: skipped on the CPU with --quick" in text
    assert (out / "results.md").read_text().count("### ") == 4


def test_bench_decode_alias_and_failing_peer(tmp_path, capsys, monkeypatch):
    real = bench.CASES["decode"]

    def with_broken_peer(*a):
        c = real(*a)
        c.fns["broken"] = lambda: (_ for _ in ()).throw(RuntimeError("not on this machine"))
        c.fns["wrong"] = lambda: c.fns["ours"]()[0] * 2  # a peer that computes something else
        return c

    monkeypatch.setitem(bench.CASES, "decode", with_broken_peer)
    assert bench.main(["--decode", "--device", "cpu", "--sizes", "64", "--reps", "1", "--budget", "0", "--no-progress",
                       "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "broken: skipped (RuntimeError: not on this machine)" in text
    assert "wrong: output differs from ours" in text
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["family"] for r in rows} == {"decode"} and "broken" not in {r["impl"] for r in rows}


def test_profile_cpu_prints_its_ranges_and_no_nsight_lines(capsys):
    """On the CPU: the profiler's table with the ranges, and no ncu / nsys command lines (Nsight
    profiles CUDA kernels only; a command line wrapping --device cpu would profile nothing)."""
    args = ["--family", "softmax", "--shape", "1,2,64,32", "--dtype", "fp32", "--device", "cpu", "--iters", "2",
            "--warmup", "1", "--backward", "--causal"]
    assert cli(["profile", *args]) == 0
    text = capsys.readouterr().out
    assert "ncu " not in text and "nsys " not in text and "Nsight" not in text
    # the header names the ISA level the CPU kernels ran, beside the figures
    header = next(ln for ln in text.splitlines() if ln.startswith("attention_ext profile:"))
    assert f"CPU {platform.machine()} {_ext.cpu_isa()}, {torch.get_num_threads()} threads" in header
    # the CPU ranges carry the same names, in torch.profiler's table
    assert "attention_ext/softmax/fwd" in text and "attention_ext/softmax/bwd" in text


def test_profile_nsight_command_lines():
    """The ncu (one per variant) and nsys lines a CUDA run prints: each wraps the same invocation."""
    args = ["--family", "softmax", "--shape", "1,2,64,32", "--dtype", "bf16", "--backward", "--causal"]
    lines = profile.commands(args, "softmax", ("fwd", "bwd"))
    ncu = [ln for ln in lines if ln.startswith("ncu ")]
    nsys = [ln for ln in lines if ln.startswith("nsys ")]
    assert len(ncu) == 2 and len(nsys) == 1 and len(lines) == 3
    assert '--nvtx --nvtx-include "attention_ext/softmax/fwd/"' in ncu[0]
    assert '"attention_ext/softmax/bwd/"' in ncu[1]
    assert nsys[0].startswith("nsys profile -t cuda,nvtx -o ")
    tail = " -m attention_ext profile " + shlex.join(args)
    assert all(ln.endswith(tail) for ln in ncu + nsys)


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to "
                 "allocate 25600000000000 bytes"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")], ids=["cpu", "cuda"])
def test_profile_shape_too_large_names_shape(error, capsys, monkeypatch):
    """An --shape whose tensors cannot be allocated: an error naming --shape, not a traceback."""
    def build(*a, **kw):
        raise error

    monkeypatch.setattr(profile, "build", build)
    with pytest.raises(SystemExit) as e:
        cli(["profile", "--family", "softmax", "--shape", "1000,1000,100000,64", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--shape 1000,1000,100000,64: the softmax op's tensors do not fit" in err
    assert "give a smaller B, H, S or D" in err


@pytest.mark.parametrize("family", ["linear", "sparse", "decode"])
def test_profile_other_families(family, capsys):
    assert profile.main(["--family", family, "--shape", "1,2,128,32", "--device", "cpu", "--iters", "1",
                         "--warmup", "0"]) == 0
    assert f"attention_ext/{family}/fwd" in capsys.readouterr().out  # the range, in the profiler's table


def test_profile_rejects_decode_backward():
    with pytest.raises(SystemExit):
        profile.main(["--family", "decode", "--shape", "1,2,128,32", "--device", "cpu", "--backward"])


def test_bench_optional_peer_setup_failure_is_a_note(tmp_path, capsys, monkeypatch):
    """A peer whose import fails (here flash-attn, claimed present) costs its row, not the case."""
    monkeypatch.setattr(bench.Peers, "__init__", _with_flash_attn(bench.Peers.__init__))
    assert bench.main(["--family", "softmax", "--device", "cpu", "--sizes", "64", "--reps", "1", "--budget", "0",
                       "--no-flex", "--no-progress", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "flash-attn: skipped (ModuleNotFoundError" in text and "| 64 | ours |" in text


def _with_flash_attn(init):
    def patched(self, *a, **kw):
        init(self, *a, **kw)
        self.flash_attn = True
    return patched


def test_bench_threads_apply_to_the_run_and_are_restored(tmp_path, capsys, monkeypatch):
    """--threads N: the cases and the ceiling run on N threads, the header says so, and the caller's
    thread count comes back after the run."""
    seen = []
    real_case, real_ceiling = bench.CASES["linear"], bench.flop_ceiling

    def case(*a):
        seen.append(("case", torch.get_num_threads()))
        return real_case(*a)

    def ceiling(*a, **kw):
        seen.append(("ceiling", torch.get_num_threads()))
        return real_ceiling(*a, **{**kw, "seconds": 0.02, "n": 256})

    monkeypatch.setitem(bench.CASES, "linear", case)
    monkeypatch.setattr(bench, "flop_ceiling", ceiling)
    before = torch.get_num_threads()
    assert bench.main(["--family", "linear", "--device", "cpu", "--sizes", "64", "--reps", "1", "--budget", "0",
                       "--threads", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    assert seen == [("ceiling", 1), ("case", 1)]
    assert ", 1 threads" in capsys.readouterr().out
    assert torch.get_num_threads() == before
    for bad in (["--threads", "0"], ["--reps", "0"], ["--budget", "-1"]):
        with pytest.raises(SystemExit):
            bench.main(["--family", "linear", "--device", "cpu", *bad])


def test_bench_help_names_the_timing_options(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads" in text and "--budget" in text and "known only to worse than 2% and" in text


BAD_ARGS = [
    (["profile", "--family", "softmax", "--shape", "1,4,16,8", "--kv-heads", "3"], "--kv-heads must divide the 4"),
    (["profile", "--family", "softmax", "--shape", "1,2,8,8", "--iters", "0"], "--iters must be >= 1"),
    (["profile", "--family", "softmax", "--shape", "1,4,-3,8"], "four positive sizes"),
    (["bench", "--sizes", "abc"], "--sizes takes comma-separated lengths"),
    (["bench", "--sizes", "0"], "--sizes: lengths >= 1"),
    (["bench", "--sizes", ""], "--sizes takes comma-separated lengths, e.g. 1024,4096, got ''"),
    (["bench", "--max-n", "4096"], "--max-n: an option of --complexity only"),
    (["bench", "--rounds", "2", "--mem-cap", "4"], "--rounds, --mem-cap: options of --complexity only"),
    (["bench", "--dtype", "fp32,"], "--dtype: unknown ''"),
    (["bench", "--family", "softmax", "--decode"], "does not combine with --family softmax"),
    (["demo", "--threads", "-1"], "--threads must be >= 0"),
    (["demo", "--s2s-steps", "0"], "--s2s-steps must be >= 1"),
    (["demo", "--s2s-batch", "0"], "--s2s-batch must be >= 1"),
    (["demo", "--s2s-max-len", "2"], "--s2s-max-len must be in [4, 63]"),
    (["demo", "--s2s-max-len", "100"], "--s2s-max-len must be in [4, 63]"),
    (["demo", "--s2s-lr", "-1"], "--s2s-lr must be a finite learning rate > 0, got -1.0"),
    (["demo", "--s2s-lr", "nan"], "--s2s-lr must be a finite learning rate > 0, got nan"),
    (["demo", "--lm-lr", "-1"], "--lm-lr must be a finite learning rate > 0"),
    (["demo", "--max-seconds", "-5"], "--max-seconds must be >= 0 seconds (0: no cap), got -5.0"),
    (["demo", "--s2s-stop-at", "0"], "--s2s-stop-at must be > 0"),
    (["demo", "--min-accuracy", "95"], "--min-accuracy must be an accuracy in [0, 1]"),
    (["demo", "--parts", "bogus"], "--parts: unknown 'bogus' (comma-separated, from seq2seq, lm, timings)"),
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv,msg", BAD_ARGS, ids=lambda x: " ".join(x) if isinstance(x, list) else "")
def test_bad_arguments_are_argparse_errors(argv, msg, capsys):
    """Each subcommand's bad values: argparse's error (exit 2) with the reason, before anything runs
    (before: tracebacks from deep inside, a silent substitute, or a crash after training started)."""
    with pytest.raises(SystemExit) as e:
        cli(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_demo_refuses_cuda_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit) as e:
        cli(["demo", "--device", "cuda"])
    assert e.value.code == 2 and "no CUDA device visible" in capsys.readouterr().err


def test_info_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["info", "-h"])
    assert e.value.code == 0 and "python -m attention_ext info" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", [["bench", "--quick"], ["bench", "--complexity", "--quick"], ["demo", "--quick"]])
@pytest.mark.parametrize("under", [False, True], ids=["file", "under-a-file"])
def test_out_that_cannot_be_a_directory_is_refused_before_the_run(cmd, under, tmp_path, capsys, monkeypatch):
    """--out naming a file, or a path under one: an argparse error naming --out before anything
    runs (before: a traceback once the whole sweep or training had run, its results lost)."""
    from attention_ext import complexity, demo

    def never(*a, **kw):
        raise AssertionError("the run started")

    monkeypatch.setattr(bench, "_run", never)
    monkeypatch.setattr(complexity, "run", never)
    monkeypatch.setattr(demo, "run_seq2seq", never)
    f = tmp_path / "taken"
    f.write_text("")
    with pytest.raises(SystemExit) as e:
        cli([*cmd, "--out", str(f / "sub" if under else f)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--out {f}" in err and "Traceback" not in err
    assert f.read_text() == ""


def test_bench_decode_takes_lengths_off_the_page_size(tmp_path, capsys):
    """A cache length that is not a multiple of the 16-token page: the paged row's last page is
    partly filled (before: an internal reshape error, and the case skipped)."""
    assert bench.main(["--decode", "--device", "cpu", "--sizes", "20", "--reps", "1", "--budget", "0",
                       "--no-progress", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "| 20 | ours paged 16 |" in text and "skipped" not in text and "differs" not in text


def test_bench_with_no_case_run_says_so(tmp_path, capsys, monkeypatch):
    """Every case failing: the header and the last line say that nothing ran and no plot was made
    (before: "the median of 0 interleaved rounds" and "1 plot group(s)")."""
    def broken(*a):
        raise RuntimeError("cannot build this case")

    monkeypatch.setitem(bench.CASES, "linear", broken)
    assert bench.main(["--family", "linear", "--device", "cpu", "--sizes", "64", "--reps", "1", "--budget", "0",
                       "--no-progress", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "no case ran" in text and "0 interleaved" not in text and "no plot (no case ran)" in text
    assert "S=64: skipped (RuntimeError: cannot build this case)" in text
    assert not list(tmp_path.glob("*.png"))


def test_ctrl_c_in_bench_writes_the_finished_cases(tmp_path, capsys, monkeypatch):
    """Ctrl-C during a sweep: the cases finished so far are written (results.csv), a line says how
    many, and the exit status is 130, with no traceback."""
    real = bench.CASES["linear"]

    def case(p, b, h, hk, s, *rest):
        if s == 128:
            raise KeyboardInterrupt
        return real(p, b, h, hk, s, *rest)

    monkeypatch.setitem(bench.CASES, "linear", case)
    assert cli(["bench", "--family", "linear", "--device", "cpu", "--sizes", "64,128,256", "--reps", "1", "--budget",
                "0", "--no-progress", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C) after 1 of 3 cases" in err and "Traceback" not in err
    with open(tmp_path / "results.csv") as f:
        assert {r["seq_len"] for r in csv.DictReader(f)} == {"64"}


@pytest.mark.parametrize("cmd", ["profile", "demo", "info"])
def test_ctrl_c_is_one_line_and_status_130(cmd, capsys, monkeypatch):
    from attention_ext import __main__ as entry, demo

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(profile, "main", interrupted)
    monkeypatch.setattr(demo, "main", interrupted)
    monkeypatch.setattr(entry, "info", interrupted)
    assert cli([cmd]) == 130
    err = capsys.readouterr().err
    assert err.strip() == f"python -m attention_ext {cmd}: interrupted (Ctrl-C) before its results were written"


def _script(rel: str):
    """A benchmark script (benchmarks/<family>/<name>.py) as a module, its main() not run."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / rel
    spec = importlib.util.spec_from_file_location(f"_bench_script_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SCRIPT_BAD_ARGS = [
    ("distributed/bench_cp.py", ["--heads", "1", "--world", "2"], "--heads 1: mode ulysses shards the heads"),
    ("distributed/bench_cp.py", ["--modes", "ring,foo"], "--modes: unknown 'foo'"),
    ("distributed/bench_cp.py", ["--seq", "100", "--world", "4"], "--seq 100: the cases' shard layouts over --world 4"),
    ("softmax/bench_cpu_masks.py", ["--isa", "avx3"], "--isa: 'avx3': not a level this build has"),
    ("decode/bench_quant_cpu.py", ["--levels", "avx2,avx3"], "--levels: 'avx3': not a level this build has"),
]


@pytest.mark.parametrize("script,argv,msg", SCRIPT_BAD_ARGS, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_benchmark_scripts_refuse_bad_arguments_up_front(script, argv, msg, capsys, monkeypatch):
    """Arguments a rank or set_cpu_isa would refuse mid-run (a nested traceback): argparse's error
    naming the flag, before anything is spawned or timed; the ISA levels' errors list the valid ones."""
    monkeypatch.setattr("sys.path", list(__import__("sys").path))  # the scripts put benchmarks/ on it
    mod = _script(script)
    monkeypatch.setattr("sys.argv", [script, *argv])  # bench_cpu_masks reads sys.argv
    if hasattr(mod, "spawn"):
        monkeypatch.setattr(mod, "spawn", lambda *a, **kw: pytest.fail("spawned ranks"))
    with pytest.raises(SystemExit) as e:
        mod.main(argv) if "argv" in mod.main.__code__.co_varnames else mod.main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err, err
    if "level" in msg:
        assert ", ".join(_ext.cpu_isas()) in err


HELPED = {"bench": ["--causal", "--no-flex", "--flex-budget", "--no-progress", "--rounds"],
          "profile": ["--kv-heads", "--warmup"],
          "demo": ["--parts", "--no-plots", "--quiet", "--min-accuracy", "--s2s-max-len", "--s2s-stop-at"]}


@pytest.mark.parametrize("cmd", sorted(HELPED))
def test_every_flag_has_help(cmd, monkeypatch):
    """The flags once listed without a help string have one (the command's parser, caught as it
    parses)."""
    import argparse

    seen, real = [], argparse.ArgumentParser.parse_args

    def caught(self, *a, **kw):
        if self.prog == "python -m attention_ext":  # the command word's parser
            return real(self, *a, **kw)
        seen.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(SystemExit):
        cli([cmd])
    helps = {o: act.help for act in seen[-1]._actions for o in act.option_strings}
    for flag in HELPED[cmd]:
        assert helps[flag] and len(helps[flag].split()) >= 3, (flag, helps[flag])
