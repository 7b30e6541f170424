// Memory for the CPU kernels: cache-line-aligned buffers (on huge pages when large), carving
// one allocation into a worker's buffers, and per-thread scratch kept across calls.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

#include "cpu/isa.h"

namespace attn {
namespace cpu {
ATTN_CPU_ISA_BEGIN

// The sanitized build (ATTN_SANITIZE, setup.py's ATTENTION_EXT_SANITIZE=1): every scratch
// buffer and output block has exactly the size asked for and is freed when its call (tensor)
// ends, so ASan's redzones sit right after the last element. Rounded up to 2 MB and reused
// across calls, as the normal build keeps them, an overrun would land in memory the process owns
// and go unreported.
#if defined(ATTN_SANITIZE)
inline constexpr bool kExactBuffers = true;
#else
inline constexpr bool kExactBuffers = false;
#endif

// Buffers the kernels stream through: 64-byte (cache-line) aligned, so with row strides and
// panels that are whole lines no vector load straddles two lines. malloc's 16-byte alignment
// would split every other 32-byte load, at a cost that changed from run to run with the heap.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes >= kHuge) {
      void* p = ::operator new(bytes, std::align_val_t(kHuge));
      madvise(p, bytes, MADV_HUGEPAGE);
      return static_cast<T*>(p);
    }
    return static_cast<T*>(::operator new(bytes, std::align_val_t(64)));
  }
  void deallocate(T* p, size_t n) {
    ::operator delete(p, std::align_val_t(n * sizeof(T) >= kHuge ? kHuge : 64));
  }
  // vector(n) default-initializes: every buffer is written before it is read, and skipping the
  // zero fill saves a pass over the (up to tens of MB) packed K / V of each call
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  // 2 MB and up: 2 MB aligned and madvise(MADV_HUGEPAGE). The packed K / V stream through L2
  // for every query block; on 4 KB pages their physical placement (hence L2 set conflicts and
  // TLB misses) changed per process, and the D=128 forward's speed changed with them; on huge
  // pages it does not (benchmarks/results/2026-11-22-cpu-v2.md).
  static constexpr size_t kHuge = size_t(2) << 20;
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using Buffer = std::vector<T, LineAllocator<T>>;

// Splits `base` into consecutive buffers of the given element counts (*ptrs[i] gets the i-th),
// each starting on a cache line. carved_size() is the storage that needs.
template <typename T, size_t N>
size_t carved_size(const std::array<size_t, N>& sizes) {
  constexpr size_t kLine = 64 / sizeof(T);
  size_t total = 0;
  for (size_t n : sizes) total += (n + kLine - 1) / kLine * kLine;
  return total;
}
template <typename T, size_t N>
void carve(T* base, const std::array<size_t, N>& sizes, const std::array<T**, N>& ptrs) {
  constexpr size_t kLine = 64 / sizeof(T);
  for (size_t i = 0; i < N; ++i) {
    *ptrs[i] = base;
    base += (sizes[i] + kLine - 1) / kLine * kLine;
  }
}

// Scratch that outlives the call, one per (thread, T, kSlot): the packed K / V on the calling
// thread, each worker's tiles on the pool threads. Each call used to fault in fresh pages (the
// kernel zeroes them: 16 MB of packed K / V for a (2, 8, 1024, 128) forward, a measurable part
// of its time: benchmarks/results/2026-11-22-cpu-v2.md); calls of the same or a smaller size now
// reuse them. At least 2 MB, so small scratch sits on a huge page too (see LineAllocator). Above
// kMaxCachedBytes a call gets its own buffer, so one huge call does not pin its memory.
template <typename T, int kSlot>
class Scratch {
 public:
  static constexpr size_t kMaxCachedBytes = size_t(32) << 20;
  explicit Scratch(size_t n) {
    if (kExactBuffers) {
      own_.resize(n);
      ptr_ = own_.data();
      return;
    }
    n = std::max(n, LineAllocator<T>::kHuge / sizeof(T));
    if (n * sizeof(T) <= kMaxCachedBytes) {
      Buffer<T>& kept = cache();
      if (kept.size() < n) {
        Buffer<T>().swap(kept);  // free first: the old and new buffer never coexist
        kept.resize(n);
      }
      ptr_ = kept.data();
    } else {
      own_.resize(n);
      ptr_ = own_.data();
    }
  }
  T* data() const { return ptr_; }

 private:
  static Buffer<T>& cache() {
    thread_local Buffer<T> kept;
    return kept;
  }
  Buffer<T> own_;
  T* ptr_;
};

// Blocks of 2 MB and up (LineAllocator: huge pages) for the kernels' output tensors, kept after
// the tensor is freed for the next call that asks for the same size. A fresh block is zeroed by
// the OS page by page on first touch, a large part of a causal forward + backward at S = 65536
// (4 x 128 MB of outputs per step; benchmarks/results/2026-11-29-figures-from-comments.md),
// where smaller outputs are recycled by malloc. Kept blocks total at most kMaxBytes, the oldest
// released first: a training step's outputs fit at long sequences, and a process holds no more
// than that once it stops calling.
class BlockCache {
 public:
  static constexpr size_t kMaxBytes = size_t(1) << 30;
  static void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex());
      Kept& k = kept();
      for (size_t i = 0; i < k.blocks.size(); ++i) {
        if (k.blocks[i].second == bytes) {
          void* p = k.blocks[i].first;
          k.blocks.erase(k.blocks.begin() + i);
          k.bytes -= bytes;
          return p;
        }
      }
    }
    return LineAllocator<char>().allocate(bytes);
  }
  // Frees every kept block; returns their bytes (attention_ext.empty_cpu_cache()).
  static size_t release() {
    std::lock_guard<std::mutex> lock(mutex());
    Kept& k = kept();
    const size_t freed = k.bytes;
    for (auto [q, n] : k.blocks) LineAllocator<char>().deallocate(static_cast<char*>(q), n);
    k.blocks.clear();
    k.bytes = 0;
    return freed;
  }
  static void give(void* p, size_t bytes) {
    if (kExactBuffers) {
      LineAllocator<char>().deallocate(static_cast<char*>(p), bytes);
      return;
    }
    std::lock_guard<std::mutex> lock(mutex());
    Kept& k = kept();
    k.blocks.emplace_back(p, bytes);
    k.bytes += bytes;
    while (k.bytes > kMaxBytes) {
      auto [q, n] = k.blocks.front();
      k.blocks.erase(k.blocks.begin());
      k.bytes -= n;
      LineAllocator<char>().deallocate(static_cast<char*>(q), n);
    }
  }

 private:
  struct Kept {
    std::vector<std::pair<void*, size_t>> blocks;  // oldest first
    size_t bytes = 0;
  };
  static Kept& kept() {
    static Kept k;
    return k;
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
};

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
