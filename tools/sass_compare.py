#!/usr/bin/env python3
"""Compare the SASS of two builds per (arch, function): identical / differ / only in one.

    python tools/sass_compare.py [--rename OLD=NEW ...] OLD NEW [OLD2 NEW2 ...]

OLD / NEW: objects or shared libraries holding cubins (e.g. two builds' attention_ext/_C*.so).
For each pair and arch (sm_80, sm_90a), `cuobjdump -sass -arch A` dumps every function once; the
dump is split per function and compared without the file-identifier lines (the source path
differs between trees). --rename applies a text substitution to the OLD side's names and code
(a renamed type changes the mangled names of the kernels that take it: e.g.
--rename 10FwdParamsT=14SoftmaxParamsT). Exit status 1 if any function present in both
differs, or if a function is only in one. CUOBJDUMP names the binary (default `cuobjdump`;
triton ships one when the toolkit lacks it). Shows that a refactor leaves the kernels
byte-identical.
"""
import argparse
import os
import re
import subprocess
import sys

CUOBJDUMP = os.environ.get("CUOBJDUMP", "cuobjdump")
ARCHS = ("sm_80", "sm_90a")


def functions(obj, arch, renames=()):
    """{function name: [SASS lines]} of every function of `arch` in `obj`."""
    text = subprocess.run([CUOBJDUMP, "-sass", "-arch", arch, obj], capture_output=True, text=True).stdout
    for old, new in renames:
        text = text.replace(old, new)
    out, name = {}, None
    for ln in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", ln)
        if m:
            name = m.group(1)
            n = 2
            while name in out:  # one name in several cubins (a helper each .cu compiles): the k-th copy
                name = f"{m.group(1)}#{n}"
                n += 1
            out[name] = []
        elif ln.startswith("Fatbin"):  # the next cubin's (or PTX's) header: the function ended
            name = None
        elif name is not None and not ln.lstrip().startswith(("identifier", "code for")):
            out[name].append(ln)
    return out


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rename", action="append", default=[], help="OLD=NEW substitution on the OLD side")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if len(a.files) % 2:
        sys.exit(__doc__)
    renames = [tuple(r.split("=", 1)) for r in a.rename]
    same = diff = only = 0
    for old, new in zip(a.files[0::2], a.files[1::2]):
        for arch in ARCHS:
            fa, fb = functions(old, arch, renames), functions(new, arch)
            for fn in sorted(set(fa) | set(fb)):
                if fn in fa and fn in fb:
                    ok = fa[fn] == fb[fn]
                    same += ok
                    diff += not ok
                    print(f"{'IDENTICAL' if ok else 'DIFFER   '} {arch} {fn} ({len(fa[fn])} lines)")
                else:
                    only += 1
                    print(f"ONLY-{'OLD' if fn in fa else 'NEW'}  {arch} {fn}")
    print(f"{same} identical, {diff} differ, {only} only in one build")
    return 1 if diff or only else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
