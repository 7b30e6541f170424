"""Shared benchmark helpers. They live in the package (attention_ext/bench.py) so that
`python -m attention_ext bench` and every script here use one FLOP formula and one timer."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_ext.bench import (Timing, allowed_pairs, at_isa_levels, bandwidth_fns, bench,  # noqa: E402,F401
                                 copy_bandwidth, cpu_model, cpu_peak_flops, cuda_time, decode_bytes, emit, flop_ceiling,
                                 flops, flops_from_pairs,
                                 interleaved, interleaved_stats, interleaved_warm, layout_pairs, linear_flops,
                                 machine_line, matmul_best, matmul_ceiling, step, timing)
from attention_ext._cli import isa_levels  # noqa: E402,F401
