"""`python -m attention_ext demo --quick`: runs end to end and reaches its accuracy threshold."""
import json
import os

import pytest

from attention_ext import demo


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


def test_bad_parts_flag(tmp_path):
    assert demo.main(["--parts", "nope", "--out", str(tmp_path)]) == 2


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_demo_quick(tmp_path):
    out = tmp_path / "demo"
    # one thread: CI machines are shared, and these models are too small to gain from more; the
    # seq2seq time budget is raised so that a slow machine does not fail the accuracy check
    rc = demo.main(["--quick", "--out", str(out), "--threads", "1", "--quiet", "--s2s-seconds", "240",
                    "--bench-reps", "2"])
    r = json.loads((out / "results.json").read_text())
    assert rc == 0
    assert r["seq2seq"]["accuracy"] >= 0.95
    assert r["char_lm"]["val_bpc"] < r["char_lm"]["unigram_bpc"] - 0.5
    assert len(r["char_lm"]["samples"]) == 3
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
