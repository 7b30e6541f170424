#!/usr/bin/env python3
"""Compare the SASS of two builds per (arch, function): identical / differ / only in one.

    python tools/sass_compare.py OLD.o NEW.o [OLD2.o NEW2.o ...]

For each pair, every function `cuobjdump -sass -arch A` lists (A in sm_80, sm_90a) is dumped with
`-fun` and compared without the file-identifier line (the source path differs between trees).
Exit status 1 if any function present in both differs. CUOBJDUMP names the binary (default
`cuobjdump`; triton ships one when the toolkit lacks it). Used to show that a refactor leaves
the kernels byte-identical (docs/design/splitkv-notes.md).
"""
import os
import re
import subprocess
import sys

CUOBJDUMP = os.environ.get("CUOBJDUMP", "cuobjdump")
ARCHS = ("sm_80", "sm_90a")


def dump(obj, arch, fn=None):
    cmd = [CUOBJDUMP, "-sass", "-arch", arch] + (["-fun", fn] if fn else []) + [obj]
    return subprocess.run(cmd, capture_output=True, text=True).stdout


def main(pairs):
    same = diff = 0
    for old, new in pairs:
        for arch in ARCHS:
            na = set(re.findall(r"Function : (\S+)", dump(old, arch)))
            nb = set(re.findall(r"Function : (\S+)", dump(new, arch)))
            for fn in sorted(na | nb):
                if fn in na and fn in nb:
                    a, b = ([ln for ln in dump(o, arch, fn).splitlines() if not ln.startswith("identifier")]
                            for o in (old, new))
                    same += a == b
                    diff += a != b
                    print(f"{'IDENTICAL' if a == b else 'DIFFER   '} {arch} {fn} ({len(a)} lines)")
                else:
                    print(f"ONLY-{'OLD' if fn in na else 'NEW'}  {arch} {fn}")
    print(f"{same} identical, {diff} differ")
    return 1 if diff else 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or len(args) % 2:
        sys.exit(__doc__)
    sys.exit(main(list(zip(args[0::2], args[1::2]))))
