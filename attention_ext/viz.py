"""Attention heatmaps, written to PNG files.

matplotlib is an optional extra (`pip install matplotlib`); it is imported only when a plot is
made. Figures are drawn on the Agg canvas directly (no pyplot, no display, no global state).

    plot_attention_heads(w, "heads.png", x_tokens=src, y_tokens=tgt)  # (H, S_q, S_k) head grid
    plot_alignment(a, "align.png", src_tokens=src, tgt_tokens=tgt)   # Bahdanau/Luong (T, S)
    plot_sparse_layout(block_layout(mask, 16), "layout.png")          # which blocks are computed
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Union

import numpy
import torch

from ._args import as_int

# the plots take tensors (any device or dtype) or numpy arrays
_Array = Union[torch.Tensor, numpy.ndarray]


def _figure(nrows: int, ncols: int, cell: float = 3.0):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("attention_ext.viz needs matplotlib: pip install matplotlib") from e
    fig = Figure(figsize=(cell * ncols + 1.0, cell * nrows + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _as_array(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().float().cpu().numpy()
    return x


def _label(ax, x_tokens, y_tokens, n_cols, n_rows):
    small = 8 if max(n_cols, n_rows) <= 24 else 6
    if x_tokens is not None:
        ax.set_xticks(range(n_cols))
        ax.set_xticklabels([str(t) for t in x_tokens][:n_cols], rotation=90, fontsize=small)
    else:
        ax.set_xticks([])
    if y_tokens is not None:
        ax.set_yticks(range(n_rows))
        ax.set_yticklabels([str(t) for t in y_tokens][:n_rows], fontsize=small)
    else:
        ax.set_yticks([])


def _save(fig, path: str, title: Optional[str]) -> str:
    if title:
        fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _check_grid(w, what: str, dims: str, ncols, batch_hint: bool) -> int:
    """w 3-D (dims names them) and ncols a positive int (returned): else a ValueError that says
    which; batch_hint: a 4-D w is a batch of sequences (attention_weights' (B, H, S_q, S_k))."""
    if w.ndim != 3:
        hint = f" (a batch: plot one sequence, {what}[b])" if batch_hint and w.ndim == 4 else ""
        raise ValueError(f"{what} must be {dims}, got shape {tuple(w.shape)}{hint}")
    n = as_int(ncols)
    if n is None or n < 1:
        raise ValueError(f"ncols must be a positive int (heads per row), got {ncols!r}")
    return n


def plot_attention_heads(weights: _Array, path: str, *, x_tokens: Optional[Sequence] = None,
                         y_tokens: Optional[Sequence] = None, title: Optional[str] = None, ncols: int = 4,
                         cmap: str = "viridis") -> str:
    """A grid of heatmaps, one per head, of weights (H, S_q, S_k) for one sequence (a (S_q, S_k)
    matrix counts as one head). Rows are queries (y_tokens), columns keys (x_tokens). One color
    scale for every head (0 to the largest weight of all, the colorbar's)."""
    w = _as_array(weights)
    if w.ndim == 2:
        w = w[None]
    ncols = _check_grid(w, "weights", "(H, S_q, S_k) or (S_q, S_k) for one sequence", ncols, True)
    h, sq, sk = w.shape
    top = float(numpy.nanmax(w)) if w.size and not numpy.isnan(w).all() else 1.0  # a NaN blanks its own cell only
    top = max(top, 1e-9)
    ncols = min(ncols, h)
    nrows = math.ceil(h / ncols)
    cell = max(2.5, min(5.0, 0.25 * max(sq, sk)))
    fig, axes = _figure(nrows, ncols, cell)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        im = ax.imshow(w[i], cmap=cmap, vmin=0.0, vmax=top, aspect="auto")
        ax.set_title(f"head {i}", fontsize=9)
        _label(ax, x_tokens, y_tokens, sk, sq)
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    return _save(fig, path, title)


def plot_alignment(weights: _Array, path: str, *, src_tokens: Optional[Sequence] = None,
                   tgt_tokens: Optional[Sequence] = None, title: Optional[str] = "alignment") -> str:
    """The alignment matrix (T, S) of a Bahdanau/Luong decoder: row t is the attention of output
    step t over the source positions, as in the papers' figures."""
    w = _as_array(weights)
    if w.ndim != 2:
        raise ValueError(f"weights must be one alignment matrix (T, S), got shape {tuple(w.shape)}"
                         + (" (pick one sequence or head: weights[i])" if w.ndim > 2 else ""))
    t, s = w.shape
    fig, axes = _figure(1, 1, max(3.0, min(8.0, 0.35 * max(t, s))))
    ax = axes[0, 0]
    ax.imshow(w, cmap="gray", vmin=0.0, vmax=1.0, aspect="auto")
    _label(ax, src_tokens, tgt_tokens, s, t)
    ax.set_xlabel("source")
    ax.set_ylabel("output")
    return _save(fig, path, title)


def block_layout(mask: _Array, block_size: int) -> torch.Tensor:
    """(..., S_q, S_k) bool mask (True = attend) -> (..., ceil(S_q/b), ceil(S_k/b)) bool: which
    (block_q, block_k) tiles hold at least one allowed entry, i.e. which tiles a kernel computes."""
    m = torch.as_tensor(mask).bool()
    sq, sk = m.shape[-2:]
    pad_q, pad_k = (-sq) % block_size, (-sk) % block_size
    m = torch.nn.functional.pad(m.float(), (0, pad_k, 0, pad_q))
    nq, nk = m.shape[-2] // block_size, m.shape[-1] // block_size
    m = m.reshape(*m.shape[:-2], nq, block_size, nk, block_size)  # (..., nq, b, nk, b)
    return m.amax(dim=(-3, -1)) > 0


def plot_sparse_layout(block_layout: _Array, path: str, *, title: Optional[str] = "block layout",
                       ncols: int = 4) -> str:
    """Plots a block-sparse layout (n_q_blocks, n_k_blocks) or one per head (H, n_q, n_k):
    dark = computed block, light = skipped; the title reports the density."""
    lay = _as_array(torch.as_tensor(_as_array(block_layout)).bool().float())
    if lay.ndim == 2:
        lay = lay[None]
    ncols = _check_grid(lay, "block_layout", "(query blocks, key blocks) or (H, query blocks, key blocks)", ncols,
                        False)
    h = lay.shape[0]
    ncols = min(ncols, h)
    nrows = math.ceil(h / ncols)
    fig, axes = _figure(nrows, ncols, 3.0)
    for i, ax in enumerate(axes.flat):
        if i >= h:
            ax.axis("off")
            continue
        ax.imshow(lay[i], cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"head {i}: {lay[i].mean():.0%} dense" if h > 1 else f"{lay[i].mean():.0%} dense", fontsize=9)
        ax.set_xlabel("key block")
        ax.set_ylabel("query block")
    return _save(fig, path, title)
