"""Every example in README.md and docs/ runs as written.

Each ```python block of README.md and docs/**/*.md is one test: it runs in a fresh interpreter
(sys.executable, a temporary working directory, this source tree first on the path), as a reader
who pastes it would run it. A block whose first lines say what it needs is run that way:
    # needs: cuda       skipped, with that reason, where torch sees no GPU
    # needs: torchrun   run as one rank of a one-rank gloo group: the environment torchrun sets
                        (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) for a world of 1
Shell blocks (```bash) are checked without running them: every `python -m attention_ext <cmd>` line
they show parses (its arguments plus --help exit 0), and every file of this repository they name
exists. The README's shape is checked too: at most 300 lines, install and the quickstart within
the first 100, relative links that resolve.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_FILES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
NEEDS = {"cuda", "torchrun"}
TIMEOUT_S = 120

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_NEEDS = re.compile(r"^#\s*needs:\s*(.+?)\s*$")


def fenced_blocks(path: Path):
    """[(language, line of the block's first code line, code)] of the file's ``` blocks."""
    blocks, lang, start, buf = [], None, 0, []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if lang is None and m:
            lang, start, buf = m.group(1).lower() or "text", n + 1, []
        elif lang is not None and line.strip() == "```":
            blocks.append((lang, start, "\n".join(buf) + "\n"))
            lang = None
        elif lang is not None:
            buf.append(line)
    assert lang is None, f"{path.name}: a ``` block opened at line {start - 1} is never closed"
    return blocks


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _blocks(langs):
    return [pytest.param(path, line, code, id=f"{_rel(path)}:{line}")
            for path in DOC_FILES for lang, line, code in fenced_blocks(path) if lang in langs]


PYTHON_BLOCKS = _blocks({"python", "py"})
SHELL_BLOCKS = _blocks({"bash", "sh", "shell"})


def needs_of(code: str) -> set:
    """The `# needs: a, b` of a block's leading comment lines (a note in parentheses may follow)."""
    found = set()
    for line in code.splitlines():
        if not line.startswith("#"):
            break
        m = _NEEDS.match(line)
        if m:  # "# needs: torchrun   (how to run it)": the words before any parenthesis
            found |= {w.strip() for w in m.group(1).split("(")[0].split(",") if w.strip()}
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_docs_have_examples():
    assert len(PYTHON_BLOCKS) >= 8 and any(p.values[0] == README for p in PYTHON_BLOCKS)
    assert any(p.values[0] == README for p in SHELL_BLOCKS)


@pytest.mark.parametrize("path,line,code", PYTHON_BLOCKS)
def test_python_block_runs(path, line, code, tmp_path):
    needs = needs_of(code)
    assert needs <= NEEDS, f"{_rel(path)}:{line}: unknown `# needs:` {sorted(needs - NEEDS)}; known: {sorted(NEEDS)}"
    if "cuda" in needs and not torch.cuda.is_available():
        pytest.skip("needs: cuda (torch sees no GPU)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # the example gets this worker's share of the cores, as a test in this process would
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    if "torchrun" in needs:
        env.update(RANK="0", LOCAL_RANK="0", GROUP_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # the file keeps the document's line numbers, so a traceback points at the document's line
    script = tmp_path / f"{path.stem}_{line}.py"
    script.write_text("\n" * (line - 1) + code, encoding="utf-8")
    try:
        r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{_rel(path)}:{line}: the example ran past {TIMEOUT_S} s (examples must stay small)")
    assert r.returncode == 0, (f"{_rel(path)}:{line}: the example fails as written (exit {r.returncode})\n"
                               f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-6000:]}")


# ---- shell blocks -------------------------------------------------------------------------------

_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}
# options whose value names something the command creates or filters on, not a file of the tree
_VALUE_NOT_A_PATH = {"--out", "-o", "--nvtx-include", "--output", "-k"}
_PATH_SUFFIXES = (".py", ".sh", ".md", ".cpp", ".h", ".cuh", ".cu", ".supp", ".toml", ".txt", ".csv", ".png")


def shell_commands(code: str):
    """The block's commands, each a token list (continuation lines joined, comments dropped)."""
    text = code.replace("\\\n", " ")
    cmds = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tokens = shlex.split(line, comments=True, posix=True)
        cmd = []
        for t in tokens:
            if t in _OPERATORS:
                if cmd:
                    cmds.append(cmd)
                cmd = []
            else:
                cmd.append(t)
        if cmd:
            cmds.append(cmd)
    return cmds


def cli_invocations(cmd):
    """The arguments after `<python> -m attention_ext` in one command, or None."""
    for i in range(len(cmd) - 2):
        if cmd[i + 1] == "-m" and cmd[i + 2] == "attention_ext" and "python" in cmd[i]:
            return cmd[i + 3:]
    return None


def named_paths(cmd):
    """The tokens of one command that name a file or folder of this repository."""
    paths, skip = [], False
    for t in cmd:
        if skip:
            skip = False
            continue
        if t in _VALUE_NOT_A_PATH:
            skip = True
            continue
        if t.startswith(("-", "$", "<", "~", "/", "http")) or "=" in t or "*" in t:
            continue
        t = t.split("::")[0]
        if "/" in t or t.endswith(_PATH_SUFFIXES):
            paths.append(t)
    return paths


@pytest.mark.parametrize("path,line,code", SHELL_BLOCKS)
def test_shell_block_paths_exist(path, line, code):
    missing = [p for cmd in shell_commands(code) for p in named_paths(cmd)
               if not (ROOT / p).exists() and not (path.parent / p).exists()]
    assert not missing, f"{_rel(path)}:{line}: the commands name paths that do not exist: {missing}"


@pytest.mark.parametrize("path,line,code", SHELL_BLOCKS)
def test_shell_block_cli_parses(path, line, code):
    from attention_ext.__main__ import main as cli

    for cmd in shell_commands(code):
        args = cli_invocations(cmd)
        if args is None:
            continue
        assert args, f"{_rel(path)}:{line}: `python -m attention_ext` needs a command: {shlex.join(cmd)}"
        out = io.StringIO()
        # --help last: argparse checks every option before it (choices, types), then exits 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = cli([*args, "--help"])
            except SystemExit as e:
                rc = e.code
        assert rc in (0, None), f"{_rel(path)}:{line}: `{shlex.join(cmd)}` does not parse:\n{out.getvalue()[-2000:]}"


# ---- the README's shape and the links ---------------------------------------------------------------

def _heading_line(lines, pattern):
    for n, line in enumerate(lines, 1):
        if re.match(pattern, line):
            return n
    raise AssertionError(f"README.md has no heading matching {pattern!r}")


def test_readme_shape():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: a user's guide of at most 300 (docs/ has the rest)"
    install = _heading_line(lines, r"^##\s+Install")
    quick = _heading_line(lines, r"^##\s+Quickstart")
    assert install < quick, "install comes before the quickstart"
    first = [(lang, start, code) for lang, start, code in fenced_blocks(README) if start > quick]
    assert first and first[0][0] == "python", "the quickstart opens with a Python example"
    lang, start, code = first[0]
    n_code = code.count("\n")
    assert n_code <= 30, f"the quickstart is {n_code} lines; at most 30"
    assert not needs_of(code), "the quickstart runs on a CPU, with no launcher"
    end = start + n_code
    assert end <= 100, f"the quickstart ends at line {end}; install and quickstart fit the first 100"
    # CI (.ci/run) runs the README's test command
    shell = [code for lang, _, code in fenced_blocks(README) if lang in ("bash", "sh", "shell")]
    assert any(cmd[:2] == ["./dev.sh", "test"] for code in shell for cmd in shell_commands(code))


def test_readme_lists_what_dev_sh_installs():
    """The install section names every package `./dev.sh` installs (its deps(): pip install lines)."""
    deps = re.search(r"^deps\(\) \{\n(.*?)^\}", (ROOT / "dev.sh").read_text(encoding="utf-8"), re.M | re.S)
    assert deps, "dev.sh has no deps() function"
    names = set()
    for line in re.findall(r"pip install (.+)", deps.group(1)):
        for tok in shlex.split(line):
            if not tok.startswith(("-", "$")):
                names.add(re.split(r"[<>=!~\[]", tok)[0])
    assert {"torch", "ninja", "pytest"} <= names, names
    text = README.read_text(encoding="utf-8")
    missing = sorted(n for n in names if not re.search(rf"\b{re.escape(n)}\b", text))
    assert not missing, f"README.md does not say that dev.sh installs {missing}"


_USER_DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_user_docs_name_features_not_issues():
    for path in _USER_DOCS:
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            assert not re.search(r"\bissue\s+#?\d+", line, re.I), f"{_rel(path)}:{n}: name the feature: {line}"
            # no package index entry: a source install, with extras as ".[hf]"
            assert "pip install attention_ext" not in line, f"{_rel(path)}:{n}: no package index entry: {line}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation dropped, spaces to dashes."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path: Path) -> set:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", _USER_DOCS, ids=_rel)
def test_links_resolve(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(target)
    assert not bad, f"{_rel(path)}: links that do not resolve: {bad}"


@pytest.mark.parametrize("args, paths", [("-k decode", 0), ("-k tests -rs", 0), ("tests/decode/test_cpu.py", 1),
                                         ("tests/decode/test_cpu.py::test_x -rs", 1), ("-m slow tests/linear", 1)])
def test_dev_sh_sanitize_tells_paths_from_option_values(args, paths):
    """`./dev.sh sanitize -k EXPR` keeps the default test slice (its comment's promise): the value
    of -k is not a test path. Before, any argument not starting with '-' counted as a path, so
    `-k decode` ran pytest's whole testpaths under the sanitizers, without the canaries."""
    text = (ROOT / "dev.sh").read_text()
    loop = re.search(r"^\s*paths=0 value=0\n.*?^\s*done\n", text, flags=re.S | re.M)
    assert loop, "dev.sh's sanitize argument loop moved: update this test"
    out = subprocess.run(["bash", "-c", f"set -- {args}\n{loop.group(0)}echo $paths"], capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == str(paths)
