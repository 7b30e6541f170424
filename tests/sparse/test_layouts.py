"""Layout builders: the drawn docstring examples, exact small grids, the papers' definitions as
properties, from_mask, and bad inputs."""
from __future__ import annotations

import doctest
import math

import pytest
import torch

from attention_ext.sparse import layouts as L


def grid(text: str) -> torch.Tensor:
    """'#'/'.' rows -> (1, n_q, n_k) bool."""
    rows = [r.strip() for r in text.strip().splitlines()]
    return torch.tensor([[ch == "#" for ch in r] for r in rows], dtype=torch.bool).unsqueeze(0)


def test_docstring_drawings():
    """Every builder's drawn example is a doctest; all of them run and match."""
    res = doctest.testmod(L, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert res.failed == 0
    finder = doctest.DocTestFinder()
    drawn = {t.name.rsplit(".", 1)[-1] for t in finder.find(L) if t.examples}
    for name in ("sliding_window", "global_tokens", "random", "strided", "fixed", "bigbird", "longformer",
                 "union", "intersection", "from_mask"):
        assert name in drawn, f"{name} has no drawn example"


def test_draw_roundtrip_and_heads():
    lay = L.random(0.5, 3, seq_len=128, block_size=32, heads=2)
    text = L.draw(lay)
    assert text.startswith("head 0:\n") and "head 1:" in text
    parts = text.split("head 1:\n")
    assert torch.equal(grid(parts[0].replace("head 0:", "")), lay[:1])
    assert torch.equal(grid(parts[1]), lay[1:])


def test_sliding_window_exact():
    assert torch.equal(L.sliding_window(0, seq_len=64, block_size=16), torch.eye(4, dtype=torch.bool)[None])
    assert torch.equal(L.sliding_window(2, seq_len=80, block_size=16, causal=True), grid("""
        #....
        ##...
        ###..
        .###.
        ..###"""))
    # non-square: 3 query blocks, 5 key blocks, aligned top-left
    assert torch.equal(L.sliding_window(1, seq_len=48, seq_len_k=80, block_size=16), grid("""
        ##...
        ###..
        .###."""))
    # odd length: ceil(100 / 32) = 4 blocks
    assert L.sliding_window(1, seq_len=100, block_size=32, heads=3).shape == (3, 4, 4)


@pytest.mark.parametrize("window,dilation", [(0, 1), (1, 1), (2, 3), (3, 2)])
def test_sliding_window_definition(window, dilation):
    lay = L.sliding_window(window, dilation, seq_len=20 * 16, block_size=16)[0]
    for r in range(20):
        want = {r + t * dilation for t in range(-window, window + 1)} & set(range(20))
        assert set(lay[r].nonzero().flatten().tolist()) == want


def test_global_tokens_exact():
    assert torch.equal(L.global_tokens([1], seq_len=48, seq_len_k=64, block_size=16), grid("""
        .#..
        ####
        .#.."""))
    # index 3 has a column but no row (3 query blocks)
    assert torch.equal(L.global_tokens([3], seq_len=48, seq_len_k=64, block_size=16), grid("""
        ...#
        ...#
        ...#"""))


def test_random_counts_seed_and_heads():
    a = L.random(0.3, 7, seq_len=640, block_size=32, heads=4)
    assert a.shape == (4, 20, 20)
    assert (a.sum(-1) == round(0.3 * 20)).all()
    assert torch.equal(a, L.random(0.3, 7, seq_len=640, block_size=32, heads=4))
    assert not torch.equal(a, L.random(0.3, 8, seq_len=640, block_size=32, heads=4))
    assert not torch.equal(a[0], a[1])  # each head draws its own
    assert not L.random(0.0, 0, seq_len=64, block_size=16).any()
    assert L.random(1.0, 0, seq_len=64, block_size=16).all()


def test_strided_exact_and_definition():
    assert torch.equal(L.strided(2, seq_len=80, block_size=16, causal=True), grid("""
        #....
        ##...
        ###..
        .###.
        #.###"""))
    lay = L.strided(4, seq_len=30 * 16, block_size=16)[0]
    for r in range(30):
        for c in range(30):
            assert bool(lay[r, c]) == (abs(r - c) < 4 or (r - c) % 4 == 0)


def test_fixed_exact():
    assert torch.equal(L.fixed(2, c=1, seq_len=96, block_size=16), grid("""
        ##.#.#
        ##.#.#
        .###.#
        .###.#
        .#.###
        .#.###"""))
    assert torch.equal(L.fixed(3, c=3, seq_len=96, block_size=16), torch.ones(1, 6, 6, dtype=torch.bool))


@pytest.mark.parametrize("builder", [L.strided, L.fixed])
def test_sqrt_n_density(builder):
    """At the default stride each row computes O(sqrt(n_blocks)) blocks: total / n^1.5 stays bounded
    (a dense layout would grow like sqrt(n))."""
    ratios = []
    for n in (16, 64, 256):
        lay = builder(seq_len=n * 16, block_size=16)[0]
        assert lay.diagonal().all()
        ratios.append(lay.sum().item() / n ** 1.5)
    assert max(ratios) <= 3.0 and max(ratios) / min(ratios) < 1.6
    default = L._default_stride(256)
    assert default == 16 and torch.equal(builder(seq_len=4096, block_size=16), builder(16, seq_len=4096, block_size=16))


def test_fixed_summary_columns_full_when_causal():
    lay = L.fixed(4, c=2, seq_len=16 * 16, block_size=16, causal=True)[0]
    for col in (2, 3, 6, 7, 10, 11):
        assert lay[col:, col].all()  # every later row reads the window's summary blocks
    assert not lay.triu(1).any()


def test_bigbird_properties():
    n = 16
    lay = L.bigbird(2, 2, 3, 5, seq_len=n * 32, block_size=32, heads=3)
    assert lay.shape == (3, n, n)
    assert lay[:, :2, :].all() and lay[:, :, :2].all()  # global rows and columns
    band = L.sliding_window(2, seq_len=n * 32, block_size=32)
    assert (lay | ~band).all()  # the window is inside
    base = band | L.global_tokens([0, 1], seq_len=n * 32, block_size=32)
    extra = (lay & ~base).sum(-1)  # random blocks are new ones
    free = (~base).sum(-1).expand_as(extra)
    assert torch.equal(extra, torch.minimum(free, torch.tensor(3)))
    assert not torch.equal(lay[0], lay[1])
    assert torch.equal(lay, L.bigbird(2, 2, 3, 5, seq_len=n * 32, block_size=32, heads=3))


def test_longformer_is_union():
    kw = dict(seq_len=300, block_size=32)
    a = L.longformer(1, [0, 5], **kw)
    assert torch.equal(a, L.union(L.sliding_window(1, **kw), L.global_tokens([0, 5], **kw)))


def test_union_intersection_broadcast_heads():
    one = L.sliding_window(1, seq_len=128, block_size=16)
    many = L.random(0.5, 1, seq_len=128, block_size=16, heads=3)
    u, i = L.union(one, many), L.intersection(one, many)
    assert u.shape == i.shape == (3, 8, 8)
    assert torch.equal(u, one | many) and torch.equal(i, one & many)
    assert torch.equal(L.union(one), one)
    with pytest.raises(ValueError, match="block grids differ"):
        L.union(one, L.sliding_window(1, seq_len=144, block_size=16))
    with pytest.raises(ValueError, match="head counts"):
        L.intersection(many, L.random(0.5, 1, seq_len=128, block_size=16, heads=2))
    with pytest.raises(TypeError, match="bool"):
        L.union(one, one.float())
    with pytest.raises(ValueError, match="at least one"):
        L.union()


# ----------------------------------------------------------------------------------------------
# from_mask


def test_from_mask_block_aligned_causal():
    sm = L.from_mask(lambda q, kv: (kv // 32) <= (q // 32), 32, seq_len=128)
    assert sm.mask is None and sm.block_size == 32
    assert torch.equal(sm.block_layout, torch.ones(4, 4, dtype=torch.bool).tril()[None])
    args = L.sparse_mask_args(sm)
    assert args["attn_mask"] is None and args["block_size"] == 32 and args["block_layout"] is sm.block_layout


def test_from_mask_element_causal_keeps_mask():
    sm = L.from_mask(lambda q, kv: kv <= q, 32, seq_len=100)
    assert torch.equal(sm.block_layout, torch.ones(4, 4, dtype=torch.bool).tril()[None])
    assert sm.mask is not None and torch.equal(sm.mask[0], torch.ones(100, 100, dtype=torch.bool).tril())
    assert L.sparse_mask_args(sm)["attn_mask"].shape == (1, 1, 100, 100)


def test_from_mask_ragged_edge_counts_as_full():
    """The last block of a 100-long sequence holds 4 real rows; a block-aligned mask over the real
    elements still needs no element mask."""
    dense = torch.ones(100, 100, dtype=torch.bool)
    sm = L.from_mask(dense, 32)
    assert sm.mask is None and sm.block_layout.all()


def test_from_mask_dense_per_head_and_function_with_heads():
    dense = torch.zeros(2, 64, 80, dtype=torch.bool)
    dense[0, 3, 70] = True
    dense[1, 40:48, :16] = True
    sm = L.from_mask(dense, 16)
    assert sm.block_layout.shape == (2, 4, 5)
    assert sm.block_layout[0].nonzero().tolist() == [[0, 4]] and sm.block_layout[1].nonzero().tolist() == [[2, 0]]
    assert sm.mask is not None and torch.equal(sm.mask, dense)
    sm2 = L.from_mask(lambda h, q, kv: (kv <= q) | (h == 1), 16, seq_len=64, heads=2)
    assert sm2.block_layout.shape == (2, 4, 4) and sm2.block_layout[1].all() and not sm2.block_layout[0].triu(1).any()


def test_from_mask_errors():
    with pytest.raises(ValueError, match="seq_len"):
        L.from_mask(lambda q, kv: kv <= q, 16)
    with pytest.raises(TypeError, match="bool"):
        L.from_mask(lambda q, kv: (kv <= q).float(), 16, seq_len=32)
    with pytest.raises(TypeError, match="bool"):
        L.from_mask(torch.ones(32, 32), 16)
    with pytest.raises(ValueError, match="multiple of 16"):
        L.from_mask(torch.ones(32, 32, dtype=torch.bool), 24)
    with pytest.raises(ValueError, match="disagrees"):
        L.from_mask(torch.ones(32, 32, dtype=torch.bool), 16, seq_len=64)
    with pytest.raises(TypeError, match="SparseMask"):
        L.sparse_mask_args(torch.ones(1, 2, 2, dtype=torch.bool))


@pytest.mark.parametrize("call,exc,match", [
    (lambda: L.sliding_window(-1, seq_len=64), ValueError, "window_blocks must be >= 0"),
    (lambda: L.sliding_window(1, 0, seq_len=64), ValueError, "dilation must be >= 1"),
    (lambda: L.sliding_window(1.5, seq_len=64), TypeError, "window_blocks must be an int"),
    (lambda: L.sliding_window(1, seq_len=64, block_size=0), ValueError, "block_size must be >= 1"),
    (lambda: L.sliding_window(1, seq_len=64, block_size=40), ValueError, "multiple of 16"),
    (lambda: L.sliding_window(1, seq_len=0), ValueError, "seq_len must be >= 1"),
    (lambda: L.sliding_window(1, seq_len=64, heads=0), ValueError, "heads must be >= 1"),
    (lambda: L.global_tokens([4], seq_len=64, block_size=16), ValueError, "out of range"),
    (lambda: L.global_tokens([-1], seq_len=64, block_size=16), ValueError, "out of range"),
    (lambda: L.global_tokens([0.5], seq_len=64, block_size=16), TypeError, "ints"),
    (lambda: L.random(1.5, 0, seq_len=64), ValueError, r"density must be in \[0, 1\]"),
    (lambda: L.random(-0.1, 0, seq_len=64), ValueError, "density"),
    (lambda: L.random("a", 0, seq_len=64), TypeError, "density must be a number"),
    (lambda: L.random(0.5, -1, seq_len=64), ValueError, "seed"),
    (lambda: L.strided(0, seq_len=64), ValueError, "stride must be >= 1"),
    (lambda: L.fixed(2, c=3, seq_len=64, block_size=16), ValueError, "c .* must be <= stride"),
    (lambda: L.fixed(2, c=0, seq_len=64, block_size=16), ValueError, "c must be >= 1"),
    (lambda: L.bigbird(1, 9, 1, 0, seq_len=128, block_size=16), ValueError, "n_global"),
    (lambda: L.bigbird(1, 1, -1, 0, seq_len=128, block_size=16), ValueError, "n_random"),
    (lambda: L.draw(torch.ones(3)), TypeError, "layout"),
])
def test_bad_inputs(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_device_argument():
    assert L.bigbird(seq_len=128, block_size=32, device="cpu").device.type == "cpu"
    assert math.isclose(L.from_mask(torch.ones(64, 64, dtype=torch.bool), 16).density(), 1.0)


def test_bigbird_causal_rows_do_not_depend_on_length():
    """A causal BigBird row is the same in every grid that contains it (a KV-cache step reads the
    same row as the whole sequence), and its random blocks lie below the window."""
    big = L.bigbird(1, 1, 2, 4, seq_len=20 * 16, block_size=16, heads=3, causal=True)
    for n in (3, 7, 12):
        small = L.bigbird(1, 1, 2, 4, seq_len=n * 16, block_size=16, heads=3, causal=True)
        assert torch.equal(big[:, :n, :n], small)
    assert not big.triu(1).any()
    base = L.sliding_window(1, seq_len=20 * 16, block_size=16, causal=True) | L.global_tokens([0], seq_len=20 * 16,
                                                                                                block_size=16)
    extra = (big & ~base).sum(-1)  # (heads, rows): min(2, free blocks left of the window)
    free = (~base & torch.ones(20, 20, dtype=torch.bool).tril()).sum(-1)
    assert torch.equal(extra, torch.minimum(free, torch.tensor(2)).expand_as(extra))
