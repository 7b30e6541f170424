"""The emulated wgmma (tests/cuda_emu: cuda_emu.h wgmma, target/cuda/wgmma_ops.cuh) through a test
kernel (wgmma_test_kernel.cuh) that builds its operands with the sm_90a kernels' own layout code
(cuda/wgmma.cuh: Sw128Tile offsets, make_desc_sw128 descriptors, kmajor_step / mnmajor_step):
D = A B + C against a float64 product for the three operand forms the kernels use, and two
deliberate layout bugs that must give wrong results (so the check can fail). The kernels
themselves: test_hopper_emulated.py."""
from __future__ import annotations

import pytest
import torch

from tests.cuda_emu.test_linear_emulated import emu  # noqa: F401  (the module fixture)


def operands(k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(64, k, generator=g).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    c = torch.randn(64, n, generator=g)
    return a, b, c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("k", [64, 128])
@pytest.mark.parametrize("variant", [0, 1, 2], ids=["ss", "rs", "ss_t"])
def test_wgmma_forms(emu, variant, k, n, dtype):
    """Each form equals a @ b + c: the products of 16-bit values are exact, the sum is rounded once
    to float32 in the emulation (the hardware's order of fp32 additions differs by a few ulp)."""
    a, b, c = operands(k, n, dtype, seed=variant * 100 + k + n)
    d = emu.wgmma_test(a, b, c, variant)
    ref = a.double() @ b.double() + c.double()
    torch.testing.assert_close(d.double(), ref, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("variant", [3, 4], ids=["halved_sbo", "unswizzled_tile"])
def test_layout_bugs_fail(emu, variant):
    """A descriptor with the wrong stride between 8-row atoms, or a tile stored without the
    128-byte swizzle, reads the wrong elements: most of D is wrong."""
    a, b, c = operands(128, 128, torch.bfloat16, seed=7)
    d = emu.wgmma_test(a, b, c, variant)
    ref = a.double() @ b.double() + c.double()
    wrong = ((d.double() - ref).abs() > 1e-3 * (1 + ref.abs())).float().mean().item()
    assert wrong > 0.5, f"a deliberate layout bug left {1 - wrong:.0%} of D right"

