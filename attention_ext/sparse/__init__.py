"""The sparse family: block-sparse attention over a block layout, the classic sparsity
patterns as layout builders, and top-k (hard) attention."""
from . import layouts, reference  # noqa: F401
from .functional import block_sparse_attention, layout_to_mask, topk_attention  # noqa: F401
from .lsh import lsh_attention, lsh_buckets  # noqa: F401
from .layouts import (SparseMask, bigbird, draw, fixed, from_mask, global_tokens, intersection,  # noqa: F401
                      longformer, random, sliding_window, sparse_mask_args, strided, union)
