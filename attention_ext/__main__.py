"""python -m attention_ext info | bench | profile | demo"""
from __future__ import annotations

import argparse
import platform
import sys


def info() -> int:
    import torch

    import attention_ext
    from attention_ext import _ext

    print(f"attention_ext {attention_ext.__version__}")
    print(f"python        {platform.python_version()}  ({platform.machine()})")
    print(f"torch         {torch.__version__}  (CUDA {torch.version.cuda or 'none'})")
    if _ext.HAS_EXT:
        c = _ext._C
        print(f"CPU kernels   yes: ISA {_ext.cpu_isa()} (levels built: {', '.join(_ext.cpu_isas(all=True))}; "
              f"this CPU runs: {', '.join(_ext.cpu_isas())}), {c.simd_width()} float32 lanes, "
              f"OpenMP {'on' if c.openmp else 'off'}, {torch.get_num_threads()} threads")
        print(f"CUDA kernels  {'yes: archs ' + c.cuda_archs if c.with_cuda else 'not compiled'}")
    else:
        print(f"CPU kernels   NOT BUILT ({_ext.IMPORT_ERROR}); using the PyTorch reference")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}         {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB")
    else:
        print("GPUs          none visible")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m attention_ext", description=__doc__)
    parser.add_argument("command", choices=["info", "bench", "profile", "demo"])
    # only the command word is ours: everything after it (-h included) belongs to the command
    args = parser.parse_args(argv[:1])
    try:
        return _command(args.command, argv[1:])
    except KeyboardInterrupt:
        # Ctrl-C is the user's choice, not a failure to debug: one line and the shell's 128 + SIGINT,
        # no traceback. bench's sweep writes the cases it finished and returns itself; this is
        # every other moment, all before a command writes its results
        print(f"\npython -m attention_ext {args.command}: interrupted (Ctrl-C) before its results were written",
              file=sys.stderr)
        return 130


def _command(command: str, rest: list) -> int:
    """The subcommand `command` on its own arguments `rest`."""
    if command == "info":
        info_parser = argparse.ArgumentParser(prog="python -m attention_ext info",
                                              description="The build, the CPU's instruction set and the GPUs seen.")
        info_parser.parse_args(rest)  # -h prints this, anything else is an error (exit 2)
        return info()
    if command == "bench":
        from attention_ext import bench

        return bench.main(rest)
    if command == "profile":
        from attention_ext import profile

        return profile.main(rest)
    from attention_ext import demo

    return demo.main(rest)


if __name__ == "__main__":
    sys.exit(main())
