"""Argument rules the command-line tools share (`python -m attention_ext bench | profile | demo`
and the scripts under benchmarks/), each stated once here. A user's mistake is an argparse error
(exit 2) that names the flag and says what it takes, found before anything runs: a bad value
found after a sweep or a training run would cost that run.

- check_out_dir(parser, path): an output directory that can be made (or exists), so that a run
  never ends in a traceback over writing its results.
"""
from __future__ import annotations

import argparse
import os


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

