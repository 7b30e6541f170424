#!/usr/bin/env python3
"""Compare the CPU kernels' machine code per function between two builds, for "a refactor left
the kernels alone" proofs (the CPU side of tools/sass_compare.py).

    python tools/compare_objs_cpu.py OLD_LEVELS NEW_LEVELS [--rename OLD=NEW ...]

OLD_LEVELS / NEW_LEVELS: a build's per-level object folders (build/temp.*/cpu_levels: one folder
per ISA level, csrc_<family>_cpu_<file>.o in each). Every function of every kernel object is
disassembled (objdump -dr, demangled) and compared in a position-independent form: addresses,
rip displacements, jump targets by address, string-pool label numbers and the alignment padding
after a function are dropped (a function that moved inside its object, because another left it,
compares equal); calls keep their relocation target. --rename applies a regex substitution to
the OLD side's names (renamed types and functions). Lists what differs or is only in one build.
"""
import re, subprocess, sys, os
import argparse

_ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_ap.add_argument("old")
_ap.add_argument("new")
_ap.add_argument("--rename", action="append", default=[], help="OLD=NEW regex substitution on the OLD side")
_args = _ap.parse_args()
OLD, NEW = _args.old, _args.new
REN = [tuple(r.split("=", 1)) for r in _args.rename]
def funcs(obj, old):
    txt = subprocess.run(["objdump", "-dr", "-C", "--no-show-raw-insn", "-M", "intel", obj], capture_output=True, text=True).stdout
    if old:
        for a, b in REN:
            txt = re.sub(a, b, txt)
    out, name = {}, None
    for ln in txt.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", ln)
        if m:
            name = m.group(1); k = 2
            while name in out: name = f"{m.group(1)}#{k}"; k += 1
            out[name] = []
        elif name and re.match(r"^\s+[0-9a-f]+: R_", ln):
            # a relocation: the instruction above reaches this symbol (its unrelocated operand
            # shows whatever symbol happens to sit at that offset)
            head = re.split(r"\s*(?:#|<)", out[name][-1], maxsplit=1)[0]
            out[name][-1] = head + " -> " + re.sub(r"\.text\+0x[0-9a-f]+", ".text+X", re.sub(r"\.LC\d+", ".LC", ln.split(None, 2)[2]))
        elif name and ln.strip() and not ln.startswith("Disassembly"):
            # drop the address column; keep the instruction (jump targets are section offsets)
            parts = ln.split("\t")
            ins = "\t".join(parts[1:]).strip()
            # position-independent form: a function's place in its section moved when another left
            # the object, so absolute targets / rip displacements are dropped, their symbol+offset kept
            ins = re.sub(r"\b[0-9a-f]+ <", "<", ins)
            ins = re.sub(r"rip\+0x[0-9a-f]+", "rip+X", ins)
            out[name].append(ins)
    for k, v in out.items():  # alignment padding after the last instruction depends on the position
        while v and (v[-1].startswith(("nop", "data16", "xchg   ax,ax", "int3")) or "nop" in v[-1].split()[:3]):
            v.pop()
    return out
same = diff = only = 0
rows = []
for lv in sorted(d for d in os.listdir(NEW) if os.path.isdir(os.path.join(NEW, d))):
    for f in sorted(os.listdir(os.path.join(NEW, lv))):
        if not f.endswith(".o") or f == "csrc_cpu_level.o": continue
        po = os.path.join(OLD, lv, f); pn = os.path.join(NEW, lv, f)
        if not os.path.exists(po): rows.append(f"NEW-OBJECT {lv}/{f}"); continue
        a, b = funcs(po, True), funcs(pn, False)
        for fn in sorted(set(a) | set(b)):
            if fn in a and fn in b:
                if a[fn] == b[fn]: same += 1
                else: diff += 1; rows.append(f"DIFFER {lv}/{f} {fn[:150]} ({len(a[fn])} vs {len(b[fn])})")
            else:
                only += 1; rows.append(f"ONLY-{'OLD' if fn in a else 'NEW'} {lv}/{f} {fn[:150]}")
print("\n".join(rows))
print(f"{same} identical, {diff} differ, {only} only in one")
sys.exit(1 if diff else 0)
