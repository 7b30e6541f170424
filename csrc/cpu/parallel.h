// Dynamic task scheduling for the CPU kernels, on the host framework's intra-op thread pool
// (torch's, OpenMP when built with -fopenmp: csrc/torch/thread_pool.cpp binds it), so that
// torch.set_num_threads governs the kernels too.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>

#include "cpu/isa.h"

namespace attn {
namespace cpu {

// The pool's thread count.
int pool_threads();
// Runs body(i0, i1) over chunks of [0, n) on the pool, at least `grain` items per chunk (the
// last excepted), one chunk per thread at most.
void pool_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

ATTN_CPU_ISA_BEGIN

// Runs make_worker()(task) for task in [0, n) on the pool, handing tasks out dynamically: tasks
// of one causal head differ in cost by up to S / kBlockM times, so a static split would leave
// threads idle. Callers number tasks most expensive first. num_threads 0 = pool_threads().
template <typename MakeWorker>
void parallel_tasks(int64_t n, int num_threads, const MakeWorker& make_worker) {
  if (n <= 0) return;
  int64_t workers = num_threads > 0 ? num_threads : pool_threads();
  workers = std::max<int64_t>(1, std::min<int64_t>(workers, n));
  std::atomic<int64_t> next{0};
  // one chunk per worker; each worker then pulls tasks until none are left
  pool_for(workers, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      auto worker = make_worker();  // per-thread scratch lives in the worker
      for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) worker(t);
    }
  });
}

ATTN_CPU_ISA_END
}  // namespace cpu
}  // namespace attn
