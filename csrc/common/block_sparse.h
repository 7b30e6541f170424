// Block-sparse attention and top-k attention as two more parts of the softmax params: which
// (query, key) pairs the fused kernels visit, shared by the CPU and CUDA backends.
//
// A layout is a (heads, n_qb, n_kb) bool grid of `block` x `block` score blocks (heads = 1: one
// grid for every head). Element rule: (i, j) may be computed only when its block is on; inside
// an on block the policy's element rules (lengths, causal, window, bool mask) apply as usual, so
// sequence lengths need not divide the block.
//
// A kernel never scans the grid. It walks a TileIndex: the layout compressed at the kernel's own
// tile sizes (tile_m query rows x tile_n keys), as CSR (the forward: per query tile, its key
// tiles) or CSC (the backward's dK / dV: per key tile, its query tiles). A tile is listed when
// any layout block under it is on, with a `full` flag when every block under it is on, so a
// kernel whose tiles do not nest inside the layout's blocks still checks the layout element-wise
// in the tiles that need it, and nowhere else. Cost is proportional to the listed tiles.
// The torch side (csrc/torch/block_index.cpp) builds the indices on the layout's device, once
// per (layout, tile sizes), and caches them.
//
// Top-k (hard) attention: each query row i keeps the k highest logits among the keys the other
// rules allow, ties going to the lower key index. A threshold pass (csrc/sparse/) stores per row
// the k-th logit thr_i and the last kept key jcut_i among the logits equal to it; the fused
// kernels then keep (i, j) iff logit > thr_i, or logit == thr_i and j <= jcut_i. Exact as long
// as both passes compute the logit bit for bit the same way (the same product code).
#pragma once

#include <cstdint>

#include "hd.h"


namespace attn {

// CSR (or CSC) of the tiles a kernel visits. For the forward: outer = query tile, inner = key
// tile; for the backward: outer = key tile, inner = query tile.
struct TileIndex {
  const int32_t* ptr;   // (heads * n_outer + 1): tiles of outer tile t of head h are
                        //   inner[ptr[h * n_outer + t] .. ptr[h * n_outer + t + 1])
  const int32_t* idx;   // (nnz) inner tile numbers, ascending within an outer tile
  const uint8_t* full;  // (nnz) 1 = every layout block under the tile is on (no element check)
  int32_t n_outer;      // outer tiles per head
  int32_t tile_m, tile_n;  // the grid the index was built for (query rows, keys per tile)
};

struct BlockSparseParams {
  // (heads, n_qb, n_kb) uint8, contiguous; nullptr = dense (every other field unused)
  const uint8_t* layout;
  int32_t heads;  // 1 or the number of query heads
  int32_t n_qb, n_kb, block;
  TileIndex fwd;  // CSR at the forward kernel's tiles
  TileIndex bwd;  // CSC at the backward kernel's tiles

  ATTN_HD bool on() const { return layout != nullptr; }
  // query head h's (n_qb, n_kb) grid
  ATTN_HD const uint8_t* head_layout(int h) const {
    return layout + (heads == 1 ? int64_t(0) : int64_t(h) * n_qb * n_kb);
  }
  // The entries [*begin, *end) of ix.idx / ix.full that outer tile t of query head h visits.
  ATTN_HD void tiles(const TileIndex& ix, int h, int t, int* begin, int* end) const {
    const int64_t row = (heads == 1 ? int64_t(0) : int64_t(h) * ix.n_outer) + t;
    *begin = ix.ptr[row];
    *end = ix.ptr[row + 1];
  }
};

}  // namespace attn
