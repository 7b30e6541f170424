"""Run flash-attn's own test suite (tests/test_flash_attn.py of its release sdist) on the CPU
through attention_ext's drop-ins: that `flash_attn_func` and its packed / varlen / kvcache
siblings keep flash-attn's semantics, judged by flash-attn's tests and tolerances rather than
ours.

    pip install einops      # the upstream test file needs it (or: pip install ".[upstream]")
    python tests/upstream/flash_attn_suite.py [--per-test 60] [--seed 0] [-k EXPR] [--sdist PATH]

Nothing of flash-attn is kept in this repository. The script downloads the pinned sdist (sha256
checked, cached under ~/.cache/attention_ext) and builds a throwaway directory with:
  - flash_attn/__init__.py: attention_ext.compat's functions under flash-attn's names;
  - flash_attn/bert_padding.py: flash-attn's own (pure PyTorch), copied from the sdist;
  - flash_attn/layers/rotary.py: apply_rotary_emb around flash-attn's own pure-PyTorch
    apply_rotary_emb_torch (taken from the sdist's source; its Triton kernel is not used), so the
    rotary oracle of the kvcache test stays upstream's math;
  - the test file, with device "cuda" -> "cpu" and the race test's 250 repeats (batch 60, for
    GPU races) cut to --race-repeats; a conftest that answers the CUDA queries the file
    makes at import (an sm_80 GPU with 16 GB, so the >= 2048 long cases skip as they do on such a
    card), leaves out what the CPU cannot reach, and draws a seeded sample of --per-test cases per
    test function (the full grid is ~400k cases; 0 = all).
Left out: dropout_p > 0 (those cases decode flash-attn's kernel-specific S_dmask encoding of its
dropout pattern, which no other implementation reproduces).

Exit status: pytest's. Results: benchmarks/results/*-flash-attn-upstream.md.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import urllib.request
from pathlib import Path

VERSION = "2.8.3"
SDIST_URL = ("https://files.pythonhosted.org/packages/3b/b2/8d76c41ad7974ee264754709c22963447f7f8134613fd9ce80984ed0d"
             "ab7/flash_attn-2.8.3.tar.gz")
SDIST_SHA256 = "1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d"
REPO = Path(__file__).resolve().parents[2]

SHIM_INIT = '''\
"""flash-attn's public functions, served by attention_ext (a test shim)."""
from attention_ext.compat import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                  flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                                  flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)
__version__ = "{version}+attention_ext"
'''

# _get_block_size_n only feeds normalize_flash_attn_S, which runs on the dropout cases (left out)
SHIM_INTERFACE = '''\
def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    raise RuntimeError("dropout cases are left out of the CPU run (flash-attn's S_dmask encoding)")
'''

SHIM_ROTARY = '''\
"""apply_rotary_emb with flash-attn's signature on flash-attn's own pure-PyTorch rotation."""
import torch
from einops import rearrange, repeat

{upstream}


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                     max_seqlen=None):
    # x (B, S, H, D); cos / sin (seqlen_ro, rotary_dim / 2); row t of sequence b rotates at
    # position seqlen_offsets[b] + t (seqlen_offsets an int or a (B,) tensor)
    if cu_seqlens is not None:
        raise NotImplementedError("the shim takes (B, S, H, D) inputs only")
    b, s = x.shape[:2]
    off = torch.as_tensor(seqlen_offsets, device=x.device).long().reshape(-1)
    pos = (off if off.numel() == b else off.expand(b))[:, None] + torch.arange(s, device=x.device)
    out = apply_rotary_emb_torch(x, cos[pos], sin[pos], interleaved)
    if inplace:
        x.copy_(out)
        return x
    return out
'''

CONFTEST = '''\
import random
import types

import pytest
import torch

# the CUDA queries test_flash_attn.py makes: answer as an sm_80 GPU with 16 GB
torch.cuda.get_device_capability = lambda *a, **k: (8, 0)
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=16 * 2**30)
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.empty_cache = lambda *a, **k: None

PER_TEST = {per_test}
SEED = {seed}


def pytest_collection_modifyitems(config, items):
    keep, dropped = [], []
    by_fn = {{}}
    for it in items:
        params = getattr(getattr(it, "callspec", None), "params", {{}})
        if params.get("dropout_p", 0.0) > 0.0:
            dropped.append(it)  # flash-attn's S_dmask encoding of its dropout pattern
            continue
        by_fn.setdefault(it.originalname, []).append(it)
    rng = random.Random(SEED)
    for name in sorted(by_fn):
        group = by_fn[name]
        keep += group if PER_TEST <= 0 or len(group) <= PER_TEST else rng.sample(group, PER_TEST)
    kept = set(keep)
    dropped = [it for it in items if it not in kept]
    items[:] = [it for it in items if it in kept]
    config.hook.pytest_deselected(items=dropped)
'''


def fetch_sdist(path: str | None) -> Path:
    if path:
        return Path(path)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attention_ext"
    cache.mkdir(parents=True, exist_ok=True)
    dst = cache / f"flash_attn-{VERSION}.tar.gz"
    if not dst.exists():
        print(f"downloading {SDIST_URL}")
        with urllib.request.urlopen(SDIST_URL, timeout=300) as r, open(dst.with_suffix(".part"), "wb") as f:
            shutil.copyfileobj(r, f)
        dst.with_suffix(".part").rename(dst)
    digest = hashlib.sha256(dst.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        dst.unlink()
        raise SystemExit(f"{dst}: sha256 {digest} is not the pinned {SDIST_SHA256}")
    return dst


def upstream_rotary_source(rotary_py: str) -> str:
    """The source of rotate_half and apply_rotary_emb_torch from flash-attn's layers/rotary.py."""
    tree = ast.parse(rotary_py)
    wanted = {"rotate_half", "apply_rotary_emb_torch"}
    parts = [ast.get_source_segment(rotary_py, n) for n in tree.body
             if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if len(parts) != len(wanted):
        raise SystemExit("flash_attn/layers/rotary.py: rotate_half / apply_rotary_emb_torch not found")
    return "\n\n\n".join(parts)


def build_tree(sdist: Path, work: Path, per_test: int, seed: int, race_repeats: int) -> Path:
    root = f"flash_attn-{VERSION}"
    with tarfile.open(sdist) as tar:
        def read(name: str) -> str:
            return tar.extractfile(f"{root}/{name}").read().decode()
        test_src = read("tests/test_flash_attn.py")
        padding_src = read("flash_attn/bert_padding.py")
        rotary_src = read("flash_attn/layers/rotary.py")
    pkg = work / "flash_attn"
    (pkg / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text(SHIM_INIT.format(version=VERSION))
    (pkg / "bert_padding.py").write_text(padding_src)
    (pkg / "flash_attn_interface.py").write_text(SHIM_INTERFACE)
    (pkg / "layers" / "__init__.py").write_text("")
    (pkg / "layers" / "rotary.py").write_text(SHIM_ROTARY.format(upstream=upstream_rotary_source(rotary_src)))
    n = test_src.count('"cuda"')
    if n == 0:
        raise SystemExit("test_flash_attn.py: no device string to replace")
    test_src = test_src.replace('"cuda"', '"cpu"')
    if test_src.count("for i in range(250):") != 1:
        raise SystemExit("test_flash_attn.py: the race test's repeat loop was not found")
    test_src = test_src.replace("for i in range(250):", f"for i in range({race_repeats}):")
    (work / "test_flash_attn.py").write_text(test_src)
    (work / "conftest.py").write_text(CONFTEST.format(per_test=per_test, seed=seed))
    return work / "test_flash_attn.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--per-test", type=int, default=60, help="seeded sample of cases per test function (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--race-repeats", type=int, default=3, help="repeats of the race test (upstream: 250)")
    ap.add_argument("-k", default=None, help="pytest -k expression (test function names)")
    ap.add_argument("--sdist", default=None, help=f"a local flash_attn-{VERSION}.tar.gz instead of downloading it")
    ap.add_argument("--keep", action="store_true", help="keep the throwaway directory and print it")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest after --")
    a = ap.parse_args()
    try:
        import einops  # noqa: F401
    except ImportError:
        raise SystemExit("flash-attn's test file needs einops: pip install einops")
    sdist = fetch_sdist(a.sdist)
    work = Path(tempfile.mkdtemp(prefix="fa-upstream-"))
    try:
        test = build_tree(sdist, work, a.per_test, a.seed, a.race_repeats)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(work), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, "-m", "pytest", str(test), "-q", "-p", "no:cacheprovider", "-rfEs",
               "--rootdir", str(work), "-W", "ignore"]
        if a.k:
            cmd += ["-k", a.k]
        cmd += a.pytest_args
        print(" ".join(cmd), flush=True)
        return subprocess.call(cmd, cwd=work, env=env)
    finally:
        if a.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
