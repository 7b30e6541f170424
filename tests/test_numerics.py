"""Numerics at the edges, on the CPU kernels: rows of tens of millions of keys (the running sums l and
O keep float32 accuracy: csrc/cpu/simd.h's kahan_add), rows with nothing visible, logits and inputs
of extreme magnitude, and linear attention's normalizer over a million positions.

The long-row tests hold V (and K for random inputs) of S = 2^24 + 2^19 keys (D = 64, float32:
4.4 GB each). They check /proc/meminfo's MemAvailable first and skip, saying so, when it is short.
The exact case (q = k = 0, K one broadcast row) runs by default, about 30 s on a 2-core machine.
The `bigmem` cases run only when selected, `pytest -m bigmem` (docs/testing.md, "Large tensors"): the random
case (drawing 2.2e9 normals and a float64 reference: about 2 min) and the fused forward's packed
path (9+ query rows: it copies K and V once more, about 14 GB in all, about 1 min)."""
from __future__ import annotations

import math

import pytest
import torch

import attention_ext as ae
from attention_ext.softmax import ops

pytestmark = pytest.mark.skipif(not ops.HAS_EXT, reason="compiled extension not built")

S1, S2, D = 2**24, 2**19, 64
S_LONG = S1 + S2  # past 2^24: a float32 sum of weights 1 stops growing there
EXACT = (S1 + 3 * S2) / S_LONG  # q = k = 0: every weight is 1; S1 values 1, S2 values 3
GB = 2**30
LONG_BYTES = S_LONG * D * 4  # one float32 (S_LONG, D) tensor


def mem_available() -> int:
    """Bytes the kernel reports as available (/proc/meminfo: psutil may not be installed)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def need_memory(nbytes: int):
    avail = mem_available()
    if avail < nbytes:
        pytest.skip(f"needs {nbytes / GB:.1f} GB of free memory, MemAvailable is {avail / GB:.1f} GB")


bigmem = [pytest.mark.bigmem]  # opt-in: pytest -m bigmem (tests/conftest.py OPT_IN)


# ---------------------------------------------------------------- long rows
# How a (1, 1, rows, D) query reaches each kernel: attention() with <= 8 rows and no gradient runs
# the decode kernel (heuristic key splits); the decode op with num_splits=1 puts every key in one
# split; requires_grad sends one row to the fused forward's direct mode (K / V read in place);
# 9 rows to its packed path.
PATHS = ["decode", "decode_one_split", "fused_direct", pytest.param("fused_packed", marks=bigmem)]


def run_path(path: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """out, lse of row 0 of query q (1, 1, 1, D) over k, v (1, 1, S, D) on `path`."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if path == "decode_one_split":
        out, lse = torch.ops.attention_ext.decode_fwd(q, k, v, None, None, None, None, None, None, scale, 0.0,
                                                      -1, -1, 1)
    elif path == "fused_packed":
        out, lse = ae.attention(q.expand(1, 1, 9, q.shape[-1]), k, v, return_lse=True)
    else:
        qq = q.clone().requires_grad_(path == "fused_direct")
        out, lse = ae.attention(qq, k, v, return_lse=True)
    return out[0, 0, 0].detach(), lse[0, 0, 0].detach()


class LongV:
    """One (1, 1, S_LONG, D) float32 V shared by the long-row tests, filled on demand with the
    exact case's pattern or the random case's values (in whichever order the tests run)."""

    def __init__(self):
        self.t = torch.empty(1, 1, S_LONG, D)
        self.fill = None

    def pattern(self) -> torch.Tensor:
        if self.fill != "pattern":
            self.t[:, :, :S1] = 1.0
            self.t[:, :, S1:] = 3.0
            self.fill = "pattern"
        return self.t

    def random(self) -> torch.Tensor:
        if self.fill != "random":
            self.t.normal_(generator=torch.Generator().manual_seed(4321))
            self.fill = "random"
        return self.t


@pytest.fixture(scope="module")
def long_v():
    need_memory(LONG_BYTES + 2 * GB)
    return LongV()


@pytest.mark.parametrize("path", PATHS)
def test_long_row_exact(long_v, path):
    # q = k = 0: every logit is 0, every weight 1; out = (S1 * 1 + S2 * 3) / S_LONG exactly, and
    # lse = log S_LONG. K is one zero row broadcast (row stride 0): only V takes memory.
    v = long_v.pattern()
    q = torch.zeros(1, 1, 1, D)
    k = torch.zeros(1, 1, 1, D).expand(1, 1, S_LONG, D)
    out, lse = run_path(path, q, k, v)
    # float32 rounding of the result, the final division and (decode) the merge of the key splits
    # through their LSEs: a few ulps of 1.06 (the uncompensated sum misses by 3e-2)
    torch.testing.assert_close(out, torch.full((D,), EXACT), rtol=1e-6, atol=0)
    assert abs(lse.item() - math.log(S_LONG)) <= 4e-6


@pytest.fixture(scope="module")
def long_random(long_v):
    """Random q, K, V at S_LONG (K takes a second 4.4 GB buffer) and the float64 reference of the
    one query row, computed in chunks of keys (float64 copies of K / V would take 17.7 GB)."""
    need_memory(LONG_BYTES + 2 * GB)
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(1, 1, 1, D, generator=g)
    k = torch.randn(1, 1, S_LONG, D, generator=g)
    v = long_v.random()
    scale = 1.0 / math.sqrt(D)
    q64 = q[0, 0, 0].double()
    chunk = 1 << 20
    s = torch.cat([(k[0, 0, c:c + chunk].double() @ q64) * scale for c in range(0, S_LONG, chunk)])
    m = s.max()
    p = torch.exp(s - m)
    l = p.sum()
    o = sum(p[c:c + chunk] @ v[0, 0, c:c + chunk].double() for c in range(0, S_LONG, chunk))
    ref_out, ref_lse = o / l, m + torch.log(l)
    torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v)[0, 0, 0]
    torch_err = (torch_out.double() - ref_out).abs().max().item()
    return q, k, None, ref_out, ref_lse.item(), torch_err


@pytest.mark.parametrize("path", ["decode", "decode_one_split", "fused_direct"])
@pytest.mark.bigmem
def test_long_row_random(long_v, long_random, path):
    # randn q, K, V: the error against float64 at most 2x torch SDPA's float32 error
    q, k, _, ref_out, ref_lse, torch_err = long_random
    v = long_v.random()
    out, lse = run_path(path, q, k, v)
    err = (out.double() - ref_out).abs().max().item()
    assert err <= 2 * torch_err, f"max error {err:.3g} vs torch SDPA's {torch_err:.3g}"
    assert abs(lse.item() - ref_lse) <= 1e-5 * abs(ref_lse)


# ---------------------------------------------------------------- the float64 reference
def ref_attention(q, k, v, allowed=None, scale=None):
    """out, lse in float64 with an allowed mask (B or 1, H or 1, Sq, Sk); a row with nothing allowed
    gives out = 0, lse = -inf (and zero gradients)."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    m = s.amax(-1, keepdim=True).detach()
    empty = torch.isinf(m) & (m < 0)
    m = torch.where(empty, torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(l == 0, torch.ones_like(l), l)
    lse = torch.where(empty, torch.full_like(m, -math.inf), m + torch.log(torch.where(l == 0, torch.ones_like(l), l)))
    return out, lse.squeeze(-1)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- rows with nothing visible
def empty_row_case(kind: str, sq: int, sk: int):
    """(attention kwargs, allowed (B, 1, Sq, Sk), empty rows (B, Sq)) with B = 2."""
    b = 2
    allowed = torch.ones(b, 1, sq, sk, dtype=torch.bool)
    if kind == "bool_mask":  # rows 1 and 3 of batch 0 see nothing
        mask = torch.rand(b, 1, sq, sk) < 0.7
        mask[0, :, 1] = False
        mask[0, :, 3] = False
        return dict(attn_mask=mask), mask
    if kind == "window":  # window (0, 0) top-left: row i sees key i, rows >= sk (< sq) nothing
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        allowed = (i == j).expand(b, 1, sq, sk)
        return dict(window=(0, 0)), allowed
    assert kind == "seqlens_k"  # batch 1 has no keys; batch 0 its first 5
    allowed = allowed.clone()
    allowed[0, ..., 5:] = False
    allowed[1] = False
    return dict(seqlens_k=torch.tensor([5, 0], dtype=torch.int32)), allowed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["bool_mask", "window", "seqlens_k"])
@pytest.mark.parametrize("sq", [4, 40])  # 4 rows without grad: the decode kernel where it applies
def test_empty_rows(dtype, kind, sq):
    torch.manual_seed(0)
    sk = sq // 2 + 1 if kind == "window" else 33
    h = 2
    q, k, v = (torch.randn(2, h, n, D).to(dtype) for n in (sq, sk, sk))
    kw, allowed = empty_row_case(kind, sq, sk)
    empty = ~allowed.any(-1)  # (B, 1, Sq)
    assert empty.any()
    ref_out, ref_lse = ref_attention(q, k, v, allowed)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)

    with torch.no_grad():  # forward alone (decode kernel where it applies)
        out, lse = ae.attention(q, k, v, return_lse=True, **kw)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    e = empty.expand_as(lse)
    assert (out.float()[e] == 0).all() and torch.isneginf(lse[e]).all()
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)  # -inf == -inf

    # forward and backward on the fused kernels
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = ae.attention(qg, kg, vg, return_lse=True, **kw)
    assert not torch.isnan(out).any() and (out.float()[e] == 0).all() and torch.isneginf(lse[e]).all()
    g = torch.randn_like(out)
    out.backward(g)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ro, _ = ref_attention(q64, k64, v64, allowed)
    ro.backward(g.double())
    for got, want in ((qg.grad, q64.grad), (kg.grad, k64.grad), (vg.grad, v64.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, **tol)
    assert (qg.grad.float()[e] == 0).all()
    if kind == "seqlens_k":
        assert (kg.grad[1] == 0).all() and (vg.grad[1] == 0).all()


# ---------------------------------------------------------------- extreme magnitudes
def check_against_ref(q, k, v, rtol, atol, grad=True):
    ref_out, ref_lse = ref_attention(q, k, v)
    for rows_grad in ([False, True] if grad else [False]):
        qq, kk, vv = (t.clone().requires_grad_(rows_grad) for t in (q, k, v))
        out, lse = ae.attention(qq, kk, vv, return_lse=True)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=atol)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=0)
        if rows_grad:
            out.backward(torch.randn_like(out))
            for t in (qq, kk, vv):
                assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq", [3, 40])
def test_huge_logits(dtype, sq):
    # |scale q.k| ~ 1e4: exp of differences only, never of the logits themselves. The softmax is
    # one-hot at that spread (the logit gaps dwarf the float32 error of q.k).
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(1, 2, sq, D, generator=g) * 100).to(dtype)
    k = (torch.randn(1, 2, 50, D, generator=g) * 100).to(dtype)
    v = torch.randn(1, 2, 50, D, generator=g).to(dtype)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    assert 5e3 < s.abs().max() < 1e5
    check_against_ref(q, k, v, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype,mag", [(torch.bfloat16, 1.3e5), (torch.float16, 256.0)])
@pytest.mark.parametrize("sq", [3, 40])
def test_inputs_whose_dot_overflows_dtype(dtype, mag, sq):
    # q, k near `mag`: q.k (64 * mag^2: 1.1e12 for bf16, 4.2e6 for fp16) is out of the input dtype's
    # range (fp16) or far past its precision (bf16); the kernels compute it in float32
    g = torch.Generator().manual_seed(2)
    sign = lambda *s: torch.where(torch.rand(*s, generator=g) < 0.5, -1.0, 1.0)
    q = (mag * (1 + 0.05 * torch.rand(1, 2, sq, D, generator=g)) * sign(1, 2, sq, D)).to(dtype)
    k = (mag * (1 + 0.05 * torch.rand(1, 2, 50, D, generator=g)) * sign(1, 2, 50, D)).to(dtype)
    v = torch.randn(1, 2, 50, D, generator=g).to(dtype)
    if dtype == torch.float16:
        assert (q.double() @ k.double().transpose(-1, -2)).abs().max() > torch.finfo(dtype).max
    check_against_ref(q, k, v, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- linear attention at S = 1M
def _peak_rss_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
        return True
    except OSError:
        return False


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("causal", [False, True])
def test_linear_normalizer_at_1m(causal):
    # phi = elu + 1 > 0: the normalizer phi(q_i) . sum_{j (<= i)} phi(k_j) grows with S, as does the
    # state; out must stay finite and match float64 on a few rows, in O(S D) memory
    s_len, d = 1_000_000, 64
    need_memory(8 * s_len * d * 4 + GB)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, s_len, d, generator=g) for _ in range(3))
    tracked = _peak_rss_reset()
    base = _peak_rss()
    out = ae.linear_attention(q, k, v, feature_map="elu", causal=causal)
    growth = _peak_rss() - base
    assert torch.isfinite(out).all()
    if tracked:  # out plus O(S D) of work space, nothing like S^2
        assert growth <= 6 * s_len * d * 4, f"peak RSS grew {growth / GB:.2f} GB"

    phi = lambda x: torch.nn.functional.elu(x.double()) + 1
    rows = [0, 1, 4095, 4096, 500_000, s_len - 1]
    chunk = 1 << 17
    kv = torch.zeros(d, d, dtype=torch.float64)
    z = torch.zeros(d, dtype=torch.float64)
    want = {}
    for c in range(0, s_len, chunk):
        pk, vc = phi(k[0, 0, c:c + chunk]), v[0, 0, c:c + chunk].double()
        if causal:  # prefix sums inside the chunk for the rows that fall in it
            for r in rows:
                if c <= r < c + chunk:
                    n = r - c + 1
                    skv = kv + pk[:n].T @ vc[:n]
                    sz = z + pk[:n].sum(0)
                    pq = phi(q[0, 0, r])
                    want[r] = (pq @ skv) / (pq @ sz + 1e-6)
        kv += pk.T @ vc
        z += pk.sum(0)
    for r in rows:
        if not causal:
            pq = phi(q[0, 0, r])
            want[r] = (pq @ kv) / (pq @ z + 1e-6)
        torch.testing.assert_close(out[0, 0, r].double(), want[r], rtol=1e-4, atol=1e-5)
