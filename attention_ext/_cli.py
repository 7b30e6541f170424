"""Argument rules the command-line tools share (`python -m attention_ext bench | profile | demo`
and the scripts under benchmarks/), each stated once here. A user's mistake is an argparse error
(exit 2) that names the flag and says what it takes, found before anything runs: a bad value
found after a sweep or a training run would cost that run.

- check_out_dir(parser, path): an output directory that can be made (or exists), so that a run
  never ends in a traceback over writing its results;
- isa_levels(parser, flag, text): comma-separated CPU ISA levels, each one this build has and this
  CPU runs (attention_ext.set_cpu_isa's names), in order.
"""
from __future__ import annotations

import argparse
import os
from typing import List


def check_out_dir(parser: argparse.ArgumentParser, path: str, flag: str = "--out") -> None:
    """parser.error naming `flag` unless `path` is a directory, or can be made one: a file there,
    or a file or an unwritable directory as the nearest existing folder above it, fails now. Makes
    nothing: the run makes the directory when it writes."""
    if not path:
        parser.error(f"{flag}: a directory, got ''")
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        parser.error(f"{flag} {path}: a file of that name exists; give a directory (a new one is made)")
    above = full
    while not os.path.exists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        parser.error(f"{flag} {path}: {above} is a file, so no directory can be made under it; give another path")
    if not os.access(above, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: {above} is not writable; give a directory you can write")


def isa_levels(parser: argparse.ArgumentParser, flag: str, text: str) -> List[str]:
    """The levels of a comma-separated `text`, each one this build has and this CPU runs, else
    parser.error naming `flag` and listing them (set_cpu_isa would raise once the run started)."""
    from attention_ext import _ext

    runs = _ext.cpu_isas()
    if not runs:
        parser.error(f"{flag}: the compiled extension is not available, so no ISA level can be chosen")
    levels = text.split(",")
    bad = [x for x in levels if x not in runs]
    if bad:
        parser.error(f"{flag}: {', '.join(repr(x) for x in bad)}: not a level this build has and this CPU runs "
                     f"(comma-separated, from {', '.join(runs)})")
    return levels
