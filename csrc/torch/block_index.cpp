// Definitions of block_index.h.
#include "torch/block_index.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <mutex>
#include <tuple>
#include <vector>

namespace attn {
namespace api {

TileIndex TileIndexTensors::view() const {
  TileIndex t{};
  t.ptr = ptr.data_ptr<int32_t>();
  t.idx = idx.data_ptr<int32_t>();
  t.full = full.data_ptr<uint8_t>();
  t.n_outer = n_outer;
  t.tile_m = tile_m;
  t.tile_n = tile_n;
  return t;
}

namespace {

// A tile is listed when the rectangle of layout blocks under it holds any on block (full: all
// on). Rectangle counts come from a 2-D prefix sum of the layout, so the build is
// O(heads * (n_qb * n_kb + tiles)) elementwise work on the layout's device, never per element.
TileIndexTensors build(const at::Tensor& layout, int64_t block, int64_t sq, int64_t sk, int64_t tm, int64_t tn,
                       bool csc) {
  using at::indexing::Slice;
  const int64_t heads = layout.size(0), nqb = layout.size(1), nkb = layout.size(2);
  const auto iopt = layout.options().dtype(at::kLong);
  // (heads, nqb + 1, nkb + 1): pre[h, r, c] = on blocks in rows < r, cols < c
  at::Tensor pre = at::zeros({heads, nqb + 1, nkb + 1}, iopt);
  pre.index_put_({Slice(), Slice(1, at::indexing::None), Slice(1, at::indexing::None)},
                 layout.to(at::kLong).cumsum(1).cumsum(2));
  const int64_t n_mt = (sq + tm - 1) / tm, n_nt = (sk + tn - 1) / tn;
  auto spans = [&](int64_t n_tiles, int64_t tile, int64_t len) {
    at::Tensor t = at::arange(n_tiles, iopt);
    at::Tensor lo = at::floor_divide(t * tile, block);
    at::Tensor hi = at::floor_divide(at::clamp_max((t + 1) * tile, len) + block - 1, block);
    return std::make_tuple(lo, hi);
  };
  auto [r0, r1] = spans(n_mt, tm, sq);
  auto [c0, c1] = spans(n_nt, tn, sk);
  auto at2 = [&](const at::Tensor& r, const at::Tensor& c) {  // (heads, n_mt, n_nt) of pre[:, r, c]
    return pre.index_select(1, r).index_select(2, c);
  };
  at::Tensor count = at2(r1, c1) - at2(r0, c1) - at2(r1, c0) + at2(r0, c0);
  at::Tensor area = ((r1 - r0).unsqueeze(1) * (c1 - c0).unsqueeze(0)).unsqueeze(0);
  at::Tensor on = count > 0, full = count == area;
  if (csc) {
    on = on.transpose(1, 2).contiguous();
    full = full.transpose(1, 2).contiguous();
  }
  TileIndexTensors out;
  out.n_outer = int32_t(csc ? n_nt : n_mt);
  out.tile_m = int32_t(tm);
  out.tile_n = int32_t(tn);
  at::Tensor counts = on.sum(-1).flatten();
  out.ptr = at::cat({at::zeros({1}, iopt), counts.cumsum(0)}).to(at::kInt);
  out.idx = on.nonzero().select(1, 2).to(at::kInt).contiguous();
  out.full = full.masked_select(on).to(at::kByte);
  return out;
}

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> owner;
  const void* data;
  uint32_t version;
  int64_t key[6];
  bool csc;
  bool pinned;  // read by a captured CUDA graph: kept for the process's life
  TileIndexTensors index;
};

constexpr size_t kMaxEntries = 64;
std::mutex g_mutex;
// Never destroyed: its tensors may live on a GPU, and a destructor run at exit comes after the
// CUDA runtime has shut down, where freeing them throws (with the caching allocator off, as under
// compute-sanitizer, that ended the process with "driver shutting down"). The OS takes the memory.
std::vector<Entry>& g_cache = *new std::vector<Entry>();

constexpr const char* kNotBuilt =
    "attention_ext: a block-sparse call captured in a CUDA graph needs its layout's tile index built before "
    "the capture (building it syncs with the host): run the call once outside the capture with the same layout "
    "tensor, as the warm-up before a capture does; pass it contiguous and on q's device (a copy made per call "
    "is a new tensor each time), and not created in inference mode (those are not cached)";

}  // namespace

TileIndexTensors tile_index(const at::Tensor& layout, int64_t block, int64_t sq, int64_t sk, int64_t tile_m,
                            int64_t tile_n, bool csc, bool capturing) {
  if (layout.is_inference()) {
    TORCH_CHECK(!capturing, kNotBuilt);
    return build(layout, block, sq, sk, tile_m, tile_n, csc);
  }
  const uint32_t version = layout.unsafeGetTensorImpl()->version_counter().current_version();
  const int64_t key[6] = {block, sq, sk, tile_m, tile_n, layout.size(0)};
  auto same = [&](const Entry& e) {
    if (e.owner.expired() || e.data != layout.data_ptr() || e.version != version || e.csc != csc) return false;
    if (e.owner._unsafe_get_target() != layout.unsafeGetTensorImpl()) return false;
    for (int i = 0; i < 6; ++i)
      if (e.key[i] != key[i]) return false;
    return true;
  };
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (Entry& e : g_cache) {
      if (same(e)) {
        e.pinned |= capturing;
        return e.index;
      }
    }
  }
  TORCH_CHECK(!capturing, kNotBuilt);
  TileIndexTensors index = build(layout, block, sq, sk, tile_m, tile_n, csc);
  std::lock_guard<std::mutex> lock(g_mutex);
  // drop the entries of freed layouts; past the cap, start over (a cache, not a store), keeping the
  // pinned ones (a graph still reads them)
  std::vector<Entry> kept;
  size_t unpinned = 0;
  for (Entry& e : g_cache) {
    if (e.pinned || !e.owner.expired()) {
      unpinned += !e.pinned;
      kept.push_back(std::move(e));
    }
  }
  if (unpinned >= kMaxEntries) {
    kept.erase(std::remove_if(kept.begin(), kept.end(), [](const Entry& x) { return !x.pinned; }), kept.end());
  }
  Entry e{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(layout.getIntrusivePtr()),
          layout.data_ptr(), version, {}, csc, false, index};
  for (int i = 0; i < 6; ++i) e.key[i] = key[i];
  kept.push_back(std::move(e));
  g_cache = std::move(kept);
  return index;
}

}  // namespace api
}  // namespace attn
