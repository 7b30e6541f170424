"""attention_ext.viz writes PNG heatmaps without a display."""
import pytest
import torch

from attention_ext import reference, viz

pytest.importorskip("matplotlib")
PNG = b"\x89PNG\r\n\x1a\n"


def _is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG


def test_head_grid(tmp_path):
    w = torch.softmax(torch.randn(6, 5, 7), -1)
    path = viz.plot_attention_heads(w, str(tmp_path / "sub" / "heads.png"), x_tokens=list("abcdefg"),
                                    y_tokens=list("vwxyz"), title="cross-attention", ncols=4)
    assert _is_png(path)
    assert _is_png(viz.plot_attention_heads(w[0].numpy(), str(tmp_path / "one.png")))


def test_alignment(tmp_path):
    a = torch.softmax(torch.randn(4, 6), -1)
    assert _is_png(viz.plot_alignment(a, str(tmp_path / "align.png"), src_tokens=range(6), tgt_tokens="wxyz"))


def test_block_layout_and_plot(tmp_path):
    ok = reference.mask_structure(40, 40, window=(8, 0))[0, 0]  # causal sliding window
    lay = viz.block_layout(ok, 16)
    assert lay.shape == (3, 3)
    assert lay.tolist() == [[True, False, False], [True, True, False], [False, True, True]]
    assert _is_png(viz.plot_sparse_layout(lay, str(tmp_path / "layout.png")))
    assert _is_png(viz.plot_sparse_layout(torch.stack([lay, lay.T]), str(tmp_path / "layouts.png")))


def test_heads_share_one_color_scale(tmp_path):
    """Every head is drawn on the colorbar's scale (0 to the largest weight of all): head 0's 0.2
    was drawn in the color the bar labels 1.0 before."""
    w = torch.zeros(2, 2, 2)
    w[0] = torch.tensor([[0.2, 0.0], [0.1, 0.05]])
    w[1] = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    from matplotlib.axes import Axes
    seen = []
    orig = Axes.imshow

    def spy(self, *a, **k):
        im = orig(self, *a, **k)
        seen.append(im.get_clim())
        return im
    Axes.imshow = spy
    try:
        assert _is_png(viz.plot_attention_heads(w, str(tmp_path / "cb.png")))
    finally:
        Axes.imshow = orig
    assert seen == [(0.0, 1.0), (0.0, 1.0)]


def test_shapes_and_ncols_are_checked(tmp_path):
    w = torch.rand(2, 3, 5, 5)  # attention_weights' (B, H, S_q, S_k)
    with pytest.raises(ValueError, match=r"for one sequence, got shape \(2, 3, 5, 5\) \(a batch: plot one"):
        viz.plot_attention_heads(w, str(tmp_path / "x.png"))
    with pytest.raises(ValueError, match="ncols must be a positive int"):
        viz.plot_attention_heads(w[0], str(tmp_path / "x.png"), ncols=0)
    with pytest.raises(ValueError, match=r"one alignment matrix \(T, S\)"):
        viz.plot_alignment(w[0], str(tmp_path / "x.png"))
