"""Context parallelism over torch.distributed: a sequence sharded across ranks, and attention
whose queries are this rank's shard and whose keys are the whole sequence.

    from attention_ext import distributed as cp
    q_l = cp.shard_sequence(q, dim=2, shard_layout="zigzag")        # this rank's shard
    out_l = cp.context_parallel_attention(q_l, k_l, v_l, causal=True, shard_layout="zigzag")
    out = cp.unshard_sequence(out_l, dim=2, shard_layout="zigzag")  # the full sequence, every rank

Packed documents: pass their global offsets as cu_seqlens (context_parallel_attention, and
shard_layout="balanced" to shard the pack by work: documents.py, sharding.py).
`shard_layout` is how the sequence is sharded; `layout` is the tensors' layout ("bhsd" / "bshd"),
as everywhere in the library. Shard layouts, the padding rule and the collectives: sharding.py.
The attention: its options (causal, window_size, seq_len, ...: one AttentionOptions, checked
once) in options.py, the front door context_parallel_attention in attention.py, one module per
mode: allgather.py (mode="allgather"), ring.py (mode="ring"), ulysses.py (mode="ulysses");
linear attention: linear.py; the delta rule: delta.py.
Whole models: pass context_parallel=ContextParallel(group, mode, shard_layout) to nn.Attention or
models.LanguageModel (context.py), and feed each rank its shard of the tokens.
"""
from .attention import MODES, context_parallel_attention
from .context import ContextParallel
from .delta import context_parallel_delta_rule_attention
from .linear import context_parallel_linear_attention
from .sharding import (
    LAYOUTS,
    SHARD_LAYOUTS,
    all_gather_sequence,
    global_positions,
    pad_to_multiple,
    sequence_multiple,
    shard_sequence,
    shard_work,
    unshard_sequence,
)

__all__ = [
    "context_parallel_attention",
    "ContextParallel",
    "context_parallel_linear_attention",
    "context_parallel_delta_rule_attention",
    "shard_sequence",
    "unshard_sequence",
    "all_gather_sequence",
    "global_positions",
    "pad_to_multiple",
    "sequence_multiple",
    "shard_work",
    "LAYOUTS",
    "SHARD_LAYOUTS",
    "MODES",
]
