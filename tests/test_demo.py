"""`python -m attention_ext demo --quick`: runs end to end, reaches its accuracy threshold, and
trains to a budget of steps, so that a loaded machine reports the same metrics as a quiet one."""
import json
import os
import subprocess
import sys
import time

import pytest

from attention_ext import demo
from attention_ext.models import Transformer, TransformerConfig


def test_stdlib_corpus_is_deterministic():
    a = demo.stdlib_text(100_000)
    b = demo.stdlib_text(100_000)
    assert a == b
    train, val, files = a
    assert len(train) > 50_000 and len(val) > 1_000 and len(files) >= 10
    assert all(ord(c) < 128 for c in val)


def test_reverse_task_holds_out_test_strings():
    task = demo.ReverseTask(4, 8, n_test=200, seed=0)
    assert not set(task.train_batch(2000)) & task.held_out
    src, lengths, dec_in, dec_out = task.encode(["abc", "hello"], "cpu")
    assert lengths.tolist() == [4, 6]
    assert task.decode(dec_out[1].tolist()) == "olleh"
    assert dec_in[1, 0] == demo.BOS and dec_out[0, 3] == demo.EOS


def test_bad_parts_flag(tmp_path, capsys):
    """An unknown part: argparse's error listing the parts, before --out is made."""
    with pytest.raises(SystemExit) as e:
        demo.main(["--parts", "seq2seq,nope", "--out", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--parts: unknown 'nope' (comma-separated, from seq2seq, lm, timings)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_demo_quick(tmp_path):
    out = tmp_path / "demo"
    # the README's command (one thread, the demo's default); only the timing table is shortened
    rc = demo.main(["--quick", "--out", str(out), "--quiet", "--bench-reps", "2"])
    r = json.loads((out / "results.json").read_text())
    assert rc == 0
    assert r["threads"] == 1 and r["seq2seq"]["stopped_by"] != "time cap" and r["char_lm"]["stopped_by"] == "steps"
    assert r["char_lm"]["steps"] == r["char_lm"]["max_steps"]
    assert r["seq2seq"]["accuracy"] >= 0.95
    assert r["char_lm"]["val_bpc"] < r["char_lm"]["unigram_bpc"] - 0.5
    assert len(r["char_lm"]["samples"]) == 3
    # the trained char LM stepping through 8-bit KV caches: perplexity within 1% of the bf16 cache's
    bits = r["char_lm"]["cache_bpc"]
    for q in ("int8", "float8_e4m3fn"):
        assert abs(2 ** (bits[q] - bits["bfloat16"]) - 1) < 0.01, bits
    assert {row["variant"] for row in r["timings"]} == {"full", "window"}
    for p in r["seq2seq"]["plots"]:
        assert os.path.getsize(p) > 1000
    assert (out / "samples.txt").exists() and (out / "log.txt").exists()


@pytest.mark.parametrize("argv", [["--attention", "bahdanau"], ["--attention", "luong", "--score", "concat"]])
def test_rnn_example_runs(tmp_path, argv, capsys):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "seq2seq_rnn.py")
    spec = importlib.util.spec_from_file_location("seq2seq_rnn", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(argv + ["--steps", "20", "--hidden", "16", "--out", str(tmp_path)]) == 0
    assert "held-out exact-match accuracy" in capsys.readouterr().out


def _quick_variant(tmp_path, variant):
    """One quick demo run of a --variant with a few steps of each part; its results and log."""
    out = tmp_path / variant
    rc = demo.main(["--quick", "--variant", variant, "--out", str(out), "--threads", "1", "--quiet",
                    "--s2s-steps", "30", "--s2s-test", "40", "--lm-steps", "15", "--lm-chars", "60000",
                    "--lm-eval-batches", "1", "--lm-sample-chars", "20", "--bench-reps", "1", "--min-accuracy", "0"])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    assert r["variant"] == variant and r["seq2seq"]["steps"] == 30 and 0.0 <= r["seq2seq"]["accuracy"] <= 1.0
    assert len(r["char_lm"]["samples"]) == 3 and all(len(s) > 20 for s in r["char_lm"]["samples"])
    assert {row["variant"] for row in r["timings"]} == {"full", variant}
    return r, (out / "log.txt").read_text()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("variant", ["linear", "performer"])
def test_demo_linear_variants(tmp_path, variant):
    """--variant linear / performer: every part runs (training, decoding and sampling with the
    recurrent state, heatmaps, the timing table against SDPA's softmax); a few steps only."""
    r, log = _quick_variant(tmp_path, variant)
    for p in r["seq2seq"]["plots"]:
        assert os.path.getsize(p) > 1000
    assert "recurrent state" in log and "SDPA has no linear form" in log


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("variant", ["bigbird", "topk"])
def test_demo_sparse_variants(tmp_path, variant):
    """--variant bigbird / topk: every part runs with sparse self-attention (training, KV-cache
    decoding and sampling, heatmaps, the timing table against SDPA's dense attention); a few steps."""
    _, log = _quick_variant(tmp_path, variant)
    assert "KV cache" in log and "our sparse attention" in log


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_demo_reformer_variant(tmp_path):
    """--variant reformer: every part runs with LSH self-attention (causal in the decoders,
    generation without a cache, the timing table against SDPA's dense attention); a few steps."""
    _, log = _quick_variant(tmp_path, "reformer")
    assert "(greedy, uncached)" in log and "uncached generation" in log and "our LSH attention" in log


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_demo_gated_delta_variant(tmp_path):
    """--variant gated_delta: the char LM trains on Gated DeltaNet layers and samples with the
    recurrent state, the timing table runs against SDPA's softmax, and seq2seq (which needs an
    encoder and cross-attention) is skipped, saying why."""
    out = tmp_path / "gated_delta"
    rc = demo.main(["--quick", "--variant", "gated_delta", "--out", str(out), "--threads", "1", "--quiet",
                    "--lm-steps", "15", "--lm-chars", "60000", "--lm-eval-batches", "1", "--lm-sample-chars", "20",
                    "--bench-reps", "1", "--no-plots"])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    assert "seq2seq" not in r and set(r["skipped"]) == {"seq2seq"}
    assert len(r["char_lm"]["samples"]) == 3 and {row["variant"] for row in r["timings"]} == {"full", "gated_delta"}
    log = (out / "log.txt").read_text()
    assert "seq2seq: skipped: --variant gated_delta is causal self-attention only" in log
    assert "recurrent state" in log and "Gated DeltaNet layer" in log


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_demo_linformer_variant(tmp_path):
    """--variant linformer is non-causal: it is the seq2seq encoder's self-attention only (the
    decoder keeps softmax), and the causal char LM and its timings are skipped, saying why."""
    from attention_ext.nn import Attention, LinformerAttention

    model = Transformer(TransformerConfig(src_vocab_size=29, d_model=32, n_heads=4, n_encoder_layers=1,
                                          n_decoder_layers=1, max_len=64, **demo.variant_options("linformer", 4, 11)))
    assert isinstance(model.encoder.layers[0].self_attn, LinformerAttention)
    dec = model.decoder.layers[0]
    assert type(dec.self_attn) is Attention and type(dec.cross_attn) is Attention
    out = tmp_path / "linformer"
    rc = demo.main(["--quick", "--variant", "linformer", "--out", str(out), "--quiet", "--s2s-steps", "30",
                    "--s2s-test", "40", "--min-accuracy", "0", "--no-plots"])
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    assert r["seq2seq"]["steps"] == 30 and "char_lm" not in r and "timings" not in r
    assert set(r["skipped"]) == {"lm", "timings"}
    assert "char LM: skipped: --variant linformer is non-causal" in (out / "log.txt").read_text()


def _demo_metrics(out, *extra):
    """`python -m attention_ext demo --quick` in a fresh process (the user's command) with the
    seed fixed; its exit status, metrics from results.json and wall time."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "attention_ext", "demo", "--quick", "--seed", "0", "--quiet",
                        "--no-plots", "--out", str(out), *extra], cwd=root, env=env, capture_output=True,
                       text=True, timeout=900)
    wall = time.perf_counter() - t0
    r = json.loads((out / "results.json").read_text())
    keys = {"seq2seq": ("steps", "max_steps", "stopped_by", "accuracy", "val_acc", "loss", "examples"),
            "char_lm": ("steps", "max_steps", "stopped_by", "val_bpc", "val_loss", "loss", "unigram_bpc",
                        "samples")}
    return p.returncode, p.stderr, {part: {k: r[part][k] for k in ks} for part, ks in keys.items()}, wall


def _hog():
    """A process that spins one core."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_demo_quick_same_metrics_on_a_loaded_machine(tmp_path):
    """The reliability issue: on a machine busy with other work the demo trained fewer steps and
    failed its accuracy threshold. It trains to step budgets now, so the --quick run reports the
    same metrics, bit for bit, with a CPU hog spinning on every core beside it; only its time
    differs. The step budgets are cut (the same in both runs) to keep the test short: what it tests
    is that nothing in training follows the clock, which the budgets' size does not change. No
    time cap: its stop would be a difference in steps (test_demo_time_cap_is_not_a_failed_model)."""
    budget = ["--parts", "seq2seq,lm", "--s2s-steps", "80", "--lm-steps", "30", "--lm-eval-batches", "2",
              "--lm-sample-chars", "40", "--min-accuracy", "0", "--max-seconds", "0"]
    rc, err, quiet, quiet_s = _demo_metrics(tmp_path / "quiet", *budget)
    assert rc == 0, err
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    hogs = [_hog() for _ in range(min(cores, 16))]
    try:
        rc, err, loaded, loaded_s = _demo_metrics(tmp_path / "loaded", *budget)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    assert rc == 0, err
    assert loaded == quiet
    assert quiet["seq2seq"]["steps"] == 80 and quiet["char_lm"]["steps"] == 30
    print(f"quiet {quiet_s:.1f} s, loaded {loaded_s:.1f} s")


def test_demo_time_cap_is_not_a_failed_model(tmp_path):
    """--max-seconds is a safety net: a run it stops says so and exits with status 3, never with
    the below-threshold status 1 of a model that trained its budget."""
    out = tmp_path / "capped"
    rc = demo.main(["--quick", "--parts", "seq2seq", "--no-plots", "--quiet", "--out", str(out), "--s2s-steps", "500",
                    "--s2s-test", "20", "--max-seconds", "0.5"])
    r = json.loads((out / "results.json").read_text())
    assert rc == demo.EXIT_TIME_CAP == 3
    assert r["seq2seq"]["stopped_by"] == "time cap" and r["seq2seq"]["steps"] < 500
    log = (out / "log.txt").read_text()
    assert f"stopped by the time cap (0.5 s, --max-seconds) after {r['seq2seq']['steps']} of 500 steps" in log


def test_demo_log_names_the_cpu_isa_level(tmp_path):
    """The log's header and the timing table name the ISA level the CPU kernels ran (the timings
    depend on it; results.json's cpu_isa alone was not beside the figures)."""
    from attention_ext import _ext

    out = tmp_path / "isa"
    assert demo.main(["--quick", "--parts", "seq2seq,timings", "--device", "cpu", "--s2s-steps", "1", "--s2s-test", "4",
                      "--bench-reps", "1", "--no-plots", "--quiet", "--min-accuracy", "0", "--out", str(out)]) == 0
    log = (out / "log.txt").read_text().splitlines()
    level = f"CPU ISA {_ext.cpu_isa()}"
    assert level in log[0]
    assert level in next(ln for ln in log if ln.startswith("[3/3]"))


def test_baseline_comparison_is_worded_either_way():
    """Fewer bits than the unigram baseline read as better; more, as worse (once: "0.77x better")."""
    assert demo._vs_baseline(2.0, 4.0) == "2.00x better"
    assert demo._vs_baseline(5.2, 4.0) == "worse than the baseline: 1.30x its bits"
    assert demo._vs_baseline(4.0, 4.0) == "the same as the baseline"
