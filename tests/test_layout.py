"""The source tree's walls, checked on the files themselves (no build needed).

csrc/<family>/ includes only its own files and the shared folders csrc/{common,cpu,cuda}; the
shared folders include no family; the torch bindings of one family include no other family's,
except the softmax binding's score-policy options, which the sparse and decode bindings extend;
nothing in csrc/ includes a tests/ path or knows the CUDA emulator. In Python, no family package
imports another family's private names.
"""
from __future__ import annotations

import ast
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
SHARED = ("common", "cpu", "cuda")
FAMILIES = tuple(sorted(d for d in os.listdir(CSRC)
                        if os.path.isdir(os.path.join(CSRC, d)) and d not in SHARED + ("torch",)))
# the torch-layer files of the shared bindings: the one op library (which registers every family)
LIBRARY = ("library.cpp",)
# the score policy's options (Options, check_inputs, make_fwd_params): softmax's binding, which
# the families that compute a softmax over scores extend
POLICY_BINDING = "torch/softmax_binding.h"
POLICY_USERS = ("sparse", "decode")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _sources():
    for dirpath, _, files in os.walk(CSRC):
        for f in files:
            if f.endswith((".h", ".cuh", ".cpp", ".cu")):
                yield os.path.join(dirpath, f)


def _includes(path):
    """The csrc-relative paths `path` includes with quotes (a same-folder include resolved)."""
    with open(path) as f:
        text = f.read()
    here = os.path.dirname(path)
    for inc in INCLUDE.findall(text):
        local = os.path.join(here, inc)
        yield os.path.relpath(local, CSRC) if os.path.exists(local) else inc


def _top(rel):
    return rel.split("/", 1)[0]


def _torch_family(name):
    """The family a csrc/torch file belongs to by its prefix (softmax_cpu.cpp -> softmax), or None
    for the shared binding files."""
    fam = name.split("_", 1)[0]
    return fam if fam in FAMILIES else None


def test_families_found():
    # the walls below are vacuous if the layout moved: the families must be there
    assert {"softmax", "linear", "sparse", "decode"} <= set(FAMILIES), FAMILIES


def test_include_walls():
    bad = []
    for path in _sources():
        rel = os.path.relpath(path, CSRC)
        top = _top(rel)
        for inc in _includes(path):
            where = _top(inc)
            if "tests/" in inc or "cuda_emu" in inc:
                bad.append(f"{rel} includes a test path: {inc}")
            elif top in FAMILIES:
                if where not in SHARED + (top,):
                    bad.append(f"{rel} (family {top}) includes {inc}")
            elif top in SHARED:
                if where not in SHARED:
                    bad.append(f"{rel} (shared) includes {inc}")
            elif top == "torch":
                fam = _torch_family(os.path.basename(rel))
                if os.path.basename(rel) in LIBRARY:
                    continue
                if fam is None:  # a shared binding file: no family
                    if where in FAMILIES or (where == "torch" and _torch_family(os.path.basename(inc))):
                        bad.append(f"{rel} (shared binding) includes {inc}")
                elif where in FAMILIES and where != fam:
                    bad.append(f"{rel} ({fam} binding) includes {inc}")
                elif where == "torch":
                    other = _torch_family(os.path.basename(inc))
                    if other not in (None, fam) and not (inc == POLICY_BINDING and fam in POLICY_USERS):
                        bad.append(f"{rel} ({fam} binding) includes {inc}")
    assert not bad, "\n".join(bad)


def test_product_knows_no_emulator():
    bad = []
    for path in _sources():
        with open(path) as f:
            if "ATTN_CUDA_EMULATE" in f.read():
                bad.append(os.path.relpath(path, CSRC))
    assert not bad, f"csrc files that branch on the emulator: {bad}"


def test_walls_catch_a_crossing(tmp_path, monkeypatch):
    """The check above fails on a file that crosses a wall (it is not vacuous)."""
    fam = tmp_path / "csrc" / "linear" / "cpu"
    fam.mkdir(parents=True)
    (fam / "x.cpp").write_text('#include "softmax/cpu/tile.h"\n')
    monkeypatch.setattr(sys.modules[__name__], "CSRC", str(tmp_path / "csrc"))
    monkeypatch.setattr(sys.modules[__name__], "FAMILIES", ("linear", "softmax"))
    with pytest.raises(AssertionError, match="linear/cpu/x.cpp"):
        test_include_walls()


def _private_imports(path, package):
    """(module, name) pairs of `from <other family> import _name` in a file of family `package`."""
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            parts = node.module.split(".")
            fam = parts[0] if node.level == 2 else (parts[1] if parts[0] == "attention_ext" and len(parts) > 1 else None)
            if fam is None or fam == package or fam not in FAMILIES:
                continue
            for alias in node.names:
                if alias.name.startswith("_") or any(p.startswith("_") for p in parts[1:]):
                    yield node.module, alias.name


def test_python_families_import_no_private_names():
    bad = []
    pkg = os.path.join(ROOT, "attention_ext")
    for fam in FAMILIES:
        d = os.path.join(pkg, fam)
        if not os.path.isdir(d):
            continue
        for f in os.listdir(d):
            if f.endswith(".py"):
                bad += [f"{fam}/{f}: from {m} import {n}" for m, n in _private_imports(os.path.join(d, f), fam)]
    assert not bad, "\n".join(bad)
