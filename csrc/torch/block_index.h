// The torch side of the block-sparse tile index (csrc/common/block_sparse.h): built from a bool
// layout with ATen ops on the layout's device, once per (layout, tile sizes), and cached.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "common/block_sparse.h"

namespace attn {
namespace api {

// The tensors behind one TileIndex; they stay alive in the cache and in the caller's copy.
struct TileIndexTensors {
  at::Tensor ptr, idx, full;  // int32 (heads * n_outer + 1), int32 (nnz), uint8 (nnz)
  int32_t n_outer = 0, tile_m = 0, tile_n = 0;
  TileIndex view() const;
};

// layout: (heads, ceil(sq / block), ceil(sk / block)) bool, contiguous. The grid of tiles of
// tile_m query rows x tile_n keys over an (sq, sk) score matrix; csc = false: CSR per query tile
// (the forward), csc = true: CSC per key tile (the backward). Cached on the layout tensor's
// identity and version (an in-place edit rebuilds; inference tensors, which have no version,
// are not cached).
// capturing: a CUDA graph is being captured. The build needs a host sync (nonzero), so the index
// must already be in the cache (an eager call with the same layout tensor, as the warm-up before
// a capture makes): otherwise a c10::Error says so. The entry is then pinned, never evicted,
// since the graph's kernels read its tensors on every replay; an in-place edit of the layout
// after the capture changes eager calls, not the replays.
TileIndexTensors tile_index(const at::Tensor& layout, int64_t block, int64_t sq, int64_t sk, int64_t tile_m,
                            int64_t tile_n, bool csc, bool capturing = false);

}  // namespace api
}  // namespace attn
