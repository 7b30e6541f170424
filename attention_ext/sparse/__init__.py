"""The sparse family: block-sparse attention over a block layout, the classic sparsity
patterns as layout builders, and top-k (hard) attention."""
from .functional import block_sparse_attention, layout_to_mask, topk_attention  # noqa: F401
